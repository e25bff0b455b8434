"""Every way a model is loaded: where a config's model lives, pretrained weights, LoRA adapters (merged or
trained on), freezing, the vision token ids generation must suppress, loading for inference, and a model
folder a reward generates with (`load_chat_model`: a local judge).

Training (vlmexp/train/), evaluation and export all load through here, so none of them imports another.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

from vlmexp.config.schema import Config, ModelConfig
from vlmexp.config.stages import StageConfig
from vlmexp.errors import ConfigError, Problem
from vlmexp.families import FAMILIES, TINY_PREFIX, Family, detect_family, get_family
from vlmexp.paths import is_hub_id

log = logging.getLogger("vlmexp.model")


def tiny_spec(cfg: ModelConfig):
    from vlmexp.tiny import TinySpec

    return TinySpec(**cfg.tiny.model_dump()) if cfg.tiny else TinySpec()


def resolve_model(cfg: ModelConfig, output_dir: str | Path) -> tuple[str, Family]:
    """(path to load, family). A tiny model is built once under <output_dir>/models/ and reused."""
    if cfg.is_tiny:
        from vlmexp.tiny import make_tiny_model

        family = get_family(cfg.path[len(TINY_PREFIX):])
        spec = tiny_spec(cfg)
        made = spec.model_dump()
        for added in ("corpus_tools", "tools_block_token"):  # folders built before these keep their name
            if not made[added]:
                del made[added]
        key = hashlib.sha256(json.dumps(made, sort_keys=True).encode()).hexdigest()[:8]
        folder = Path(output_dir) / "models" / f"tiny-{family.name}-{key}"
        if not (folder / "config.json").is_file():
            make_tiny_model(folder, family.name, spec)
        return str(folder), family
    if is_hub_id(cfg.path):
        if cfg.family is None:
            raise ValueError(f"model.path {cfg.path!r} is a hub id: set model.family (one of "
                             f"{', '.join(FAMILIES)}) or download it and give the local folder")
        return cfg.path, get_family(cfg.family)
    family = detect_family(cfg.path)
    if cfg.family and cfg.family != family.name:
        raise ValueError(f"model.family {cfg.family!r} contradicts {cfg.path}/config.json "
                         f"(model_type {family.name!r}): remove model.family")
    return cfg.path, family


def adapter_base(path: str) -> str | None:
    """The base model of a PEFT adapter folder (adapter_config.json), or None for a full model."""
    config = Path(path) / "adapter_config.json"
    return json.loads(config.read_text())["base_model_name_or_path"] if config.is_file() else None


def check_hardware(stage_cfg: StageConfig, stage: str) -> None:
    """Refuse what this machine cannot run, before anything is loaded."""
    import importlib.util

    import torch

    if stage_cfg.peft is None or stage_cfg.peft.method != "qlora":
        return
    if not torch.cuda.is_available():
        raise ConfigError(Problem(f"{stage}.peft.method", "",
                                  "QLoRA loads the base in 4 bits with bitsandbytes, "
                                  "which needs a CUDA GPU; on this machine use method: lora", "qlora"))
    if importlib.util.find_spec("bitsandbytes") is None:
        raise ConfigError(Problem(f"{stage}.peft.method", "", "QLoRA needs bitsandbytes: "
                                  "pip install 'vlmexp[gpu]'", "qlora"))


def load_pretrained(cfg: Config, model_path: str, family: Family, quantize_4bit: bool = False):
    """The family's model class from a folder or hub id, with the config's dtype and attention."""
    import torch
    import transformers

    dtype = "auto" if cfg.model.dtype == "auto" else getattr(torch, cfg.model.dtype)
    extra: dict[str, Any] = {}
    if quantize_4bit:
        extra["quantization_config"] = transformers.BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.bfloat16,
            llm_int8_skip_modules=[family.vision_module.strip("."), family.projector_module.strip("."),
                                   "lm_head"])
    model = getattr(transformers, family.model_class).from_pretrained(
        model_path, dtype=dtype, attn_implementation=cfg.model.attn_implementation,
        trust_remote_code=cfg.model.trust_remote_code, **extra,
    )
    if missing := missing_linear_attention_kernels(model.config):
        say_reference_kernels(missing)
    return model


# the CUDA/Triton kernels of Qwen3.5's Gated DeltaNet layers (the gpu extra), by the module they import as
LINEAR_ATTENTION_KERNELS = {"fla": "flash-linear-attention", "causal_conv1d": "causal-conv1d"}


def missing_linear_attention_kernels(config) -> tuple[str, ...]:
    """The kernel packages a model with linear-attention layers runs without here (() for other models)."""
    from importlib.util import find_spec

    text = getattr(config, "text_config", config)
    if "linear_attention" not in (getattr(text, "layer_types", None) or ()):
        return ()
    return tuple(dist for module, dist in LINEAR_ATTENTION_KERNELS.items() if find_spec(module) is None)


@functools.cache
def say_reference_kernels(missing: tuple[str, ...]) -> None:
    """Say once (per process: a stage) what running without the kernels costs, in place of transformers'
    message per kernel function (4 for Qwen3.5), which a filter on its logger drops from here on."""
    import logging

    class _Said(logging.Filter):
        def filter(self, record):
            return "is falling back to its reference PyTorch implementation" not in record.getMessage()

    logging.getLogger("transformers.integrations.hub_kernels").addFilter(_Said())
    log.warning("linear attention runs transformers' PyTorch reference kernels: %s not installed (CUDA only; "
                "the gpu extra). Correct but slow: on a 2-core CPU a 1.6M-parameter Qwen3.5 (3 linear + 1 "
                "full layers) took 2.3-3.8 s a forward and backward of 8 x 128 tokens, ~110 ms a generated "
                "token",
                " and ".join(missing))


def merged_start(cfg: Config, adapter: str, family: Family, processor: Any, stage_dir: Path) -> str:
    """Merge an adapter into its base once, under <stage_dir>/start-merged, and return that folder.

    A folder on disk (not an in-memory merge) so GRPO's reference model, loaded from the policy's
    `name_or_path`, is the merged model rather than the bare base.
    """
    from filelock import FileLock
    from peft import PeftModel

    from vlmexp.files import new_folder

    target = stage_dir / "start-merged"
    stage_dir.mkdir(parents=True, exist_ok=True)
    with FileLock(stage_dir / ".merge.lock"):  # one rank merges, the others wait and reuse
        if not (target / "config.json").is_file():
            base = load_pretrained(cfg, adapter_base(adapter), family)
            merged = PeftModel.from_pretrained(base, adapter).merge_and_unload()
            # replace: a folder without config.json is a leftover
            with new_folder(target, replace=True) as tmp:
                merged.save_pretrained(str(tmp), is_main_process=True)
                processor.save_pretrained(str(tmp))
            log.info("merged adapter %s into %s", adapter, target)
    return str(target.resolve())


def load_for_training(cfg: Config, stage_cfg: StageConfig, path: str, family: Family, processor: Any,
                      stage_dir: Path, resume_from: str | None):
    """(model, peft_config for the trainer or None). Handles full, LoRA, QLoRA and starting from an adapter:
    `grpo.sft_adapter: merge` merges it first (into `stage_dir`), `continue` keeps training it; the weights
    of a full-model checkpoint `resume_from` are loaded here."""
    base = adapter_base(path)
    if base is not None and getattr(stage_cfg, "sft_adapter", "merge") == "merge":
        path, base = merged_start(cfg, path, family, processor, stage_dir), None
    qlora = stage_cfg.peft is not None and stage_cfg.peft.method == "qlora"
    weights = base or path
    ckpt = resume_from
    if ckpt and (Path(ckpt) / "config.json").is_file() and not (Path(ckpt) / "adapter_config.json").is_file():
        # Full-model resume: the Trainer restores optimizer, scheduler, RNG and step, but loads the weights
        # with a plain load_state_dict that skips transformers' key conversion, so a Qwen-VL checkpoint
        # (saved as model.layers.*, visual.*) would silently keep only lm_head (transformers#43701).
        # from_pretrained converts the keys; the Trainer's own load then only matches lm_head (same values)
        # and warns about the other keys: that warning is expected.
        log.info("loading the weights to resume from %s through from_pretrained (transformers#43701)", ckpt)
        weights = ckpt
    model = load_pretrained(cfg, weights, family, quantize_4bit=qlora)
    model.config._name_or_path = base or path  # GRPO builds its reference model from this: the start model
    if base is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, path, is_trainable=True)
        log.info("continuing to train the adapter in %s", path)
        return model, None
    frozen = freeze(model, family, vision=stage_cfg.freeze_vision, merger=stage_cfg.freeze_merger)
    if frozen:
        log.info("froze %d vision parameters", frozen)
    return model, lora_config(stage_cfg)


def freeze(model, family: Family, vision: bool, merger: bool) -> int:
    """Stop gradients to the vision tower and/or the merger (projector); return the number of tensors
    frozen."""
    n = 0
    for name, param in model.named_parameters():
        part = family.vision_part(name)
        if (part == "vision" and vision) or (part == "projector" and merger):
            param.requires_grad_(False)
            n += 1
    return n


def lora_config(stage_cfg: StageConfig):
    """peft's LoraConfig for the stage's `peft` section (None: full fine-tuning)."""
    if stage_cfg.peft is None:
        return None
    from peft import LoraConfig

    p = stage_cfg.peft
    return LoraConfig(r=p.r, lora_alpha=p.alpha, lora_dropout=p.dropout, target_modules=p.target_modules,
                      target_parameters=p.target_parameters, modules_to_save=p.modules_to_save,
                      task_type="CAUSAL_LM")


def vision_token_ids(processor, family: Family) -> list[int]:
    """Ids of the family's vision placeholder tokens. A completion must never contain them: Qwen-VL's rope
    index counts them as image positions, InternVL puts image features there, and the policy's forward pass
    fails with a shape mismatch."""
    tok = processor.tokenizer
    ids = [tok.convert_tokens_to_ids(t) for t in family.vision_tokens]
    return [i for i in ids if i is not None and i != tok.unk_token_id]


def load_for_inference(cfg: Config, model_path: str):
    """(model, processor, family) from a full model folder or a LoRA adapter folder (merged for speed), on
    this process's GPU when there is one."""
    import torch

    from vlmexp.processor import load_processor

    base = adapter_base(model_path)
    family = detect_family(base or model_path)
    model = load_pretrained(cfg, base or model_path, family)
    if base is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, model_path).merge_and_unload()
    model.eval()
    # generation on the GPU the process owns (torchrun's LOCAL_RANK), not the CPU
    if torch.cuda.is_available():
        model.to(torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))))
    processor = load_processor(model_path, family, cfg.model.image_knobs,
                               trust_remote_code=cfg.model.trust_remote_code)
    return model, processor, family


def load_chat_model(folder: str, trust_remote_code: bool):
    """(model, processor, family) of a local model folder that answers chat prompts, read as its config.json
    says: a vlmexp family's model class and processor (the processor's own image budget), else a causal
    language model with its tokenizer as the processor and family None; in eval mode on this process's device
    (accelerate's PartialState)."""
    import transformers
    from accelerate import PartialState

    from vlmexp.processor import load_processor

    model_type = json.loads((Path(folder) / "config.json").read_text()).get("model_type")
    if model_type in FAMILIES:
        family = get_family(model_type)
        model = getattr(transformers, family.model_class).from_pretrained(folder,
                                                                          trust_remote_code=trust_remote_code)
        processor = load_processor(folder, family, {}, trust_remote_code=trust_remote_code)
    else:
        family = None
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=trust_remote_code)
        processor = transformers.AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code)
    return model.to(PartialState().device).eval(), processor, family
