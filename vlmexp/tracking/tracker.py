"""The MLflow tracker and registry: one experiment per config, a parent run per pipeline run, a child run per
stage, registered models and their champion alias.

Runs are addressed by id through `MlflowClient` (never the thread-local "active run"), so Prefect tasks
in any thread log to the right run. A training subprocess is told its stage's child run id (an argument)
and logs into it through its one logger (`vlmexp.tracking.stage_run`), TRL's step metrics included.
`tracking.backend: none` gives a `NullTracker`; both are `Tracker`s.
"""

from __future__ import annotations

import json
import logging
import os
import re
from abc import ABC, abstractmethod
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from vlmexp.config.schema import Config
from vlmexp.provenance import SECRET_NAME, source_tags

log = logging.getLogger("vlmexp.tracking")

# The experiment's kind, as MLflow's UI reads it from this tag: "finetuning" is one of the kinds its JS bundle
# knows (with genai_development, custom_model_development, regression, ...) and maps to the model-training
# view (runs, metric charts, artifacts); an experiment without a kind is taken for GenAI (traces, evaluation
# runs). A kind a person set by hand is kept.
EXPERIMENT_KIND_TAG, EXPERIMENT_KIND = "mlflow.experimentKind", "finetuning"
# MLflow 3.17's UI no longer picks the view from that tag: a "GenAI | Model training" switch kept in the
# browser (default GenAI) decides, and this query in the address selects model training (read in its JS
# bundle, checked in headless Chromium). `vlmexp ui` prints an address with it.
UI_MODEL_TRAINING = "workflowType=machine_learning"
DIGEST_CHARS = 16  # of a dataset input's digest: MLflow's store keeps up to 36 characters
# The first charts of a run page. MLflow 3.17's UI makes one chart per metric, in sections named by the key up
# to its last "/", sections sorted by name (JavaScript's sort: upper case before lower case) and charts by
# key, and the keys without "/" last ("Model metrics"); the layout a person rearranges lives in the browser
# only (RunsChartsCardConfig.getBaseChartAndSectionConfigs and RunViewMetricChartsV2 in its bundle, which
# keeps it in localStorage), so names are the one lever the server has. TRL's keys are lower case
# (clip_ratio/..., the first section before), so "Summary/reward" and "Summary/<export.metric>" open the page
# of a GRPO, DPO and parent run.
HEADLINE = "Summary"
# the reward a stage's headline chart shows: (the Trainer's key, the chart's name)
HEADLINE_REWARD = {"grpo": ("reward", "reward"), "dpo": ("rewards/margins", "reward_margin")}


def sanitize_metric_name(name: str) -> str:
    """What MLflow accepts in a metric name: letters, digits, _ - . / : and space."""
    return re.sub(r"[^0-9A-Za-z_\-. :/]", "_", name)


def store_uri(cfg: Config) -> str:
    """MLFLOW_TRACKING_URI, else tracking.tracking_uri, else a sqlite file in the run's output folder."""
    env = os.environ.get("MLFLOW_TRACKING_URI")
    if env:
        return env
    if cfg.tracking.tracking_uri:
        return cfg.tracking.tracking_uri
    return f"sqlite:///{Path(cfg.run.output_dir).resolve() / 'mlflow.db'}"


