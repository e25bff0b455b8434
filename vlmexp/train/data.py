"""Sampled records -> TRL datasets (prompts and targets from vlmexp.prompts, shared with evaluation).

SFT rows: conversational `prompt` / `completion` plus `images` (PIL); TRL's collator inserts the image
parts and computes the loss on the completion only. When a record holds earlier turns (a multi-turn
conversation), every row is conversational language modeling instead, `messages` (the prompt's turns and the
answer) plus `images`, and SFT trains with TRL's `assistant_only_loss`: the loss falls on every assistant turn
and on nothing else (`require_assistant_masks`). A record whose answer took tool calls (`tool_turns`) trains
on its calls and its answer, never on the tool turns, whose images (a zoom's crop) the processor loads from
their files: such rows keep `messages` as JSON text, turned into messages when the collator reads a row
(`tool_messages`), since one Arrow type cannot hold both TRL's `{"type": "image"}` placeholders and image
parts carrying their file. GRPO rows: conversational `prompt` plus the question's `images`;
the record's `reward_columns` (the source's other fields, then solution, task, accu_reward_method,
image_sizes, source_row, image_path) reach the reward functions as keyword columns.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from vlmexp.config.schema import DataConfig
from vlmexp.data.record import SampledRecord, read_sampled, reward_columns, source_column_names
from vlmexp.families import Family
from vlmexp.prompts import build_prompt, load_images, target_text


def build_dataset(path: str | Path, data: DataConfig, family: Family, budget, stage: str,
                  target_template: str | None = None):
    """A datasets.Dataset for `stage` ("sft" or "grpo") from a sampled JSONL file; SFT's targets per
    `target_template` (sft.target_template, `vlmexp.prompts.target_text`)."""
    from datasets import Dataset

    records = read_sampled(path)
    multi_turn = stage == "sft" and any(r.history or r.tool_turns for r in records)
    tool_use = stage == "sft" and any(r.tool_turns for r in records)
    # every row gets every column: Dataset.from_list takes the first row's keys
    names = source_column_names(records)
    rows = []
    for record in records:
        row: dict[str, Any] = {"prompt": build_prompt(record, data, family),
                               "images": load_images(record.question_images)}
        if stage == "sft":
            answer = [{"role": "assistant", "content": target_text(record, family, budget, target_template)}]
            if tool_use:
                row = {"messages": json.dumps(row.pop("prompt") + tool_messages(record) + answer), **row}
            elif multi_turn:
                row = {"messages": row.pop("prompt") + answer, **row}
            else:
                row["completion"] = answer
        else:
            row.update(reward_columns(record, names))
        rows.append(row)
    if stage != "sft":  # SFT's rows hold no reward columns
        check_column_types(path, rows, names)
    dataset = Dataset.from_list(rows)
    return dataset.with_transform(_decode_messages) if tool_use else dataset


def tool_messages(record: SampledRecord) -> list[dict[str, Any]]:
    """The record's tool use as chat messages: the assistant's turns (its calls rendered in its text) and the
    tool turns, each image part naming its file (the processor loads it; TRL fills only the placeholders of
    other turns)."""
    crops = iter(record.images[len(record.question_images):])
    out: list[dict[str, Any]] = []
    for turn in record.tool_turns:
        if turn["role"] == "assistant":
            out.append({"role": "assistant", "content": turn["content"]})
        else:
            parts = [{"type": "image", "image": next(crops)} for _ in range(turn.get("images", 0))]
            text = [{"type": "text", "text": turn["content"]}] if turn["content"] else []
            out.append({"role": "tool", "content": parts + text})
    return out


def _decode_messages(batch: dict[str, list]) -> dict[str, list]:
    """A batch of rows with their `messages` JSON turned into messages (the dataset's transform)."""
    return {**batch, "messages": [json.loads(m) for m in batch["messages"]]}


def check_column_types(path: str | Path, rows: list[dict[str, Any]], names: list[str]) -> None:
    """Refuse, naming the column, a source column whose values Arrow (TRL's datasets) cannot hold as one type,
    as when one source writes `difficulty: 2` and another `difficulty: "hard"`."""
    import pyarrow as pa

    from vlmexp.errors import DataError, Problem

    for name in names:
        try:
            pa.array([row[name] for row in rows])
        except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
            types = sorted({type(row[name]).__name__ for row in rows if row[name] is not None})
            raise DataError(Problem(str(path), name, f"the source column {name!r} holds values of different "
                                    f"types across records ({', '.join(types)}: {e}); GRPO's dataset (Arrow, "
                                    "as TRL's) needs one type per column: write it alike in every source, or "
                                    "give one source's column another name with `columns:`"),
                            title="a reward column TRL's dataset cannot hold") from None


def require_assistant_masks(args, processor) -> None:
    """Train on every assistant turn of `messages` rows: set `args.assistant_only_loss`, which TRL 1.16 gives
    a VLM through the chat template's `{% generation %}` markers, swapping in its own marked copy of a
    template it knows (Qwen2.5-VL's, Qwen3-VL's: trl/chat_templates/README.md, `get_training_chat_template`).
    A template it cannot mark is refused before any step (ConfigError with the fix)."""
    from trl.chat_template_utils import get_training_chat_template

    from vlmexp.errors import ConfigError, Problem

    try:
        get_training_chat_template(processor)
    except ValueError as e:
        raise ConfigError(Problem("model", "chat_template", "multi-turn records train SFT on every assistant "
                                  "turn through TRL's assistant_only_loss, which needs a chat template with "
                                  "{% generation %} markers or one TRL can mark (the released Qwen2.5-VL and "
                                  f"Qwen3-VL templates); this model's cannot be ({e}); add the markers to "
                                  "its chat template, or sample single-turn records")) from None
    args.assistant_only_loss = True


def check_sequence_lengths(path: str | Path, data: DataConfig, family: Family, budget, processor,
                           max_length: int | None, field: str, target_template: str | None = None) -> None:
    """Refuse, before any step, records whose image tokens plus prompt and answer do not fit `max_length`.

    TRL truncates such a sequence: cut inside the image placeholders, the model then fails with "Image
    features and image tokens do not match"; cut after them, the answer the loss is computed on is lost.
    """
    from vlmexp.errors import DataError, Problem

    if not max_length:
        return
    tokenizer = getattr(processor, "tokenizer", processor)
    limit = family.budget_knobs[-1]  # the knob that caps an image's tokens: max_pixels, max_patches
    problems = []
    for n, record in enumerate(read_sampled(path), start=1):
        image_tokens = sum(family.image_tokens(w, h, budget) for w, h in record.image_sizes)
        target = target_text(record, family, budget, target_template)
        turns = [*build_prompt(record, data, family), *record.tool_turns]
        text = "".join(m["content"] for m in turns) + target
        total = image_tokens + len(tokenizer(text)["input_ids"]) + 16  # + chat template and vision markers
        if total > max_length:
            problems.append(Problem(
                f"{path}:{n}", field, f"record from {record.where} needs about {total} tokens "
                f"({image_tokens} for its image(s) of {record.image_sizes} at {limit} "
                f"{getattr(budget, limit)}), over {field} = {max_length}: truncation would cut the image "
                f"tokens or the answer; raise {field} or lower model.{limit}"))
            if len(problems) >= 20:
                break
    if problems:
        raise DataError(problems, title="sequences longer than the training limit")
