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
  Customization/Custom-dataset.md).
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
