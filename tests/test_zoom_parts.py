"""The zoom tool's parts without training: the crop a box gives in each family's frame, what a completion
did with the tool read from its messages, the tool reward on literal completions, Qwen2.5-VL's chat template
with tools, and the config's refusals (InternVL, a tool reward or evaluation with the tool but no tool)."""

from __future__ import annotations

from pathlib import Path

import pytest

from vlmexp.families.qwen import PixelBudget
from vlmexp.rewards import completion_text
from vlmexp.tools.zoom import ZoomEnvironment, ZoomRefused, crop_box, zoom_counts

REPO = Path(__file__).resolve().parents[1]
BUDGET = PixelBudget(patch_size=14, merge_size=2, min_pixels=3136, max_pixels=1003520)


def test_a_box_maps_from_the_family_frame_to_a_crop_inside_the_image_at_least_min_side():
    # 0-1000 grid of a 200 x 100 image: [250, 250, 750, 750] is x 50-150, y 25-75
    assert crop_box([250, 250, 750, 750], 200, 100, "grid1000", None, 28) == [50, 25, 150, 75]
    # Qwen2.5-VL: pixels of the resized image (200 x 100 -> 196 x 112 at factor 28)
    assert crop_box([0, 0, 98, 56], 200, 100, "pixels", BUDGET, 28) == [0, 0, 100, 50]
    # partly outside: clamped; a 4-pixel box grows to 28 around its centre, shifted inside the image
    assert crop_box([-50, 900, 100, 1200], 200, 100, "grid1000", None, 28) == [0, 72, 28, 100]
    assert crop_box([10, 10, 30, 30], 200, 100, "grid1000", None, 28) == [0, 0, 28, 28]
    assert crop_box([0, 0, 1000, 1000], 20, 10, "grid1000", None, 28) == [0, 0, 20, 10]  # the whole image
    with pytest.raises(ZoomRefused, match="^outside: .* lies outside the image"):
        crop_box([1100, 0, 1200, 500], 200, 100, "grid1000", None, 28)
    for bad in ([1, 2], "0,0,5,5", [5, 5, 1, 9], [0, 0, True, 4], None):
        with pytest.raises(ZoomRefused, match="^malformed: "):
            crop_box(bad, 200, 100, "grid1000", None, 28)


def test_the_environment_returns_the_crop_and_keeps_its_box():
    from PIL import Image

    image = Image.new("RGB", (200, 100), "white")
    image.paste((255, 0, 0), (50, 25, 150, 75))
    env = ZoomEnvironment("grid1000", None, 28)
    env.reset(images=[image], solution="red")
    [part] = env.image_zoom_in_tool([250, 250, 750, 750], label="the square")
    assert part["type"] == "image" and part["image"].size == (100, 50)
    assert part["image"].getcolors() == [(5000, (255, 0, 0))] and env.crops == [[50, 25, 150, 75]]
    env.reset(images=[image])
    assert env.crops == []


CALL = {"type": "function",
        "function": {"name": "image_zoom_in_tool", "arguments": {"bbox_2d": [1, 2, 3, 4]}}}
IMAGE = [{"type": "image", "image": None}]


def conversation(*turns):
    return [{"role": "assistant", "content": t, "tool_calls": [CALL]} if t == "call"
            else {"role": "tool", "name": "image_zoom_in_tool", "content": t} if not isinstance(t, str)
            or t.startswith("{'error'") else {"role": "assistant", "content": t} for t in turns]


def test_zoom_counts_and_the_tool_reward_read_the_conversation():
    from vlmexp.rewards_loader import build_reward

    zoomed = conversation("call", IMAGE, "<answer>red</answer>")
    refused = conversation("call", "{'error': 'outside: the box lies outside the image'}",
                           "<answer>red</answer>")
    looping = conversation("call", IMAGE, "call", IMAGE, "call")
    garbled = conversation("<tool_call>{oops</tool_call>")
    wrong = conversation("call", IMAGE, "<answer>blue</answer>")
    counts = [zoom_counts(c) for c in (zoomed, refused, looping, garbled, wrong)]
    assert [(c.zooms, c.problems, c.unanswered, c.malformed) for c in counts] == [
        (1, {}, False, 0), (0, {"outside": 1}, False, 0), (2, {}, True, 0), (0, {}, False, 1),
        (1, {}, False, 0)]
    logged = {}
    reward = build_reward("tool", {"max_turns": 2}, "grid1000", None)
    scores = reward(completions=[zoomed, refused, looping, garbled, wrong], solution=["red"] * 5,
                    task=["exact"] * 5, accu_reward_method=["all_match"] * 5,
                    log_metric=lambda k, v: logged.__setitem__(k, v))
    assert scores == [1.0, 0.0, 0.0, 0.0, 0.0]  # right and zoomed; right without a zoom scores no bonus
    assert logged == {"zoom/zooms_per_completion": 4 / 5, "zoom/zoomed_share": 3 / 5, "zoom/malformed": 1.0,
                      "zoom/outside": 1.0, "zoom/over_limit": 1.0, "zoom/cut": 0.0}
    # the final turn is what the accuracy rewards read
    assert build_reward("exact", {"default_match": "exact"}, "grid1000", None)(
        completions=[zoomed, wrong], solution=["red"] * 2, task=["exact"] * 2) == [1.0, 0.0]
    # Qwen's response parser moves a turn's <think> into reasoning_content: the format reward sees it again
    parsed = [*zoomed[:-1], {"role": "assistant", "content": "<answer>red</answer>",
                             "reasoning_content": "The zoom shows it."}]
    assert completion_text(parsed) == "<think>The zoom shows it.</think><answer>red</answer>"
    assert build_reward("format", {}, "grid1000", None)(completions=[parsed, zoomed]) == [1.0, 0.0]


