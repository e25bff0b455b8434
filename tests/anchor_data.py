"""Small datasets in the exact layouts the field publishes them, written as their publishers do (parquet with
embedded images through `datasets`, JSON / JSONL with image paths), for the format tests.

- TRL language modeling: HuggingFaceH4/llava-instruct-mix-vsft (`messages` whose content is a list of typed
  parts with `index`, `text`, `type`; `images` a list of Image), multi-turn.
- TRL prompt-completion: trl-lib/llava-instruct-mix (`images`, `prompt`, `completion`, string content).
- TRL preference: trl-lib/rlaif-v (`prompt`, `chosen`, `rejected` as lists of messages of typed parts;
  `images`).
- RLAIF-V: openbmb/RLAIF-V-Dataset (`ds_name`, `image`, `question`, `chosen`, `rejected` as strings,
  `origin_dataset`, `origin_split`, `idx`, and `image_path`, the image's path in its origin dataset).
- TRL prompt-only: the GRPO VLM example's layout (trl examples/scripts/grpo_vlm.py: `image`, a `prompt` of
  system + user messages, `solution`).
- LLaMA-Factory: data/mllm_demo.json (OpenAI-style `messages`, `<image>` tags, `images` paths, multi-turn), a
  sharegpt preference file (`conversations` from/value, `chosen` / `rejected` messages) and an alpaca file
  with images and history, with their dataset_info.json entries as data/dataset_info.json writes them.
- ms-swift: `messages` with `<image>` tags, `images`, `rejected_response` (docs:
  Customization/Custom-dataset.md); its agent layout, `tool_call` / `tool_response` turns and a `tools`
  column.
- V* Bench (craigwu/vstar_bench): test_questions.jsonl (`image`, `text` with the options, `label`,
  `question_id`, `category`) beside the images' folders; and the plain V*-style form, `question`, `image`,
  `answer`, `bbox`.
- DeepEyes-47k (ChenShawn/DeepEyes-Datasets-47k): verl rows in parquet, `data_source`, `prompt` (DeepEyes'
  tool system prompt and the user turn), `images`, `ability`, `reward_model`, `extra_info`.
- TRL's tool calling with images: `messages` whose assistant turns carry `tool_calls` and whose `tool` turns
  carry the crop as an image part; `images` lists the question's image, then the crops.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

from conftest import make_png, write_jsonl

COLORS = ("red", "blue", "green", "yellow")


def png(color: str, size=(56, 56)) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    return buf.getvalue()


def _image(color: str) -> dict:
    return {"bytes": png(color), "path": f"{color}.png"}


def _parts(text: str, image: bool = False, index: bool = False) -> list[dict]:
    parts = [{"type": "image"}] if image else []
    parts.append({"type": "text", "text": text})
    # HuggingFaceH4/llava-instruct-mix-vsft: every part has index (images) and text (texts), else None
    if index:
        parts = [{"index": 0 if p["type"] == "image" else None, "text": p.get("text"), "type": p["type"]}
                 for p in parts]
    return parts


def to_parquet(rows: dict, features, path: Path) -> Path:
    """`rows` written as the Hub stores a dataset: `Dataset.from_dict(..., features=...).to_parquet`."""
    from datasets import Dataset

    path.parent.mkdir(parents=True, exist_ok=True)
    Dataset.from_dict(rows, features=features).to_parquet(path)
    return path


def _text(t: str | None) -> list[dict]:
    return [{"text": t, "type": "text"}]


def trl_language_modeling(folder: Path, n: int = 4) -> Path:
    from datasets import Features, Image, List, Value

    part = {"index": Value("int64"), "text": Value("string"), "type": Value("string")}
    features = Features({"messages": List({"content": List(part), "role": Value("string")}),
                         "images": List(Image())})
    rows = {"messages": [[
        {"role": "user", "content": _parts(f"What colour is shape {i}?", image=True, index=True)},
        {"role": "assistant", "content": _parts(f"It is {COLORS[i % 4]}.", index=True)},
        {"role": "user", "content": _parts("And its shape?", index=True)},
        {"role": "assistant", "content": _parts("A square.", index=True)}] for i in range(n)],
        "images": [[_image(COLORS[i % 4])] for i in range(n)]}
    path = folder / "llava-instruct-mix-vsft" / "data" / "train-00000-of-00001.parquet"
    return to_parquet(rows, features, path)


def trl_prompt_completion(folder: Path, n: int = 4) -> Path:
    from datasets import Features, Image, List, Value

    message = {"content": Value("string"), "role": Value("string")}
    features = Features({"images": List(Image()), "prompt": List(message), "completion": List(message)})
    rows = {"images": [[_image(COLORS[i % 4])] for i in range(n)],
            "prompt": [[{"role": "user", "content": f"Name the colour of shape {i}."}] for i in range(n)],
            "completion": [[{"role": "assistant", "content": COLORS[i % 4]}] for i in range(n)]}
    path = folder / "llava-instruct-mix" / "train.parquet"
    return to_parquet(rows, features, path)


def trl_preference(folder: Path, n: int = 4) -> Path:
    from datasets import Features, Image, List, Value

    message = {"content": List({"text": Value("string"), "type": Value("string")}), "role": Value("string")}
    features = Features({"chosen": List(message), "rejected": List(message), "images": List(Image()),
                         "prompt": List(message)})
    rows = {"prompt": [[{"role": "user", "content": [{"text": None, "type": "image"},
                                                     *_text(f"Which colour is shape {i}?")]}]
                       for i in range(n)],
            "chosen": [[{"role": "assistant", "content": _text(COLORS[i % 4])}] for i in range(n)],
            "rejected": [[{"role": "assistant", "content": _text(COLORS[(i + 1) % 4])}] for i in range(n)],
            "images": [[_image(COLORS[i % 4])] for i in range(n)]}
    path = folder / "rlaif-v" / "data" / "train-00000-of-00001.parquet"
    return to_parquet(rows, features, path)


def rlaif_v(folder: Path, n: int = 4) -> Path:
    from datasets import Features, Image, Value

    features = Features({"ds_name": Value("string"), "image": Image(), "question": Value("string"),
                         "chosen": Value("string"), "rejected": Value("string"),
                         "origin_dataset": Value("string"), "origin_split": Value("string"),
                         "idx": Value("string"), "image_path": Value("string")})
    rows = {"ds_name": ["RLAIF-V"] * n, "image": [_image(COLORS[i % 4]) for i in range(n)],
            "question": [f"Which colour is shape {i}?" for i in range(n)],
            "chosen": [f"It is {COLORS[i % 4]}." for i in range(n)],
            "rejected": [f"It is {COLORS[(i + 1) % 4]}." for i in range(n)],
            "origin_dataset": ["OK-VQA"] * n,
            "origin_split": ['{"model": "OmniLMM-12B", "type": "question_answering"}'] * n,
            "idx": [f"OK-VQA_train_{i}" for i in range(n)],
            "image_path": [f"OK-VQA/train/COCO_train2014_{i:012d}.jpg" for i in range(n)]}
    path = folder / "RLAIF-V-Dataset" / "RLAIF-V-Dataset_000.parquet"
    return to_parquet(rows, features, path)


def trl_prompt_only(folder: Path, n: int = 4) -> Path:
    from datasets import Features, Image, List, Value

    message = {"content": Value("string"), "role": Value("string")}
    features = Features({"image": Image(), "prompt": List(message), "solution": Value("string")})
    rows = {"image": [_image(COLORS[i % 4]) for i in range(n)],
            "prompt": [[{"role": "system", "content": "Think, then answer."},
                        {"role": "user", "content": f"What is {i} + {i}?"}] for i in range(n)],
            "solution": [str(2 * i) for i in range(n)]}
    path = folder / "grpo-vlm" / "train.parquet"
    return to_parquet(rows, features, path)


def llamafactory_folder(folder: Path, n: int = 4) -> Path:
    """A LLaMA-Factory data folder: mllm_demo.json (OpenAI-style messages) and a sharegpt preference file."""
    root = folder / "llamafactory"
    for color in COLORS:
        make_png(root / "mllm_demo_data" / f"{color}.png", (56, 56), color)
    demo = [{"messages": [{"content": "<image>Who is this?", "role": "user"},
                          {"content": f"A {COLORS[i % 4]} square.", "role": "assistant"},
                          {"content": "What is it doing?<image>", "role": "user"},
                          {"content": "Standing still.", "role": "assistant"}],
             "images": [f"mllm_demo_data/{COLORS[i % 4]}.png"] * 2} for i in range(n)]
    (root / "mllm_demo.json").write_text(json.dumps(demo, indent=2))
    preference = [{"conversations": [{"from": "human", "value": "<image>Which colour is it?"}],
                   "chosen": {"from": "gpt", "value": COLORS[i % 4]},
                   "rejected": {"from": "gpt", "value": COLORS[(i + 2) % 4]},
                   "images": [f"mllm_demo_data/{COLORS[i % 4]}.png"]} for i in range(n)]
    (root / "rlhf_v_demo.json").write_text(json.dumps(preference, indent=2))
    info = {"mllm_demo": {"file_name": "mllm_demo.json", "formatting": "sharegpt",
                          "columns": {"messages": "messages", "images": "images"},
                          "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user",
                                   "assistant_tag": "assistant"}},
            "rlhf_v_demo": {"file_name": "rlhf_v_demo.json", "ranking": True, "formatting": "sharegpt",
                            "columns": {"messages": "conversations", "chosen": "chosen",
                                        "rejected": "rejected", "images": "images"}},
            "alpaca_mm_demo": {"file_name": "alpaca_mm_demo.json",
                               "columns": {"prompt": "instruction", "query": "input", "response": "output",
                                           "history": "history", "images": "images"}},
            "mllm_video_demo": {"file_name": "mllm_demo.json", "formatting": "sharegpt",
                                "columns": {"messages": "messages", "videos": "videos"}}}
    alpaca = [{"instruction": "<image>Name the colour.", "input": "One word.", "output": COLORS[i % 4],
               "history": [["Hello.", "Hello! Show me an image."]],
               "images": [f"mllm_demo_data/{COLORS[i % 4]}.png"]}
              for i in range(n)]
    (root / "alpaca_mm_demo.json").write_text(json.dumps(alpaca, indent=2))
    (root / "dataset_info.json").write_text(json.dumps(info, indent=2))
    return root


def ms_swift(folder: Path, n: int = 4) -> Path:
    root = folder / "swift"
    for color in COLORS:
        make_png(root / f"{color}.png", (56, 56), color)
    rows = [{"messages": [{"role": "system", "content": "You are a helpful assistant."},
                          {"role": "user", "content": "<image>What colour is this?"},
                          {"role": "assistant", "content": f"It is {COLORS[i % 4]}."}],
             "images": [f"{COLORS[i % 4]}.png"], "rejected_response": f"It is {COLORS[(i + 1) % 4]}."}
            for i in range(n)]
    return write_jsonl(root / "dpo.jsonl", rows)


def ms_swift_video(folder: Path) -> Path:
    """ms-swift's standard format with a video (docs Customization/Custom-dataset.md, "multimodal"): a
    `<video>` tag in the user turn, `videos` paths; beside it an image record of the same file."""
    root = folder / "swift-video"
    make_png(root / "red.png", (56, 56), "red")
    (root / "clip.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42")
    rows = [{"messages": [{"role": "user", "content": "<image>What colour is this?"},
                          {"role": "assistant", "content": "Red."}], "images": ["red.png"]},
            {"messages": [{"role": "user", "content": "<video>What happens in the clip?"},
                          {"role": "assistant", "content": "A red square moves."}], "videos": ["clip.mp4"]}]
    return write_jsonl(root / "train.jsonl", rows)


def easyr1_video(folder: Path) -> Path:
    """EasyR1's layout with video (verl/utils/dataset.py, `video_key: videos`): `problem` with a `<video>`
    tag, `answer`, `videos`; written as parquet, as EasyR1's datasets are published."""
    from datasets import Features, List, Value

    features = Features({"problem": Value("string"), "answer": Value("string"),
                         "videos": List(Value("string"))})
    rows = {"problem": ["<video>How many squares appear?"], "answer": ["2"], "videos": [["clip.mp4"]]}
    return to_parquet(rows, features, folder / "easyr1-video" / "train.parquet")


