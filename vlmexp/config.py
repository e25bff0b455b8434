"""The one typed config tree. Every section rejects unknown keys; `load_config` reports all errors at once.

The schema is pure: it imports pydantic and the family table only, and validating it (`Config.model_validate`)
runs no user code and reads no file. What needs other modules or has side effects (registered reward names,
sampling strategies, a source's `columns`, importing a `module:function` reward, probing paths, building
TRL's argument classes) is the loader's check phase (`vlmexp.config_checks`, run by `load_config`).

Relative paths in a config resolve against the working directory the command runs in (the repository
root for the shipped configs). Training arguments that TRL defines are not restated here: `sft.args`
and `grpo.args` pass through to `trl.SFTConfig` / `trl.GRPOConfig` and are validated by building them
(see `vlmexp.config_loader.check_trl_args`).
"""

from __future__ import annotations

import re
import string
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PositiveInt,
    ValidationInfo,
    field_validator,
    model_validator,
)

from vlmexp.families import BUDGET_KNOBS, FAMILIES, TINY_PREFIX, FamilyName

Task = Literal["rec", "math", "exact", "detection"]
TASKS: tuple[str, ...] = ("rec", "math", "exact", "detection")
TRAINING_STAGES: tuple[str, ...] = ("sft", "dpo", "grpo")  # in the order the pipeline runs them
DEPLOYABLE_STAGES: tuple[str, ...] = (*TRAINING_STAGES, "eval")  # pipeline.stage_deployments keys

FRAME_HINTS = {
    "pixels": "in absolute pixel coordinates of the image",
    "grid1000": "in coordinates normalised to 0-1000",
}
DEFAULT_PROMPT_TEMPLATES: dict[str, str] = {
    "rec": (
        "Locate {problem}. First output the thinking process in <think> </think> tags, then output "
        "the bounding box as [x1, y1, x2, y2] {frame} in <answer> </answer> tags."
    ),
    "math": (
        "{problem} First think step by step in <think> </think> tags, then give the final answer "
        "in <answer> </answer> tags."
    ),
    "exact": "{problem} Think in <think> </think> tags, then answer in <answer> </answer> tags.",
    "detection": (  # VLM-R1's detection question template (src/eval/test_od_r1.py), with the box format spelled out
        "{problem} First output the thinking process in <think> </think> tags and then output the final answer "
        "in <answer> </answer> tags. Output the final answer in JSON format: a ```json block listing "
        "{{\"bbox_2d\": [x1, y1, x2, y2], \"label\": ...}} for each object, {frame}, or None if there is none."
    ),
}
TEMPLATE_FIELDS = ("problem", "frame")  # what a prompt template may use
TARGET_FIELDS = ("answer", "problem")  # what sft.target_template may use


def check_template(template: str, fields: tuple[str, ...], what: str) -> None:
    """Raise ValueError unless `template` is a str.format template using only `fields`, the first among them."""
    try:
        used = {f for _, f, _, _ in string.Formatter().parse(template) if f is not None}
    except ValueError as e:
        raise ValueError(f"{what} is malformed ({e}); escape braces as {{{{ }}}}") from None
    unknown = used - set(fields)
    if unknown:
        raise ValueError(f"{what} uses {sorted(unknown)}; only {' and '.join('{' + f + '}' for f in fields)} exist "
                         "(escape literal braces as {{ }})")
    if fields[0] not in used:
        raise ValueError(f"{what} must contain {{{fields[0]}}}")


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # NaN/inf: "Input should be a finite number"


class RunConfig(Section):
    name: str = Field("vlmexp", description="Experiment name: MLflow experiment, output folder name.")
    output_dir: str | None = Field(None, description="Where every stage writes. Default: outputs/<name>.")
    seed: int = Field(42, description="Seed for sampling, initialisation and training.")

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", v):
            raise ValueError("use letters, digits, '.', '_' and '-' only, starting with a letter or digit")
        return v

    @model_validator(mode="after")
    def _default_output_dir(self) -> RunConfig:
        if self.output_dir is None:
            self.output_dir = f"outputs/{self.name}"
        return self


