"""Record formats a source may use, detected per source from its first record.

(a) "rec": VLM-R1 REC, {"image", "problem", "solution": [x1, y1, x2, y2]} (box in original pixels; the
    solution may be a string holding the list or <answer>[...]</answer>); optional "demonstration": another
    box, the one SFT imitates (an annotator's), while rewards and evaluation score against the solution.
(b) "conversations": VLM-R1 JSONL, {"id", "image": str | list, "conversations": [{"from": "human",
    "value": "<image>..."}, {"from": "gpt", "value": "..."}]}, optional "accu_reward_method".
(c) "easyr1": EasyR1 / geometry3k, {"problem", "answer", "images": [image, ...]}.
(d) "pairs": preference pairs for DPO (RLAIF-V / VLFeedback style), {"image" or "images", "question" or
    "problem", "chosen", "rejected"}; the solution is the chosen answer, task "exact" by default.

An image is a path, a `{bytes, path}` struct (a `datasets.Image` as parquet and Arrow store it), raw bytes
or a PIL image (vlmexp.data.images). A source's `columns` renames its columns to these field names first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vlmexp.config import TASKS
from vlmexp.coords import parse_box

FORMATS = ("rec", "conversations", "easyr1", "pairs")
DEFAULT_TASK = {"rec": "rec", "conversations": "exact", "easyr1": "math", "pairs": "exact"}
# Formats whose records carry an answer written out for a model to imitate (SFT trains on it as written): a
# pairs record's chosen answer, a conversation's gpt turn. The others hold a ground truth to score against
# (EasyR1's `answer`; a rec record's box, from which SFT builds its target).
ANSWER_TEXT = {"pairs": "chosen", "conversations": "the gpt turn"}
# accu_reward_method values of VLM-R1 JSONL data (om-ai-lab/VLM-R1, src/open-r1-multimodal/src/open_r1/
# grpo_jsonl.py, accuracy_reward) -> our task; the method itself travels with the record (Example.method) and
# picks the scoring within the task (vlmexp.answers, vlmexp.detection). Any other value is refused.
ACCU_TASK = {"iou": "rec", "default": "exact", "mcq": "exact", "yes_no": "exact", "all_match": "exact",
             "math": "math", "od_ap": "detection", "od_ap50": "detection", "map": "detection",
             "odLength": "detection", "weighted_sum": "detection"}
TASK_METHOD = {"rec": "iou", "exact": "default", "math": "math"}  # a record without accu_reward_method
REFUSED_METHODS = {  # methods VLM-R1 defines that vlmexp does not run, and why
    "llm": "VLM-R1 asks a judge model over an OpenAI-compatible API for it, which vlmexp does not call; map these "
           "records to another accu_reward_method (e.g. default or all_match), or score them with your own "
           "`module:function` reward in grpo.rewards and give the records a method it reads",
}
# the field names a source's `columns` mapping may produce
FIELDS = ("image", "images", "problem", "solution", "answer", "conversations", "accu_reward_method", "task", "id",
          "chosen", "rejected", "demonstration")
EXPECTED = ("rec: image, problem, solution; conversations: image, conversations; "
            "easyr1: problem, answer, images; pairs: image(s), question or problem, chosen, rejected")


@dataclass(frozen=True)
class Example:
    """What every format reduces to before its images are checked (vlmexp.data.normalise makes the
    SampledRecord from it): images as written in the record, the question, the answer and how it is scored."""

    images: list[Any]  # as written in the record: paths, {bytes, path} structs, bytes or PIL images
    problem: str
    solution: Any  # a box (list of 4 floats) for rec, else a string
    task: str
    method: str | None  # how the answer is scored within the task (ACCU_TASK)
    target: str | None = None  # the answer text SFT imitates as written (ANSWER_TEXT formats)
    rejected: str | None = None  # the dispreferred answer of a "pairs" record (solution is the chosen one)
    demonstration: list[float] | None = None  # rec: the box SFT imitates (an annotator's)
    id: str | None = None  # the record's own id field


def detect_format(record: dict[str, Any]) -> str | None:
    if "chosen" in record or "rejected" in record:
        return "pairs"
    if "conversations" in record:
        return "conversations"
    if "answer" in record and "images" in record:
        return "easyr1"
    if "solution" in record and "problem" in record:
        return "rec"
    return None


def parse_record(record: dict[str, Any], fmt: str, task: str | None) -> Example:
    """The record's Example, or ValueError naming the missing or malformed field and the fix."""
    def need(key: str) -> Any:
        if key not in record or record[key] is None:
            raise ValueError(f"missing field {key!r} (format {fmt!r} needs {EXPECTED.split(';')[FORMATS.index(fmt)]})")
        return record[key]

    rejected, demonstration = None, None
    if fmt == "pairs":
        images = _as_list(record["image"] if "image" in record else need("images"), "images")
        problem = record["question"] if "question" in record else need("problem")
        solution, rejected = _pair(need("chosen"), "chosen"), _pair(need("rejected"), "rejected")
        if solution.strip() == rejected.strip():
            raise ValueError("chosen and rejected are the same answer, so the pair teaches nothing; drop the record")
    elif fmt == "rec":
        images, problem, solution = _as_list(need("image"), "image"), need("problem"), need("solution")
    elif fmt == "easyr1":
        images, problem, solution = _as_list(need("images"), "images"), need("problem"), need("answer")
        problem = _strip_image_tags(problem, len(images), "problem")
    else:
        turns = need("conversations")
        if not isinstance(turns, list) or len(turns) < 2:
            raise ValueError("field 'conversations' must list a human turn and a gpt turn")
        human = next((t for t in turns if isinstance(t, dict) and t.get("from") == "human"), None)
        gpt = next((t for t in turns if isinstance(t, dict) and t.get("from") == "gpt"), None)
        if human is None or gpt is None or "value" not in human or "value" not in gpt:
            raise ValueError("field 'conversations' needs {'from': 'human', 'value'} and {'from': 'gpt', 'value'}")
        images = _as_list(record.get("image", []), "image")
        problem, solution = _strip_image_tags(str(human["value"]), len(images), "human turn"), gpt["value"]
    method = _method(record)
    task = record.get("task") if record.get("task") in TASKS else task
    task = task or ACCU_TASK.get(method or "") or DEFAULT_TASK[fmt]
    if method is not None and ACCU_TASK[method] != task:
        raise ValueError(f"accu_reward_method {method!r} scores task {ACCU_TASK[method]!r}, but this record's task "
                         f"is {task!r} (the source's or the record's `task`); drop the `task` or change the method")
    method = method or TASK_METHOD.get(task)
    if method is None and task != "exact":
        raise ValueError(f"a {task} record needs accu_reward_method, one of "
                         f"{', '.join(m for m, t in ACCU_TASK.items() if t == task)}")
    if not isinstance(problem, str) or not problem.strip():
        raise ValueError("the question (problem) is empty; give each record a question")
    if task == "rec":
        box = parse_box(solution)
        if box is None:
            from vlmexp.data.images import describe

            raise ValueError(f"solution {describe(solution)} holds no box; write [x1, y1, x2, y2] in original pixels")
        solution = box
        if record.get("demonstration") is not None and parse_box(record["demonstration"]) is None:
            from vlmexp.data.images import describe

            raise ValueError(f"demonstration {describe(record['demonstration'])} holds no box; write [x1, y1, x2, y2] "
                             "in original pixels or drop the field")
        if record.get("demonstration") is not None:
            demonstration = parse_box(record["demonstration"])
    else:
        solution = str(solution)
        _check_solution(solution, method, len(images))
    target = solution if fmt in ANSWER_TEXT else None
    record_id = None if record.get("id") is None else str(record["id"])
    return Example(images=images, problem=problem, solution=solution, task=task, method=method, target=target,
                   rejected=rejected, demonstration=demonstration, id=record_id)