class Tracker(ABC):
    """What the pipeline's process records about a run, wherever it records it: runs addressed by id, their
    params, metrics, tags and artifacts, the registered models and their alias. `NullTracker` (tracking
    off) and `MlflowTracker` are its two kinds."""

    enabled: bool
    uri: str

    @abstractmethod
    def start_pipeline(self, name: str, params: Mapping[str, str], tags: Mapping[str, str]) -> str:
        """A new top-level run; its id."""

    @abstractmethod
    def start_stage(self, parent_id: str, name: str, tags: Mapping[str, str] | None = None) -> str:
        """A child run of `parent_id`; its id."""

    @abstractmethod
    def log_params(self, run_id: str, params: Mapping[str, str]) -> None:
        """Params, secrets left out."""

    @abstractmethod
    def log_metrics(self, run_id: str, metrics: Mapping[str, float], step: int | None = None) -> None:
        """Scalars at `step` (0 when None)."""

    @abstractmethod
    def set_tags(self, run_id: str, tags: Mapping[str, str]) -> None:
        """Tags, values as strings."""

    @abstractmethod
    def log_artifact(self, run_id: str, path: str | Path, artifact_path: str | None = None) -> None:
        """A file under `artifact_path`."""

    @abstractmethod
    def log_table(self, run_id: str, rows: list[dict[str, Any]], artifact_file: str) -> None:
        """Rows as an MLflow table."""

    @abstractmethod
    def log_text(self, run_id: str, text: str, artifact_file: str) -> None:
        """Text as an artifact file."""

    @abstractmethod
    def log_datasets(self, run_id: str, manifests: Mapping[str, str | Path]) -> None:
        """Sampled data as the run's dataset inputs."""

    @abstractmethod
    def end(self, run_id: str, status: str = "FINISHED") -> None:
        """End the run with `status`."""

    @abstractmethod
    def metric_history(self, run_id: str, key: str) -> list[tuple[int, float]]:
        """(step, value) of each point of `key`."""

    @abstractmethod
    def metric_keys(self, run_id: str) -> list[str]:
        """The run's metric names, sorted."""

    @abstractmethod
    def run_link(self, run_id: str) -> str:
        """Where to find the run."""

    @abstractmethod
    def register_model(self, run_id: str, folder: str | Path, name: str, tags: Mapping[str, str],
                       metrics: Mapping[str, float] | None = None, dataset: str | Path | None = None,
                       registration: Mapping[str, Any] | None = None) -> str:
        """Register `folder` as a new version of `name`; the version."""

    @abstractmethod
    def log_evaluated_models(self, eval_run_id: str, models: Mapping[str, Mapping[str, float]],
                             dataset: str | Path | None, headline: str | None = None) -> list[str]:
        """Evaluation metrics onto the evaluated logged models; their ids."""

    @abstractmethod
    def champion(self, name: str, alias: str = "champion") -> tuple[str, dict[str, str]] | None:
        """(version, tags) holding `alias`, or None."""

    @abstractmethod
    def set_alias(self, name: str, version: str, alias: str = "champion") -> None:
        """Point `alias` at `version`."""


class NullTracker(Tracker):
    """Tracking switched off: every call does nothing and returns empty values."""

    enabled = False
    uri = ""

    def start_pipeline(self, name: str, params: Mapping[str, str], tags: Mapping[str, str]) -> str:
        return ""

    def start_stage(self, parent_id: str, name: str, tags: Mapping[str, str] | None = None) -> str:
        return ""

    def log_params(self, run_id: str, params: Mapping[str, str]) -> None: ...
    def log_metrics(self, run_id: str, metrics: Mapping[str, float], step: int | None = None) -> None: ...
    def set_tags(self, run_id: str, tags: Mapping[str, str]) -> None: ...
    def log_artifact(self, run_id: str, path: str | Path, artifact_path: str | None = None) -> None: ...
    def log_table(self, run_id: str, rows: list[dict[str, Any]], artifact_file: str) -> None: ...
    def log_text(self, run_id: str, text: str, artifact_file: str) -> None: ...
    def log_datasets(self, run_id: str, manifests: Mapping[str, str | Path]) -> None: ...
    def end(self, run_id: str, status: str = "FINISHED") -> None: ...

    def metric_history(self, run_id: str, key: str) -> list[tuple[int, float]]:
        return []

    def metric_keys(self, run_id: str) -> list[str]:
        return []

    def run_link(self, run_id: str) -> str:
        return ""

    def register_model(self, run_id: str, folder: str | Path, name: str, tags: Mapping[str, str],
                       metrics: Mapping[str, float] | None = None, dataset: str | Path | None = None,
                       registration: Mapping[str, Any] | None = None) -> str:
        return ""

    def log_evaluated_models(self, eval_run_id: str, models: Mapping[str, Mapping[str, float]],
                             dataset: str | Path | None, headline: str | None = None) -> list[str]:
        return []

    def champion(self, name: str, alias: str = "champion") -> tuple[str, dict[str, str]] | None:
        return None

    def set_alias(self, name: str, version: str, alias: str = "champion") -> None: ...