def as_jsonl_with_paths(parquet: Path, folder: Path) -> Path:
    """The same rows as JSONL with image paths: every embedded image written to a file beside it, each
    `{bytes, path}` struct replaced by that file's relative path."""
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    count = 0

    def unembed(value):
        nonlocal count
        if isinstance(value, dict) and isinstance(value.get("bytes"), bytes):
            count += 1
            (folder / f"{count}.png").write_bytes(value["bytes"])
            return f"{count}.png"
        if isinstance(value, dict):
            return {k: unembed(v) for k, v in value.items()}
        if isinstance(value, list):
            return [unembed(v) for v in value]
        return value

    rows = [unembed(row) for row in pq.read_table(parquet).to_pylist()]
    return write_jsonl(folder / "data.jsonl", rows)


ZOOM_TOOL = "image_zoom_in_tool"
# DeepEyes' system prompt (Visual-Agent/DeepEyes eval/eval_vstar.py, the training data's alike) and user
# suffix
DEEPEYES_SYSTEM = (
    "You are a helpful assistant.\n\n# Tools\nYou may call one or more functions to assist with the user "
    "query.\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    '{"type":"function","function":{"name":"image_zoom_in_tool","description":"Zoom in on a specific region '
    'of an '
    'image by cropping it based on a bounding box (bbox) and an optional object label.","parameters":{"type":'
    '"object","properties":{"bbox_2d":{"type":"array","items":{"type":"number"},"minItems":4,"maxItems":4},'
    '"label":{"type":"string"}},"required":["bbox"]}}}\n</tools>\n\n# How to call a tool\nReturn a json '
    'object '
    "with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')
DEEPEYES_SUFFIX = ("\nThink first, call **image_zoom_in_tool** if needed, then answer. Format strictly as:  "
                   "<think>...</think>  <tool_call>...</tool_call> (if tools needed)  <answer>...</answer> ")


def jpeg(color: str, size=(160, 120)) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="JPEG")
    return buf.getvalue()


