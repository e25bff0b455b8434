"""What SFT trains on: a rec record's box, the answer text a record carries (pairs: chosen; conversations:
the gpt turn), or sft.target_template; records with only a ground truth are refused before any step."""

from __future__ import annotations

import pytest
from conftest import make_png, write_json, write_jsonl

from vlmexp.cli import main
from vlmexp.config.schema import DataSource
from vlmexp.config.stages import SFTStageConfig
from vlmexp.data.record import SampledRecord, read_sampled
from vlmexp.data.sampling import sample_sources
from vlmexp.errors import DataError
from vlmexp.families import get_family
from vlmexp.processor import PixelBudget
from vlmexp.prompts import check_sft_targets, target_text

BUDGET = PixelBudget(patch_size=14, merge_size=2, min_pixels=3136, max_pixels=102400)
FAMILY = get_family("qwen2_5_vl")
TEMPLATE = "<think>{problem}</think><answer>{answer}</answer>"


@pytest.fixture
def sampled(tmp_path) -> dict[str, list[SampledRecord]]:
    """Sampled records of each format, by format, from real sources."""
    make_png(tmp_path / "a.png", (112, 112))  # stays 112 x 112: boxes keep their pixels
    sources = {
        "rec": write_json(tmp_path / "rec.json", [{"image": "a.png", "problem": "the red thing",
                                                   "solution": [1, 2, 30, 40]}]),
        "conversations": write_jsonl(tmp_path / "conv.jsonl", [{"image": "a.png", "conversations": [
            {"from": "human", "value": "<image>What colour?"},
            {"from": "gpt", "value": "<answer>red</answer>"}]}]),
        "pairs": write_jsonl(tmp_path / "pairs.jsonl", [{"image": "a.png", "question": "What colour?",
                                                         "chosen": "It is red.", "rejected": "Blue."}]),
        "easyr1": write_jsonl(tmp_path / "geo.jsonl", [{"problem": "<image>Find x.", "answer": "30",
                                                        "images": ["a.png"]}] * 3),
    }
    out = {}
    for fmt, path in sources.items():
        result = sample_sources([DataSource(json_path=str(path), image_root=str(tmp_path))],
                                tmp_path / f"{fmt}.out.jsonl", 0)
        out[fmt] = read_sampled(result.path)
    return out


def test_targets_per_record_format(sampled):
    assert target_text(sampled["rec"][0], FAMILY, BUDGET) == ("<think>the red thing is here.</think>"
                                                              "<answer>[1, 2, 30, 40]</answer>")
    assert target_text(sampled["conversations"][0], FAMILY, BUDGET) == "<answer>red</answer>"  # as written
    assert target_text(sampled["pairs"][0], FAMILY, BUDGET) == "It is red."
    easyr1 = sampled["easyr1"][0]
    with pytest.raises(ValueError, match=r"this record \(format 'easyr1', task 'math'\) holds only "
                                         r"a ground-truth answer.*"
                                         r"set sft.target_template"):
        target_text(easyr1, FAMILY, BUDGET)
    assert target_text(easyr1, FAMILY, BUDGET, TEMPLATE) == "<think>Find x.</think><answer>30</answer>"
    assert target_text(sampled["pairs"][0], FAMILY, BUDGET, TEMPLATE) == ("<think>What colour?</think>"
                                                                          "<answer>It is red.</answer>")
    assert target_text(sampled["rec"][0], FAMILY, BUDGET, TEMPLATE).endswith(
        "<answer>[1, 2, 30, 40]</answer>")  # the box


def test_check_names_each_source_without_answer_text(sampled, tmp_path):
    def lines(*fmts):
        return [r.to_json() for fmt in fmts for r in sampled[fmt]]

    mixed = write_jsonl(tmp_path / "train.jsonl", lines("rec", "easyr1", "pairs"))
    with pytest.raises(DataError) as e:
        check_sft_targets(mixed, None)
    [problem] = e.value.problems
    source = sampled["easyr1"][0].source
    assert str(problem).startswith(f"{source} row 0: sft.target_template: "
                                   "this record (format 'easyr1', task 'math') "
                                   "holds only a ground-truth answer, no answer text for SFT to imitate")
    assert "(3 such record(s) from this source)" in str(problem) and "or sft.enabled: false" in str(problem)
    check_sft_targets(mixed, TEMPLATE)  # named: nothing to refuse
    check_sft_targets(write_jsonl(tmp_path / "ok.jsonl", lines("rec", "conversations")), None)


@pytest.mark.parametrize("template, needle", [
    ("<answer>{solution}</answer>", "uses ['solution']; only {answer} and {problem} exist"),
    ("<think>{problem}</think>", "must contain {answer}"),
    ("<answer>{answer</answer>", "is malformed"),
])
def test_target_template_is_checked_by_the_schema(template, needle):
    with pytest.raises(ValueError, match=needle.replace("[", r"\[").replace("{", r"\{")):
        SFTStageConfig(target_template=template)


def test_sft_refuses_before_any_step(tmp_path, tiny_models, sampled, capsys):
    """`vlmexp train sft` on EasyR1 records: refused with the source, the task and the fix; nothing trained.
    With sft.target_template the SFT dataset holds the template's text."""
    from vlmexp.config.schema import DataConfig
    from vlmexp.train.data import build_dataset

    source = sampled["easyr1"][0].source
    config = tmp_path / "c.yaml"
    config.write_text(f"run:\n  output_dir: {tmp_path / 'out'}\nmodel:\n  path: {tiny_models['qwen2_5_vl']}\n"
                      f"tracking:\n  backend: none\nsft:\n  args: {{max_steps: 1}}\ndata:\n  datasets:\n"
                      f"    - {{json_path: {source}, image_root: {tmp_path}}}\n")
    assert main(["train", "sft", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert (f"{source} row 0: sft.target_template" in err and "task 'math'" in err
            and "set sft.target_template" in err), err
    assert (not list((tmp_path / "out").rglob("checkpoint-*"))
            and not (tmp_path / "out" / "sft" / "final").exists())
    train = tmp_path / "out" / "data" / "train.jsonl"
    rows = build_dataset(train, DataConfig(datasets=[DataSource(json_path=source)]), FAMILY, BUDGET, "sft",
                         TEMPLATE)
    assert rows[0]["completion"] == [{"role": "assistant",
                                      "content": "<think>Find x.</think><answer>30</answer>"}]
