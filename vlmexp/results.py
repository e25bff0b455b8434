"""What the pipeline's steps return: typed records of paths, keys, run ids and numbers (never models).

Prefect pickles them into its result cache, a stage run on another work pool writes its result as
<stage folder>/stage_result.json (`StageResult` / `Evaluation` as JSON), and `PipelineResult` is what the
flow returns and the summary is built from (`vlmexp.summary`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict


@dataclass
class Promotion:
    """A registered version and whether it took the champion alias, with the comparison that decided it."""
    name: str
    version: str
    metric: str
    value: float | None
    champion_version: str | None  # the champion before this decision
    champion_value: float | None
    promoted: bool
    reason: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class Result(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SampledData(Result):
    """The run's sampled data and the config it was sampled for."""

    resolved: str  # <output_dir>/config.resolved.yaml, committed once the data sampled cleanly
    train: str  # sampled train.jsonl
    val: str | None  # sampled val.jsonl; None when the config holds no records out
    # the sampled data's content digest (PreparedData.content_sha256): what the stage keys depend on
    hash: str
    base_model: str  # the folder (or hub id) the first stage starts from


class StageResult(Result):
    """A finished training stage."""

    stage: str
    final: str  # <output_dir>/<stage>/final: the trained model or adapter
    key: str  # the stage key it was trained for (vlmexp.pipeline.keys.stage_key)
    run_id: str  # its MLflow child run ("" with tracking off)
    seconds: float
    # the Prefect flow run that trained it (a later run that reads it from cache differs)
    flow_run_id: str = ""
    validation: dict[str, Any] | None = None  # validation during training: <stage>/validation.json, else None

    @property
    def output(self) -> str:
        return self.final


class Evaluation(Result):
    """One model evaluated on the held-out records."""

    name: str  # candidate: base, sft, dpo or grpo
    model: str
    metrics: dict[str, int | float]  # as evaluation reports them (count is an int)
    samples: str  # per-sample JSONL
    key: str
    seconds: float

    @property
    def output(self) -> str:
        return self.samples


class PipelineResult(Result):
    """Everything one run of the pipeline produced; the flow's return value."""

    name: str  # run.name
    config: str  # the config path as given
    data: SampledData
    flow_run_id: str
    mlflow_run_id: str  # the parent run ("" with tracking off)
    stages: dict[str, StageResult | None] = {}  # in stage order; None: the stage is disabled
    evaluations: list[Evaluation] = []
    evaluation: list[dict[str, Any]] = []  # the comparison table, one row per model
    export: str | None = None  # the exported folder
    promotion: Promotion | None = None
    summary: str = ""  # the markdown summary

    @property
    def trained(self) -> list[StageResult]:
        return [s for s in self.stages.values() if s is not None]

    @property
    def model(self) -> str:
        """The newest model: the last trained stage's, else the base model."""
        return self.trained[-1].final if self.trained else self.data.base_model

    @property
    def upstream_key(self) -> str:
        """The key of the last trained stage ("" before any): what the next stage's key depends on."""
        return self.trained[-1].key if self.trained else ""

    def start_model(self, stage: str) -> str | None:
        """The model `stage` starts from; None: the base model (which the stage resolves from the config)."""
        return None if stage == "sft" or not self.trained else self.model

    def candidates(self, checkpoint: str = "last") -> list[tuple[str, str, str]]:
        """(name, model, stage key) of every model to evaluate: the base model, then each trained stage's,
        then with `checkpoint` "best" (export.checkpoint) the last stage's best checkpoint, as
        `<stage>-best`."""
        out = [("base", self.data.base_model, "")] + [(s.stage, s.final, s.key) for s in self.trained]
        if checkpoint == "best" and self.trained:
            last = self.trained[-1]
            out.append((f"{last.stage}-best", self.exported(checkpoint)[0], last.key))
        return out

    def metrics(self, checkpoint: str = "last") -> dict[str, int | float]:
        """The exported model's evaluation metrics ({} without evaluation): the newest model's, or with
        `checkpoint` "best" (export.checkpoint) the last stage's best checkpoint's (`<stage>-best`)."""
        exported = self.candidates(checkpoint)[-1][0]
        return next((dict(e.metrics) for e in self.evaluations if e.name == exported), {})

    def metric(self, name: str, checkpoint: str = "last") -> float | None:
        """The exported model's evaluation metric `name` (None without evaluation)."""
        return self.metrics(checkpoint).get(name)

    def exported(self, checkpoint: str) -> tuple[str, dict[str, Any]]:
        """(model folder, why) of what export.checkpoint picks from the last trained stage: "last", its final
        model; "best", its checkpoint with the best validation during training. `why`: the stage, step, metric
        and value, and the reason in words (the export manifest's `checkpoint`)."""
        last = self.trained[-1]
        v = last.validation or {}
        why = {"choice": checkpoint, "stage": last.stage, "metric": v.get("metric"),
               "direction": v.get("direction")}
        if checkpoint == "last":
            return last.final, {**why, "step": v.get("last_step"), "value": v.get("last_value"),
                                "reason": "export.checkpoint: last, the stage's final model"}
        if not v.get("best_checkpoint"):
            raise ValueError(f"export.checkpoint: best, but the {last.stage} stage recorded no best "
                             f"checkpoint ({last.final}/../validation.json: {v or 'missing'}); train it "
                             "with eval.every_steps on")
        steps = len(v["history"])
        reason = (f"export.checkpoint: best: {v['metric']} {v['best_value']:.4f} at step {v['best_step']}, "
                  f"the best ({v['direction']}) of {steps} validations during training; the last, at step "
                  f"{v['last_step']}, gave {v['last_value']:.4f}")
        return v["best_checkpoint"], {**why, "step": v["best_step"], "value": v["best_value"],
                                      "reason": reason}

    def provenance(self, checkpoint: str = "last") -> dict[str, Any]:
        """What an exported model's manifest records about how it was made, and which checkpoint and why."""
        from vlmexp.provenance import git_commit

        return {"stage_key": self.upstream_key, "data_content_sha256": self.data.hash,
                "git_commit": git_commit(), "mlflow_parent_run_id": self.mlflow_run_id,
                "mlflow_stage_run_ids": {s.stage: s.run_id for s in self.trained},
                "evaluation": self.evaluation, "checkpoint": self.exported(checkpoint)[1]}


def comparison_table(evaluations: list[Evaluation]) -> list[dict[str, Any]]:
    """One row per evaluated model: its name and its metrics (config.METRIC_KEYS present), rounded to 4
    places."""
    from vlmexp.config.stages import METRIC_KEYS

    return [{"model": e.name, **{k: round(e.metrics[k], 4) for k in METRIC_KEYS if k in e.metrics}}
            for e in evaluations]
