"""The config sections of the training stages and what follows them: SFT, DPO (with its preference pairs) and
GRPO (with its rewards, difficulty filter and online filter), LoRA, evaluation and export. Part of the pure
schema (see `vlmexp.config.schema`, whose root `Config` holds these sections): pydantic only."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field, PositiveInt, field_validator, model_validator

from vlmexp.config.base import Section, check_template

TARGET_FIELDS = ("answer", "problem")  # what sft.target_template may use

# attention and MLP projections of the language model, and Qwen3.5's linear-attention (Gated DeltaNet) ones;
# never the vision tower (under `visual.` / `vision_tower.`, outside `language_model`). Qwen3.5-MoE's fused
# experts are 3-D parameters, not modules: `peft.target_parameters` reaches them (docs/training.md, LoRA).
LM_LORA_TARGETS = (r".*language_model.*\.((q|k|v|o|gate|up|down)_proj"
                   r"|linear_attn\.(in_proj_qkv|in_proj_z|in_proj_a|in_proj_b|out_proj))")


class PeftConfig(Section):
    """LoRA on the language model (QLoRA: the base loaded in 4 bits, CUDA + bitsandbytes only)."""

    method: Literal["lora", "qlora"] = Field("lora", description="lora, or qlora: LoRA on a 4-bit base (CUDA "
                                                                 "+ bitsandbytes).")
    r: PositiveInt = Field(16, description="LoRA rank.")
    alpha: PositiveInt = Field(32, description="LoRA scaling numerator (the update is scaled by alpha / r).")
    dropout: float = Field(0.05, ge=0, lt=1, description="Dropout on the LoRA path.")
    target_modules: str | list[str] = Field(
        LM_LORA_TARGETS, description="Regex (full match) or module names. The default keeps LoRA off the "
                                     "vision tower, whose MLP shares the language model's layer names.")
    target_parameters: list[str] | None = Field(
        None, description="Parameters (not modules) LoRA also adapts, by name suffix: for Qwen3.5-MoE's "
        "fused experts, [mlp.experts.gate_up_proj, mlp.experts.down_proj] (PEFT's target_parameters). "
        "null: the fused experts stay frozen; the shared expert, attention and linear attention train.")
    modules_to_save: list[str] | None = Field(None, description="Extra modules trained in full and saved.")

    @model_validator(mode="after")
    def _parameter_dropout(self) -> PeftConfig:
        if self.target_parameters and self.dropout:
            raise ValueError(f"target_parameters: PEFT's LoRA on parameters has no dropout (dropout is "
                             f"{self.dropout}): set dropout: 0")
        return self


class StageConfig(Section):
    enabled: bool = Field(True, description="Run this stage; off, the next stage starts from the previous "
                                            "model.")
    args: dict[str, Any] = Field(default_factory=dict, description="Passed through to TRL's config class.")
    peft: PeftConfig | None = Field(None, description="LoRA/QLoRA; null = full fine-tuning.")
    freeze_vision: bool = Field(False, description="Full fine-tuning: keep the vision tower's weights fixed.")
    freeze_merger: bool = Field(False, description="Full fine-tuning: keep the merger/projector fixed.")
    resume: bool = Field(True, description="Resume from the newest complete checkpoint in the stage folder.")

    @model_validator(mode="after")
    def _resumable(self) -> StageConfig:
        if self.resume and self.args.get("save_only_model"):
            raise ValueError("args.save_only_model: true writes checkpoints without optimizer, scheduler and "
                             "RNG state, so a resumed run would not continue where it stopped; remove it, or "
                             "set resume: false")
        if self.peft is not None and (self.freeze_vision or self.freeze_merger):
            raise ValueError("freeze_vision/freeze_merger apply to full fine-tuning; with peft only the "
                             "adapters train already: remove them")
        return self


class SFTStageConfig(StageConfig):
    """Supervised fine-tuning with trl.SFTTrainer; `args` are trl.SFTConfig fields."""

    target_template: str | None = Field(
        None, description="What SFT trains on for records that are not rec (whose target is built from the "
        "box): this text with {answer} (the record's answer or solution) and optionally {problem}, e.g. "
        "'<think>...</think><answer>{answer}</answer>'. Default null: pairs records train on their chosen "
        "answer and conversations records on their gpt turn as written, and SFT refuses, before any step, "
        "records that hold only a ground truth (EasyR1's answer).")

    @field_validator("target_template")
    @classmethod
    def _target_template(cls, v: str | None) -> str | None:
        if v is not None:
            check_template(v, TARGET_FIELDS, "the template")
        return v


class RewardSpec(Section):
    name: str = Field(..., min_length=1, description="A registered reward (format, iou, iou_threshold, "
                      "giou, math, exact, detection, tool, zoom_target, judge, reward_model) or "
                      "module:function. The loader checks the name; its `import_rewards` switch (on in "
                      "`vlmexp validate`, `run` and `train`) also imports a module:function's module, in a "
                      "child process.")
    weight: float = Field(1.0, description="Weight of this reward in the sum GRPO optimises.")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments the reward is built "
                                                                     "with (e.g. iou_threshold's threshold; "
                                                                     "exact's default_match: vlm_r1 | "
                                                                     "exact).")


class DifficultyFilterConfig(Section):
    """GRPO's dynamic sampling, done offline: before training, the start model samples `num_samples`
    completions per training prompt, scored like GRPO's; prompt groups whose scores carry no signal (all
    equal) or whose mean lies outside (low, high) are dropped, and GRPO trains on the rest (EasyR1's
    online_filtering semantics)."""

    enabled: bool = Field(False, description="Filter the training prompts before GRPO; off by default.")
    num_samples: int = Field(8, ge=2, description="Completions per prompt (use grpo.args.num_generations to "
                                                  "see the groups GRPO will see).")
    temperature: float | None = Field(None, gt=0, description="Sampling temperature; default: GRPO's "
                                                              "(grpo.args.temperature, TRL's default 1.0).")
    max_new_tokens: PositiveInt | None = Field(None, description="Tokens per completion; default: GRPO's "
                                                                 "max_completion_length.")
    reward: str = Field("overall", description="What a group is judged by: overall (the weighted sum of "
                                               "grpo.rewards GRPO's advantages come from; EasyR1's "
                                               "filter_key) or the name of one of grpo.rewards.")
    low: float | None = Field(None, description="Keep a prompt only if its group's mean score is above this "
                                                "(EasyR1's filter_low, 0.01 there for a 0/1 accuracy). "
                                                "Default: no bound.")
    high: float | None = Field(None, description="Keep a prompt only if its group's mean score is below this "
                                                 "(EasyR1's filter_high, 0.99 there). Default: no bound.")
    batch_size: PositiveInt = Field(8, description="Prompts per generate call while sampling.")

    @model_validator(mode="after")
    def _bounds(self) -> DifficultyFilterConfig:
        if self.low is not None and self.high is not None and self.low >= self.high:
            raise ValueError(f"low ({self.low}) must be below high ({self.high}): a group's mean must lie "
                             "between them")
        return self


class OnlineFilterConfig(Section):
    """GRPO's dynamic sampling, online (DAPO; EasyR1's algorithm.online_filtering, verl's
    algorithm.filter_groups): after each generation the prompt groups without signal, or whose mean lies
    outside (low, high), are dropped and new prompts are generated until the batch holds as many groups as it
    was given, at most `max_extra_rounds` more generations (`vlmexp.train.online_filter`)."""

    enabled: bool = Field(False, description="Filter the groups of each generation batch during GRPO; off by "
                                             "default.")
    key: str = Field("std", description="What a group is judged by: std (dropped when every completion "
                                        "scored the same overall reward), overall (the group's mean overall "
                                        "weighted reward) or the name of one of grpo.rewards (that reward's "
                                        "group mean; EasyR1's filter_key).")
    low: float | None = Field(None, description="Keep a group only if its mean key is above this (EasyR1's "
                                                "filter_low, exclusive). Not with key std.")
    high: float | None = Field(None, description="Keep a group only if its mean key is below this (EasyR1's "
                                                 "filter_high, exclusive). Not with key std.")
    max_extra_rounds: int = Field(4, ge=0, description="Extra generation rounds per generation batch to "
                                                       "refill the dropped groups; when they run out, the "
                                                       "batch is filled with dropped groups that train "
                                                       "nothing.")
    refill: Literal["whole", "needed"] = Field(
        "whole", description="How many groups an extra round generates: whole (a whole generation batch, as "
                             "EasyR1 and verl refill) or needed (the groups still missing divided by the "
                             "share of in-band groups so far in this generation batch, at most a batch: "
                             "fewer rollouts generated and not trained on, sometimes one more round).")

    @model_validator(mode="after")
    def _bounds(self) -> OnlineFilterConfig:
        bounds = self.low is not None or self.high is not None
        if self.key == "std" and bounds:
            raise ValueError(f"key std drops the groups whose rewards are all equal and has no bounds (low "
                             f"{self.low}, high {self.high}): remove low/high, or set key to overall or a "
                             "reward's name to keep the groups whose mean lies between them")
        if self.key != "std" and not bounds:
            raise ValueError(f"key {self.key!r} judges a group's mean against low/high and neither is set: "
                             "set low and/or high (e.g. low: 0.01, high: 0.99 for a 0/1 accuracy), or use "
                             "key std")
        if self.low is not None and self.high is not None and self.low >= self.high:
            raise ValueError(f"low ({self.low}) must be below high ({self.high}): a group's mean must lie "
                             "between them")
        return self


TOOL_NAMES = ("zoom",)  # the tools GRPO's rollouts may offer (vlmexp.tools)


class ToolsConfig(Section):
    """Tools the model may call during GRPO's rollouts ("thinking with images"), given to TRL's GRPOTrainer
    through its `environment_factory`: one environment per rollout holds the record's image. `zoom` offers
    `image_zoom_in_tool(bbox_2d, label)`: the model names a box in its family's box frame (Qwen2.5-VL:
    pixels of the resized image; Qwen2-VL, Qwen3-VL: the 0-1000 grid), and the crop of the original image
    comes back as an image in a tool turn, which the model sees in its next turn and the loss forward
    receives (tool tokens masked out of the loss). Evaluation runs with and without the tool (eval.tools)."""

    names: list[Literal["zoom"]] = Field(
        default_factory=list, description="The tools offered: [] (the default: single-turn GRPO) or [zoom].")
    max_turns: PositiveInt = Field(
        3, description="Tool calls a completion may make (TRL's max_tool_calling_iterations): the turn after "
        "the last allowed call is generated, and a call in it is not run but counted (zoom/over_limit).")
    min_crop_side: PositiveInt = Field(
        28, description="A zoom box narrower or shorter than this many pixels of the original image grows "
        "around its centre to this side (DeepEyes: 28), inside the image; the crop then goes through the "
        "processor's own image budget (model.min_pixels / max_pixels) as any image does.")

    without: float = Field(
        0.0, ge=0.0, lt=1.0, description="The share of GRPO's training prompts given without the tools "
        "(no tools block; the same prompts at every start, drawn with run.seed): their groups answer "
        "directly, as evaluation without the tool asks and SFT's tool-less demonstrations "
        "(data.zoom_demo.direct) taught. With 0 (the default) every prompt offers the tools, and a policy "
        "rewarded for zooming may stop answering in form without them.")

    @field_validator("names")
    @classmethod
    def _unique(cls, v: list[str]) -> list[str]:
        if len(set(v)) != len(v):
            raise ValueError(f"names {v} lists a tool twice; list each once")
        return v

    @model_validator(mode="after")
    def _without_needs_tools(self) -> ToolsConfig:
        if self.without and not self.names:
            raise ValueError(f"without ({self.without}) is the share of prompts given without the tools, and "
                             "names offers none; set names: [zoom], or leave without out")
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
        default_factory=DifficultyFilterConfig, description="Drop the training prompts whose sampled rewards "
        "carry no signal before GRPO trains (dynamic sampling, offline); off by default.")
    online_filter: OnlineFilterConfig = Field(
        default_factory=OnlineFilterConfig, description="Drop the groups of each generation batch that carry "
        "no signal (or lie outside a band) and refill from new prompts (dynamic sampling, online); off by "
        "default.")
    tools: ToolsConfig = Field(default_factory=ToolsConfig, description="Tools the model may call in its "
                               "rollouts (multi-turn GRPO, e.g. zoom); none by default.")

    @model_validator(mode="after")
    def _adapter_mode(self) -> GRPOStageConfig:
        if self.sft_adapter == "continue" and self.peft is not None:
            raise ValueError("sft_adapter: continue trains the SFT stage's adapter as it is; remove "
                             "grpo.peft, or use sft_adapter: merge to add a new adapter on the merged model")
        names = [r.name for r in self.rewards]
        if self.difficulty_filter.reward not in ("overall", *names):
            raise ValueError(f"difficulty_filter.reward {self.difficulty_filter.reward!r} is not overall nor "
                             f"one of grpo.rewards {names}; name one of them")
        if self.online_filter.key not in ("std", "overall", *names):
            raise ValueError(f"online_filter.key {self.online_filter.key!r} is not std, overall nor one of "
                             f"grpo.rewards {names}; name one of them")
        for name in ("tool", "zoom_target"):
            if name in names and not self.tools.names:
                raise ValueError(f"the {name} reward scores completions that called a tool, and "
                                 "grpo.tools.names offers none: add tools (e.g. grpo.tools.names: [zoom]) or "
                                 f"remove the {name} reward")
        if self.tools.names and self.difficulty_filter.enabled:
            raise ValueError("difficulty_filter samples single-turn completions, without the tools that "
                             "grpo.tools offers: set difficulty_filter.enabled: false, or "
                             "grpo.tools.names: []")
        if self.tools.names and "max_tool_calling_iterations" in self.args:
            raise ValueError("grpo.args.max_tool_calling_iterations is set from grpo.tools.max_turns: "
                             "remove it from grpo.args and set grpo.tools.max_turns")
        if self.tools.names and self.args.get("mask_truncated_completions"):
            # TRL zeroes a truncated completion's mask, which is also the forward's attention: a crop
            # inside it vanishes from Qwen-VL's rope index while its grid stays (vlmexp.train.grpo_pairing)
            raise ValueError("grpo.args.mask_truncated_completions: true hides the tools' images in a "
                             "truncated completion from the model's forward (TRL 1.16 zeroes its attention "
                             "mask), and the positions of every later sample go wrong; remove it, or raise "
                             "grpo.args.max_completion_length so that fewer completions are cut")
        return self


class DPOPairsConfig(Section):
    """Where DPO's preference pairs come from."""

    model_config = ConfigDict(extra="forbid", validate_by_name=True, validate_by_alias=True,
                              serialize_by_alias=True)

    from_: Literal["data", "samples"] = Field(
        "data", alias="from", description="data: records with chosen/rejected answers; samples: the start "
        "model's own completions for the training prompts, scored with grpo.rewards, best vs worst.")
    num_samples: int = Field(4, ge=2, description="samples: completions per prompt.")
    temperature: float = Field(1.0, gt=0, description="samples: sampling temperature.")
    max_new_tokens: PositiveInt = Field(64, description="samples: tokens per completion.")
    min_margin: float = Field(0.1, ge=0, description="samples: keep a pair only when best - worst reward >= "
                                                     "this.")
    batch_size: PositiveInt = Field(8, description="samples: prompts per generate call.")