class TinyModelConfig(Section):
    """Sizes of the embedded model (`model.path: tiny:<family>`). The defaults give ~0.8M parameters, which
    train on a laptop CPU in seconds. `vlmexp.tiny.TinySpec` extends these with the shapes of published
    checkpoints."""

    hidden_size: PositiveInt = Field(128, description="Text model width (also the vision merger's output).")
    intermediate_size: PositiveInt = Field(256, description="Text model MLP width.")
    num_layers: PositiveInt = Field(2, description="Text decoder layers.")
    num_heads: PositiveInt = Field(4, description="Text attention heads; hidden_size / num_heads must be a "
                                                  "multiple of 8.")
    num_kv_heads: PositiveInt = Field(2, description="Text key/value heads (grouped-query attention); divides "
                                                     "num_heads.")
    vision_hidden_size: PositiveInt = Field(64, description="Vision tower width.")
    vision_depth: PositiveInt = Field(2, description="Vision tower blocks.")
    vision_heads: PositiveInt = Field(4, description="Vision tower attention heads.")
    vocab_size: PositiveInt = Field(1024, description="BPE vocabulary trained locally, before the special tokens.")
    seed: int = Field(0, description="Seed of the tokenizer corpus and the random weights.")

    @model_validator(mode="after")
    def _heads(self) -> TinyModelConfig:
        if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 8:
            raise ValueError("hidden_size / num_heads must be a multiple of 8 (mrope needs it)")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        return self


class ModelConfig(Section):
    path: str = Field(..., description="Local HF folder, hub id (org/name), or tiny:<family>.")
    family: FamilyName | None = Field(
        None, description="Detected from the checkpoint's config.json when left out."
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Weights' dtype when loading; auto: the checkpoint's own (float32 for tiny models).")
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2", "flash_attention_3"] = Field(
        "sdpa", description="transformers' attention kernel; flash_attention_* need the flash-attn package (GPU).")
    min_pixels: PositiveInt | None = Field(None, description="Qwen-VL families: smart_resize's image pixel floor; "
                                           "default: the processor's. Refused for internvl, which tiles.")
    max_pixels: PositiveInt | None = Field(None, description="Qwen-VL families: smart_resize's image pixel ceiling; "
                                           "default: the processor's. Refused for internvl, which tiles.")
    min_patches: PositiveInt | None = Field(None, description="internvl: fewest tiles an image is cut into; default: "
                                            "the processor's (1). Refused for the Qwen-VL families.")
    max_patches: PositiveInt | None = Field(None, description="internvl: most tiles (448 x 448 crops in the released "
                                            "checkpoints, plus a thumbnail when there is more than one) an image is "
                                            "cut into, VLM-R1's max_anyres_num; default: the processor's (12). "
                                            "Refused for the Qwen-VL families.")
    trust_remote_code: bool = Field(False, description="Let transformers run Python code shipped with the "
                                                        "checkpoint (only for checkpoints you trust).")
    tiny: TinyModelConfig | None = Field(None, description="Sizes for tiny:<family> models.")

    @field_validator("path")
    @classmethod
    def _path(cls, v: str) -> str:
        if v.startswith(TINY_PREFIX) and v[len(TINY_PREFIX):] not in FAMILIES:
            raise ValueError(f"unknown tiny family; use one of: {', '.join(TINY_PREFIX + f for f in FAMILIES)}")
        if not v.strip():
            raise ValueError("give a local model folder, a hub id (org/name) or tiny:<family>")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> ModelConfig:
        if self.min_pixels and self.max_pixels and self.min_pixels > self.max_pixels:
            raise ValueError(f"min_pixels ({self.min_pixels}) exceeds max_pixels ({self.max_pixels}): swap them")
        if self.min_patches and self.max_patches and self.min_patches > self.max_patches:
            raise ValueError(f"min_patches ({self.min_patches}) exceeds max_patches ({self.max_patches}): swap them")
        if self.tiny is not None and not self.path.startswith(TINY_PREFIX):
            raise ValueError("model.tiny applies only to model.path: tiny:<family>; remove model.tiny")
        if self.path.startswith(TINY_PREFIX):
            family = self.path[len(TINY_PREFIX):]
            if self.family not in (None, family):
                raise ValueError(f"family {self.family!r} contradicts path {self.path!r}: remove model.family")
            self.family = family  # type: ignore[assignment]
        if self.family is not None:  # else checked once the checkpoint's family is read (vlmexp.processor)
            FAMILIES[self.family].check_budget_knobs(self.image_knobs)
        return self

    @property
    def image_knobs(self) -> dict[str, int | None]:
        """The image-budget fields (BUDGET_KNOBS), for `vlmexp.processor.load_processor`."""
        return {k: getattr(self, k) for k in BUDGET_KNOBS}

    @property
    def is_tiny(self) -> bool:
        return self.path.startswith(TINY_PREFIX)


