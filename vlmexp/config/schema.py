"""The one typed config tree. Every section rejects unknown keys; `load_config` reports all errors at once.

The schema is pure: it imports pydantic and the family table only, and validating it (`Config.model_validate`)
runs no user code and reads no file. It spans five modules: this one (the root `Config` and the run, model,
data, tracking, pipeline and launch sections), `vlmexp.config.stages` (the training stages, evaluation and
export), `vlmexp.config.generated_data` (the generated datasets' sections), `vlmexp.config.tiny_model` (the
embedded model's sizes) and `vlmexp.config.base` (what every section shares). What needs other modules or
has side effects (registered reward names, sampling strategies, a source's `columns`, importing a
`module:function` reward, probing paths, building TRL's argument classes) is the loader's check phase
(`vlmexp.checks.rules`, run by `vlmexp.checks.loader.load_config`), a floor above this package.

Relative paths in a config resolve against the working directory the command runs in (the repository
root for the shipped configs). Training arguments that TRL defines are not restated here: `sft.args`
and `grpo.args` pass through to `trl.SFTConfig` / `trl.GRPOConfig` and are validated by building them
(see `vlmexp.config.trl_args.check_trl_args`).
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, PositiveFloat, PositiveInt, field_validator, model_validator

from vlmexp.config.base import Section, check_template
from vlmexp.config.generated_data import DemoDataConfig, ZoomDemoConfig

# Imported for Config's fields only, not re-exported: every module imports a stage section from
# vlmexp.config.stages, where it is defined, so each name has one import path.
from vlmexp.config.stages import (
    DPOStageConfig,
    EvalConfig,
    ExportConfig,
    GenerationConfig,
    GRPOStageConfig,
    SFTStageConfig,
)
from vlmexp.config.tiny_model import TinyModelConfig
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
    # VLM-R1's detection question template (src/eval/test_od_r1.py), with the box format spelled out
    "detection": (
        "{problem} First output the thinking process in <think> </think> tags and then output the final "
        "answer in <answer> </answer> tags. Output the final answer in JSON format: a ```json block "
        "listing {{\"bbox_2d\": [x1, y1, x2, y2], \"label\": ...}} for each object, {frame}, or None if "
        "there is none."
    ),
}
TEMPLATE_FIELDS = ("problem", "frame")  # what a prompt template may use


class RunConfig(Section):
    name: str = Field("vlmexp", description="Experiment name: MLflow experiment, output folder name.")
    output_dir: str | None = Field(None, description="Where every stage writes. Default: outputs/<name>.")
    seed: int = Field(42, description="Seed for sampling, initialisation and training.")
    on_busy: Literal["refuse", "wait"] = Field(
        "refuse", description="When another run holds the output folder (a pipeline run, a deployment run, a "
        "`vlmexp train` by hand, on any machine sharing the folder): refuse at once, naming it, or wait for "
        "it to end (up to busy_wait_seconds). A holder whose process is gone or whose heartbeat stopped is "
        "taken over, with a warning.")
    busy_wait_seconds: PositiveFloat = Field(
        3600.0, description="With on_busy: wait, how long to wait for the holder before refusing.")

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


class ModelConfig(Section):
    path: str = Field(..., description="Local HF folder, hub id (org/name), or tiny:<family>.")
    family: FamilyName | None = Field(
        None, description="Detected from the checkpoint's config.json when left out."
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Weights' dtype when loading; "
        "auto: the checkpoint's own (float32 for tiny models).")
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2", "flash_attention_3"] = Field(
        "sdpa", description="transformers' attention kernel; "
        "flash_attention_* need the flash-attn package (GPU).")
    min_pixels: PositiveInt | None = Field(None, description="Qwen-VL families: "
                                           "smart_resize's image pixel floor; default: the "
                                           "processor's. Refused for internvl, which tiles.")
    max_pixels: PositiveInt | None = Field(None, description="Qwen-VL families: "
                                           "smart_resize's image pixel ceiling; default: the "
                                           "processor's. Refused for internvl, which tiles.")
    min_patches: PositiveInt | None = Field(None, description="internvl: fewest tiles an image is cut into; "
                                            "default: the processor's (1). Refused for the Qwen-VL families.")
    max_patches: PositiveInt | None = Field(None, description="internvl: most tiles (448 x 448 crops in the "
                                            "released checkpoints, plus a thumbnail when there is more than "
                                            "one) an image is cut into, VLM-R1's max_anyres_num; default: "
                                            "the processor's (12). Refused for the Qwen-VL families.")
    trust_remote_code: bool = Field(False, description="Let transformers run Python code shipped with the "
                                                        "checkpoint (only for checkpoints you trust).")
    tiny: TinyModelConfig | None = Field(None, description="Sizes for tiny:<family> models.")

    @field_validator("path")
    @classmethod
    def _path(cls, v: str) -> str:
        if v.startswith(TINY_PREFIX) and v[len(TINY_PREFIX):] not in FAMILIES:
            raise ValueError("unknown tiny family; use one of: "
                             f"{', '.join(TINY_PREFIX + f for f in FAMILIES)}")
        if not v.strip():
            raise ValueError("give a local model folder, a hub id (org/name) or tiny:<family>")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> ModelConfig:
        if self.min_pixels and self.max_pixels and self.min_pixels > self.max_pixels:
            raise ValueError(f"min_pixels ({self.min_pixels}) exceeds "
                             f"max_pixels ({self.max_pixels}): swap them")
        if self.min_patches and self.max_patches and self.min_patches > self.max_patches:
            raise ValueError(f"min_patches ({self.min_patches}) exceeds max_patches ({self.max_patches}): "
                             "swap them")
        if self.tiny is not None and not self.path.startswith(TINY_PREFIX):
            raise ValueError("model.tiny applies only to model.path: tiny:<family>; remove model.tiny")
        if self.path.startswith(TINY_PREFIX):
            family = self.path[len(TINY_PREFIX):]
            if self.family not in (None, family):
                raise ValueError(f"family {self.family!r} contradicts "
                                 f"path {self.path!r}: remove model.family")
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

    json_path: str = Field(..., description="A .json (list), .jsonl, .parquet or .arrow file; a glob or "
                           "folder of shards (data/train-*.parquet, folder@split); a save_to_disk folder; a "
                           "LLaMA-Factory dataset folder (with dataset_info.json; name the dataset with "
                           "`dataset`); or a Hugging Face Hub dataset org/name@split (EasyR1's syntax).")
    sampling_strategy: str = Field("all", description="all | first:N | end:N | random:N, N may be 'P%'.")
    image_root: str | None = Field(None, description="Folder that relative image paths resolve against. "
                                   "Default: the file's or folder's own.")
    task: Task | None = Field(None, description="rec | math | exact | detection; default from the records' "
                              "accu_reward_method, else from the record format.")
    columns: dict[str, str | None] | None = Field(
        None, description="Rename columns to the fields vlmexp reads, e.g. {problem: question, answer: "
        "solution, images: image} (EasyR1's prompt_key / answer_key / image_key), or a column of your own to "
        "the name rewards receive it under, e.g. {caption: normal_caption}; `column: null` drops the "
        "source's column (e.g. {videos: null}: vlmexp trains images only).")
    subset: str | None = Field(None, description="Hub dataset: the configuration (subset) name.")
    revision: str | None = Field(None, description="Hub dataset: a branch, tag or commit.")
    box_form: Literal["xyxy", "xywh"] | None = Field(
        None, description="The form of the boxes the source's records carry (`bbox`, a rec record's "
        "solution): xyxy [x1, y1, x2, y2] or xywh [x, y, w, h] (top-left corner, width, height), in original "
        "pixels. Default: the format's own (V* annotations: xywh; vlmexp's `bbox` and VLM-R1's solutions: "
        "xyxy); a `bbox` listing boxes in a format that names no form is refused without it.")
    dataset: str | None = Field(None, description="A LLaMA-Factory dataset folder: "
                                "the dataset_info.json entry to read (its file, "
                                "formatting, columns and tags); only with such a folder.")

    @field_validator("columns")
    @classmethod
    def _columns(cls, v: dict[str, str | None] | None) -> dict[str, str | None] | None:
        # the field names themselves are checked against vlmexp.data.formats.FIELDS by the check phase
        mapped = [c for c in (v or {}).values() if c is not None]
        if len(set(mapped)) != len(mapped):
            raise ValueError("columns maps one source column to two fields; map each column once")
        return v


class DataConfig(Section):
    datasets: list[DataSource] | None = Field(None, description="Training sources (VLM-R1 YAML entries).")
    data_yaml: str | None = Field(None, description="A VLM-R1 data YAML with a `datasets:` list.")
    demo: DemoDataConfig | None = Field(None, description="Use the generated demo dataset.")
    zoom_demo: ZoomDemoConfig | None = Field(None, description="Use the generated zoom dataset (images "
                                             "whose answer needs a zoom; configs/demo_zoom.yaml).")
    val_datasets: list[DataSource] | None = Field(None, description="Held-out sources.")
    val_data_yaml: str | None = Field(None, description="A VLM-R1 data YAML of held-out sources.")
    val_fraction: float | None = Field(None, gt=0, lt=1, description="Hold out this share of training rows.")
    system_prompt: str | None = Field(None, description="A system message put "
                                      "before every prompt; none by default.")
    prompt_templates: dict[Task, str] = Field(
        default_factory=lambda: dict(DEFAULT_PROMPT_TEMPLATES),
        description="The user prompt per task (rec, math, exact, detection), with {problem} and, for rec and "
                    "detection, {frame} (the family's box frame); tasks not given keep the default "
                    "(vlmexp.config.schema.DEFAULT_PROMPT_TEMPLATES).")

    @field_validator("prompt_templates")
    @classmethod
    def _templates(cls, v: dict[str, str]) -> dict[str, str]:
        for task, template in v.items():
            check_template(template, TEMPLATE_FIELDS, f"template for {task!r}")
        return {**DEFAULT_PROMPT_TEMPLATES, **v}

    @model_validator(mode="after")
    def _one_train_source(self) -> DataConfig:
        given = [k for k in ("datasets", "data_yaml", "demo", "zoom_demo") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"set exactly one of data.datasets, data.data_yaml, data.demo, data.zoom_demo "
                             f"(got {given or 'none'})")
        val = [k for k in ("val_datasets", "val_data_yaml", "val_fraction") if getattr(self, k) is not None]
        if len(val) > 1:
            raise ValueError(f"set at most one of data.val_datasets, data.val_data_yaml, data.val_fraction "
                             f"(got {val})")
        return self




class TrackingConfig(Section):
    """Where runs, metrics and artifacts are recorded."""

    backend: Literal["mlflow", "none"] = Field("mlflow", description="mlflow, or none: nothing is recorded "
                                               "(and mlflow is not imported).")
    tracking_uri: str | None = Field(None, description="Default sqlite:///<run.output_dir>/mlflow.db; "
                                                        "MLFLOW_TRACKING_URI wins.")
    experiment_name: str | None = Field(None, description="Default: run.name.")
    artifact_location: str | None = Field(None, description="Where a new experiment keeps artifacts. "
                                                             "Default: <run.output_dir>/mlartifacts.")
    completions_every: int = Field(10, ge=0, description="Log a table of sample GRPO completions with their "
                                                         "rewards every N steps (0 = never).")
    completions_per_table: PositiveInt = Field(8, description="Completions per table.")
    system_metrics: bool = Field(True, description="Sample CPU, memory, disk and network use, and GPU use "
                                 "and memory where a GPU is present (needs nvidia-ml-py: the gpu extra), "
                                 "into each training stage's run: MLflow's System metrics tab. false: none.")
    system_metrics_seconds: float = Field(10, gt=0, description="Seconds between system-metric samples "
                                          "(MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL wins).")


class PipelineConfig(Section):
    """How the Prefect flow runs the stages."""

    retries: int = Field(1, ge=0, description="Retries per task; a retried training stage resumes from its "
                                              "last checkpoint.")
    retry_delay_seconds: float = Field(10, ge=0,
                                       description="Seconds between a task's failure and its retry.")
    stage_deployments: dict[str, str] = Field(
        default_factory=dict,
        description="Run a stage as its own Prefect deployment (`flow/deployment`, e.g. "
                    "`{grpo: vlm-stage/gpu}`) on that deployment's work pool; stages not named run in the "
                    "flow's process. Keys: "
                    + ", ".join(DEPLOYABLE_STAGES) + ".")

    @field_validator("stage_deployments")
    @classmethod
    def _deployments(cls, value: dict[str, str]) -> dict[str, str]:
        for stage, name in value.items():
            if stage not in DEPLOYABLE_STAGES:
                raise ValueError(f"unknown stage {stage!r}; stages that can run as a deployment: "
                                 f"{', '.join(DEPLOYABLE_STAGES)}")
            if not re.fullmatch(r"[^/\s]+/[^/\s]+", name):
                raise ValueError(f"{stage}: {name[:200]!r} is not a deployment name; write "
                                 "'flow/deployment', e.g. 'vlm-stage/gpu'")
        return value


class RayLaunchConfig(Section):
    """A stage on a running Ray cluster (launch.launcher: ray): `num_workers` Ray actors in a placement group
    run the stage function, as torchrun's ranks do (vlmexp.ray_launch)."""

    address: str | None = Field(None, description="The running cluster: ray://HEAD:10001 (Ray Client: "
                                "this machine need not be a node), HEAD:6379 (the GCS address, from a node), "
                                "or auto (the cluster this node belongs to). Not set: Ray's own rule, as "
                                "ray.init() and `ray job submit` follow it: RAY_ADDRESS, else auto, else "
                                "refused naming both.")
    num_workers: PositiveInt = Field(1, description="Training processes (ranks); one GPU each when "
                                     "gpus_per_worker is 1.")
    gpus_per_worker: float = Field(0, ge=0, description="GPUs each worker reserves (0 trains on CPU).")
    cpus_per_worker: float = Field(1, ge=0, description="CPUs each worker reserves.")
    resources_per_worker: dict[str, float] = Field(
        default_factory=dict, description="Custom resources each worker reserves, e.g. {node_a: 1} or "
        "{\"accelerator_type:H100\": 0.001}.")
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "PACK", description="How the workers' placement group spreads over nodes (Ray's strategies): "
        "STRICT_SPREAD puts each worker on its own node.")
    max_failures: int = Field(0, ge=0, description="Worker-group failures after which the driver starts the "
                              "workers again (the stage resumes from its newest complete checkpoint); 0: the "
                              "first fails the stage.")
    runtime_env: dict | None = Field(None, description="Ray's runtime environment for nodes that lack the "
                                     "code, e.g. {working_dir: ., pip: [...]}; null: the nodes have vlmexp "
                                     "installed.")


