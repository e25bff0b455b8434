"""The models a run makes, as MLflow 3 logged models: the experiment's Models tab and the run page's Logged
models box list each checkpoint and final model of a stage and each exported model, linked to the run and
the step that made it, with the metrics of that step and, once evaluated, the evaluation's metrics.

What MLflow's own `log_model(..., step=N)` does (mlflow/models/model.py, `Model.log`: a logged model whose
source run is the run, `log_outputs` with `LoggedModelOutput(model_id, step)`, the run's metrics of step N
copied onto the model), without copying the weights: a checkpoint is an *external* model
(`mlflow.create_external_model`'s tag and MLmodel spec) whose tag `vlmexp.path` names its folder. An export
registered by copy is the one model whose files MLflow holds (`log_model_artifacts`). Everything goes
through an `MlflowClient` of the configured store, never the process's active run.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
import time
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

PATH_TAG, STEP_TAG, STAGE_TAG = "vlmexp.path", "vlmexp.step", "vlmexp.stage"


def model_name(path: str | Path) -> str:
    """A model's name from its folder: `<stage>-final`, `<stage>-checkpoint-N`, `<run>-export`."""
    path = Path(path)
    return f"{path.parent.name}-{path.name}"


def log_folder_model(client, experiment_id: str, run_id: str, folder: str | Path, model_type: str, step: int,
                     keys: Iterable[str] = (), copy: bool = False) -> str:
    """The logged model of `folder`, made by run `run_id` at `step` (created once: the same run, folder and
    step give the same model back, so a resumed stage does not list a checkpoint twice). `copy`: the folder's
    files are uploaded as the model's artifacts; otherwise it is external and only its path is recorded.
    The run's metrics `keys` of `step` are copied onto it with their timestamps (the run's history keeps one
    point each, as MLflow's log_model does). Returns the model id."""
    from mlflow.entities import LoggedModelOutput, LoggedModelStatus

    folder = Path(folder).resolve()
    found = find_model(client, experiment_id, folder, run_id=run_id, step=step)
    if found is not None:
        return found.model_id
    tags = {PATH_TAG: str(folder), STEP_TAG: str(step), STAGE_TAG: folder.parent.name}
    if not copy:
        from mlflow.utils.mlflow_tags import MLFLOW_MODEL_IS_EXTERNAL

        tags[MLFLOW_MODEL_IS_EXTERNAL] = "true"
    model = client.create_logged_model(experiment_id, name=model_name(folder), source_run_id=run_id,
                                       tags=tags, model_type=model_type)
    if copy:
        client.log_model_artifacts(model.model_id, str(folder))
    else:  # what mlflow.create_external_model writes: an MLmodel saying the files live elsewhere
        from mlflow.models.utils import get_external_mlflow_model_spec

        with tempfile.TemporaryDirectory() as tmp:
            get_external_mlflow_model_spec(model).save(str(Path(tmp) / "MLmodel"))
            client.log_model_artifacts(model.model_id, tmp)
    client.finalize_logged_model(model.model_id, LoggedModelStatus.READY)
    client.log_outputs(run_id, [LoggedModelOutput(model.model_id, step)])
    copy_step_metrics(client, run_id, model.model_id, step, keys)
    return model.model_id


def forget_rotated_checkpoints(client, experiment_id: str, run_id: str) -> list[str]:
    """Delete the logged models of run `run_id`'s checkpoints whose folder is gone (the Trainer's
    `save_total_limit` rotated it away), so the Models tab lists the checkpoints that exist; one a registered
    version was made from stays. The run keeps its history (metrics, model outputs). Returns their names."""
    from mlflow.utils.mlflow_tags import MLFLOW_MODEL_VERSIONS

    gone, token = [], None
    while True:
        page = client.search_logged_models([experiment_id], filter_string=f"source_run_id = '{run_id}'",
                                           page_token=token)
        for model in page:
            path = model.tags.get(PATH_TAG)
            if model.model_type == "checkpoint" and path and not Path(path).exists() \
                    and MLFLOW_MODEL_VERSIONS not in model.tags:
                client.delete_logged_model(model.model_id)
                gone.append(model.name)
        token = page.token
        if not token:
            return gone