class DPOStageConfig(StageConfig):
    """DPO with trl.DPOTrainer; `args` are trl.DPOConfig fields. With peft the reference model is the
    adapter-disabled policy (no copy); in full fine-tuning TRL loads one frozen copy of the start model
    (precompute_ref_log_probs is refused by TRL 1.16 for image data)."""

    enabled: bool = Field(False, description="Run DPO (between SFT and GRPO); off by default.")
    pairs: DPOPairsConfig = Field(default_factory=DPOPairsConfig, description="Where the preference pairs "
                                                                              "come from.")

    @model_validator(mode="after")
    def _no_precompute(self) -> DPOStageConfig:
        if self.args.get("precompute_ref_log_probs"):
            raise ValueError("args.precompute_ref_log_probs: TRL 1.16's DPOTrainer refuses it for image "
                             "data; remove it (use peft for a reference model without a copy)")
        return self


class EvalConfig(Section):
    """Evaluation of the base model and of each trained stage's model on the held-out records."""

    enabled: bool = Field(True, description="Evaluate (needs held-out records: data.val_* or the demo's).")
    batch_size: PositiveInt = Field(8, description="Records per generate call.")
    max_new_tokens: PositiveInt = Field(128, description="Tokens generated per record.")
    temperature: float = Field(0.0, ge=0, description="0 = greedy.")
    max_samples: PositiveInt | None = Field(None, description="Evaluate on the first N held-out records "
                                                              "only; default: all.")
    math_grader: Literal["math_verify", "mathruler"] | None = Field(
        None, description="Who grades math answers for math_accuracy: math_verify, or mathruler (EasyR1's "
                          "and verl's grader, `pip install 'vlmexp[mathruler]'`) to compare with their "
                          "figures. Default: the grader of grpo.rewards' math entry, else math_verify.")
    every_steps: int | None = Field(
        None, ge=0, description="Validate during SFT, DPO and GRPO every N optimizer steps and at the last "
        "step: generate on the first eval.during_training_samples held-out records in the stage process and "
        "score them with this evaluation's scorers, logged to the stage's MLflow run as val/<metric> at that "
        "step. 0 or null: off (the default).")
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
    pictures: int = Field(16, ge=0, le=256, description="Draw the first N held-out records with the ground "
        "truth and each evaluated model's boxes (PNG, at most 512 px a side): "
        "<output_dir>/eval/<model>/pictures/, and in the pipeline's MLflow evaluation run "
        "evaluation/pictures/ (every model on one picture, and a grid). 0: none.")
    tools: Literal["auto", "on", "off", "both"] = Field(
        "auto", description="Evaluate with the tools grpo.tools offers (on: the model may call them, at most "
        "grpo.tools.max_turns times a record), without them (off), or both (metrics with the tool prefixed "
        "tool_: tool_exact_accuracy, tool_zooms_per_answer, tool_zoomed_share, tool_zoom_on_target: the "
        "share of records with the target's box whose zooms hold it whole). auto: both when grpo.tools "
        "names a tool, else off.")
    during_training_pictures: int = Field(4, ge=0, le=64, description="At each validation during training "
        "(eval.every_steps), log the first N held-out records with the current model's box as MLflow images "
        "(validation/record_<i>, one per step: the image slider shows the box move). At most "
        "during_training_samples are drawn. 0: none.")

    @model_validator(mode="after")
    def _samples_differ(self) -> EvalConfig:
        if self.during_training_n > 1 and self.during_training_temperature == 0:
            raise ValueError(f"during_training_n: {self.during_training_n} greedy completions of one record "
                             "are all the same; set during_training_temperature > 0 (e.g. 1.0), or "
                             "during_training_n: 1")
        return self


