"""GRPO phase costs at Qwen2.5-VL-3B's published shape: generation, log-prob passes, policy update, memory.

    .venv/bin/python bench/gpu_grpo.py           # on a GPU: 3B shape, bf16, 448x448 images, G=8, 256 tokens
    .venv/bin/python bench/gpu_grpo.py --tiny    # anywhere: the same code at the tiny shape (tested on CPU)
    [--repeats 3] [--out bench/results/gpu_grpo.json]

The model is built offline from the 3B config values (random weights; cost does not depend on the values),
with the embedded tokenizer and processor. One GRPO step's phases are timed as TRL runs them:
  generation      HF `generate` of G completions of exactly N new tokens (EOS suppressed), sampling
  logprob pass    a no-grad forward over prompt + completion (the old policy's and the reference's pass)
  policy update   forward + backward + AdamW step over the G sequences (gradient checkpointing on)
MFU = model FLOPs (6 x LM parameters x tokens for the update, 2 x for a forward) / time / the measured
matmul peak of this device in the same dtype. Reported: median and spread over --repeats.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def build(spec, device, dtype):
    """(model, processor): random weights at `spec`'s shape (vlmexp.tiny.SHAPES), the embedded processor."""
    import transformers

    from vlmexp.families import get_family
    from vlmexp.processor import load_processor
    from vlmexp.tiny import make_tiny_model, model_config

    family = get_family("qwen2_5_vl")
    folder = make_tiny_model(Path(tempfile.mkdtemp()) / "tiny", family.name)  # tokenizer, processor
    processor = load_processor(folder, family)
    config = model_config(family, spec, processor.tokenizer)
    with device:
        model = transformers.Qwen2_5_VLForConditionalGeneration._from_config(
            config, dtype=dtype, attn_implementation="sdpa")
    return model, processor


def matmul_peak(device, dtype, n: int) -> float:
    """Measured FLOP/s of an n x n matmul in `dtype`: the denominator of MFU."""
    import torch

    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    sync(device)
    t, reps = time.perf_counter(), 10
    for _ in range(reps):
        a @ b
    sync(device)
    return 2 * n**3 * reps / (time.perf_counter() - t)


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    import torch
    from PIL import Image

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true",
                        help="tiny shape (CPU-friendly), for tests and smoke runs")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None)
    parser.add_argument("--generations", type=int, default=None,
                        help="sequences generated at once (default 8; tiny: 2)")
    parser.add_argument("--compile", action="store_true",
                        help="generate as the generation section's compiled setting does (static cache, "
                        "torch.compile; vlmexp.generation)")
    parser.add_argument("--generate-only", action="store_true",
                        help="time generation alone (64 sequences' update in one batch would not fit)")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    G, new_tokens, side = (2, 16, 56) if args.tiny else (8, 256, 448)
    G = args.generations or G
    from vlmexp.generation import Settings, generation_config_kwargs

    compiled = generation_config_kwargs(Settings(True, "static", 64), device.type) if args.compile else {}
    from vlmexp.tiny import SHAPES, TinySpec

    model, processor = build(TinySpec() if args.tiny else SHAPES["qwen2.5-vl-3b"], device, dtype)
    lm_params = sum(p.numel() for n, p in model.named_parameters() if "visual" not in n)
    tokenizer = processor.tokenizer
    messages = [{"role": "user", "content": [{"type": "image"},
                                             {"type": "text", "text": "Find the red circle."}]}]
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    image = Image.new("RGB", (side, side), (200, 40, 40))
    inputs = processor(text=[text] * G, images=[image] * G, return_tensors="pt", padding=True).to(device)
    eos = [tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.pad_token_id]
    model.gradient_checkpointing_enable()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    phases: dict[str, list[float]] = {"generation_s": [], "logprob_pass_s": [], "update_s": []}
    for _ in range(args.repeats + 1):  # the first round warms up kernels and allocators
        model.eval()
        sync(device)
        t = time.perf_counter()
        with torch.no_grad():  # not inference_mode: the sequences feed the update's autograd graph
            seqs = model.generate(**inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                  do_sample=True, suppress_tokens=eos, pad_token_id=tokenizer.pad_token_id,
                                  **compiled)
        sync(device)
        gen = time.perf_counter() - t
        if args.generate_only:
            phases["generation_s"].append(gen)
            continue
        # per-token inputs cover the prompt only
        batch = {k: inputs[k].clone() for k in ("pixel_values", "image_grid_thw")}
        mask = torch.ones_like(seqs)
        t = time.perf_counter()
        with torch.no_grad():
            model(input_ids=seqs, attention_mask=mask, **batch).logits.float().log_softmax(-1)
        sync(device)
        logprob = time.perf_counter() - t
        model.train()
        t = time.perf_counter()
        logits = model(input_ids=seqs.clone(), attention_mask=mask, **batch).logits[:, -new_tokens - 1:-1]
        lp = logits.float().log_softmax(-1).gather(-1, seqs[:, -new_tokens:, None]).squeeze(-1)
        advantages = torch.randn(G, 1, device=device)
        (-(lp * advantages).mean()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync(device)
        update = time.perf_counter() - t
        for key, value in (("generation_s", gen), ("logprob_pass_s", logprob), ("update_s", update)):
            phases[key].append(value)
    phases = {k: v[1:] for k, v in phases.items() if v}
    tokens = G * seqs.shape[1]
    peak = matmul_peak(device, dtype, 8192 if device.type == "cuda" else 1024)
    med = {k: statistics.median(v) for k, v in phases.items()}

    def rate(key: str, flops: float) -> float | None:
        return flops / med[key] if key in med else None  # absent with --generate-only

    result = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "dtype": str(dtype).removeprefix("torch."), "shape": "tiny" if args.tiny else "qwen2.5-vl-3b",
        "lm_parameters": lm_params, "G": G, "new_tokens": new_tokens, "compiled_generation": args.compile,
        "image": f"{side}x{side}",
        "sequence_tokens": int(seqs.shape[1]), "repeats": args.repeats,
        "phases_s": {k: {"median": statistics.median(v), "min": min(v), "max": max(v)}
                     for k, v in phases.items()},
        "generation_tokens_per_s": G * new_tokens / med["generation_s"],
        "update_tokens_per_s": rate("update_s", tokens),
        "matmul_peak_tflops": peak / 1e12,
        "update_mfu": rate("update_s", 6 * lm_params * tokens / peak),
        "logprob_pass_mfu": rate("logprob_pass_s", 2 * lm_params * tokens / peak),
        "peak_gpu_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
    }
    text_out = json.dumps(result, indent=2)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text_out + "\n")
    print(text_out)


if __name__ == "__main__":
    main()
