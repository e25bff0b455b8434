"""The vlm-data-sensor flow: looks at a config's data sources and, when they changed since its last look,
emits `vlmexp.data.changed`, on which the `scheduled-retrain` deployment's trigger (prefect.yaml) starts a
retrain.

prefect.yaml deploys it as `vlm-data-sensor/watch-demo` every 15 minutes on the `cpu` pool; what it compares
is `vlmexp.pipeline.data_watch.sources_fingerprint` (source files' sizes and times, Hub commits, the config's
data section), and the last look is kept in the Prefect Variable `vlmexp-data-<run.name>` on the server, so
any worker may run it. The first look records the sources and emits nothing.
"""

from __future__ import annotations

import re

from prefect import flow, get_run_logger
from prefect.runtime import flow_run

from tasks.events import DATA_CHANGED, emit


def variable_name(run_name: str) -> str:
    """The Prefect Variable holding the sources' last digest (names allow a-z, 0-9, - and _)."""
    return "vlmexp-data-" + re.sub(r"[^a-z0-9_-]+", "-", run_name.lower())


@flow(name="vlm-data-sensor", log_prints=True)
def vlm_data_sensor(config: str, overrides: list[str] | None = None) -> bool:
    """Emit `vlmexp.data.changed` when `config`'s data sources changed since the last look; True when it
    did."""
    from prefect.variables import Variable

    from vlmexp.checks.loader import load_config
    from vlmexp.pipeline.data_watch import sources_fingerprint

    cfg = load_config(config, overrides or [])
    now, key = sources_fingerprint(cfg), variable_name(cfg.run.name)
    before = Variable.get(key, default=None)
    changed = before is not None and before != now
    if changed:  # before the new digest is kept: a look that fails to emit is repeated next time
        emit(DATA_CHANGED, "data", cfg.run.name, {"config": config, "overrides": overrides or [],
                                                  "fingerprint": now, "previous": before},
             str(flow_run.id or ""))
    if before != now:
        Variable.set(key, now, overwrite=True)
    get_run_logger().info("%s: data sources %s", cfg.run.name,
                          "changed: emitted " + DATA_CHANGED if changed
                          else "first look: recorded" if before is None else "unchanged")
    return changed
