"""Each reward against literal completions, malformed ones included; the registry and custom rewards."""

from __future__ import annotations

import pickle
import sys
from pathlib import Path

import pytest

from vlmexp.processor import PixelBudget
from vlmexp.rewards import (
    ExactReward,
    FormatReward,
    IoUReward,
    MathReward,
    RewardError,
    completion_text,
    extract_answer,
    guarded,
)
from vlmexp.rewards_loader import build_reward, check_reward_name

BUDGET = PixelBudget(patch_size=14, merge_size=2, min_pixels=3136, max_pixels=12845056)


def msg(text: str) -> list[dict]:
    return [{"role": "assistant", "content": text}]


def test_completion_text_and_answer_extraction():
    assert completion_text(msg("hi")) == "hi" and completion_text("x") == "x"
    assert completion_text([{"role": "assistant", "content": [{"type": "text", "text": "a"}]}]) == "a"
    assert extract_answer("<answer> 42 </answer>") == "42"
    assert extract_answer("so \\boxed{\\frac{1}{2}} done") == "\\frac{1}{2}"
    assert extract_answer("<answer>1</answer> then <answer>2</answer>") == "2"
    assert extract_answer("nothing") is None


def test_format_reward():
    r = FormatReward()
    assert r(completions=[msg("<think>a</think><answer>b</answer>"),
                          msg(" <think>\na\n</think>\n<answer>b</answer>\n"),
                          msg("<answer>b</answer>"), msg("<think>a</think><answer>b</answer> trailing"),
                          msg("")]) == [1.0, 1.0, 0.0, 0.0, 0.0]
    assert FormatReward(think_tag="reason")(completions=["<reason>x</reason><answer>y</answer>"]) == [1.0]


def test_iou_pixels_frame_by_hand():
    # 1000x500 image -> resized 1008x504 (x and y scale 1.008). GT [100, 50, 200, 100] is
    # [100.8, 50.4, 201.6, 100.8] in the model's frame.
    r = IoUReward(frame="pixels", budget=BUDGET)
    gt, size = [100, 50, 200, 100], [[1000, 500]]
    scores = r(completions=[msg("<answer>[100.8, 50.4, 201.6, 100.8]</answer>"),
                            msg('<answer>{"bbox_2d": [151.2, 50.4, 252, 100.8]}</answer>'),  # shifted by half
                            msg("<answer>[100, 50, 200, 100]</answer>")],
               solution=[gt] * 3, image_sizes=[size] * 3)
    assert scores[0] == pytest.approx(1.0)
    assert scores[1] == pytest.approx(50 / 150)
    # the raw original-pixel box, read as model-frame pixels, maps back to [100, 50, 200, 100] / 1.008
    x1, y1, x2, y2 = (v / 1.008 for v in (100, 50, 200, 100))
    inter = (x2 - 100) * (y2 - 50)
    assert scores[2] == pytest.approx(inter / (5000 + (x2 - x1) * (y2 - y1) - inter))


def test_iou_grid1000_frame_by_hand():
    r = IoUReward(frame="grid1000")
    # 200x100 image, GT [20, 10, 60, 50] -> grid [100, 100, 300, 500]
    scores = r(completions=["<answer>[100, 100, 300, 500]</answer>", "<answer>[200, 100, 400, 500]</answer>"],
               solution=[[20, 10, 60, 50]] * 2, image_sizes=[[[200, 100]]] * 2)
    assert scores == [pytest.approx(1.0), pytest.approx(1 / 3)]


class Hooks:
    """What TRL's GRPOTrainer passes every reward: `log_metric` and `log_extra`, recorded."""

    def __init__(self):
        self.metrics, self.extra = {}, {}

    def kwargs(self):
        return {"log_metric": self.metrics.__setitem__, "log_extra": self.extra.__setitem__}


def test_iou_malformed_completions_score_zero_and_are_counted_through_the_hooks():
    r, hooks = IoUReward(frame="grid1000"), Hooks()
    completions = ["no tags at all", "<answer>left corner</answer>", "<answer>[50, 50, 10, 10]</answer>",
                   "<answer>[0, 0, 500, 500]</answer>"]
    assert r(completions=completions, solution=[[0, 0, 5, 5]] * 4, image_sizes=[[[10, 10]]] * 4,
             **hooks.kwargs()) == [0.0] * 3 + [1.0]
    assert hooks.metrics == {"rewards/iou/unparsable/no_answer": 1.0, "rewards/iou/unparsable/no_box": 1.0,
                             "rewards/iou/unparsable/degenerate_box": 1.0,
                             "rewards/iou/unparsable/non_finite_box": 0.0}
    assert hooks.extra == {"iou/unparsable": ["no_answer", "no_box", "degenerate_box", None]}
    # stateless: a second call reports its own counts only, and no hooks (evaluation) report nothing
    assert r(completions=completions[:1], solution=[[0, 0, 5, 5]], image_sizes=[[[10, 10]]],
             **hooks.kwargs()) == [0.0]
    assert (hooks.metrics["rewards/iou/unparsable/no_box"] == 0.0
            and hooks.extra["iou/unparsable"] == ["no_answer"])
    assert r(completions=completions[:1], solution=[[0, 0, 5, 5]], image_sizes=[[[10, 10]]]) == [0.0]