# The metrics evaluation produces (vlmexp.scoring.score_records), those present for the records' tasks.
PLAIN_METRIC_KEYS = ("count", "format_rate", "rec_mean_iou", "rec_acc50", "rec_acc75", "math_accuracy",
                     "exact_accuracy", "detection_reward", "detection_ap", "detection_ap50", "judge_score",
                     "reward_model_score")
# evaluation with the tool (eval.tools): the same metrics prefixed tool_, with what the tool did
TOOL_METRIC_KEYS = (*(f"tool_{k}" for k in PLAIN_METRIC_KEYS), "tool_zooms_per_answer", "tool_zoomed_share",
                    "tool_zoom_on_target")
METRIC_KEYS = PLAIN_METRIC_KEYS + TOOL_METRIC_KEYS


class ExportConfig(Section):
    """Export of the last trained model and its registration in the MLflow Model Registry."""

    enabled: bool = Field(True, description="Export the last trained model (a self-contained folder with "
                                            "manifest.json) and register it.")
    merge_lora: bool = Field(True, description="Merge a LoRA adapter into the base weights; false: export "
                                               "the adapter folder as it is.")
    registered_name: str | None = Field(None, description="Registered model name in MLflow; default: "
                                                          "run.name.")
    metric: str = Field("rec_mean_iou", description="The evaluation metric that decides whether a new "
                                                    "version takes the `champion` alias.")
    direction: Literal["maximize", "minimize"] = Field("maximize", description="Whether a higher or a lower "
                                                                               "metric is better.")
    registration: Literal["auto", "copy", "reference"] = Field(
        "auto", description="How the export is registered: copy (its files uploaded into MLflow), reference "
                            "(the version points at them where they are: a hard-linked snapshot in the "
                            "output folder, or export.reference_uri), or auto: copy up to "
                            "export.copy_max_gib, reference above.")
    copy_max_gib: float = Field(1.0, gt=0, description="auto: the largest export (GiB) registered by copy.")
    reference_uri: str | None = Field(None, description="reference: where the version points instead of a "
                                                        "snapshot, e.g. s3://bucket/models/demo-v7; it must "
                                                        "hold this export (its manifest.json is compared).")
    checkpoint: Literal["last", "best"] = Field(
        "last", description="What is exported and registered: last, the last trained stage's final model; "
        "best, that stage's checkpoint with the best validation during training (export.metric in "
        "export.direction, as val/<metric>, or val/<metric>/mean_at_N with eval.during_training_n > 1), "
        "which is kept out of checkpoint rotation. best needs eval.every_steps.")

    @field_validator("metric")
    @classmethod
    def _evaluated(cls, v: str) -> str:
        if v not in METRIC_KEYS:
            raise ValueError(f"evaluation produces no metric {v!r}; use one of {', '.join(METRIC_KEYS)}")
        return v


