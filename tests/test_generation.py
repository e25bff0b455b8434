"""The one generation module (vlmexp.generation) on the tiny Qwen2.5-VL: the `generation:` section's checks
and what it resolves to, bucketing that never changes a completion, compiled generation giving eager's greedy
tokens with one compilation per shape, the static cache under autocast, and TRL's GRPO rollouts set up from
it."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from conftest import SMALL_BATCHES

from vlmexp.checks.loader import load_config
from vlmexp.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]
TEXTS = ("the red square", "the small blue circle at the left of the picture, next to the green triangle",
         "a shape", "the large yellow star in the lower right corner of the image, under the purple ellipse")
SIZES = ((112, 112), (224, 168), (112, 112), (168, 280))  # 16, 48, 16, 60 vision tokens: prompts of 4 lengths


def _cfg(tmp_path, *overrides):
    return load_config(REPO / "configs/demo.yaml", [f"run.output_dir={tmp_path}", "tracking.backend=none",
                                                    "data.demo.train=16", "data.demo.val=4", *SMALL_BATCHES,
                                                    *overrides])


def _prompts():
    from PIL import Image

    prompts = [[{"role": "user", "content": f"Locate {t}."}] for t in TEXTS]
    images = [[Image.new("RGB", size, (40 * i, 90, 200 - 40 * i))] for i, size in enumerate(SIZES)]
    return prompts, images


@pytest.fixture(scope="module")
def tiny(tiny_models, tmp_path_factory):
    from vlmexp.modeling import load_for_inference

    cfg = _cfg(tmp_path_factory.mktemp("gen"))
    return cfg, *load_for_inference(cfg, str(tiny_models["qwen2_5_vl"]))


def test_section_checks_and_resolves(tmp_path):
    from vlmexp.generation import AUTO_BUCKET, Settings, generation_config_kwargs, resolve

    cfg = _cfg(tmp_path, "generation.compile=off")  # YAML reads off as false: taken as the switch it names
    assert (cfg.generation.compile == "off"
            and _cfg(tmp_path, "generation.compile=on").generation.compile == "on")
    default = _cfg(tmp_path).generation
    assert resolve(default, "cpu") == Settings(False, "dynamic", 1)  # the CPU default: generation as it was
    # transformers' own defaults, untouched
    assert generation_config_kwargs(resolve(default, "cpu"), "cpu") == {}
    assert resolve(default, "cuda") == Settings(True, "static", AUTO_BUCKET)
    assert resolve(_cfg(tmp_path, "generation.cache=static",
                        "generation.prompt_bucket=32").generation, "cpu") == Settings(False, "static", 32)
    kwargs = generation_config_kwargs(Settings(True, "static", 64), "cpu")
    assert kwargs["disable_compile"] is False and kwargs["compile_config"]._compile_all_devices
    with pytest.raises(ConfigError, match="compile: on needs a static cache.*set cache: static or auto"):
        _cfg(tmp_path, "generation.compile=on", "generation.cache=dynamic")
    with pytest.raises(ConfigError, match=r"generation.compile.*'auto', 'on' or 'off'"):
        _cfg(tmp_path, "generation.compile=fast")
    with pytest.raises(ConfigError, match="generation.prompt_bucket"):
        _cfg(tmp_path, "generation.prompt_bucket=0")
    with pytest.raises(ConfigError, match="generation.cache_size"):
        _cfg(tmp_path, "generation.cache_size=4")


def test_bucketing_never_changes_a_completion(tiny):
    from vlmexp.generation import Generator, Settings

    _, model, processor, family = tiny
    prompts, images = _prompts()
    outputs = {}
    for bucket in (1, 16, 64):
        for cache in ("dynamic", "static"):
            generate = Generator(model, processor, family, Settings(False, cache, bucket))
            outputs[bucket, cache] = (generate(prompts, images, 12, 0.0, 2)
                                      + generate(prompts, images, 12, 0.0, 4))
            assert generate.count.total == 0  # eager: nothing compiled
    first = outputs[1, "dynamic"]
    assert len(set(first)) > 1 and first[:4] == first[4:]  # the batch size changes nothing either
    assert all(out == first for out in outputs.values()), {k: v[:2] for k, v in outputs.items()}


def test_static_cache_follows_the_autocast_precision(tiny):
    """A float32 model whose forward runs under bf16 autocast (as accelerate wraps it for bf16 training):
    transformers' static cache takes the keys' dtype (float32 after the rotary embedding) and refuses the bf16
    values; the module's cache holds both in bf16, and without autocast in the model's own float32."""
    import torch

    from vlmexp.generation import Generator, Settings, make_precise_static_cache

    _, model, processor, family = tiny
    prompts, images = _prompts()
    generate = Generator(model, processor, family, Settings(False, "static", 16))
    inputs = processor(text=["x"], return_tensors="pt")
    model.forward = torch.autocast("cpu", dtype=torch.bfloat16)(model.forward)  # accelerate's mixed precision
    try:
        with pytest.raises(RuntimeError, match="same dtype"):  # what the pipeline hit on the GPU, reproduced
            model.generate(**inputs, max_new_tokens=3, cache_implementation="static", do_sample=False)
        texts = generate(prompts, images, 6, 0.0, 4)
        cache = make_precise_static_cache(model, 64)
        model(**inputs, past_key_values=cache, use_cache=True)
    finally:
        del model.forward
    assert len(texts) == 4 and cache.layers[0].keys.dtype == cache.layers[0].values.dtype == torch.bfloat16
    plain = make_precise_static_cache(model, 64)
    model(**inputs, past_key_values=plain, use_cache=True)
    assert plain.layers[0].keys.dtype == plain.layers[0].values.dtype == torch.float32


@pytest.mark.slow
def test_compiled_generation_matches_eager_and_compiles_once_per_shape(tiny):
    """Greedy tokens of the compiled decoder (static cache, torch.compile on CPU) equal eager's. Compilations:
    one per decode shape (batch size, cache length), none again for a shape seen before."""
    from vlmexp.generation import Generator, Settings

    _, model, processor, family = tiny
    prompts, images = _prompts()
    eager = Generator(model, processor, family, Settings(False, "dynamic", 1))(prompts, images, 8, 0.0, 2)
    compiled = Generator(model, processor, family, Settings(True, "static", 64))
    assert compiled(prompts, images, 8, 0.0, 2) == eager
    count = compiled.count
    # batches of 2, prompts padded to 128 and to 192 tokens: at most two cache lengths (fewer when an earlier
    # call left a longer cache, which transformers and the module keep), each compiled once
    assert 1 <= len(count.shapes) <= 2 and all(batch == 2 for batch, _ in count.shapes)
    assert len(set(count.shapes.values())) == 1 and not count.unexplained
    assert count.total == sum(count.shapes.values()) > 0
    total = count.total
    assert compiled(prompts[:2], images[:2], 8, 0.0, 2) == eager[:2]  # transformers keeps its longest cache
    smaller = Generator(model, processor, family, replace(compiled.settings, bucket=16), count)
    assert smaller(prompts, images, 8, 0.0, 2) == eager  # other buckets, the same longest cache: nothing new
    assert count.total == total and not count.unexplained, count
    assert count.metrics() == {"generation/compilations": total,
                               "generation/compiled_shapes": len(count.shapes),
                               "generation/unexplained_compilations": 0}
    seen = next(iter(count.shapes))
    count.record(seen, 1)  # a shape compiled before that compiles again: named, not explained by the buckets
    assert count.unexplained and f"batch 2 x cache length {seen[1]}" in count.unexplained[0]


@pytest.mark.slow
def test_grpo_rollouts_generate_as_the_section_says(tmp_path, tiny_models):
    """GRPO through TRL with a static cache and prompt buckets (eager on CPU): TRL's generation config and
    padding are set from the section, the rollouts go through the counted generate, and a step trains with the
    pairing guard satisfied: prompts padded to the bucket keep their images' positions."""
    from vlmexp.train.grpo import build_grpo_trainer
    from vlmexp.train.stage import train_and_save

    cfg = _cfg(tmp_path, f"model.path={tiny_models['qwen2_5_vl']}", "sft.enabled=false",
               "grpo.args.max_steps=1", "grpo.args.num_generations=2",
               "grpo.args.per_device_train_batch_size=4", "grpo.args.max_completion_length=8",
               "generation.cache=static", "generation.prompt_bucket=32")
    trainer, inputs, rows = build_grpo_trainer(cfg)
    assert trainer.generation_config.cache_implementation == "static"
    assert trainer.generation_config.disable_compile is True and trainer.pad_to_multiple_of == 32
    final = train_and_save(trainer, inputs, rows)
    counter = next(c for c in trainer.callback_handler.callbacks if type(c).__name__ == "CompileCountLog")
    # every rollout went through the counted generate, its prompts padded by TRL to a multiple of 32 tokens
    assert counter.count.shapes and counter.count.total == 0 and trainer.state.global_step == 1
    assert all((cache_len - 8) % 32 == 0 for _, cache_len in counter.count.shapes), counter.count.shapes
    assert (final / "model.safetensors").is_file()