class LaunchConfig(Section):
    """How a training stage's process is started (vlmexp.launch.stage_command)."""

    launcher: Literal["local", "torchrun", "accelerate", "deepspeed", "ray"] = Field(
        "local", description="local: one process; torchrun, "
        "accelerate or deepspeed: their launcher around it; ray: Ray workers on the cluster at "
        "launch.ray.address.")
    ray: RayLaunchConfig | None = Field(None, description="launcher ray: the cluster, the workers and their "
                                        "resources.")
    nproc_per_node: PositiveInt = Field(1, description="Processes (GPUs) per node.")
    nnodes: PositiveInt = Field(1, description="Nodes taking part.")
    node_rank: int = Field(0, ge=0, description="This node's rank, 0 to nnodes - 1.")
    rdzv_endpoint: str | None = Field(None, description="host:port of node 0 for multi-node runs.")
    deepspeed: str | None = Field(None, description="DeepSpeed JSON config path.")
    accelerate_config: str | None = Field(None,
                                          description="An accelerate config YAML (launcher accelerate).")
    hostfile: str | None = Field(None, description="DeepSpeed hostfile (lines of 'host slots=N') for "
                                 "multi-node runs.")

    @model_validator(mode="after")
    def _multi_node(self) -> LaunchConfig:
        if self.node_rank >= self.nnodes:
            raise ValueError(f"node_rank {self.node_rank} must be below nnodes {self.nnodes}")
        if self.nnodes > 1 and self.launcher in ("torchrun", "accelerate") and not self.rdzv_endpoint:
            raise ValueError("multi-node torchrun/accelerate needs "
                             "launch.rdzv_endpoint (host:port of node 0)")
        if self.launcher == "local" and (self.nproc_per_node > 1 or self.nnodes > 1):
            raise ValueError("launcher 'local' runs one process; use torchrun, accelerate or deepspeed")
        if self.rdzv_endpoint and not re.fullmatch(r"[^:\s]+:\d+", self.rdzv_endpoint):
            raise ValueError(f"rdzv_endpoint {self.rdzv_endpoint!r} must be host:port, e.g. 10.0.0.1:29500")
        if self.launcher == "deepspeed" and self.nnodes > 1 and not self.hostfile:
            raise ValueError("multi-node deepspeed needs launch.hostfile (lines of 'host slots=N')")
        if self.accelerate_config and self.launcher != "accelerate":
            raise ValueError("launch.accelerate_config is read by accelerate only; "
                             f"launcher is {self.launcher!r}")
        if self.launcher == "ray" and self.ray is None:  # the defaults: the cluster Ray's own rule finds
            self.ray = RayLaunchConfig()
        if self.launcher != "ray" and self.ray is not None:
            raise ValueError(f"launch.ray is read by launcher ray only; launcher is {self.launcher!r}")
        if self.launcher == "ray" and (self.nproc_per_node > 1 or self.nnodes > 1 or self.hostfile):
            raise ValueError("launcher 'ray' places launch.ray.num_workers workers itself: remove "
                             "launch.nproc_per_node, launch.nnodes and launch.hostfile")
        return self


