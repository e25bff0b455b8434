"""Record formats a source may use, detected per source from its first record (after its `columns`).

Every format reduces to an Example (the question, the answer, how it is scored, images as written); the
sampler then checks the images and writes the SampledRecord (vlmexp.data.normalise). Formats, by anchor:

(a) "rec": VLM-R1 REC, {"image", "problem", "solution": [x1, y1, x2, y2]} (box in original pixels; the
    solution may be a string holding the list or <answer>[...]</answer>); optional "demonstration": another
    box, the one SFT imitates (an annotator's), while rewards and evaluation score against the solution.
(b) "conversations": VLM-R1 JSONL and LLaMA-Factory sharegpt, {"image" or "images", "conversations": [{"from":
    "human", "value": "<image>..."}, {"from": "gpt", "value": "..."}, ...]}, optional "accu_reward_method"; a
    LLaMA-Factory preference record adds "chosen" / "rejected" messages after a conversation ending in a user
    turn.
(c) "easyr1": EasyR1 / geometry3k, {"problem", "answer", "images": [image, ...]}.
(d) "pairs": preference pairs for DPO (RLAIF-V / VLFeedback style), {"image" or "images", "question" or
    "problem", "chosen", "rejected"} as strings; the solution is the chosen answer.
(e) "messages": TRL's conversational language modeling, LLaMA-Factory's OpenAI-style sharegpt and ms-swift's
    standard format, {"messages": [{"role", "content"}, ...], "images"}; ms-swift's "rejected_response" and
    LLaMA-Factory's "chosen" / "rejected" make it a preference record.
(f) "prompt_completion": TRL's conversational prompt-completion, {"prompt": [messages], "completion":
    [assistant message], "images"}.
(g) "preference": TRL's conversational preference, {"prompt": [messages], "chosen", "rejected", "images"}; or
    its implicit-prompt form, {"chosen": [messages], "rejected": [messages]} whose shared first turns are the
    prompt (as trl.data_utils.extract_prompt reads it).
(h) "prompt_only": TRL's prompt-only (GRPO), {"prompt": [messages], "image" or "images", "solution" or
    "answer"}.
(i) "alpaca": LLaMA-Factory's alpaca, {"instruction", "input", "output", "history": [[instruction, response]],
    "images"}; its preference form has "chosen" / "rejected" strings instead of "output".
(j) "deepeyes": DeepEyes-47k's verl rows (ChenShawn/DeepEyes-Datasets-47k), {"data_source", "prompt": [system
    (the tool prompt), user], "images": [{bytes, path}], "ability", "reward_model": {"ground_truth", "style"},
    "extra_info"}; the answer is reward_model.ground_truth, graded by a judge model where style is "model"
    (DeepEyes asks one), by VLM-R1's default where it is "rule".
(k) "vstar": V* Bench's test_questions.jsonl (craigwu/vstar_bench), {"image", "text" (the question with its
    options (A) ..., (D)), "label" (the option letter), "question_id", "category"}: a multiple-choice record.
(l) "vstar_annotation": V* Bench's per-image annotation (penghao-wu/vstar README, "Benchmark"), `sa_<n>.json`
    beside `sa_<n>.jpg`, {"target_object": [names], "bbox": [[x, y, w, h], ...], "question", "options"}: the
    lettered multiple-choice question test_questions.jsonl asks, options[0] the right one (vlmexp.data.boxes).
(m) "vqa": a question about an image, {"image" or "images", "question", "answer"}, optional "bbox": the
    target's box [x1, y1, x2, y2] in original pixels (any format may carry one; its form: vlmexp.data.boxes).
Conversational formats may hold tool use between the question and the answer (vlmexp.data.turns): the
assistant's calls and the tools' turns, whose images follow the question's in "images".

Conversations are read by vlmexp.data.turns (roles, typed content parts, `<image>` tags, turn order).
An image is a path, a `{bytes, path}` struct (a `datasets.Image` as parquet and Arrow store it), raw bytes
or a PIL image (vlmexp.data.images).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vlmexp.config.schema import TASKS
from vlmexp.coords import parse_box
from vlmexp.data.boxes import target_boxes, to_xyxy, vstar_question
from vlmexp.data.turns import Conversation, Tags, Turn, answer_text, conversation, read_turns, text_of

# the fields that make a record one format (what `vlmexp sample --explain` shows and a record fitting none is
# compared against), in the order formats are tried
FORMAT_FIELDS: dict[str, tuple[str, ...]] = {
    "preference": ("prompt", "chosen", "rejected"),
    "prompt_completion": ("prompt", "completion"),
    "prompt_only": ("prompt", "solution or answer"),
    "messages": ("messages",),
    "conversations": ("conversations",),
    "alpaca": ("instruction", "output or chosen / rejected"),
    "pairs": ("image or images", "question or problem", "chosen", "rejected"),
    "easyr1": ("problem", "answer", "images"),
    "rec": ("image", "problem", "solution"),
    "deepeyes": ("prompt", "reward_model"),
    "vstar": ("image", "text", "label"),
    "vstar_annotation": ("question", "options", "image (the file of the same name beside it)"),
    "vqa": ("image or images", "question", "answer"),
}
FORMATS = tuple(FORMAT_FIELDS)
DEFAULT_TASK = {**{fmt: "exact" for fmt in FORMATS}, "rec": "rec", "easyr1": "math"}
# DeepEyes-47k's reward_model.style -> accu_reward_method: DeepEyes grades its answers with a judge model
DEEPEYES_STYLES = {"model": "llm", "rule": "default"}
# What each format's records carry for SFT to imitate as written. The others hold a ground truth to score
# against (EasyR1's `answer`; a rec record's box, from which SFT builds its target; a prompt-only record's
# solution).
ANSWER_TEXT = {"pairs": "chosen", "preference": "chosen", "conversations": "the last assistant turn",
               "messages": "the last assistant turn", "prompt_completion": "the completion",
               "alpaca": "the output"}
# accu_reward_method values of VLM-R1 JSONL data (om-ai-lab/VLM-R1, src/open-r1-multimodal/src/open_r1/
# grpo_jsonl.py, accuracy_reward) -> our task; the method itself travels with the record (Example.method) and
# picks the scoring within the task (vlmexp.answers, vlmexp.detection). Any other value is refused.
ACCU_TASK = {"iou": "rec", "default": "exact", "mcq": "exact", "yes_no": "exact", "all_match": "exact",
             "math": "math", "od_ap": "detection", "od_ap50": "detection", "map": "detection",
             "odLength": "detection", "weighted_sum": "detection", "llm": "exact"}
# VLM-R1 asks a judge model for these records' scores: the `judge` reward scores them, and sampling keeps them
# only when the config has one (vlmexp.data.sampling, `judged`)
JUDGED_METHOD = "llm"
NO_JUDGE = ("accu_reward_method 'llm' is scored by a judge model (VLM-R1 asks one over an OpenAI-compatible "
            "API), and none is configured: add {name: judge, kwargs: {model: ..., endpoint: ...}} to "
            "grpo.rewards (`vlmexp sample`: pass --judged), or map these records to another "
            "accu_reward_method")
TASK_METHOD = {"rec": "iou", "exact": "default", "math": "math"}  # a record without accu_reward_method
REFUSED_METHODS: dict[str, str] = {}  # methods VLM-R1 defines that vlmexp does not run, and why
# the field names a source's `columns` mapping may produce
FIELDS = ("image", "images", "problem", "question", "solution", "answer", "conversations", "messages",
          "prompt", "completion", "system", "instruction", "input", "output", "history", "accu_reward_method",
          "task", "id", "chosen", "rejected", "rejected_response", "demonstration", "bbox", "text", "label",
          "reward_model", "options")


@dataclass(frozen=True)
class Example:
    """What every format reduces to before its images are checked (vlmexp.data.normalise makes the
    SampledRecord from it): images as written in the record, the question, the answer and how it is scored."""

    images: list[Any]  # as written in the record: paths, {bytes, path} structs, bytes or PIL images
    problem: str
    solution: Any  # a box (list of 4 floats) for rec, else a string
    task: str
    method: str | None  # how the answer is scored within the task (ACCU_TASK)
    target: str | None = None  # the answer text SFT imitates as written (ANSWER_TEXT)
    rejected: str | None = None  # the dispreferred answer of a preference record
    demonstration: list[float] | None = None  # rec: the box SFT imitates (an annotator's)
    id: str | None = None  # the record's own id field
    system: str | None = None  # the record's own system message
    history: list[dict[str, str]] = field(default_factory=list)  # turns before the last user turn
    tool_turns: list[dict[str, Any]] = field(default_factory=list)  # tool use before the answer (turns.py)
    boxes: list[list[float]] | None = None  # the targets' boxes, xyxy in original pixels (`bbox`)


def detect_format(record: dict[str, Any]) -> tuple[str, list[str]] | None:
    """(the record's format, the fields that decided it), or None when it fits none (`no_format`)."""
    has = [k for k in ("prompt", "completion", "chosen", "rejected", "rejected_response", "messages",
                       "conversations", "instruction", "output", "answer", "images", "solution", "problem")
           if k in record]
    if "prompt" in has and "reward_model" in record:
        return "deepeyes", ["prompt", "reward_model"]
    if "prompt" in has:
        pair = [k for k in ("chosen", "rejected") if k in has]
        if pair:
            return "preference", ["prompt", *pair]
        return (("prompt_completion", ["prompt", "completion"]) if "completion" in has
                else ("prompt_only", ["prompt"]))
    for key in ("messages", "conversations"):
        if key in has:
            return key, [key, *(k for k in ("chosen", "rejected", "rejected_response") if k in has)]
    if "instruction" in has:
        return "alpaca", ["instruction", *(k for k in ("output", "chosen", "rejected") if k in has)]
    if _message_list(record.get("chosen")) and _message_list(record.get("rejected")):
        # TRL's implicit prompt: the turns both answers start with
        return "preference", ["chosen", "rejected"]
    if "chosen" in has or "rejected" in has:
        return "pairs", [k for k in ("chosen", "rejected") if k in has]
    if "question" in record and "options" in record:
        return "vstar_annotation", ["question", "options"]
    if "question" in record and "answer" in has:
        return "vqa", ["question", "answer"]
    if "text" in record and "label" in record and "image" in record:
        return "vstar", ["text", "label"]
    if "answer" in has and "images" in has:
        return "easyr1", ["answer", "images"]
    if "solution" in has and "problem" in has:
        return "rec", ["problem", "solution"]
    return None


def formats_tried() -> str:
    """The formats in the order they are tried, each with the fields that make a record that format."""
    return "; ".join(f"{fmt} ({', '.join(fields)})" for fmt, fields in FORMAT_FIELDS.items())


def no_format(record: dict[str, Any]) -> str:
    """Why a record fits no format: the formats it was tried against, with their fields, and its own
    fields."""
    return (f"unknown record format (fields: {sorted(record)}); tried {formats_tried()}: see "
            "docs/data-formats.md, or map the source's columns with `columns:`")


def parse_record(record: dict[str, Any], fmt: str, task: str | None, tags: Tags | None = None,
                 box_form: str | None = None) -> Example:
    """The record's Example, or ValueError naming the missing or malformed field and the fix; `box_form`: the
    source's (vlmexp.data.boxes)."""
    def need(key: str) -> Any:
        if key not in record or record[key] is None:
            raise ValueError(f"missing field {key!r} (format {fmt!r} needs {', '.join(FORMAT_FIELDS[fmt])})")
        return record[key]

    parts: dict[str, Any] = {"rejected": None, "demonstration": None, "target": None}
    if fmt == "preference" and "prompt" not in record:
        record = implicit_prompt(record)
    if fmt == "pairs":
        images = _as_list(record["image"] if "image" in record else need("images"), "images")
        problem = record["question"] if "question" in record else need("problem")
        solution, parts["rejected"] = _pair(need("chosen"), "chosen"), _pair(need("rejected"), "rejected")
        parts["target"] = solution
    elif fmt == "rec":
        images, problem, solution = _as_list(need("image"), "image"), need("problem"), need("solution")
    elif fmt == "easyr1":
        images, problem, solution = _as_list(need("images"), "images"), need("problem"), need("answer")
        problem = _strip_image_tags(problem, len(images), "problem")
    elif fmt == "vqa":
        images = _as_list(record["image"] if "image" in record else need("images"), "images")
        problem, solution = _strip_image_tags(need("question"), len(images), "question"), need("answer")
    elif fmt == "vstar":
        images, problem, solution = _as_list(need("image"), "image"), need("text"), need("label")
        record = {"accu_reward_method": "mcq", **record}  # V*'s label is the option letter
    elif fmt == "vstar_annotation":
        if "image" not in record:
            raise ValueError("no image: a V* annotation `sa_<n>.json` pairs with the image of the same name "
                             "beside it (`sa_<n>.jpg`); put the image there, or give the record an `image`")
        images = _as_list(record["image"], "image")
        problem, solution = vstar_question(record, need)
        record = {"accu_reward_method": "mcq", **record}
    elif fmt == "deepeyes":
        images, problem, solution, parts, record = _deepeyes(record, need, tags or Tags())
    else:
        images, problem, solution, parts = _conversational(record, fmt, need, tags or Tags())
    if parts["rejected"] is not None and parts["target"] is not None and \
            parts["target"].strip() == parts["rejected"].strip():
        raise ValueError("chosen and rejected are the same answer, so the pair teaches nothing; drop the "
                         "record")
    method, task = _method_and_task(record, task, fmt)
    if not isinstance(problem, str) or not problem.strip():
        raise ValueError("the question (problem) is empty; give each record a question")
    if task == "rec":
        solution, parts["demonstration"] = _boxes(record, solution, box_form or "xyxy")
    else:
        solution = str(solution)
        _check_solution(solution, method, len(images))
    record_id = next((str(record[k]) for k in ("id", "question_id") if record.get(k) is not None), None)
    return Example(images=images, problem=problem, solution=solution, task=task, method=method, id=record_id,
                   boxes=target_boxes(record, fmt, box_form), **parts)


def _deepeyes(record: dict[str, Any], need, tags: Tags) -> tuple[list, str, Any, dict[str, Any], dict]:
    """(images, problem, solution, parts, the record with its accu_reward_method) of a DeepEyes-47k row: the
    prompt's system message (DeepEyes' tool prompt) and user turn, the answer in reward_model.ground_truth."""
    grading = need("reward_model")
    if not isinstance(grading, dict) or not isinstance(grading.get("ground_truth"), str):
        raise ValueError("field 'reward_model' must be {ground_truth: the answer, style: model | rule}, got "
                         f"{str(grading)[:120]}")
    style = grading.get("style")
    if style not in DEEPEYES_STYLES:
        raise ValueError(f"reward_model.style {style!r} is not one of {', '.join(DEEPEYES_STYLES)} (model: a "
                         "judge model grades the answer, as DeepEyes does; rule: VLM-R1's default matching)")
    conv = conversation(read_turns(need("prompt"), "prompt", tags), "prompt")
    images = _as_list(need("images"), "images")
    if conv.image_tags != len(images) or conv.answer is not None:
        raise ValueError(f"prompt has {conv.image_tags} <image> tags for {len(images)} images and "
                         f"{'an' if conv.answer else 'no'} answer turn; a DeepEyes prompt is a system and a "
                         "user turn whose tags match `images`")
    parts = {"rejected": None, "demonstration": None, "target": None, "system": conv.system,
             "history": conv.history}
    method = record.get("accu_reward_method") or DEEPEYES_STYLES[style]
    return images, conv.problem, grading["ground_truth"], parts, {**record, "accu_reward_method": method}


def read_fields(record: dict[str, Any], fmt: str) -> set[str]:
    """The fields of `record` that `parse_record` reads in format `fmt`; the record's others travel with it as
    the SampledRecord's `extra` and reach the rewards as keyword columns (vlmexp.data.normalise)."""
    common = {"accu_reward_method", "task", "id", "bbox"}
    if fmt == "vqa":
        return common | {"image", "images", "question", "answer"}
    if fmt == "vstar":
        return common | {"image", "text", "label", "question_id"}
    if fmt == "vstar_annotation":
        return common | {"image", "question", "options"}
    if fmt == "deepeyes":
        return common | {"prompt", "images", "reward_model"}
    if fmt == "pairs":
        return common | {"image", "images", "question", "problem", "chosen", "rejected"}
    if fmt == "rec":
        return common | {"image", "problem", "solution", "demonstration"}
    if fmt == "easyr1":
        return common | {"images", "problem", "answer"}
    key = {"conversations": "conversations", "messages": "messages",
           "alpaca": "instruction"}.get(fmt, "prompt")
    graded = next((k for k in ("solution", "answer") if record.get(k) is not None), "solution")
    own = {key, graded, "images", "image", "chosen", "rejected", "rejected_response", "system"}
    return common | own | {"prompt_completion": {"completion"},
                           "alpaca": {"history", "input", "output"}}.get(fmt, set())


def _message_list(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(m, dict) for m in value)


def implicit_prompt(record: dict[str, Any]) -> dict[str, Any]:
    """TRL's implicit-prompt preference record with its prompt made explicit: the turns `chosen` and
    `rejected` both start with (trl/data_utils.py, extract_prompt), the rest of each as the answers. Not TRL's
    function itself: sampling imports no trl/torch, and a record sharing no turn must be refused, not given an
    empty prompt; at least one turn of each answer is left."""
    chosen, rejected = record["chosen"], record["rejected"]
    shared = 0
    while shared < min(len(chosen), len(rejected)) - 1 and chosen[shared] == rejected[shared]:
        shared += 1
    if shared == 0:
        raise ValueError("`chosen` and `rejected` share no first turn, so the record has no prompt: TRL's "
                         "implicit-prompt layout repeats the prompt's turns at the start of both; or give a "
                         "`prompt` field")
    return {**record, "prompt": chosen[:shared], "chosen": chosen[shared:], "rejected": rejected[shared:]}


def _conversational(record: dict[str, Any], fmt: str, need,
                    tags: Tags) -> tuple[list, str, Any, dict[str, Any]]:
    """(images, problem, solution, the Example's other parts) of a conversational record: the turns read by
    vlmexp.data.turns, the answer after the last user turn (or a preference record's chosen one) as SFT's
    target, a `solution` / `answer` column (else that answer) as what rewards grade."""
    key = {"conversations": "conversations", "messages": "messages",
           "alpaca": "instruction"}.get(fmt, "prompt")
    turns = _alpaca_turns(record, need) if fmt == "alpaca" else read_turns(need(key), key, tags)
    if fmt == "prompt_completion":
        turns = [*turns, Turn("assistant", answer_text(need("completion"), "completion", tags), 0)]
    conv: Conversation = conversation(turns, key)
    images = _as_list(record["images"] if "images" in record else record.get("image", []), "images")
    if conv.image_tags and conv.image_tags != len(images):
        raise ValueError(f"{key} has {conv.image_tags} <image> tags but the record lists {len(images)} "
                         "images (`{type: image}` parts count as tags); make them match")
    chosen_key = "chosen" if "chosen" in record else None
    rejected_key = next((k for k in ("rejected", "rejected_response") if k in record), None)
    if fmt == "preference" or chosen_key or rejected_key:
        if fmt == "preference" or chosen_key:
            if conv.answer is not None:
                raise ValueError(f"field {key!r} ends in an assistant turn but the record also has `chosen`; "
                                 "a preference record's conversation ends in the user turn the answers reply "
                                 "to")
            target = answer_text(need("chosen"), "chosen", tags)
        else:
            target = conv.answer
        rejected = answer_text(need(rejected_key or "rejected"), rejected_key or "rejected", tags)
        if target is None:
            raise ValueError(f"a preference record needs the chosen answer: the last turn of {key!r} or "
                             "`chosen`")
    else:
        target, rejected = conv.answer, None
    solution = next((record[k] for k in ("solution", "answer") if record.get(k) is not None), target)
    if solution is None:
        raise ValueError(f"no answer to grade: {key!r} ends in a user turn and the record has no `solution` "
                         "or `answer`; add the answer column (GRPO grades against it), or map it with "
                         "`columns:`")
    problem = conv.problem
    system = (record.get("system") if conv.system is None and isinstance(record.get("system"), str)
              else conv.system)
    return images, problem, solution, {"rejected": rejected, "demonstration": None, "target": target,
                                       "system": system, "history": conv.history,
                                       "tool_turns": conv.tool_turns}


def _alpaca_turns(record: dict[str, Any], need) -> list[Turn]:
    """An alpaca record's turns as LLaMA-Factory builds them (src/llamafactory/data/converter.py,
    AlpacaDatasetConverter): the `history` pairs, then `instruction` and `input` joined by a newline as the
    user turn, then `output` (absent in a preference record, whose answers are `chosen` / `rejected`)."""
    history = record.get("history") or []
    if not isinstance(history, list) or not all(isinstance(h, (list, tuple)) and len(h) == 2
                                                for h in history):
        raise ValueError("field 'history' must list [instruction, response] pairs")
    texts = []
    for instruction, response in history:
        texts += [("user", instruction), ("assistant", response)]
    texts.append(("user", "\n".join(str(v) for v in (need("instruction"), record.get("input")) if v)))
    if record.get("output") is not None:
        texts.append(("assistant", record["output"]))
    return [Turn(role, *text_of(text, f"alpaca {role} turn {i}")) for i, (role, text) in enumerate(texts)]


def _method_and_task(record: dict[str, Any], task: str | None, fmt: str) -> tuple[str | None, str]:
    """The record's scoring method and task: accu_reward_method, the record's or the source's `task`, else the
    format's default; a contradiction or a task that needs a method is a ValueError."""
    method = _method(record)
    task = record.get("task") if record.get("task") in TASKS else task
    task = task or ACCU_TASK.get(method or "") or DEFAULT_TASK[fmt]
    if method is not None and ACCU_TASK[method] != task:
        raise ValueError(f"accu_reward_method {method!r} scores task {ACCU_TASK[method]!r}, but this "
                         f"record's task is {task!r} (the source's or the record's `task`); drop the `task` "
                         "or change the method")
    method = method or TASK_METHOD.get(task)
    if method is None and task != "exact":
        raise ValueError(f"a {task} record needs accu_reward_method, one of "
                         f"{', '.join(m for m, t in ACCU_TASK.items() if t == task)}")
    return method, task


def _boxes(record: dict[str, Any], solution: Any, form: str) -> tuple[list[float], list[float] | None]:
    """A rec record's solution box and its demonstration box (or None) as xyxy, or ValueError with the
    fix; `form`: the source's box form."""
    from vlmexp.data.images import describe

    box = parse_box(solution)
    if box is None:
        raise ValueError(f"solution {describe(solution)} holds no box; write [x1, y1, x2, y2] in original "
                         "pixels")
    box = to_xyxy(box, form, "solution")
    if record.get("demonstration") is None:
        return box, None
    shown = parse_box(record["demonstration"])
    if shown is None:
        raise ValueError(f"demonstration {describe(record['demonstration'])} holds no box; write [x1, y1, "
                         "x2, y2] in original pixels or drop the field")
    return box, to_xyxy(shown, form, "demonstration")


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
        raise ValueError(f"field {key!r} must be an image (a path, a {{bytes, path}} struct, bytes or a PIL "
                         f"image) or a list of them, got {type(bad).__name__} {describe(bad)}")
    return items


def _strip_image_tags(text: Any, images: int, what: str) -> Any:
    """The question without `<image>` placeholders (TRL adds the image parts), which must match the images."""
    if not isinstance(text, str):
        return text
    tags = text.count("<image>")
    if tags and tags != images:
        raise ValueError(f"{what} has {tags} <image> tags but the record lists {images} images; make them "
                         "match")
    return text.replace("<image>", "").strip()