class MlflowTracker(Tracker):
    enabled = True

    def __init__(self, uri: str, experiment: str, artifact_location: str):
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        self.uri = uri
        try:
            self.client = MlflowClient(tracking_uri=uri)
            found = self.client.get_experiment_by_name(experiment)
            self.experiment_id = found.experiment_id if found else self.client.create_experiment(
                experiment, artifact_location=artifact_location, tags={EXPERIMENT_KIND_TAG: EXPERIMENT_KIND})
            if found and EXPERIMENT_KIND_TAG not in found.tags:  # made before the tag existed: tag it once
                self.client.set_experiment_tag(self.experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)
        except (MlflowException, OSError) as e:
            reason = (e.message if isinstance(e, MlflowException) else str(e)).splitlines()[0]
            raise ConnectionError(f"MLflow store {uri!r} cannot be used ({reason}); "
                                  "fix tracking.tracking_uri or MLFLOW_TRACKING_URI, "
                                  "or set tracking.backend: none") from e

    def start_pipeline(self, name: str, params: Mapping[str, str], tags: Mapping[str, str]) -> str:
        run = self.client.create_run(self.experiment_id, run_name=name, tags=dict(tags))
        self.log_params(run.info.run_id, params)
        return run.info.run_id

    def start_stage(self, parent_id: str, name: str, tags: Mapping[str, str] | None = None) -> str:
        run = self.client.create_run(self.experiment_id, run_name=name,
                                     tags={"mlflow.parentRunId": parent_id, "stage": name, **source_tags(),
                                           **(tags or {})})
        return run.info.run_id

    def log_params(self, run_id: str, params: Mapping[str, str]) -> None:
        from mlflow.entities import Param

        items = [Param(k, str(v)[:6000]) for k, v in params.items()
                 if not SECRET_NAME.search(k.split(".")[-1])]
        for i in range(0, len(items), 100):
            self.client.log_batch(run_id, params=items[i:i + 100])

    def log_metrics(self, run_id: str, metrics: Mapping[str, float], step: int | None = None) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        items = [Metric(sanitize_metric_name(k), float(v), now, step or 0) for k, v in metrics.items()]
        if items:
            self.client.log_batch(run_id, metrics=items)

    def set_tags(self, run_id: str, tags: Mapping[str, str]) -> None:
        for k, v in tags.items():
            self.client.set_tag(run_id, k, str(v))

    def log_artifact(self, run_id: str, path: str | Path, artifact_path: str | None = None) -> None:
        self.client.log_artifact(run_id, str(path), artifact_path)

    def log_table(self, run_id: str, rows: list[dict[str, Any]], artifact_file: str) -> None:
        import pandas as pd

        self.client.log_table(run_id, pd.DataFrame(rows), artifact_file)

    def log_text(self, run_id: str, text: str, artifact_file: str) -> None:
        self.client.log_text(run_id, text, artifact_file)

    def log_datasets(self, run_id: str, manifests: Mapping[str, str | Path]) -> None:
        """The sampled data as the run's dataset inputs, MLflow's Dataset column: {context: manifest} with
        context "training" or "evaluation"; the digest is the manifest's content digest (the same data shows
        the same digest in every run, wherever it was sampled), the profile its rows and sources."""
        from mlflow.entities import Dataset, DatasetInput, InputTag

        inputs = []
        for context, path in manifests.items():
            manifest = json.loads(Path(path).read_text())
            data = Path(path).with_name(Path(path).name.removesuffix(".manifest.json") + ".jsonl")
            profile = {"rows": manifest["rows"], "content_sha256": manifest["content_sha256"],
                       "sources": [src["json_path"] for src in manifest["sources"]]}
            name, digest = dataset_ref(path)
            dataset = Dataset(name=name, digest=digest, source_type="local",
                              source=json.dumps({"uri": str(data.resolve())}), profile=json.dumps(profile))
            inputs.append(DatasetInput(dataset, tags=[InputTag("mlflow.data.context", context)]))
        self.client.log_inputs(run_id, datasets=inputs)

    def end(self, run_id: str, status: str = "FINISHED") -> None:
        self.client.set_terminated(run_id, status)

    def metric_history(self, run_id: str, key: str) -> list[tuple[int, float]]:
        return [(m.step, m.value) for m in self.client.get_metric_history(run_id, key)]

    def metric_keys(self, run_id: str) -> list[str]:
        return sorted(self.client.get_run(run_id).data.metrics)

    def run_link(self, run_id: str) -> str:
        return f"{self.uri} experiment {self.experiment_id} run {run_id}"

    def register_model(self, run_id: str, folder: str | Path, name: str, tags: Mapping[str, str],
                       metrics: Mapping[str, float] | None = None, dataset: str | Path | None = None,
                       registration: Mapping[str, Any] | None = None) -> str:
        """Log `folder` as a logged model of run `run_id`, with its evaluation `metrics` (`eval/<metric>`, on
        the `dataset` manifest's data), and register that model as a new version of `name`. `registration`
        (mode copy or reference, `vlmexp.tracking.registration`): copied, the model holds the files and the
        version's source is `models:/<model_id>`; by reference, the model is external and the version points
        at the files where they stay (`reference_target`)."""
        from mlflow.exceptions import MlflowException

        from vlmexp.tracking.logged_models import log_export_model, register_version
        from vlmexp.tracking.registration import reference_target

        if not registration or registration.get("mode") not in ("copy", "reference"):
            raise ValueError(f"registration of {folder} must say mode copy or reference, "
                             f"not {registration!r}")
        copy = registration["mode"] == "copy"
        model_id = log_export_model(self.client, self.experiment_id, run_id, folder, copy, metrics or {},
                                    dataset_ref(dataset) if dataset else None)
        try:
            self.client.get_registered_model(name)
        except MlflowException:
            self.client.create_registered_model(name, description="Exported by vlmexp; the `champion` "
                                                                  "alias marks the best version so far")
        files = (f"models:/{model_id}" if copy
                 else reference_target(folder, model_id, registration.get("reference_uri")))
        self.client.set_logged_model_tags(model_id, {"vlmexp.registration": registration["mode"],
                                                     "vlmexp.files": files})
        return register_version(self.client, self.uri, name, model_id, files, run_id, tags)

    def log_evaluated_models(self, eval_run_id: str, models: Mapping[str, Mapping[str, float]],
                             dataset: str | Path | None, headline: str | None = None) -> list[str]:
        """Each evaluated model folder's metrics ({folder: metrics}) onto its logged model, as `eval/<metric>`
        at the model's step in the run that made it, on the `dataset` manifest's data; the models become
        inputs of the evaluation run. The `headline` metric is also `Summary/<headline>` in that run (its
        first chart). A folder no run logged as a model (the base model) is left out. Returns the ids."""
        from mlflow.entities import LoggedModelInput

        from vlmexp.tracking.logged_models import STEP_TAG, find_model, log_model_metrics

        ids = []
        for folder, metrics in models.items():
            model = find_model(self.client, self.experiment_id, folder) if Path(folder).is_dir() else None
            if model is None:
                continue
            step = int(model.tags.get(STEP_TAG, 0))
            fresh = log_model_metrics(self.client, model.model_id,
                                      {f"eval/{k}": v for k, v in metrics.items()}, step,
                                      dataset_ref(dataset) if dataset else None)
            if headline in metrics and fresh:  # logged once, with the model's own metrics
                self.log_metrics(model.source_run_id, {f"{HEADLINE}/{headline}": metrics[headline]}, step)
            ids.append(model.model_id)
        if ids:
            self.client.log_inputs(eval_run_id, models=[LoggedModelInput(i) for i in ids])
        return ids

    def champion(self, name: str, alias: str = "champion") -> tuple[str, dict[str, str]] | None:
        """(version, tags) of the version holding `alias`, or None when there is none yet."""
        from mlflow.exceptions import MlflowException

        try:
            version = self.client.get_model_version_by_alias(name, alias)
        except MlflowException as e:
            if e.error_code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
                return None
            raise
        return str(version.version), dict(version.tags)

    def set_alias(self, name: str, version: str, alias: str = "champion") -> None:
        self.client.set_registered_model_alias(name, alias, version)