class Config(Section):
    """A whole experiment: one YAML, every stage. A config may build on others with a top-level
    `extends: base.yaml` (or a list of files, merged in order; paths relative to the file that names them):
    the bases' mappings are merged key by key at any depth, and the file's own values win; a list or a value
    replaces the base's whole (write `null` to drop a base's section, e.g.
    `data: {demo: null, datasets: [...]}`). Dotted overrides apply after the merge; errors name the file and
    line where each value was written, a base file's included."""

    run: RunConfig = Field(default_factory=RunConfig, description="Name, output folder and seed.")
    model: ModelConfig = Field(...,
                               description="The model to train: a checkpoint, a hub id or tiny:<family>.")
    data: DataConfig = Field(..., description="Training and held-out data, and the prompts.")
    sft: SFTStageConfig = Field(default_factory=SFTStageConfig, description="Supervised fine-tuning.")
    dpo: DPOStageConfig = Field(default_factory=DPOStageConfig, description="Direct preference optimisation.")
    grpo: GRPOStageConfig = Field(default_factory=GRPOStageConfig,
                                  description="GRPO with the configured rewards.")
    eval: EvalConfig = Field(default_factory=EvalConfig, description="Evaluation on the held-out records.")
    generation: GenerationConfig = Field(default_factory=GenerationConfig, description="How every stage "
                                         "generates: compilation, key/value cache, prompt-length buckets.")
    export: ExportConfig = Field(default_factory=ExportConfig, description="Export and registry promotion.")
    tracking: TrackingConfig = Field(default_factory=TrackingConfig, description="MLflow tracking.")
    launch: LaunchConfig = Field(default_factory=LaunchConfig, description="How training processes start.")
    pipeline: PipelineConfig = Field(default_factory=PipelineConfig,
                                     description="Retries and where stages run.")