def test_registry_entries_are_reward_classes():
    from vlmexp.rewards import REGISTRY, GIoUReward, IoUThresholdReward, Reward

    assert all(isinstance(cls, type) and issubclass(cls, Reward) and cls.name == name
               for name, cls in REGISTRY.items())
    assert REGISTRY["iou_threshold"] is IoUThresholdReward and REGISTRY["giou"] is GIoUReward
    assert build_reward("iou_threshold", {"threshold": 0.75}, "grid1000", None).fn == IoUThresholdReward(
        frame="grid1000", threshold=0.75)


def test_iou_threshold_and_task_filter():
    r = build_reward("iou_threshold", {"threshold": 0.5}, "grid1000", None)
    scores = r(completions=["<answer>[0, 0, 1000, 1000]</answer>", "<answer>[0, 0, 500, 1000]</answer>",
                            "<answer>[0, 0, 400, 1000]</answer>", "<answer>7</answer>"],
               solution=[[0, 0, 10, 10]] * 3 + ["7"], image_sizes=[[[10, 10]]] * 4,
               task=["rec", "rec", "rec", "math"])
    assert scores == [1.0, 1.0, 0.0, None]


@pytest.mark.parametrize("answer, solution, expected", [
    ("<answer>0.5</answer>", "1/2", 1.0),
    ("<answer>\\frac{1}{2}</answer>", "0.5", 1.0),
    ("The result is \\boxed{30^\\circ}", "30", 1.0),
    ("<answer>2\\sqrt{3}</answer>", "\\sqrt{12}", 1.0),
    ("<answer>x = 4</answer>", "4", 1.0),
    ("<answer>5</answer>", "4", 0.0),
])
def test_math_reward_notations(answer, solution, expected):
    assert MathReward()(completions=[answer], solution=[solution], task=["math"]) == [expected]


def test_math_reward_malformed():
    r, hooks = MathReward(), Hooks()
    assert r(completions=["I don't know", "<answer></answer>"], solution=["3", "3"],
             **hooks.kwargs()) == [0.0, 0.0]
    assert hooks.metrics["rewards/math/unparsable/no_answer"] == 1 and sum(hooks.metrics.values()) == 2


@pytest.mark.parametrize("answer, solution, expected", [
    ("<answer>A Cat.</answer>", "a cat", 1.0),
    ("<answer>(B)</answer>", "B", 1.0),
    ("<answer>B. the dog</answer>", "B", 1.0),
    ("<answer>C</answer>", "B", 0.0),
    ("<answer>yes</answer>", "no", 0.0),
])
def test_exact_reward(answer, solution, expected):
    assert ExactReward()(completions=[answer], solution=[solution]) == [expected]


def custom_len(prompts, completions, **kwargs):
    return [float(len(completion_text(c))) for c in completions]


def broken(prompts, completions, solution, **kwargs):
    return [1.0 / (len(s) - 3) for s in solution]


def test_custom_reward_by_module_function():
    r = build_reward("test_rewards:custom_len", {}, "pixels", None)
    assert r(completions=[msg("abc"), "hello"]) == [3.0, 5.0]
    assert r.__name__ == "test_rewards:custom_len"


def test_raising_reward_names_itself_and_the_sample():
    r = build_reward("test_rewards:broken", {}, "pixels", None)
    with pytest.raises(RewardError) as e:
        r(prompts=["p0", "p1"], completions=["ok", "bad"], solution=["ab", "abc"])
    assert ("reward 'test_rewards:broken'" in str(e.value) and "sample 1" in str(e.value)
            and "'bad'" in str(e.value))


@pytest.mark.parametrize("name, needle", [
    ("accuracy", "unknown reward 'accuracy'"),
    ("os.system", "unknown reward"),
    ("no_such_module_xyz:f", "cannot import"),
    ("test_rewards:nothing_here", "no callable 'nothing_here'"),
    ("a:b c", "neither a registered name"),
])
def test_bad_reward_names(name, needle):
    with pytest.raises(ValueError) as e:
        check_reward_name(name)
    assert needle in str(e.value)


def test_bad_reward_kwargs():
    with pytest.raises(ValueError, match="bad kwargs"):
        build_reward("format", {"tag": "x"}, "pixels", None)


def test_rewards_pickle():
    r = build_reward("iou", {}, "pixels", BUDGET)
    again = pickle.loads(pickle.dumps(r))
    # a 28x28 image is upscaled to 56x56 (min_pixels 3136), so the full image is [0, 0, 56, 56]
    assert again(completions=["<answer>[0, 0, 56, 56]</answer>"], solution=[[0, 0, 28, 28]],
                 image_sizes=[[[28, 28]]]) == [pytest.approx(1.0)]


