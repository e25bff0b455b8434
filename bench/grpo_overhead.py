"""GRPO per-step cost: a plain TRL GRPOTrainer script against `vlmexp train grpo`, same model, data and args.

    .venv/bin/python bench/grpo_overhead.py [--rounds 3] [--steps 12] [--out bench/results/grpo_overhead.json]

Alternates A (plain TRL) and B (vlmexp) `--rounds` times in one run, each in a fresh process, and reports
the median and spread of TRL's own `step_time` per step (first two steps of each run dropped as warm-up),
and the ratio B / A. Both sides train the tiny Qwen2.5-VL on the demo data with the IoU reward, tracking off.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ARGS = {"per_device_train_batch_size": 8, "num_generations": 8, "max_completion_length": 48, "temperature": 0.8,
        "learning_rate": 3e-4, "beta": 0.0, "logging_steps": 1, "save_strategy": "no", "report_to": [],
        "seed": 42}

PLAIN = r'''
import json, sys
from pathlib import Path
from datasets import Dataset
from PIL import Image
from transformers import AutoModelForImageTextToText
from trl import GRPOConfig, GRPOTrainer
sys.path.insert(0, sys.argv[4])
from vlmexp.families import get_family
from vlmexp.processor import load_processor

model_path, train, out, _, args = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], json.loads(sys.argv[5])
args.setdefault("bf16", False)  # float32 weights, as the demo config trains them
rows = []
for line in Path(train).read_text().splitlines():
    r = json.loads(line)
    rows.append({"prompt": [{"role": "user", "content": f"Output the bounding box of {r['problem']} as "
                             "[x1, y1, x2, y2] in <answer></answer> tags, after reasoning in <think></think>."}],
                 "images": [Image.open(r["image_paths"][0]).convert("RGB")], "solution": r["solution"]})

def iou(prompts, completions, solution, **kw):
    import re
    out = []
    for c, s in zip(completions, solution):
        m = re.search(r"\[(\d+), (\d+), (\d+), (\d+)\]", c[0]["content"])
        if not m:
            out.append(0.0); continue
        a = list(map(float, m.groups()))
        ix = max(0.0, min(a[2], s[2]) - max(a[0], s[0])); iy = max(0.0, min(a[3], s[3]) - max(a[1], s[1]))
        u = (a[2] - a[0]) * (a[3] - a[1]) + (s[2] - s[0]) * (s[3] - s[1]) - ix * iy
        out.append(ix * iy / u if u > 0 else 0.0)
    return out

family = get_family("qwen2_5_vl")
processor = load_processor(model_path, family, 3136, 102400)
model = AutoModelForImageTextToText.from_pretrained(model_path, dtype="float32", attn_implementation="sdpa")
trainer = GRPOTrainer(model=model, reward_funcs=[iou], args=GRPOConfig(output_dir=out, **args),
                      train_dataset=Dataset.from_list(rows), processing_class=processor)
trainer.train()
json.dump(trainer.state.log_history, open(Path(out) / "log_history.json", "w"))
'''


def call(command: list[str], env: dict[str, str] | None = None) -> None:
    r = subprocess.run(command, capture_output=True, text=True, cwd=REPO, env={**os.environ, **(env or {})})
    if r.returncode != 0:
        raise SystemExit(f"{command[:4]} failed ({r.returncode}):\n{r.stderr[-3000:]}")


def step_times(history: list[dict]) -> list[float]:
    return [h["step_time"] for h in history if "step_time" in h][2:]


def run_plain(model: str, train: str, work: Path, steps: int) -> list[float]:
    out = work / f"plain-{time.monotonic_ns()}"
    out.mkdir()
    call([sys.executable, "-c", PLAIN, model, train, str(out), str(REPO), json.dumps({**ARGS, "max_steps": steps})])
    return step_times(json.loads((out / "log_history.json").read_text()))


def run_vlmexp(work: Path, steps: int) -> list[float]:
    out = work / f"vlmexp-{time.monotonic_ns()}"
    same = ("per_device_train_batch_size", "num_generations", "max_completion_length", "temperature",
            "learning_rate", "beta")  # the plain script's values, whatever configs/demo.yaml says
    overrides = [f"run.output_dir={out}", "tracking.backend=none", f"grpo.args.max_steps={steps}",
                 f"grpo.args.save_steps={steps}", "grpo.args.logging_steps=1", "grpo.rewards=[{name: iou}]",
                 *(f"grpo.args.{k}={ARGS[k]}" for k in same)]
    # share the built model and sampled data, so both sides read the same files
    for name in ("models", "data"):
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).symlink_to(work / "shared" / name)
    (out / next((work / "shared").glob("demo_data-*")).name).symlink_to(next((work / "shared").glob("demo_data-*")))
    # as under the pipeline: the data is sampled already, the stage does not sample it again
    call([sys.executable, "-m", "vlmexp.cli", "train", "grpo", "--config", "configs/demo.yaml", *overrides],
         env={"VLMEXP_DATA_SAMPLED": "1"})
    state = json.loads((out / "grpo" / f"checkpoint-{steps}" / "trainer_state.json").read_text())
    return step_times(state["log_history"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "grpo_overhead.json"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        call([sys.executable, "-m", "vlmexp.cli", "train", "sft", "--config", "configs/demo.yaml",
              f"run.output_dir={work / 'shared'}", "tracking.backend=none", "sft.args.max_steps=1",
              "sft.args.save_steps=1"])  # builds the model and samples the data
        [model] = (work / "shared" / "models").glob("tiny-*")
        train = str(work / "shared" / "data" / "train.jsonl")
        plain, ours = [], []
        for i in range(args.rounds):
            plain += run_plain(str(model), train, work, args.steps)
            ours += run_vlmexp(work, args.steps)
            print(f"round {i + 1}: plain median {statistics.median(plain):.3f}s, vlmexp median "
                  f"{statistics.median(ours):.3f}s", flush=True)
    result = {"rounds": args.rounds, "steps_per_run": args.steps, "plain_trl_step_s": summary(plain),
              "vlmexp_step_s": summary(ours), "ratio": statistics.median(ours) / statistics.median(plain)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


def summary(values: list[float]) -> dict[str, float]:
    q = statistics.quantiles(values, n=4)
    return {"median": statistics.median(values), "p25": q[0], "p75": q[2], "n": len(values)}


if __name__ == "__main__":
    main()