def log_export_model(client, experiment_id: str, run_id: str, folder: str | Path, copy: bool,
                     metrics: Mapping[str, float], dataset: tuple[str, str] | None) -> str:
    """The exported `folder` as a logged model of run `run_id` (its files copied into it, or external), with
    the evaluation `metrics` of the model it holds (`eval/<metric>`) and tag `vlmexp.exported_from`: the
    logged model of the stage folder its manifest names as its source, when a stage logged one. Returns its
    id."""
    model_id = log_folder_model(client, experiment_id, run_id, folder, "export", 0, copy=copy)
    manifest = Path(folder) / "manifest.json"
    made_from = json.loads(manifest.read_text()).get("source") if manifest.is_file() else None
    origin = find_model(client, experiment_id, made_from) if made_from else None
    if origin is not None:  # the stage model it was exported from (a LoRA merged into its base, or as it is)
        client.set_logged_model_tags(model_id, {"vlmexp.exported_from": origin.model_id})
    if metrics:
        log_model_metrics(client, model_id, {f"eval/{k}": v for k, v in metrics.items()}, 0, dataset)
    return model_id


def copy_step_metrics(client, run_id: str, model_id: str, step: int, keys: Iterable[str]) -> None:
    """The run's values of `keys` at `step` onto the model, timestamps kept (the run's history is
    unchanged)."""
    from mlflow.entities import Metric

    metrics = [Metric(m.key, m.value, m.timestamp, m.step, model_id=model_id)
               for key in keys for m in client.get_metric_history(run_id, key) if m.step == step]
    if metrics:
        client.log_batch(run_id, metrics=metrics, synchronous=True)


def find_model(client, experiment_id: str, folder: str | Path, run_id: str | None = None,
               step: int | None = None):
    """The newest logged model of `folder` in the experiment (of `run_id` and `step` when given), or None."""
    folder, name = str(Path(folder).resolve()), model_name(folder)
    where = (([f"name = '{name}'"] if "'" not in name else [])
             + ([f"source_run_id = '{run_id}'"] if run_id else []))
    token = None
    # newest first; the folder is compared here, not in the filter (a path may hold any character)
    while True:
        page = client.search_logged_models([experiment_id], filter_string=" AND ".join(where) or None,
                                           page_token=token,
                                           order_by=[{"field_name": "creation_time", "ascending": False}])
        for model in page:
            if model.tags.get(PATH_TAG) == folder and (step is None or model.tags.get(STEP_TAG) == str(step)):
                return model
        token = page.token
        if not token:
            return None


def log_model_metrics(client, model_id: str, metrics: Mapping[str, float], step: int,
                      dataset: tuple[str, str] | None = None) -> list[str]:
    """Evaluation metrics onto the model, logged in the run that made it at `step` and tied to `dataset`
    (name, digest); keys the model already holds are left as they are (a re-run logs nothing twice). Returns
    the keys logged."""
    from mlflow.entities import Metric

    model = client.get_logged_model(model_id)
    held = {m.key for m in model.metrics or []}
    now = int(time.time() * 1000)
    name, digest = dataset or (None, None)
    fresh = [Metric(k, float(v), now, step, model_id=model_id, dataset_name=name, dataset_digest=digest)
             for k, v in metrics.items() if k not in held]
    if fresh:
        client.log_batch(model.source_run_id, metrics=fresh, synchronous=True)
    return [m.key for m in fresh]


def register_version(client, uri: str, name: str, model_id: str, source: str, run_id: str,
                     tags: Mapping[str, str]) -> str:
    """A new version of registered model `name` made from logged model `model_id`, its files at `source`
    (`models:/<model_id>`: those MLflow holds for the model; else where they are). As `mlflow.register_model`
    does: the version names the model (and, as tag `model_id`, on stores that do not keep it), and the model
    lists its versions (tag `mlflow.modelVersions`, the Models tab's registered-versions column). Returns
    it."""
    from mlflow.utils.mlflow_tags import MLFLOW_MODEL_VERSIONS

    with tracking_uri_of_process(uri):
        version = client.create_model_version(name, source, run_id=run_id,
                                              tags={**tags, "model_id": model_id}, model_id=model_id)
    listed = json.loads(client.get_logged_model(model_id).tags.get(MLFLOW_MODEL_VERSIONS, "[]"))
    listed.append({"name": name, "version": str(version.version)})
    client.set_logged_model_tags(model_id, {MLFLOW_MODEL_VERSIONS: json.dumps(listed)})
    return str(version.version)


@contextlib.contextmanager
def tracking_uri_of_process(uri: str) -> Iterator[None]:
    """The process's tracking URI set to `uri` for a block, then put back as it was. MLflow's SQL registry
    resolves a `models:/<model_id>` source through the process's URI, not the client's
    (mlflow/store/model_registry/
    sqlalchemy_store.py, create_model_version: "TODO: Propagate tracking URI"); a tracking server resolves it
    in its own store."""
    import mlflow
    from mlflow.tracking import is_tracking_uri_set

    if mlflow.get_tracking_uri() == uri:
        yield
        return
    was_set, previous = is_tracking_uri_set(), mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(uri)
    try:
        yield
    finally:
        mlflow.set_tracking_uri(previous if was_set else None)