def test_non_finite_and_none_scores_are_masked_and_counted():
    import math

    sys_path = str(Path(__file__).parent)
    if sys_path not in sys.path:
        sys.path.insert(0, sys_path)
    r, hooks = build_reward("rewards_for_tests:sometimes_broken", {}, "grid1000", None), Hooks()
    scores = r(prompts=["p"] * 12, completions=["abc"] * 12, **hooks.kwargs())
    assert scores[0] is None and scores[4] is None and scores[8] is None  # NaN, inf, None
    assert all(s is None or math.isfinite(s) for s in scores) and scores[1] == pytest.approx(3 / 20)
    prefix = "rewards/rewards_for_tests:sometimes_broken/masked/"
    assert hooks.metrics == {prefix + "nan": 1.0, prefix + "inf": 1.0, prefix + "none": 1.0}
    # a built-in's None means "not this sample's task": not counted as masked
    iou, hooks = build_reward("iou", {}, "grid1000", None), Hooks()
    assert iou(completions=["x"], solution=["1"], task=["math"], **hooks.kwargs()) == [None]
    assert not any("/masked/" in k for k in hooks.metrics)


def test_reward_returning_the_wrong_shape_or_type_names_itself():
    bad_len = guarded(lambda prompts=None, completions=(), **k: [1.0], "short")
    with pytest.raises(RewardError, match="'short' must return a list of 2 scores"):
        bad_len(completions=["a", "b"])
    bad_type = guarded(lambda prompts=None, completions=(), **k: ["high"], "wordy")
    with pytest.raises(RewardError, match="'wordy' returned 'high' for sample 0; return a float or None"):
        bad_type(completions=["a"])


def zoomed(*boxes: list[int]) -> list[dict]:
    """A tool conversation whose calls zoom into `boxes` (grid1000 frame), each answered by a crop."""
    turns = []
    for box in boxes:
        call = {"type": "function", "function": {"name": "image_zoom_in_tool", "arguments": {"bbox_2d": box}}}
        turns += [{"role": "assistant", "content": "", "tool_calls": [call]},
                  {"role": "tool", "name": "image_zoom_in_tool", "content": [{"type": "image"}]}]
    return [*turns, {"role": "assistant", "content": "<answer>red</answer>"}]


def test_zoom_target_pays_the_share_of_the_target_the_zooms_held():
    """200 x 100 image, target x 40-60, y 40-60: a crop of x 0-100 holds it, one of x 50-200 half of it; the
    best of several crops counts; no zoom scores 0, a record without a box None; `whole` pays only a held
    target; two targets average."""
    from vlmexp.config.stages import GRPOStageConfig
    from vlmexp.scoring import without_tool_reward
    from vlmexp.tools import reward_specs

    completions = [zoomed([0, 0, 500, 1000]), zoomed([250, 0, 1000, 1000]),
                   zoomed([250, 0, 1000, 1000], [100, 300, 400, 700]), msg("<answer>red</answer>"),
                   zoomed([0, 0, 500, 1000])]
    columns = {"bbox": [[40, 40, 60, 60]] * 4 + [None], "image_sizes": [[[200, 100]]] * 5}
    assert build_reward("zoom_target", {}, "grid1000", None)(completions=completions, **columns) == [
        1.0, 0.5, 1.0, 0.0, None]
    assert build_reward("zoom_target", {"whole": True}, "grid1000", None)(
        completions=completions, **columns) == [1.0, 0.0, 1.0, 0.0, None]
    # max_crop_side: a crop wider than 60 pixels (x 0-100 of the 200) holds nothing, one of x 30-80 does
    narrow = zoomed([250, 0, 1000, 1000], [150, 300, 400, 700])
    assert build_reward("zoom_target", {"whole": True, "max_crop_side": 60}, "grid1000", None)(
        completions=[completions[0], narrow], **{k: v[:2] for k, v in columns.items()}) == [0.0, 1.0]
    with pytest.raises(ValueError, match=r"max_crop_side 20 must be a whole number of pixels at least "
                                         r"grpo.tools.min_crop_side \(28\)"):
        build_reward("zoom_target", {"max_crop_side": 20}, "grid1000", None)
    two = {"bbox": [[[40, 40, 60, 60], [150, 40, 170, 60]]], "image_sizes": [[[200, 100]]]}
    assert build_reward("zoom_target", {}, "grid1000", None)(completions=completions[:1], **two) == [0.5]
    # GRPO tells it the tool's min_crop_side; a single answer's scoring leaves it out; it needs the tool
    grpo = GRPOStageConfig(rewards=[{"name": "exact"}, {"name": "zoom_target"}],
                           tools={"names": ["zoom"], "min_crop_side": 40})
    assert [s.kwargs for s in reward_specs(grpo)] == [{}, {"min_crop_side": 40}, {"max_turns": 3}]
    assert [r.name for r in without_tool_reward(grpo.rewards)] == ["exact"]
    with pytest.raises(ValueError, match="the zoom_target reward scores completions that called a tool"):
        GRPOStageConfig(rewards=[{"name": "zoom_target"}])
