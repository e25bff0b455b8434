"""Generation: the one code path every part that generates text goes through (nanochat's engine, one for
all). It generates and counts compilations; it loads no model, builds no reward and logs nothing.

`Generator` serves evaluation (`vlmexp.evaluate`), validation during training (`vlmexp.train.validation`),
DPO's pairs from samples and GRPO's difficulty filter (`vlmexp.train.sampling.sample_and_score`) and a local
judge model (`vlmexp.model_rewards.judge`, a vision-language model of a family or a text-only one); GRPO's
rollouts are TRL's own `model.generate` call, set up by `configure_trainer` from the same `generation:`
section.

What the section decides (`resolve`): whether the decoding step is compiled (`compile: auto` is on where CUDA
is, off on CPU), the key/value cache (static when compiled), and the prompt-length bucket (prompts left-padded
to a multiple of it, so a compiled decoder sees one shape per bucket). Measured on one H100 at Qwen2.5-VL-3B's
shape (bench/RESULTS.md): TRL builds its generation config with `disable_compile=True`, so a static cache
alone made GRPO's generation slower; compiled, it was 2.5-3.8 x faster.

The static cache's precision: transformers sizes a static cache by the first keys it stores. A float32 model
under bf16 autocast produces float32 keys (Qwen-VL's rotary embedding multiplies by float32 cos/sin) and bf16
values, and the cache then refuses the values (`index_copy_(): self and source expected to have the same
dtype`). `make_precise_static_cache` holds both in the precision the model runs in (the autocast dtype when
autocast is on inside the forward, as accelerate's mixed-precision wrapper has it) and casts what it stores;
every static-cache generate call of the module gets one (`counted_generate`).

Compilations are counted (`CompileCount`, from torch._dynamo's counter of graphs); a generate call at a shape
(batch size, cache length) that compiled before and compiles again is a warning naming the shape.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vlmexp.config.schema import Config
    from vlmexp.config.stages import GenerationConfig

log = logging.getLogger("vlmexp.generation")
AUTO_BUCKET = 64  # tokens: the prompt-length bucket when compiled and generation.prompt_bucket is not set


@dataclass(frozen=True)
class Settings:
    """What the `generation:` section resolves to on this machine."""

    compile: bool
    cache: str  # "static" | "dynamic"
    bucket: int  # prompts are left-padded to a multiple of this many tokens (1: the batch's longest prompt)


EAGER = Settings(compile=False, cache="dynamic", bucket=1)  # transformers' defaults: what no section changes


def resolve(section: GenerationConfig, device_type: str | None = None) -> Settings:
    """The settings `section` means on `device_type` (default: cuda when CUDA is available, else cpu)."""
    if device_type is None:
        import torch

        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    compiled = {"on": True, "off": False, "auto": device_type == "cuda"}[section.compile]
    cache = section.cache if section.cache != "auto" else ("static" if compiled else "dynamic")
    if compiled and cache != "static":
        raise ValueError("generation.compile needs a static cache (set by generation.compile: auto on CUDA); "
                         "set generation.cache: static or auto, or generation.compile: off")
    bucket = section.prompt_bucket or (AUTO_BUCKET if compiled else 1)
    return Settings(compiled, cache, bucket)


def generation_config_kwargs(settings: Settings, device_type: str) -> dict[str, Any]:
    """transformers GenerationConfig fields for `settings`: nothing when eager with a dynamic cache
    (transformers' own defaults, what generation was before the section existed)."""
    if not settings.compile and settings.cache == "dynamic":
        return {}
    out: dict[str, Any] = {"cache_implementation": settings.cache, "disable_compile": not settings.compile}
    if settings.compile and device_type != "cuda":  # transformers compiles only on accelerators unless told
        from transformers import CompileConfig

        config = CompileConfig(fullgraph=False, dynamic=False, mode="default")
        config._compile_all_devices = True
        out["compile_config"] = config
    return out


@dataclass
class CompileCount:
    """Graphs torch.compile built during generation, per shape (batch size, cache length) that compiled them,
    and the calls that compiled again at a shape seen before (what the buckets do not explain)."""

    total: int = 0
    shapes: dict[tuple[int, int], int] = field(default_factory=dict)
    unexplained: list[str] = field(default_factory=list)

    def record(self, shape: tuple[int, int], graphs: int) -> None:
        self.total += graphs
        if shape in self.shapes and graphs:
            cause = (f"{graphs} graph(s) compiled again for batch {shape[0]} x cache length {shape[1]}, "
                     "a shape compiled before: something other than the prompt buckets changed (sampling "
                     "settings, a new model or dtype, grad mode); TORCH_LOGS=recompiles names the guard")
            self.unexplained.append(cause)
            log.warning("generation recompiled: %s", cause)
        self.shapes[shape] = self.shapes.get(shape, 0) + graphs

    def metrics(self) -> dict[str, float]:
        return {"generation/compilations": float(self.total),
                "generation/compiled_shapes": float(len(self.shapes)),
                "generation/unexplained_compilations": float(len(self.unexplained))}


def graphs_compiled() -> int:
    """torch._dynamo's running count of graphs compiled in this process."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def bucketed(length: int, bucket: int) -> int:
    """`length` rounded up to a multiple of `bucket`."""
    return -(-length // bucket) * bucket


def make_precise_static_cache(model, max_cache_len: int):
    """A static cache for `model` whose keys and values are held in the dtype the model computes in: decided
    when the first keys arrive (inside the forward, where accelerate's autocast wrapper is active during
    training), the autocast dtype when autocast is on, else the values' dtype; what is stored is cast to
    it."""
    import torch
    from transformers.cache_utils import StaticCache, StaticLayer

    class PrecisionStaticLayer(StaticLayer):
        def lazy_initialization(self, key_states, value_states):
            device = key_states.device.type
            dtype = (torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device)
                     else value_states.dtype)
            super().lazy_initialization(key_states.to(dtype), value_states.to(dtype))

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            return super().update(key_states.to(self.dtype), value_states.to(self.dtype), *args, **kwargs)

    cache = StaticCache(config=model.config.get_text_config(decoder=True), max_cache_len=max_cache_len)
    cache.layers = [PrecisionStaticLayer(max_cache_len=max_cache_len) if type(layer) is StaticLayer else layer
                    for layer in cache.layers]
    return cache


def counted_generate(model, generate, count: CompileCount, **kwargs):
    """`generate(**kwargs)` for `model`, counting the graphs it compiles under its decode shape; a static
    cache holds keys and values in the model's running precision (see the module docstring)."""
    import copy

    config = kwargs.get("generation_config") or model.generation_config
    static = "static" in (getattr(config, "cache_implementation", None), kwargs.get("cache_implementation"))
    batch, length = kwargs["input_ids"].shape
    new_tokens = kwargs.get("max_new_tokens") or config.max_new_tokens
    # as transformers reuses its cache
    cache_len = max(length + new_tokens, getattr(model, "_vlmexp_cache_len", 0))
    if static:
        model._vlmexp_cache_len = cache_len
        if "past_key_values" not in kwargs:
            kwargs["past_key_values"] = precise_static_cache(model, batch, cache_len)
            # transformers refuses a cache and a cache_implementation
            kwargs.pop("cache_implementation", None)
            kwargs["generation_config"] = copy.copy(config)
            kwargs["generation_config"].cache_implementation = None
    before = graphs_compiled()
    out = generate(**kwargs)
    count.record((batch, cache_len if static else length), graphs_compiled() - before)
    return out


def precise_static_cache(model, batch: int, cache_len: int):
    """The model's precise static cache for this shape, reset; built once per shape, as transformers keeps one
    cache across calls (a compiled step then finds the same tensors)."""
    key = (batch, cache_len)
    cache = getattr(model, "_vlmexp_caches", {}).get(key)
    if cache is None:
        model._vlmexp_caches = {key: make_precise_static_cache(model, cache_len)}
        return model._vlmexp_caches[key]
    cache.reset()
    return cache


def configure_trainer(trainer, settings: Settings) -> CompileCount:
    """Make a TRL GRPOTrainer generate as `settings` say: its GenerationConfig's compile switch, cache and
    compile config, the prompt padding to the bucket (TRL's own `pad_to_multiple_of`, used where it left-pads
    prompts), and the model's `generate` counting compilations (and using the precise static cache). Eager
    with a dynamic cache leaves TRL's generation config as TRL built it."""
    count = CompileCount()
    device_type = trainer.accelerator.device.type
    for key, value in generation_config_kwargs(settings, device_type).items():
        setattr(trainer.generation_config, key, value)
        if hasattr(trainer, "generation_kwargs") and key != "compile_config":
            trainer.generation_kwargs[key] = value
    if settings.bucket > 1:
        trainer.pad_to_multiple_of = settings.bucket
    model = trainer.model.get_base_model() if hasattr(trainer.model, "get_base_model") else trainer.model
    model.generate = functools.partial(counted_generate, model, model.generate, count)
    return count


def with_image_parts(messages: list[dict], images: int) -> list[dict]:
    """`messages` with one image part per image at the start of the first user turn, where TRL's
    `prepare_multimodal_messages` puts them in training (trl/data_utils.py)."""
    first = next(i for i, m in enumerate(messages) if m["role"] == "user")
    user = messages[first]
    content = [{"type": "image"} for _ in range(images)] + [{"type": "text", "text": user["content"]}]
    return [*messages[:first], {**user, "content": content}, *messages[first + 1:]]


@dataclass
class Generator:
    """Generates completions for chat prompts with their images, as the `generation:` section says; counts the
    compilations of every call. `family` None: a text-only model, with its tokenizer as the processor (a
    local judge), whose prompts go to its chat template as they are."""

    model: Any
    processor: Any
    family: Any  # vlmexp.families.Family, or None
    settings: Settings = EAGER
    count: CompileCount = field(default_factory=CompileCount)

    @classmethod
    def for_config(cls, cfg: Config, model, processor, family,
                   count: CompileCount | None = None) -> Generator:
        """The generator `cfg.generation` asks for on the model's device; `count`: a count to go on adding
        to."""
        return cls(model, processor, family, resolve(cfg.generation, model.device.type),
                   count or CompileCount())

    def __call__(self, prompts: list[list[dict]], images: list[list], max_new_tokens: int, temperature: float,
                 batch_size: int) -> list[str]:
        """Completions for `prompts`, `batch_size` at a time, left-padded (to the bucket); the family's vision
        tokens are never generated; temperature 0 is greedy. The chat template writes the special tokens (the
        tokenizer adds none, as in TRL's generation)."""
        texts = [self.processor.apply_chat_template(
            m if self.family is None else with_image_parts(m, len(imgs)), tokenize=False,
            add_generation_prompt=True) for m, imgs in zip(prompts, images, strict=True)]
        ids = self.generate_ids(texts, images, max_new_tokens, temperature, batch_size)
        tokenizer = getattr(self.processor, "tokenizer", self.processor)
        return tokenizer.batch_decode([new for _, new in ids], skip_special_tokens=True)

    def generate_ids(self, texts: list[str], images: list[list], max_new_tokens: int, temperature: float,
                     batch_size: int) -> list[tuple[list[int], list[int]]]:
        """(prompt ids, new ids) for rendered prompts `texts` with their images, pads left out (the end of
        turn kept)."""
        import torch

        from vlmexp.modeling import vision_token_ids

        tokenizer = getattr(self.processor, "tokenizer", self.processor)
        tokenizer.padding_side = "left"
        if tokenizer.pad_token is None:  # a causal model's tokenizer may have none: pad with its end token
            tokenizer.pad_token = tokenizer.eos_token
        sampling = ({"do_sample": True, "temperature": temperature} if temperature > 0
                    else {"do_sample": False})
        sampling.update(generation_config_kwargs(self.settings, self.model.device.type))
        if self.family is not None:
            sampling["suppress_tokens"] = vision_token_ids(self.processor, self.family)
        padding = {"pad_to_multiple_of": self.settings.bucket} if self.settings.bucket > 1 else {}
        out: list[tuple[list[int], list[int]]] = []
        for start in range(0, len(texts), batch_size):
            batch_texts, batch_images = texts[start:start + batch_size], images[start:start + batch_size]
            flat = [im for imgs in batch_images for im in imgs]
            inputs = self.processor(text=batch_texts, **({"images": flat} if flat else {}), padding=True,
                                    add_special_tokens=False, return_tensors="pt", **padding)
            inputs = inputs.to(self.model.device)
            with torch.inference_mode():
                generated = counted_generate(self.model, self.model.generate, self.count, **inputs,
                                             max_new_tokens=max_new_tokens,
                                             pad_token_id=tokenizer.pad_token_id, **sampling)
            width = inputs["input_ids"].shape[1]
            for row, mask in zip(generated.tolist(), inputs["attention_mask"].tolist(), strict=True):
                new = row[width:]
                while new and new[-1] == tokenizer.pad_token_id:
                    new.pop()
                out.append(([t for t, m in zip(row[:width], mask, strict=True) if m], new))
        return out

    def converse(self, prompts: list[list[dict]], images: list[list], environments: list, max_turns: int,
                 max_new_tokens: int, temperature: float, batch_size: int) -> list[list[dict]]:
        """Completions with tools (grpo.tools), turn by turn as TRL's tool loop makes them in GRPO: each
        completion is the messages after the prompt (assistant turns, each parsed by the tokenizer's response
        parser, and tool turns), TRL's form. A turn that calls a tool runs it in the prompt's environment
        (`environments`, one per prompt) and the next turn sees the result; at most `max_turns` calls are
        run, and the turn after the last ends the completion. `max_new_tokens` bounds each turn.

        As in TRL's loop, the next turn's prompt is the text so far, the turn as generated and the tool turns
        (`tool_suffix`), never a re-rendering of the parsed turn: the parser moves a turn's <think> into
        `reasoning_content`, which a chat template may not write back, and the model would meet a history it
        did not write."""
        from trl.chat_template_utils import parse_response

        from vlmexp.tools import run_tool_calls, tool_methods

        tools = tool_methods(environments[0]) if environments else []
        tokenizer = self.processor.tokenizer
        done: list[list[dict]] = [[] for _ in prompts]
        seen = [list(imgs) for imgs in images]  # each conversation's images so far: the record's, the crops
        texts = [self.processor.apply_chat_template(with_image_parts(p, len(imgs)), tools=tools,
                                                    tokenize=False, add_generation_prompt=True)
                 for p, imgs in zip(prompts, images, strict=True)]
        active = list(range(len(prompts)))
        for turn in range(max_turns + 1):
            ids = self.generate_ids([texts[i] for i in active], [seen[i] for i in active], max_new_tokens,
                                    temperature, batch_size)
            calling = []
            for i, (prompt_ids, new) in zip(active, ids, strict=True):
                message = parse_response(tokenizer, new, prefix=prompt_ids, tools=tools)
                done[i].append(message)
                if message.get("tool_calls") and turn < max_turns:
                    results = run_tool_calls(environments[i], message["tool_calls"])
                    done[i] += results
                    seen[i] += [p["image"] for m in results if isinstance(m["content"], list)
                                for p in m["content"] if p.get("type") == "image"]
                    texts[i] += tokenizer.decode(new) + self.tool_suffix(results, tools)
                    calling.append(i)
            active = calling
            if not active:
                break
        return done

    def tool_suffix(self, tool_messages: list[dict], tools: list) -> str:
        """What follows a turn's end token for its tool turns, up to the next assistant turn's header: TRL's
        `_get_tool_suffix_ids` as text (the template renders a one-call conversation with and without the
        tool turns; the difference after the end token)."""
        call = [{"type": "function", "function": {"name": tool_messages[0]["name"], "arguments": {}}}]
        dummy = [{"role": "user", "content": "dummy"},
                 {"role": "assistant", "content": "", "tool_calls": call}]
        before = self.processor.apply_chat_template(dummy, tools=tools, tokenize=False)
        after = self.processor.apply_chat_template(dummy + tool_messages, tools=tools, tokenize=False,
                                                   add_generation_prompt=True)
        end = self.processor.tokenizer.eos_token
        if end and end in before:  # templates that write "<|im_end|>\n": cut at the end token, as TRL does
            before = before[: before.rindex(end) + len(end)]
        if not after.startswith(before):
            raise ValueError("the chat template renders a conversation's tool turns by changing what comes "
                             "before them; the tool loop cannot append them")
        return after[len(before):]