def _method(record: dict[str, Any]) -> str | None:
    """The record's accu_reward_method, or ValueError naming it: refused (REFUSED_METHODS) or unknown."""
    method = record.get("accu_reward_method")
    if method is None:
        return None
    if method in REFUSED_METHODS:
        raise ValueError(f"accu_reward_method {method!r} is not supported: {REFUSED_METHODS[method]}")
    if method not in ACCU_TASK:
        raise ValueError(f"unknown accu_reward_method {method!r}; use one of {', '.join(ACCU_TASK)} (see "
                         f"docs/data-formats.md)")
    return method


def _check_solution(solution: str, method: str | None, images: int) -> None:
    """Refuse a solution its method cannot score: a choice that names none, boxes that do not parse."""
    from vlmexp.answers import CHOICE_METHODS, gold_choice

    if method in CHOICE_METHODS and gold_choice(method, solution) is None:
        raise ValueError(f"the {method} solution {solution[:80]!r} names no "
                         f"{'option letter' if method == 'mcq' else 'yes or no'}; fix the record's answer")
    if ACCU_TASK.get(method or "") == "detection":
        from vlmexp.detection import gold_objects

        if images != 1:
            raise ValueError(f"a detection record needs exactly one image, got {images}")
        gold_objects(solution, method)


def _pair(value: Any, key: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"field {key!r} must be a non-empty answer string, got {value!r}")
    return value


def _as_list(value: Any, key: str) -> list[Any]:
    from vlmexp.data.images import describe, is_image_value

    items = value if isinstance(value, list) else [value]
    if not all(is_image_value(v) for v in items):
        bad = next(v for v in items if not is_image_value(v))
        raise ValueError(f"field {key!r} must be an image (a path, a {{bytes, path}} struct, bytes or a PIL image) or "
                         f"a list of them, got {type(bad).__name__} {describe(bad)}")
    return items


def _strip_image_tags(text: Any, images: int, what: str) -> Any:
    """The question without `<image>` placeholders (TRL adds the image parts), which must match the images."""
    if not isinstance(text, str):
        return text
    tags = text.count("<image>")
    if tags and tags != images:
        raise ValueError(f"{what} has {tags} <image> tags but the record lists {images} images; make them match")
    return text.replace("<image>", "").strip()
