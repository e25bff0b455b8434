"""VLM-R1's accu_reward_method values against literal completions; thinking templates; math graders;
refusals."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from vlmexp.data.formats import parse_record
from vlmexp.detection import AP_THRESHOLDS, coco_ap, weighted_score
from vlmexp.processor import PixelBudget
from vlmexp.rewards import DetectionReward, ExactReward, FormatReward, MathReward
from vlmexp.rewards_loader import build_reward

BUDGET = PixelBudget(patch_size=14, merge_size=2, min_pixels=3136, max_pixels=12845056)
SIZE = [[112, 112]]  # a multiple of 28: the pixels frame maps boxes 1:1


def exact(method: str, completions: list[str], solution: str, **kwargs) -> list:
    return ExactReward(**kwargs)(completions=completions, solution=[solution] * len(completions),
                                 accu_reward_method=[method] * len(completions))


def boxes(*objects: tuple[list[float], str], fence: bool = True) -> str:
    text = json.dumps([{"bbox_2d": b, "label": label} for b, label in objects])
    return f"```json\n{text}\n```" if fence else text


def detect(method: str, answer: str, gold: str) -> float:
    return DetectionReward(frame="pixels", budget=BUDGET)(
        completions=[answer], solution=[gold], accu_reward_method=[method], image_sizes=[SIZE])[0]


def test_mcq_extracts_the_choice_first():
    assert exact("mcq", ["<think>A or B?</think><answer>The answer is (B).</answer>",
                         "<answer>B. a cat</answer>", "<answer>(C)</answer>",
                         "<answer>I cannot tell</answer>"],
                 "B") == [1.0, 1.0, 0.0, 0.0]
    assert exact("mcq", ["<answer>B</answer>"], "<answer>(B) a cat</answer>") == [1.0]
    # default, as VLM-R1 scores it, extracts the letter from a choice-letter solution's answer too;
    # default_match: exact compares the whole answer, and the sentence is not "B"
    assert exact("default", ["<answer>The answer is (B).</answer>"], "B") == [1.0]
    assert exact("default", ["<answer>The answer is (B).</answer>"], "B", default_match="exact") == [0.0]


def test_levenshtein_ratio_as_python_levenshtein():
    from vlmexp.answers import levenshtein_ratio

    # python-Levenshtein / rapidfuzz's documented values: ratio("lewenstein", "levenshtein") = 0.857142...
    assert levenshtein_ratio("lewenstein", "levenshtein") == pytest.approx(18 / 21)
    assert levenshtein_ratio("kitten", "sitting") == pytest.approx(8 / 13)  # LCS "ittn"
    assert levenshtein_ratio("", "") == 1.0 and levenshtein_ratio("abc", "") == 0.0
    assert levenshtein_ratio("a red cat", "a red cat") == 1.0
    import random

    def lcs(a: str, b: str) -> int:  # the plain dynamic programme, against the bit-parallel count
        row = [0] * (len(b) + 1)
        for x in a:
            prev, row = row, [0]
            for j, y in enumerate(b):
                row.append(prev[j] + 1 if x == y else max(prev[j + 1], row[j]))
        return row[-1]

    rng = random.Random(0)
    for _ in range(200):
        a, b = ("".join(rng.choice("abcd ") for _ in range(rng.randrange(0, 90))) for _ in range(2))
        assert levenshtein_ratio(a, b) == pytest.approx(2 * lcs(a, b) / (len(a) + len(b)) if a or b else 1.0)


def test_default_scores_as_vlm_r1_default_accuracy_reward():
    """om-ai-lab/VLM-R1 grpo_jsonl.py `default_accuracy_reward`, branch by branch."""
    # math-verify equivalence first
    assert exact("default", ["<answer>\\frac{1}{2}</answer>", "<answer>0.5</answer>"],
                 "<answer>1/2</answer>") == [1.0, 1.0]
    # a solution with digits: numbers compared as numbers, else the ratio of the cleaned texts
    assert exact("default", ["<answer>7</answer>", "<answer>8</answer>"], "7.0") == [1.0, 0.0]
    assert exact("default", ["<answer>room 12b</answer>"],
                 "Room 13A.") == [pytest.approx(12 / 16)]  # "room 1"
    # as in VLM-R1, math-verify reads a number out of text: "room 12b" and "Room 12A." both read as 12
    assert exact("default", ["<answer>room 12b</answer>"], "Room 12A.") == [1.0]
    # an option letter: the letter the answer names; none named is unparsable (0, counted)
    counts = {}
    scores = ExactReward()(completions=["<answer>C.</answer>", "<answer>a cat</answer>"], solution=["C", "C"],
                           accu_reward_method=["default"] * 2, log_metric=lambda k, v: counts.update({k: v}))
    assert scores == [1.0, 0.0] and counts["rewards/exact/unparsable/no_choice"] == 1
    # text: partial credit, the Levenshtein ratio of VLM-R1's clean_text (lower case, final '.' dropped)
    assert exact("default", ["<answer>A red cat.</answer>", "<answer>a red hat</answer>", "a red cat"],
                 "<answer>a red cat</answer>") == [1.0, pytest.approx(16 / 18), 1.0]  # no tag: the whole text
    assert exact("default", ["<answer>blue</answer>"],
                 "Red.") == [pytest.approx(2 / 7)]  # "blue" / "red": LCS "e"
    assert exact("default", ["<answer>blue</answer>"], "Red.", default_match="exact") == [0.0]


def test_default_match_refused_unless_known(tmp_path):
    from vlmexp.checks.loader import load_config
    from vlmexp.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        load_config(Path(__file__).resolve().parents[1] / "configs/demo.yaml",
                    ["grpo.rewards=[{name: exact, kwargs: {default_match: fuzzy}}]"])
    assert "grpo.rewards.0.kwargs.default_match" in str(e.value) and "vlm_r1, exact" in str(e.value)


def test_yes_no_reads_whole_words():
    assert exact("yes_no", ["<answer>Yes, it is.</answer>", "<answer>no</answer>",
                            "<answer>I don't know</answer>"],
                 "Yes") == [1.0, 0.0, 0.0]


def test_all_match_uses_vlm_r1_clean_text():
    assert exact("all_match", ["<answer>A red\ncat.</answer>", "<answer>a red dog</answer>"],
                 "<answer>a red cat</answer>") == [1.0, 0.0]


def test_two_boxes_against_two_targets_give_coco_ap():
    gold = "<answer>" + boxes(([0, 0, 10, 10], "cat"), ([20, 20, 40, 40], "dog")) + "</answer>"
    # cat exact (AP 1 at every threshold); dog at IoU 0.5 exactly (matched at .50 only): (1 + 1/10) / 2
    answer = "<think>two animals</think><answer>" + boxes(([0, 0, 10, 10], "cat"),
                                                          ([20, 20, 40, 30], "dog")) + "</answer>"
    assert detect("od_ap", answer, gold) == pytest.approx(0.55)
    assert detect("map", answer, gold) == pytest.approx(0.55)
    assert detect("od_ap50", answer, gold) == pytest.approx(1.0)
    assert detect("odLength", answer, gold) == pytest.approx(0.55)
    # three boxes for two targets: the extra one is a false positive, and odLength multiplies by 2/3
    extra = "<answer>" + boxes(([0, 0, 10, 10], "cat"), ([20, 20, 40, 40], "dog"),
                               ([50, 50, 60, 60], "dog")) + "</answer>"
    # the false positive ranks last: precision stays 1
    assert detect("od_ap", extra, gold) == pytest.approx(1.0)
    assert detect("odLength", extra, gold) == pytest.approx(2 / 3)
    # a label no target has is left out, as COCO's categories come from the targets
    assert detect("od_ap", "<answer>" + boxes(([0, 0, 10, 10], "bird")) + "</answer>", gold) == 0.0


def test_detection_none_answers_and_unreadable_ones():
    none = "<answer>None</answer>"
    assert detect("od_ap", none, none) == 1.0 and detect("weighted_sum", none, none) == 1.0
    gold = "<answer>" + boxes(([0, 0, 10, 10], "cat")) + "</answer>"
    assert detect("od_ap", none, gold) == 0.0
    logged = {}
    reward = DetectionReward(frame="pixels", budget=BUDGET)
    scores = reward(completions=["no tags", "<answer>[1, 2]</answer>", "<answer>```json [oops```</answer>"],
                    solution=[gold] * 3, accu_reward_method=["od_ap"] * 3, image_sizes=[SIZE] * 3,
                    log_metric=lambda k, v: logged.__setitem__(k, v))
    assert scores == [0.0, 0.0, 0.0]
    assert logged["rewards/detection/unparsable/no_answer"] == 1.0
    assert logged["rewards/detection/unparsable/no_json_block"] == 1.0
    assert logged["rewards/detection/unparsable/bad_json"] == 1.0


def test_weighted_sum_is_vlm_r1_detection_score():
    gold = "<answer>" + boxes(([0, 0, 10, 10], "Cat"), ([20, 20, 40, 40], "dog")) + "</answer>"
    # one exact match (labels compared in lower case), one target missed:
    # (0.7 * 1/2 + 0.3 * (1 - (1/2 + 0)/2))
    assert detect("weighted_sum", "<answer>" + boxes(([0, 0, 10, 10], "cat")) + "</answer>", gold) == \
        pytest.approx(0.7 * 0.5 + 0.3 * 0.75)
    # VLM-R1's iou counts pixels inclusively: [0,0,10,10] vs [0,0,10,10] is 1
    assert weighted_score([([0, 0, 10, 10], "a")], [([0, 0, 10, 10], "a")]) == pytest.approx(1.0)


def test_coco_ap_matches_pycocotools():  # pycocotools: the `test` extra
    import contextlib
    import io

    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    images = [([([0, 0, 10, 10], "a"), ([1, 1, 9, 12], "a"), ([30, 30, 50, 45], "b")],
               [([0, 0, 10, 10], "a"), ([30, 30, 50, 50], "b"), ([60, 60, 70, 70], "b")]),
              ([([5, 5, 20, 20], "b")], [([4, 4, 20, 21], "b")])]
    cats = {"a": 0, "b": 1}
    gt = {"images": [{"id": i} for i in range(2)],
          "categories": [{"id": v, "name": k} for k, v in cats.items()],
          "annotations": [{"id": n + 1, "image_id": i, "category_id": cats[lab], "iscrowd": 0,
                           "bbox": [b[0], b[1], b[2] - b[0], b[3] - b[1]],
                           "area": (b[2] - b[0]) * (b[3] - b[1])}
                          for n, (i, b, lab) in enumerate((i, b, lab) for i, (_, g) in enumerate(images)
                                                         for b, lab in g)]}
    dt = [{"image_id": i, "category_id": cats[lab], "bbox": [b[0], b[1], b[2] - b[0], b[3] - b[1]],
           "score": 1.0}
          for i, (p, _) in enumerate(images) for b, lab in p]
    with contextlib.redirect_stdout(io.StringIO()):
        coco = COCO()
        coco.dataset = gt
        coco.createIndex()
        ev = COCOeval(coco, coco.loadRes(dt), "bbox")
        ev.evaluate()
        ev.accumulate()
        ev.summarize()
    assert coco_ap(images, AP_THRESHOLDS) == pytest.approx(ev.stats[0], abs=1e-12)
    assert coco_ap(images, AP_THRESHOLDS[:1]) == pytest.approx(ev.stats[1], abs=1e-12)


def test_format_reward_reads_completions_that_start_inside_a_prefilled_think():
    text = "reasoning...</think><answer>B</answer>"
    assert FormatReward()(completions=[text]) == [0.0]
    assert (FormatReward(prefilled_think=True)(completions=[text, "<think>r</think><answer>B</answer>"])
            == [1.0, 1.0])
    assert build_reward("format", {}, "pixels", BUDGET, prefilled_think=True)(completions=[text]) == [1.0]
    assert build_reward("format", {"prefilled_think": False}, "pixels", BUDGET,
                        True)(completions=[text]) == [0.0]
    # the answer parsers read after the last </think> when there is no <answer>: reasoning is never the answer
    assert exact("mcq", ["A looks wrong, so...</think>B."], "B") == [1.0]


class _Template:
    def __init__(self, ending: str):
        self.chat_template, self.ending = "x", ending

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False):
        return "<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n" + self.ending


def test_prefilled_think_is_read_from_the_chat_template():
    from vlmexp.processor import prefills_think

    assert prefills_think(_Template("<think>\n")) is True
    assert prefills_think(_Template("")) is False


def test_math_grader_choice_and_refusal(monkeypatch):
    assert MathReward()(completions=["<answer>0.5</answer>"], solution=["\\frac{1}{2}"]) == [1.0]
    with pytest.raises(ValueError, match="not one of math_verify, mathruler"):
        MathReward(grader="sympy")
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "mathruler" else real(name, *a))
    with pytest.raises(ValueError, match=r"pip install 'vlmexp\[mathruler\]'"):
        MathReward(grader="mathruler")


def test_mathruler_grades_as_easyr1():  # mathruler and pylatexenc: the `mathruler` extra, in `test`
    import mathruler  # noqa: F401 - what MathReward(grader="mathruler") calls
    import pylatexenc  # noqa: F401

    reward = MathReward(grader="mathruler")
    assert reward(completions=["<think>x</think> so \\boxed{\\frac{1}{2}}", "<answer>3</answer>"],
                  solution=["\\frac{1}{2}", "4"]) == [1.0, 0.0]


def conversation(method: str | None, answer: str, **extra) -> dict:
    record = {"image": "a.png", "conversations": [{"from": "human", "value": "<image>Which?"},
                                                  {"from": "gpt", "value": answer}], **extra}
    return {**record, "accu_reward_method": method} if method else record


@pytest.mark.parametrize("method, answer, needle", [
    ("fuzzy", "B", "unknown accu_reward_method 'fuzzy'; use one of iou, default"),
    ("mcq", "a cat", "names no option letter"),
    ("yes_no", "maybe", "names no yes or no"),
    ("od_ap", "<answer>boxes</answer>", "holds no JSON list of boxes"),
])
def test_records_the_method_cannot_score_are_refused(method, answer, needle):
    with pytest.raises(ValueError, match=needle):
        parse_record(conversation(method, answer), "conversations", None)


def test_methods_pick_task_and_travel_with_the_record():
    gold = "<answer>" + boxes(([0, 0, 10, 10], "cat")) + "</answer>"
    assert parse_record(conversation("od_ap", gold), "conversations", None).task == "detection"
    ex = parse_record(conversation("mcq", "(B)"), "conversations", None)
    assert (ex.task, ex.method) == ("exact", "mcq")
    assert parse_record(conversation(None, "B"), "conversations", None).method == "default"
    with pytest.raises(ValueError, match="scores task 'detection', but this record's task is 'exact'"):
        parse_record(conversation("od_ap", gold), "conversations", "exact")


def test_sample_refuses_llm_without_a_judge_and_unknown_methods_naming_the_record(tmp_path):
    from PIL import Image

    Image.new("RGB", (32, 32)).save(tmp_path / "a.png")
    rows = [conversation("default", "B"), conversation("llm", "B"), conversation("od_map", "B")]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "data.yaml").write_text(
        yaml.safe_dump({"datasets": [{"json_path": str(tmp_path / "d.jsonl")}]}))
    run = subprocess.run([sys.executable, "-m", "vlmexp.cli", "sample", str(tmp_path / "data.yaml"), "--out",
                          str(tmp_path / "out" / "s.jsonl")],
                         capture_output=True, text=True, timeout=600, check=False)
    assert run.returncode != 0
    err = run.stderr + run.stdout
    assert "d.jsonl:2" in err and "accu_reward_method 'llm' is scored by a judge model" in err, err
    assert ("add {name: judge, kwargs: {model: ..., endpoint: ...}} to grpo.rewards" in err
            and "--judged" in err), err
    assert "d.jsonl:3" in err and "unknown accu_reward_method 'od_map'" in err, err
    assert not (tmp_path / "out" / "s.jsonl").exists()


def test_evaluation_gives_detection_ap_over_all_records():
    from vlmexp.data.record import SampledRecord
    from vlmexp.scoring import score_records

    gold = "<answer>" + boxes(([0, 0, 10, 10], "cat")) + "</answer>"
    records = [SampledRecord(task="detection", method="od_ap", problem="Which?", solution=gold,
                             images=["a.png"], image_sizes=SIZE, image_refs=["a.png"], source="d.jsonl",
                             source_id="", source_row=0, record_format="conversations")] * 2
    completions = ["<think>r</think><answer>" + boxes(([0, 0, 10, 10], "cat")) + "</answer>",
                   "<answer>None</answer>"]
    metrics, _ = score_records(records, completions, "pixels", BUDGET)
    assert metrics["detection_reward"] == pytest.approx(0.5) and metrics["format_rate"] == 0.5
    # pooled: one of two targets found, at precision 1: 101-point AP = 51/101
    assert (metrics["detection_ap"] == pytest.approx(51 / 101)
            and metrics["detection_ap50"] == pytest.approx(51 / 101))


def test_config_asking_for_a_missing_mathruler_is_refused_at_load(tmp_path, monkeypatch):
    import importlib.util

    from vlmexp.checks.loader import load_config
    from vlmexp.errors import VlmexpError

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "mathruler" else real(name, *a))
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"model": {"path": "tiny:qwen2_5_vl"}, "data": {"demo": {}},
                                    "eval": {"math_grader": "mathruler"},
                                    "grpo": {"rewards": [{"name": "math",
                                                          "kwargs": {"grader": "mathruler"}}]}}))
    with pytest.raises(VlmexpError) as e:
        load_config(path)
    text = str(e.value)
    assert ("eval.math_grader = 'mathruler'" in text
            and "grpo.rewards.0.kwargs.grader = 'mathruler'" in text), text
    assert text.count("pip install 'vlmexp[mathruler]'") == 2, text


def test_grpo_refuses_records_whose_answers_no_reward_scores():
    """Records of a task that no configured reward scores would train on the format reward alone: refused,
    naming the task and the reward that would score it, before the model loads."""
    from vlmexp.checks.loader import load_config
    from vlmexp.errors import ConfigError
    from vlmexp.rewards_loader import unscored_tasks
    from vlmexp.train.grpo import check_rewards_score

    cfg = load_config(Path(__file__).resolve().parents[1] / "configs" / "demo.yaml")  # rewards: format, iou
    check_rewards_score(cfg, {"rec"})
    with pytest.raises(ConfigError) as e:
        check_rewards_score(cfg, {"rec", "math", "detection"})
    text = str(e.value)
    assert "grpo.rewards" in text and "task 'math'" in text and "add math to grpo.rewards" in text
    assert "task 'detection'" in text and "add detection to grpo.rewards" in text and "task 'rec'" not in text
    assert unscored_tasks({"math"}, ["format", "mod:fn"]) == []  # a module:function reward may score anything