class DataSource(Section):
    """One entry of a VLM-R1 data YAML's `datasets:` list."""

    json_path: str = Field(..., description="A .json (list), .jsonl, .parquet or .arrow file; a glob or folder of "
                           "shards (data/train-*.parquet, folder@split); a save_to_disk folder; a LLaMA-Factory "
                           "dataset folder (with dataset_info.json; name the dataset with `dataset`); or a Hugging "
                           "Face Hub dataset org/name@split (EasyR1's syntax).")
    sampling_strategy: str = Field("all", description="all | first:N | end:N | random:N, N may be 'P%'.")
    image_root: str | None = Field(None, description="Folder that relative image paths resolve against. "
                                   "Default: the file's or folder's own.")
    task: Task | None = Field(None, description="rec | math | exact | detection; default from the records' "
                              "accu_reward_method, else from the record format.")
    columns: dict[str, str] | None = Field(None, description="Rename columns to the fields vlmexp reads, "
                                           "e.g. {problem: question, answer: solution, images: image} (EasyR1's "
                                           "prompt_key / answer_key / image_key).")
    subset: str | None = Field(None, description="Hub dataset: the configuration (subset) name.")
    revision: str | None = Field(None, description="Hub dataset: a branch, tag or commit.")
    dataset: str | None = Field(None, description="A LLaMA-Factory dataset folder: the dataset_info.json entry to "
                                "read (its file, formatting, columns and tags); only with such a folder.")

    @field_validator("columns")
    @classmethod
    def _columns(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        # the field names themselves are checked against vlmexp.data.formats.FIELDS by the check phase
        if v and len(set(v.values())) != len(v):
            raise ValueError("columns maps one source column to two fields; map each column once")
        return v


def check_scene_range(name: str, value: tuple[int, int]) -> None:
    """Raise ValueError unless a generated images' range (width, height: pixels; objects: shapes) can work;
    the schema's data.demo and vlmexp.data.demo.Scenes both ask here."""
    lo, hi = value
    if not 0 < lo <= hi:
        raise ValueError(f"scenes.{name} must be [low, high] with 0 < low <= high, got [{lo}, {hi}]")
    if name in ("width", "height") and lo < 64:
        raise ValueError(f"scene images must be at least 64 pixels a side, got {name} {list(value)}")


class DemoDataConfig(Section):
    """Generate the embedded grounding dataset under <output_dir>/demo_data on first use. The defaults are the
    demo's recipe (configs/demo.yaml) and `vlmexp make-demo-data`'s (vlmexp.data.demo.Scenes reads them here)."""

    train: PositiveInt = Field(1024, description="Training records to generate.")
    val: PositiveInt = Field(256, description="Held-out records to generate.")
    seed: int = Field(0, description="Seed of the generated images and captions (not run.seed: the data stays "
                                     "the same across training seeds).")
    width: tuple[PositiveInt, PositiveInt] = Field((112, 112), description="Image width range [low, high].")
    height: tuple[PositiveInt, PositiveInt] = Field((112, 112), description="Image height range [low, high].")
    objects: tuple[PositiveInt, PositiveInt] = Field((1, 1), description="Shapes per image [low, high].")
    background: Literal["plain", "gradient"] = Field(
        "gradient", description="gradient: the shade encodes x (red) and y (green), so a tiny vision tower, which "
        "has no absolute position embedding, can see where a shape is.")
    annotator_jitter: float = Field(
        0.05, ge=0, le=1, description="Training demonstrations (the boxes SFT imitates) move each edge by a uniform "
        "draw in [-j, +j] x the box's side; the reward and evaluation score against the exact box. 0: exact.")
    annotator_loose: float = Field(
        0.25, ge=0, le=1, description="Training demonstrations push each edge outward by this share of the box's "
        "side (a loose annotator). 0: tight.")

    @field_validator("width", "height", "objects")
    @classmethod
    def _scenes(cls, value: tuple[int, int], info: ValidationInfo) -> tuple[int, int]:
        check_scene_range(str(info.field_name), value)
        return value


class DataConfig(Section):
    datasets: list[DataSource] | None = Field(None, description="Training sources (VLM-R1 YAML entries).")
    data_yaml: str | None = Field(None, description="A VLM-R1 data YAML with a `datasets:` list.")
    demo: DemoDataConfig | None = Field(None, description="Use the generated demo dataset.")
    val_datasets: list[DataSource] | None = Field(None, description="Held-out sources.")
    val_data_yaml: str | None = Field(None, description="A VLM-R1 data YAML of held-out sources.")
    val_fraction: float | None = Field(None, gt=0, lt=1, description="Hold out this share of training rows.")
    system_prompt: str | None = Field(None, description="A system message put before every prompt; none by default.")
    prompt_templates: dict[Task, str] = Field(
        default_factory=lambda: dict(DEFAULT_PROMPT_TEMPLATES),
        description="The user prompt per task (rec, math, exact, detection), with {problem} and, for rec and "
                    "detection, {frame} (the family's box frame); tasks not given keep the default (vlmexp.config.DEFAULT_PROMPT_TEMPLATES).")

    @field_validator("prompt_templates")
    @classmethod
    def _templates(cls, v: dict[str, str]) -> dict[str, str]:
        for task, template in v.items():
            check_template(template, TEMPLATE_FIELDS, f"template for {task!r}")
        return {**DEFAULT_PROMPT_TEMPLATES, **v}

    @model_validator(mode="after")
    def _one_train_source(self) -> DataConfig:
        given = [k for k in ("datasets", "data_yaml", "demo") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(
                f"set exactly one of data.datasets, data.data_yaml, data.demo (got {given or 'none'})"
            )
        val = [k for k in ("val_datasets", "val_data_yaml", "val_fraction") if getattr(self, k) is not None]
        if len(val) > 1:
            raise ValueError(f"set at most one of data.val_datasets, data.val_data_yaml, data.val_fraction "
                             f"(got {val})")
        return self


LM_LORA_TARGETS = r".*language_model.*\.(q|k|v|o|gate|up|down)_proj"


class PeftConfig(Section):
    """LoRA on the language model (QLoRA: the base loaded in 4 bits, CUDA + bitsandbytes only)."""

    method: Literal["lora", "qlora"] = Field("lora", description="lora, or qlora: LoRA on a 4-bit base (CUDA + "
                                                                 "bitsandbytes).")
    r: PositiveInt = Field(16, description="LoRA rank.")
    alpha: PositiveInt = Field(32, description="LoRA scaling numerator (the update is scaled by alpha / r).")
    dropout: float = Field(0.05, ge=0, lt=1, description="Dropout on the LoRA path.")
    target_modules: str | list[str] = Field(
        LM_LORA_TARGETS, description="Regex (full match) or module names. The default keeps LoRA off the "
                                     "vision tower, whose MLP shares the language model's layer names.")
    modules_to_save: list[str] | None = Field(None, description="Extra modules trained in full and saved.")


class StageConfig(Section):
    enabled: bool = Field(True, description="Run this stage; off, the next stage starts from the previous model.")
    args: dict[str, Any] = Field(default_factory=dict, description="Passed through to TRL's config class.")
    peft: PeftConfig | None = Field(None, description="LoRA/QLoRA; null = full fine-tuning.")
    freeze_vision: bool = Field(False, description="Full fine-tuning: keep the vision tower's weights fixed.")
    freeze_merger: bool = Field(False, description="Full fine-tuning: keep the merger/projector fixed.")
    resume: bool = Field(True, description="Resume from the newest complete checkpoint in the stage folder.")

    @model_validator(mode="after")
    def _resumable(self) -> StageConfig:
        if self.resume and self.args.get("save_only_model"):
            raise ValueError("args.save_only_model: true writes checkpoints without optimizer, scheduler and RNG "
                             "state, so a resumed run would not continue where it stopped; remove it, or set "
                             "resume: false")
        if self.peft is not None and (self.freeze_vision or self.freeze_merger):
            raise ValueError("freeze_vision/freeze_merger apply to full fine-tuning; with peft only the "
                             "adapters train already: remove them")
        return self


class SFTStageConfig(StageConfig):
    """Supervised fine-tuning with trl.SFTTrainer; `args` are trl.SFTConfig fields."""

    target_template: str | None = Field(
        None, description="What SFT trains on for records that are not rec (whose target is built from the box): "
        "this text with {answer} (the record's answer or solution) and optionally {problem}, e.g. "
        "'<think>...</think><answer>{answer}</answer>'. Default null: pairs records train on their chosen answer "
        "and conversations records on their gpt turn as written, and SFT refuses, before any step, records that "
        "hold only a ground truth (EasyR1's answer).")

    @field_validator("target_template")
    @classmethod
    def _target_template(cls, v: str | None) -> str | None:
        if v is not None:
            check_template(v, TARGET_FIELDS, "the template")
        return v


class RewardSpec(Section):
    name: str = Field(..., min_length=1, description="A registered reward (format, iou, iou_threshold, giou, math, exact, "
                      "detection) "
                      "or module:function. The loader checks the name; its `import_rewards` switch (on in `vlmexp "
                      "validate`, `run` and `train`) also imports a module:function's module, in a child process.")
    weight: float = Field(1.0, description="Weight of this reward in the sum GRPO optimises.")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments the reward is built with "
                                                                     "(e.g. iou_threshold's threshold; exact's "
                                                                     "default_match: vlm_r1 | exact).")


class DifficultyFilterConfig(Section):
    """GRPO's dynamic sampling, done offline: before training, the start model samples `num_samples` completions
    per training prompt, scored like GRPO's; prompt groups whose scores carry no signal (all equal) or whose mean
    lies outside (low, high) are dropped, and GRPO trains on the rest (EasyR1's online_filtering semantics)."""

    enabled: bool = Field(False, description="Filter the training prompts before GRPO; off by default.")
    num_samples: int = Field(8, ge=2, description="Completions per prompt (use grpo.args.num_generations to see "
                                                  "the groups GRPO will see).")
    temperature: float | None = Field(None, gt=0, description="Sampling temperature; default: GRPO's "
                                                              "(grpo.args.temperature, TRL's default 1.0).")
    max_new_tokens: PositiveInt | None = Field(None, description="Tokens per completion; default: GRPO's "
                                                                 "max_completion_length.")
    reward: str = Field("overall", description="What a group is judged by: overall (the weighted sum of "
                                               "grpo.rewards GRPO's advantages come from; EasyR1's filter_key) or the "
                                               "name of one of grpo.rewards.")
    low: float | None = Field(None, description="Keep a prompt only if its group's mean score is above this "
                                                "(EasyR1's filter_low, 0.01 there for a 0/1 accuracy). Default: no bound.")
    high: float | None = Field(None, description="Keep a prompt only if its group's mean score is below this "
                                                 "(EasyR1's filter_high, 0.99 there). Default: no bound.")
    batch_size: PositiveInt = Field(8, description="Prompts per generate call while sampling.")

    @model_validator(mode="after")
    def _bounds(self) -> DifficultyFilterConfig:
        if self.low is not None and self.high is not None and self.low >= self.high:
            raise ValueError(f"low ({self.low}) must be below high ({self.high}): a group's mean must lie between them")
        return self


class GRPOStageConfig(StageConfig):
    """GRPO with trl.GRPOTrainer; `args` are trl.GRPOConfig fields."""

    rewards: list[RewardSpec] = Field(
        default_factory=lambda: [RewardSpec(name="format", weight=0.5), RewardSpec(name="iou", weight=1.0)],
        description="The reward functions and their weights; evaluation scores with the same ones.")
    sft_adapter: Literal["merge", "continue"] = Field(
        "merge", description="When starting from an SFT LoRA adapter: merge it into the base (then train in "
                             "full or with a new grpo.peft), or continue training that adapter.")
    difficulty_filter: DifficultyFilterConfig = Field(
        default_factory=DifficultyFilterConfig, description="Drop the training prompts whose sampled rewards carry "
        "no signal before GRPO trains (dynamic sampling, offline); off by default.")

    @model_validator(mode="after")
    def _adapter_mode(self) -> GRPOStageConfig:
        if self.sft_adapter == "continue" and self.peft is not None:
            raise ValueError("sft_adapter: continue trains the SFT stage's adapter as it is; remove grpo.peft, "
                             "or use sft_adapter: merge to add a new adapter on the merged model")
        names = [r.name for r in self.rewards]
        if self.difficulty_filter.reward not in ("overall", *names):
            raise ValueError(f"difficulty_filter.reward {self.difficulty_filter.reward!r} is not overall nor one of "
                             f"grpo.rewards {names}; name one of them")
        return self


class DPOPairsConfig(Section):
    """Where DPO's preference pairs come from."""

    model_config = ConfigDict(extra="forbid", validate_by_name=True, validate_by_alias=True, serialize_by_alias=True)

    from_: Literal["data", "samples"] = Field(
        "data", alias="from", description="data: records with chosen/rejected answers; samples: the start model's "
        "own completions for the training prompts, scored with grpo.rewards, best vs worst.")
    num_samples: int = Field(4, ge=2, description="samples: completions per prompt.")
    temperature: float = Field(1.0, gt=0, description="samples: sampling temperature.")
    max_new_tokens: PositiveInt = Field(64, description="samples: tokens per completion.")
    min_margin: float = Field(0.1, ge=0, description="samples: keep a pair only when best - worst reward >= this.")
    batch_size: PositiveInt = Field(8, description="samples: prompts per generate call.")


class DPOStageConfig(StageConfig):
    """DPO with trl.DPOTrainer; `args` are trl.DPOConfig fields. With peft the reference model is the
    adapter-disabled policy (no copy); in full fine-tuning TRL loads one frozen copy of the start model
    (precompute_ref_log_probs is refused by TRL 1.16 for image data)."""

    enabled: bool = Field(False, description="Run DPO (between SFT and GRPO); off by default.")
    pairs: DPOPairsConfig = Field(default_factory=DPOPairsConfig, description="Where the preference pairs come "
                                                                                "from.")

    @model_validator(mode="after")
    def _no_precompute(self) -> DPOStageConfig:
        if self.args.get("precompute_ref_log_probs"):
            raise ValueError("args.precompute_ref_log_probs: TRL 1.16's DPOTrainer refuses it for image data; "
                             "remove it (use peft for a reference model without a copy)")
        return self


class EvalConfig(Section):
    """Evaluation of the base model and of each trained stage's model on the held-out records."""

    enabled: bool = Field(True, description="Evaluate (needs held-out records: data.val_* or the demo's).")
    batch_size: PositiveInt = Field(8, description="Records per generate call.")
    max_new_tokens: PositiveInt = Field(128, description="Tokens generated per record.")
    temperature: float = Field(0.0, ge=0, description="0 = greedy.")
    max_samples: PositiveInt | None = Field(None, description="Evaluate on the first N held-out records only; "
                                                              "default: all.")
    math_grader: Literal["math_verify", "mathruler"] | None = Field(
        None, description="Who grades math answers for math_accuracy: math_verify, or mathruler (EasyR1's and "
                          "verl's grader, `pip install 'vlmexp[mathruler]'`) to compare with their figures. "
                          "Default: the grader of grpo.rewards' math entry, else math_verify.")
    every_steps: int | None = Field(
        None, ge=0, description="Validate during SFT, DPO and GRPO every N optimizer steps and at the last step: "
        "generate on the first eval.during_training_samples held-out records in the stage process and score them "
        "with this evaluation's scorers, logged to the stage's MLflow run as val/<metric> at that step. 0 or null: "
        "off (the default).")
    during_training_samples: PositiveInt = Field(
        64, description="Held-out records each validation during training generates on (the first N of the "
        "sampled held-out file); with max_new_tokens and during_training_n it bounds a validation's cost.")
    during_training_n: PositiveInt = Field(
        1, description="Completions per record in a validation during training. 1: one completion (greedy at "
        "temperature 0), logged as val/<metric>. N > 1: N samples at during_training_temperature, logged as "
        "val/<metric>/mean_at_N (the metric averaged over the N samples) and val/<metric>/best_at_N (each "
        "record's best-scoring sample): verl's mean@N and best@N, named so MLflow accepts them.")
    during_training_temperature: float = Field(
        0.0, ge=0, description="Sampling temperature of validation during training; 0 = greedy (needs "
        "during_training_n: 1).")

    @model_validator(mode="after")
    def _samples_differ(self) -> EvalConfig:
        if self.during_training_n > 1 and self.during_training_temperature == 0:
            raise ValueError(f"during_training_n: {self.during_training_n} greedy completions of one record are all "
                             "the same; set during_training_temperature > 0 (e.g. 1.0), or during_training_n: 1")
        return self


# The metrics evaluation produces (vlmexp.evaluate.score_records), those present for the records' tasks.
METRIC_KEYS = ("count", "format_rate", "rec_mean_iou", "rec_acc50", "rec_acc75", "math_accuracy", "exact_accuracy",
               "detection_reward", "detection_ap", "detection_ap50")


class ExportConfig(Section):
    """Export of the last trained model and its registration in the MLflow Model Registry."""

    enabled: bool = Field(True, description="Export the last trained model (a self-contained folder with "
                                            "manifest.json) and register it.")
    merge_lora: bool = Field(True, description="Merge a LoRA adapter into the base weights; false: export the "
                                               "adapter folder as it is.")
    registered_name: str | None = Field(None, description="Registered model name in MLflow; default: run.name.")
    metric: str = Field("rec_mean_iou", description="The evaluation metric that decides whether a new version "
                                                    "takes the `champion` alias.")
    direction: Literal["maximize", "minimize"] = Field("maximize", description="Whether a higher or a lower "
                                                                               "metric is better.")
    registration: Literal["auto", "copy", "reference"] = Field(
        "auto", description="How the export is registered: copy (its files uploaded into MLflow), reference (the "
                            "version points at them where they are: a hard-linked snapshot in the output folder, or "
                            "export.reference_uri), or auto: copy up to export.copy_max_gib, reference above.")
    copy_max_gib: float = Field(1.0, gt=0, description="auto: the largest export (GiB) registered by copy.")
    reference_uri: str | None = Field(None, description="reference: where the version points instead of a snapshot, "
                                                        "e.g. s3://bucket/models/demo-v7; it must hold this export "
                                                        "(its manifest.json is compared).")
    checkpoint: Literal["last", "best"] = Field(
        "last", description="What is exported and registered: last, the last trained stage's final model; best, "
        "that stage's checkpoint with the best validation during training (export.metric in export.direction, "
        "as val/<metric>, or val/<metric>/mean_at_N with eval.during_training_n > 1), which is kept out of "
        "checkpoint rotation. best needs eval.every_steps.")

    @field_validator("metric")
    @classmethod
    def _evaluated(cls, v: str) -> str:
        if v not in METRIC_KEYS:
            raise ValueError(f"evaluation produces no metric {v!r}; use one of {', '.join(METRIC_KEYS)}")
        return v


class TrackingConfig(Section):
    """Where runs, metrics and artifacts are recorded."""

    backend: Literal["mlflow", "none"] = Field("mlflow", description="mlflow, or none: nothing is recorded (and "
                                                                     "mlflow is not imported).")
    tracking_uri: str | None = Field(None, description="Default sqlite:///<run.output_dir>/mlflow.db; "
                                                        "MLFLOW_TRACKING_URI wins.")
    experiment_name: str | None = Field(None, description="Default: run.name.")
    artifact_location: str | None = Field(None, description="Where a new experiment keeps artifacts. "
                                                             "Default: <run.output_dir>/mlartifacts.")
    completions_every: int = Field(10, ge=0, description="Log a table of sample GRPO completions with their "
                                                         "rewards every N steps (0 = never).")
    completions_per_table: PositiveInt = Field(8, description="Completions per table.")
    system_metrics: bool = Field(True, description="Sample CPU, memory, disk and network use, and GPU use and "
                                 "memory where a GPU is present (needs nvidia-ml-py: the gpu extra), into each "
                                 "training stage's run: MLflow's System metrics tab. false: none.")
    system_metrics_seconds: float = Field(10, gt=0, description="Seconds between system-metric samples "
                                                                "(MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL wins).")


class PipelineConfig(Section):
    """How the Prefect flow runs the stages."""

    retries: int = Field(1, ge=0, description="Retries per task; a retried training stage resumes from its "
                                              "last checkpoint.")
    retry_delay_seconds: float = Field(10, ge=0, description="Seconds between a task's failure and its retry.")
    stage_deployments: dict[str, str] = Field(
        default_factory=dict,
        description="Run a stage as its own Prefect deployment (`flow/deployment`, e.g. `{grpo: vlm-stage/gpu}`) "
                    "on that deployment's work pool; stages not named run in the flow's process. Keys: "
                    + ", ".join(DEPLOYABLE_STAGES) + ".")

    @field_validator("stage_deployments")
    @classmethod
    def _deployments(cls, value: dict[str, str]) -> dict[str, str]:
        for stage, name in value.items():
            if stage not in DEPLOYABLE_STAGES:
                raise ValueError(f"unknown stage {stage!r}; stages that can run as a deployment: "
                                 f"{', '.join(DEPLOYABLE_STAGES)}")
            if not re.fullmatch(r"[^/\s]+/[^/\s]+", name):
                raise ValueError(f"{stage}: {name[:200]!r} is not a deployment name; write 'flow/deployment', "
                                 "e.g. 'vlm-stage/gpu'")
        return value


class LaunchConfig(Section):
    """How a training stage's process is started (vlmexp.launch.stage_command)."""

    launcher: Literal["local", "torchrun", "accelerate", "deepspeed"] = Field(
        "local", description="local: one process; torchrun, accelerate or deepspeed: their launcher around it.")
    nproc_per_node: PositiveInt = Field(1, description="Processes (GPUs) per node.")
    nnodes: PositiveInt = Field(1, description="Nodes taking part.")
    node_rank: int = Field(0, ge=0, description="This node's rank, 0 to nnodes - 1.")
    rdzv_endpoint: str | None = Field(None, description="host:port of node 0 for multi-node runs.")
    deepspeed: str | None = Field(None, description="DeepSpeed JSON config path.")
    accelerate_config: str | None = Field(None, description="An accelerate config YAML (launcher accelerate).")
    hostfile: str | None = Field(None, description="DeepSpeed hostfile (lines of 'host slots=N') for multi-node runs.")

    @model_validator(mode="after")
    def _multi_node(self) -> LaunchConfig:
        if self.node_rank >= self.nnodes:
            raise ValueError(f"node_rank {self.node_rank} must be below nnodes {self.nnodes}")
        if self.nnodes > 1 and self.launcher in ("torchrun", "accelerate") and not self.rdzv_endpoint:
            raise ValueError("multi-node torchrun/accelerate needs launch.rdzv_endpoint (host:port of node 0)")
        if self.launcher == "local" and (self.nproc_per_node > 1 or self.nnodes > 1):
            raise ValueError("launcher 'local' runs one process; use torchrun, accelerate or deepspeed")
        if self.rdzv_endpoint and not re.fullmatch(r"[^:\s]+:\d+", self.rdzv_endpoint):
            raise ValueError(f"rdzv_endpoint {self.rdzv_endpoint!r} must be host:port, e.g. 10.0.0.1:29500")
        if self.launcher == "deepspeed" and self.nnodes > 1 and not self.hostfile:
            raise ValueError("multi-node deepspeed needs launch.hostfile (lines of 'host slots=N')")
        if self.accelerate_config and self.launcher != "accelerate":
            raise ValueError(f"launch.accelerate_config is read by accelerate only; launcher is {self.launcher!r}")
        return self


class Config(Section):
    """A whole experiment: one YAML, every stage. A config may build on others with a top-level `extends: base.yaml`
    (or a list of files, merged in order; paths relative to the file that names them): the bases' mappings are
    merged key by key at any depth, and the file's own values win; a list or a value replaces the base's whole
    (write `null` to drop a base's section, e.g. `data: {demo: null, datasets: [...]}`). Dotted overrides apply
    after the merge; errors name the file and line where each value was written, a base file's included."""

    run: RunConfig = Field(default_factory=RunConfig, description="Name, output folder and seed.")
    model: ModelConfig = Field(..., description="The model to train: a checkpoint, a hub id or tiny:<family>.")
    data: DataConfig = Field(..., description="Training and held-out data, and the prompts.")
    sft: SFTStageConfig = Field(default_factory=SFTStageConfig, description="Supervised fine-tuning.")
    dpo: DPOStageConfig = Field(default_factory=DPOStageConfig, description="Direct preference optimisation.")
    grpo: GRPOStageConfig = Field(default_factory=GRPOStageConfig, description="GRPO with the configured rewards.")
    eval: EvalConfig = Field(default_factory=EvalConfig, description="Evaluation on the held-out records.")
    export: ExportConfig = Field(default_factory=ExportConfig, description="Export and registry promotion.")
    tracking: TrackingConfig = Field(default_factory=TrackingConfig, description="MLflow tracking.")
    launch: LaunchConfig = Field(default_factory=LaunchConfig, description="How training processes start.")
    pipeline: PipelineConfig = Field(default_factory=PipelineConfig, description="Retries and where stages run.")