def test_zoom_on_target_counts_records_whose_zooms_hold_the_whole_target():
    from vlmexp.tools.zoom import ZoomCounts, answer_zoom_metrics

    target = [40, 40, 60, 60]
    crops = [[[0, 0, 112, 112]], [[0, 0, 50, 112], [30, 30, 70, 70]], [[0, 0, 59, 112]], [], [[0, 0, 9, 9]]]
    counts = [ZoomCounts(zooms=len(c)) for c in crops]
    metrics = answer_zoom_metrics(counts, crops, [[target], [target], [target], [target], None])
    # held whole by one crop, by the second of two, cut by a pixel, no zoom; the last record has no box
    assert metrics == {"zooms_per_answer": 5 / 5, "zoomed_share": 4 / 5, "zoom_on_target": 2 / 4}
    assert "zoom_on_target" not in answer_zoom_metrics(counts[:1], crops[:1], [None])


def test_zoom_on_target_with_two_targets_needs_both_held():
    """V*'s relative-position questions name two targets: the zooms held them when each is whole inside one
    of the crops (one crop for both, or one each); one of the two is not enough."""
    from vlmexp.tools.zoom import ZoomCounts, answer_zoom_metrics

    left, right = [10, 10, 20, 20], [80, 10, 90, 20]
    crops = [[[0, 0, 100, 30]], [[5, 5, 25, 25], [75, 5, 95, 25]], [[5, 5, 25, 25]]]
    metrics = answer_zoom_metrics([ZoomCounts(zooms=len(c)) for c in crops], crops, [[left, right]] * 3)
    assert metrics["zoom_on_target"] == 2 / 3


def test_qwen2_5_vl_tool_template_renders_tools_calls_and_tool_images(tiny_models):
    from trl.chat_template_utils import (
        get_training_chat_template,
        is_chat_template_prefix_preserving,
        supports_tool_calling,
    )

    from vlmexp.families import get_family
    from vlmexp.processor import load_processor
    from vlmexp.tools.zoom import ZoomEnvironment

    family = get_family("qwen2_5_vl")
    processor = load_processor(tiny_models["qwen2_5_vl"], family)
    plain = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour?"}]},
             {"role": "assistant", "content": "<answer>red</answer>"}]
    released = processor.apply_chat_template(plain, tokenize=False)
    family.use_tools(processor)
    assert processor.apply_chat_template(plain, tokenize=False) == released  # no tools: byte for byte
    assert supports_tool_calling(processor) and is_chat_template_prefix_preserving(processor)
    assert get_training_chat_template(processor) is None  # assistant-only loss markers are in it
    env = ZoomEnvironment("pixels", None)
    messages = [plain[0], {"role": "assistant", "content": "", "tool_calls": [CALL]},
                {"role": "tool", "name": "image_zoom_in_tool", "content": [{"type": "image"}]},
                plain[1]]
    text = processor.apply_chat_template(messages, tools=[env.image_zoom_in_tool], tokenize=False)
    assert '{"type": "function", "function": {"name": "image_zoom_in_tool"' in text  # the tools block
    assert '"bbox_2d": {"type": "array", "items": {"type": "number"}' in text
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "image_zoom_in_tool", "arguments": {"bbox_2d": '
            '[1, 2, 3, 4]}}\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n'
            '<|vision_start|><|image_pad|><|vision_end|>\n</tool_response><|im_end|>') in text
    # the response parser reads the call back
    ids = processor.tokenizer.encode('<tool_call>\n{"name": "image_zoom_in_tool", "arguments": '
                                     '{"bbox_2d": [1, 2, 3, 4]}}\n</tool_call><|im_end|>')
    from trl.chat_template_utils import parse_response

    prefix = processor.tokenizer.encode("<|im_start|>assistant\n")
    assert parse_response(processor.tokenizer, ids, prefix=prefix)["tool_calls"] == [CALL]


def test_validate_refuses_tools_for_internvl_and_tool_settings_without_a_tool(vlmexp_main):
    rc, out, err = vlmexp_main("validate", "--no-check-paths", REPO / "configs/demo.yaml",
                               "model.path=tiny:internvl", "model.min_pixels=null", "model.max_pixels=null",
                               "grpo.tools.names=[zoom]")
    assert rc != 0 and "grpo.tools.names" in err and "internvl cannot call tools" in err
    assert "huggingface/trl#6906" in err and "<IMG_CONTEXT>" in err
    rc, out, err = vlmexp_main("validate", "--no-check-paths", REPO / "configs/demo.yaml",
                               "grpo.rewards=[{name: tool}]", "eval.tools=on")
    assert rc != 0 and "grpo.tools.names offers none" in err
    rc, out, err = vlmexp_main("validate", "--no-check-paths", REPO / "configs/demo.yaml", "eval.tools=both")
    assert rc != 0 and "evaluation with the tool needs a tool" in err
    rc, out, err = vlmexp_main("validate", "--no-check-paths", REPO / "configs/demo.yaml",
                               "grpo.tools.names=[zoom]", "grpo.rewards=[{name: exact}, {name: tool}]")
    assert rc == 0, err
