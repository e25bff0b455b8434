"""`vlmexp score`: completions from any system scored by the training rewards, against hand-computed
values."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import make_png, write_jsonl

from vlmexp.coords import giou
from vlmexp.errors import DataError
from vlmexp.evaluate import score_predictions
from vlmexp.rewards import GIoUReward

REPO = Path(__file__).resolve().parents[1]


def score_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vlmexp.cli", "score", *args], capture_output=True,
                          text=True, cwd=REPO)


def test_score_pixels_frame_by_hand(tmp_path):
    # 1000x500 image: Qwen2.5-VL resizes it to 1008x504 (scale 1.008 on both axes) with the released
    # checkpoints' pixel budget, so GT [100, 50, 200, 100] is [100.8, 50.4, 201.6, 100.8] in its frame.
    make_png(tmp_path / "img" / "wide.png", size=(1000, 500))
    rec = {"image": "img/wide.png", "problem": "the red box", "solution": [100, 50, 200, 100], "task": "rec"}
    preds = write_jsonl(tmp_path / "preds.jsonl", [
        {**rec, "completion": "<think>x</think><answer>[100.8, 50.4, 201.6, 100.8]</answer>"},  # IoU 1
        {**rec,
         "completion": '<think>x</think><answer>{"bbox_2d": [151.2, 50.4, 252, 100.8]}</answer>'},  # 1/3
        {**rec, "completion": "<answer>[151.2, 50.4, 252, 100.8]</answer>"},  # 1/3, no think: format 0
        {**rec, "completion": "<think>x</think><answer>the left one</answer>"},  # no box: 0
    ])
    r = score_cli(str(preds), "--family", "qwen2_5_vl", "--per-sample", str(tmp_path / "scores.jsonl"))
    assert r.returncode == 0, r.stderr
    metrics = json.loads(r.stdout)
    assert metrics["count"] == 4
    assert metrics["rec_mean_iou"] == pytest.approx((1 + 1 / 3 + 1 / 3 + 0) / 4)
    assert metrics["rec_acc50"] == pytest.approx(0.25) and metrics["rec_acc75"] == pytest.approx(0.25)
    assert metrics["format_rate"] == pytest.approx(0.75)
    assert "math_accuracy" not in metrics  # only the tasks the file holds
    rows = [json.loads(line) for line in (tmp_path / "scores.jsonl").read_text().splitlines()]
    assert [round(row["score"], 4) for row in rows] == [1.0, 0.3333, 0.3333, 0.0]
    assert rows[1]["answer"] == '{"bbox_2d": [151.2, 50.4, 252, 100.8]}'


def test_score_pixel_budget_options_change_the_frame(tmp_path):
    # With max_pixels 250000 the 1000x500 image resizes to 700x336 (a multiple of 28, area <= 250000):
    # the GT box is [70, 33.6, 140, 67.2] there, and the default-budget answer no longer matches.
    make_png(tmp_path / "wide.png", size=(1000, 500))
    rec = {"image": "wide.png", "problem": "p", "solution": [100, 50, 200, 100], "task": "rec"}
    preds = write_jsonl(tmp_path / "p.jsonl", [{**rec,
                                                "completion": "<answer>[70, 33.6, 140, 67.2]</answer>"}])
    small, _ = score_predictions(preds, "qwen2_5_vl", {"max_pixels": 250000})
    default, _ = score_predictions(preds, "qwen2_5_vl")
    assert small["rec_mean_iou"] == pytest.approx(1.0)
    assert default["rec_mean_iou"] < 0.2


def test_score_grid1000_frame_by_hand(tmp_path):
    # Qwen2-VL answers on a 0-1000 grid: for a 200x100 image GT [20, 10, 60, 50] is [100, 100, 300, 500]
    make_png(tmp_path / "a.png", size=(200, 100))
    rec = {"image": str(tmp_path / "a.png"), "problem": "p", "solution": "[20, 10, 60, 50]", "task": "rec"}
    preds = write_jsonl(tmp_path / "p.jsonl", [{**rec, "completion": "<answer>[100, 100, 300, 500]</answer>"},
                                               {**rec,
                                                "completion": "<answer>[200, 100, 400, 500]</answer>"}])
    metrics, rows = score_predictions(preds, "qwen2_vl")
    assert [r["score"] for r in rows] == [pytest.approx(1.0), pytest.approx(1 / 3)]
    assert metrics["rec_mean_iou"] == pytest.approx(2 / 3) and metrics["rec_acc50"] == 0.5


def test_score_math_notations_and_exact_answers(tmp_path):
    make_png(tmp_path / "g.png")
    math = {"problem": "Find x.", "answer": "0.5", "images": ["g.png"], "task": "math"}
    exact = {"image": "g.png", "conversations": [{"from": "human", "value": "<image>Colour?"},
                                                 {"from": "gpt", "value": "Red."}], "task": "exact"}
    preds = write_jsonl(tmp_path / "p.jsonl", [
        {**math, "completion": "<think>…</think><answer>\\frac{1}{2}</answer>"},
        {**math, "completion": "so x = \\boxed{1/2}"},
        {**math, "completion": "<answer>50\\%</answer>"},  # math-verify reads percentages as 0.5
        {**math, "completion": "<answer>2</answer>"},
        {**exact, "completion": "<answer>red</answer>"},
        {**exact, "completion": "<answer>blue</answer>"},
    ])
    metrics, rows = score_predictions(preds, "qwen2_5_vl")
    assert [r["score"] for r in rows[:4]] == [1.0, 1.0, 1.0, 0.0]
    # "default" as VLM-R1 scores it: "blue" against "Red." earns the Levenshtein ratio of "blue" and "red",
    # 2/7
    assert (metrics["math_accuracy"] == pytest.approx(0.75)
            and metrics["exact_accuracy"] == pytest.approx((1 + 2 / 7) / 2))
    assert "rec_mean_iou" not in metrics and metrics["count"] == 6


def test_score_refuses_bad_lines_naming_file_and_line(tmp_path):
    make_png(tmp_path / "a.png")
    good = {"image": "a.png", "problem": "p", "solution": [1, 1, 5, 5], "task": "rec", "completion": "x"}
    preds = write_jsonl(tmp_path / "p.jsonl", [good, {**good, "completion": None},
                                               {"foo": 1, "completion": "x"},
                                               {**good, "image": "missing.png"}, "{not json"])
    with pytest.raises(DataError) as e:
        score_predictions(preds, "qwen2_5_vl")
    assert f"{preds}:5" in str(e.value) and "malformed JSON" in str(e.value)
    r = score_cli(str(write_jsonl(tmp_path / "q.jsonl", [good, {**good, "completion": None},
                                                         {"foo": 1, "completion": "x"},
                                                         {**good, "image": "missing.png"}])),
                  "--family", "qwen2_5_vl")
    assert r.returncode == 2 and r.stdout == ""
    for needle in ("q.jsonl:2: completion = None", "q.jsonl:3", "unknown record format", "q.jsonl:4: image",
                   "image not found"):
        assert needle in r.stderr, (needle, r.stderr)


def test_giou_reward_by_hand():
    # same-size boxes side by side with a gap of 100: IoU 0, GIoU = 0 - (enclosing - union) / enclosing
    assert giou([0, 0, 100, 100], [200, 0, 300, 100]) == pytest.approx(-1 / 3)
    assert giou([0, 0, 100, 100], [0, 0, 100, 100]) == pytest.approx(1.0)
    r = GIoUReward(frame="grid1000")
    # 1000x1000 image: grid == pixels; a far box scores less than a near one although both have IoU 0
    far, near = "<answer>[600, 0, 700, 100]</answer>", "<answer>[200, 0, 300, 100]</answer>"
    scores = r(completions=[far, near, "<answer>[0, 0, 100, 100]</answer>", "no answer"],
               solution=[[0, 0, 100, 100]] * 4, image_sizes=[[[1000, 1000]]] * 4)
    assert scores[0] < scores[1] < scores[2] == pytest.approx(1.0) and scores[3] == 0.0
    assert scores[1] == pytest.approx((1 - 1 / 3) / 2)


def test_evaluation_scores_with_the_configured_rewards():
    """Evaluation builds its scorers with build_reward from grpo.rewards: a boxed-style format reward in the
    config is the format evaluation measures (the metric names stay)."""
    from vlmexp.config.stages import RewardSpec
    from vlmexp.data.record import SampledRecord
    from vlmexp.scoring import score_records

    records = [SampledRecord(task="math", method="math", problem="1+1?", solution="2", images=[],
                             image_sizes=[], image_refs=[], source="s.jsonl", source_id="", source_row=0,
                             record_format="easyr1")] * 2
    texts = ["<think>add</think> so \\boxed{2}", "<think>add</think><answer>3</answer>"]
    default, default_rows = score_records(records, texts, "pixels", None)
    boxed, rows = score_records(records, texts, "pixels", None,
                                [RewardSpec(name="format", kwargs={"style": "boxed"}),
                                 RewardSpec(name="math")])
    assert default == {"count": 2.0, "format_rate": 0.5, "math_accuracy": 0.5}
    assert boxed == {"count": 2.0, "format_rate": 0.5, "math_accuracy": 0.5}
    assert [r["format"] for r in default_rows] == [0.0, 1.0]  # the "answer" style by default
    assert [r["format"] for r in rows] == [1.0, 0.0] and [r["score"] for r in rows] == [1.0, 0.0]


def test_score_reads_conversational_records_and_keeps_completion_for_the_output(tmp_path):
    """TRL and LLaMA-Factory records are scored like the sampler reads them; `completion` is always the
    model's output (a prompt-only record is not taken for a prompt-completion one)."""
    make_png(tmp_path / "a.png")
    trl = {"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "2+2?"}]}],
           "image": "a.png", "solution": "4", "task": "math"}
    chat = {"messages": [{"role": "user", "content": "<image>Colour?"},
                         {"role": "assistant", "content": "red"}],
            "images": ["a.png"]}
    preds = write_jsonl(tmp_path / "p.jsonl", [{**trl, "completion": "<think>x</think><answer>4</answer>"},
                                               {**trl, "completion": "<answer>5</answer>"},
                                               {**chat,
                                                "completion": "<think>x</think><answer>red</answer>"}])
    metrics, rows = score_predictions(preds, "qwen2_5_vl")
    assert ([r["score"] for r in rows] == [1.0, 0.0, 1.0]
            and [r["problem"] for r in rows][::2] == ["2+2?", "Colour?"])
    assert metrics["math_accuracy"] == 0.5 and metrics["exact_accuracy"] == 1.0