@pytest.mark.slow
def test_compiled_rollouts_put_the_compile_count_in_every_log_callbacks_see(tmp_path, tiny_models):
    """With compiled generation the compile count is in each log that the trainer's other callbacks see
    (MLflow's, a caller's, added when the trainer is built): it runs first, not after them."""
    from transformers import TrainerCallback

    from vlmexp.train.grpo import build_grpo_trainer

    class Seen(TrainerCallback):
        def __init__(self):
            self.logs: list[dict] = []

        def on_log(self, args, state, control, logs=None, **kwargs):
            self.logs.append(dict(logs))

    cfg = _cfg(tmp_path, f"model.path={tiny_models['qwen2_5_vl']}", "sft.enabled=false",
               "grpo.args.num_generations=2", "grpo.args.per_device_train_batch_size=4",
               "generation.compile=on")
    seen = Seen()
    trainer, _, _ = build_grpo_trainer(cfg, callbacks=[seen])
    trainer.log({"loss": 0.5})
    assert seen.logs[-1]["loss"] == 0.5
    assert {"generation/compilations": 0.0, "generation/compiled_shapes": 0.0,
            "generation/unexplained_compilations": 0.0}.items() <= seen.logs[-1].items(), seen.logs[-1]
    eager = _cfg(tmp_path / "eager", f"model.path={tiny_models['qwen2_5_vl']}", "sft.enabled=false",
                 "grpo.args.num_generations=2", "grpo.args.per_device_train_batch_size=4",
                 "generation.compile=off")
    trainer, _, _ = build_grpo_trainer(eager, callbacks=[seen])
    trainer.log({"loss": 0.25})
    assert seen.logs[-1]["loss"] == 0.25 and "generation/compilations" not in seen.logs[-1]