class GenerationConfig(Section):
    """How every stage that generates text generates it (GRPO's rollouts through TRL, DPO's sampling, the
    difficulty filter, validation during training and evaluation): one code path, `vlmexp.generation`. A
    compiled decoder runs each token step as one graph (a static key/value cache holds fixed-size tensors); it
    is compiled once per batch size and prompt-length bucket, so prompts are left-padded up to a multiple of
    `prompt_bucket` tokens."""

    compile: Literal["auto", "on", "off"] = Field(
        "auto", description="Compile the decoding step with torch.compile. auto: on where CUDA is, off on "
        "CPU (on 2 CPU cores the tiny model's compiled generation was slower, bench/RESULTS.md); on: also on "
        "CPU (needs a C++ compiler); off: eager, as transformers generates by default.")
    cache: Literal["auto", "static", "dynamic"] = Field(
        "auto", description="The key/value cache: static (preallocated, what compilation needs) or dynamic "
        "(grows per token). auto: static when compiled, dynamic otherwise (static without compile is "
        "slower). The static cache holds keys and values in the precision the model runs in (bf16 under bf16 "
        "autocast).")
    prompt_bucket: PositiveInt | None = Field(
        None, description="Left-pad each generation batch's prompts to a multiple of this many tokens, so a "
        "compiled decoder compiles once per bucket rather than per prompt length (padding never changes a "
        "completion: it is masked). Default: 64 when compiled, 1 (no padding beyond the batch's longest "
        "prompt) otherwise.")

    @field_validator("compile", mode="before")
    @classmethod
    def _yaml_switch(cls, v: Any) -> Any:
        # YAML 1.1 reads on/off as booleans
        return {True: "on", False: "off"}.get(v, v) if isinstance(v, bool) else v

    @model_validator(mode="after")
    def _compile_needs_static(self) -> GenerationConfig:
        if self.compile == "on" and self.cache == "dynamic":
            raise ValueError("compile: on needs a static cache (a dynamic cache changes shape every token, "
                             "so transformers does not compile with it); set cache: static or auto, or "
                             "compile: off")
        return self