def dataset_ref(manifest: str | Path) -> tuple[str, str]:
    """(name, digest) of a sampled file as MLflow's datasets name it: the file's stem and the first characters
    of its manifest's content digest (the same data, the same digest, wherever it was sampled)."""
    name = Path(manifest).name.removesuffix(".manifest.json")
    return name, json.loads(Path(manifest).read_text())["content_sha256"][:DIGEST_CHARS]


def ui_address(host: str, port: int, uri: str = "", experiment: str = "") -> str:
    """The MLflow UI's address that opens on model training: `experiment`'s runs when the store at `uri` holds
    it, else the list of experiments."""
    path = "/experiments"
    if uri and experiment:
        from mlflow.tracking import MlflowClient

        found = MlflowClient(tracking_uri=uri).get_experiment_by_name(experiment)
        path += f"/{found.experiment_id}" if found else ""
    return f"http://{host}:{port}/#{path}?{UI_MODEL_TRAINING}"


def make_tracker(cfg: Config) -> Tracker:
    """The configured tracker; raises ConnectionError (with the fix) when the MLflow store is unusable."""
    if cfg.tracking.backend == "none":
        return NullTracker()
    out = Path(cfg.run.output_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    artifacts = cfg.tracking.artifact_location or (out / "mlartifacts").as_uri()
    return MlflowTracker(store_uri(cfg), cfg.tracking.experiment_name or cfg.run.name, artifacts)


