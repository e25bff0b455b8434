"""The plain TRL side of bench/grpo_overhead.py: the GRPO script a user would write without vlmexp.

    python bench/plain_trl_grpo.py MODEL_DIR TRAIN_JSONL OUT_DIR ARGS_JSON PROMPT_TEMPLATE

A GRPOTrainer on the tiny Qwen2.5-VL and the sampled demo records, an IoU reward written inline, the
GRPOConfig from ARGS_JSON; writes OUT_DIR/log_history.json. vlmexp is used only to load the tiny model's
processor with the demo's pixel budget (it has no hub copy), so both sides see the same image tokens.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def iou(prompts, completions, solution, **kwargs):
    out = []
    for c, s in zip(completions, solution):
        m = re.search(r"\[(\d+), (\d+), (\d+), (\d+)\]", c[0]["content"])
        if not m:
            out.append(0.0)
            continue
        a = list(map(float, m.groups()))
        ix = max(0.0, min(a[2], s[2]) - max(a[0], s[0]))
        iy = max(0.0, min(a[3], s[3]) - max(a[1], s[1]))
        union = (a[2] - a[0]) * (a[3] - a[1]) + (s[2] - s[0]) * (s[3] - s[1]) - ix * iy
        out.append(ix * iy / union if union > 0 else 0.0)
    return out


def build(model_path: str, train: str, out: str, args: dict, template: str):
    from datasets import Dataset
    from PIL import Image
    from transformers import AutoModelForImageTextToText
    from trl import GRPOConfig, GRPOTrainer

    from vlmexp.data.record import read_sampled
    from vlmexp.families import get_family
    from vlmexp.processor import load_processor

    rows = []
    for r in read_sampled(train):
        rows.append({"prompt": [{"role": "user", "content": template.format(problem=r.problem)}],
                     "images": [Image.open(r.images[0]).convert("RGB")], "solution": r.solution})
    processor = load_processor(model_path, get_family("qwen2_5_vl"),
                               {"min_pixels": 3136, "max_pixels": 102400})
    model = AutoModelForImageTextToText.from_pretrained(model_path, dtype="float32",
                                                        attn_implementation="sdpa")
    config = GRPOConfig(output_dir=out, **{"bf16": False, **args})  # float32, as the demo config trains
    return GRPOTrainer(model=model, reward_funcs=[iou], args=config, train_dataset=Dataset.from_list(rows),
                       processing_class=processor)


if __name__ == "__main__":
    model_path, train, out, args, template = sys.argv[1:4] + [json.loads(sys.argv[4]), sys.argv[5]]
    trainer = build(model_path, train, out, args, template)
    trainer.train()
    (Path(out) / "log_history.json").write_text(json.dumps(trainer.state.log_history))