# V*'s per-image annotations (penghao-wu/vstar README, "Benchmark"): targets' boxes [x, y, w, h] in original
# pixels; a direct-attribute question has one target, a relative-position question two
VSTAR_TARGETS = {"direct_attributes": (["glove"], [[4, 6, 30, 30]]),
                 "relative_position": (["cup", "glove"], [[10, 60, 20, 30], [110, 50, 40, 40]])}


def vstar_bench(folder: Path, n: int = 4) -> Path:
    """craigwu/vstar_bench as downloaded: test_questions.jsonl, the images under their category's folder,
    each `sa_<n>.jpg` with its annotation `sa_<n>.json` beside it ({target_object, bbox, question, options},
    the right option first)."""
    root = folder / "vstar_bench"
    rows = []
    for i in range(n):
        category = ("direct_attributes", "relative_position")[i % 2]
        name = f"{category}/sa_{1000 + i}.jpg"
        (root / category).mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(jpeg(COLORS[i % 4]))
        targets, boxes = VSTAR_TARGETS[category]
        choices = ["red", "blue", "green", "yellow"] if category == "direct_attributes" else ["left", "right"]
        annotation = {"target_object": targets, "bbox": boxes, "question": (
            "What is the colour of the glove?" if category == "direct_attributes"
            else "Is the cup on the left or right side of the glove?"), "options": choices}
        (root / name).with_suffix(".json").write_text(json.dumps(annotation))
        options = ("(A) red\n(B) blue\n(C) green\n(D) yellow" if category == "direct_attributes"
                   else "(A) left\n(B) right")
        rows.append({"image": name, "text": f"What is the colour of the glove?\n{options}\nAnswer with the "
                     "option's letter from the given choices directly.", "category": category,
                     "question_id": i, "label": "AB"[i % 2]})
    return write_jsonl(root / "test_questions.jsonl", rows)


def vqa_with_box(folder: Path, n: int = 4) -> Path:
    """The plain V*-style form: a question, an image, the answer, the target's box in original pixels."""
    root = folder / "vqa"
    for color in COLORS:
        make_png(root / f"{color}.png", (160, 120), color)
    rows = [{"image": f"{COLORS[i % 4]}.png", "question": "What colour is the small square?",
             "answer": COLORS[i % 4], "bbox": [10 + i, 20, 40 + i, 50]} for i in range(n)]
    return write_jsonl(root / "vqa.jsonl", rows)


def deepeyes_47k(folder: Path, n: int = 4) -> Path:
    """A DeepEyes-47k shard as published (data_0.1.2_visual_toolbox_v2.parquet's columns)."""
    from datasets import Features, Image, List, Value

    message = {"content": Value("string"), "role": Value("string")}
    features = Features({
        "data_source": Value("string"), "prompt": List(message), "images": List(Image()),
        "ability": Value("string"),
        "reward_model": {"ground_truth": Value("string"), "style": Value("string")},
        "extra_info": {"answer": Value("string"), "index": Value("int64"), "question": Value("string"),
                       "split": Value("string")},
    })
    questions = [f"What is the colour of the umbrella {i}?" for i in range(n)]
    rows = {"data_source": ["vstar"] * n,
            "prompt": [[{"role": "system", "content": DEEPEYES_SYSTEM},
                        {"role": "user", "content": f"<image>\n{q}{DEEPEYES_SUFFIX}"}] for q in questions],
            "images": [[{"bytes": jpeg(COLORS[i % 4]), "path": None}] for i in range(n)],
            "ability": ["vl_chart"] * n,
            "reward_model": [{"ground_truth": COLORS[i % 4], "style": "model"} for i in range(n)],
            "extra_info": [{"answer": COLORS[i % 4], "index": i, "question": q, "split": "train"}
                           for i, q in enumerate(questions)]}
    shard = folder / "DeepEyes-Datasets-47k" / "data_0.1.2_visual_toolbox_v2.parquet"
    return to_parquet(rows, features, shard)


def zoom_turns(i: int) -> tuple[list[float], str]:
    """The zoom box and the answer of tool-use record `i` (shared by the TRL and ms-swift layouts)."""
    return [8.0 + i, 8.0, 40.0 + i, 40.0], COLORS[i % 4]


def trl_tool_calls(folder: Path, n: int = 4) -> Path:
    """TRL's tool-calling conversations with images (parquet): the question and its image, the assistant's
    zoom call, the tool turn with the crop as an image part, the answer; `images`: the image, then the
    crop."""
    from datasets import Features, Image, List, Value

    part = {"text": Value("string"), "type": Value("string")}
    call = {"function": {"arguments": {"bbox_2d": List(Value("float64"))}, "name": Value("string")},
            "type": Value("string")}
    features = Features({"messages": List({"content": List(part), "role": Value("string"),
                                           "tool_calls": List(call)}),
                         "images": List(Image()), "solution": Value("string")})
    messages, images = [], []
    for i in range(n):
        box, answer = zoom_turns(i)
        messages.append([
            {"role": "user", "content": [{"type": "image", "text": None},
                                         {"type": "text", "text": "What colour is the small square?"}],
             "tool_calls": None},
            {"role": "assistant", "content": [{"type": "text", "text": "<think>It is small.</think>"}],
             "tool_calls": [{"type": "function",
                             "function": {"name": ZOOM_TOOL, "arguments": {"bbox_2d": box}}}]},
            {"role": "tool", "content": [{"type": "image", "text": None}], "tool_calls": None},
            {"role": "assistant", "content": [{"type": "text", "text": f"<answer>{answer}</answer>"}],
             "tool_calls": None}])
        images.append([{"bytes": png(COLORS[i % 4], (96, 96)), "path": None},
                       {"bytes": png(COLORS[(i + 1) % 4], (32, 32)), "path": None}])
    rows = {"messages": messages, "images": images, "solution": [zoom_turns(i)[1] for i in range(n)]}
    return to_parquet(rows, features, folder / "trl-tools" / "train.parquet")


def ms_swift_agent(folder: Path, n: int = 4) -> Path:
    """ms-swift's agent layout: `tool_call` turns holding the call's JSON, `tool_response` turns (here with
    the crop's `<image>` tag), a `tools` column of JSON schemas, `images` paths in the order of their tags."""
    root = folder / "swift-agent"
    tools = json.dumps([{"type": "function", "function": {"name": ZOOM_TOOL, "parameters": {
        "type": "object", "properties": {"bbox_2d": {"type": "array"}}}}}])
    rows = []
    for i in range(n):
        box, answer = zoom_turns(i)
        make_png(root / f"full_{i}.png", (96, 96), COLORS[i % 4])
        make_png(root / f"crop_{i}.png", (32, 32), COLORS[(i + 1) % 4])
        rows.append({"tools": tools, "images": [f"full_{i}.png", f"crop_{i}.png"], "messages": [
            {"role": "user", "content": "<image>What colour is the small square?"},
            {"role": "assistant", "content": "<think>It is small.</think>"},
            {"role": "tool_call", "content": json.dumps({"name": ZOOM_TOOL, "arguments": {"bbox_2d": box}})},
            {"role": "tool_response", "content": "<image>"},
            {"role": "assistant", "content": f"<answer>{answer}</answer>"}]})
    return write_jsonl(root / "agent.jsonl", rows)
