"""What the data sensor (flows/data_sensor.py) watches: a digest of a config's data sources as they are now.

It changes when a local source file is rewritten (its size or modification time, as `make` and rsync decide:
reading every byte of a large dataset on each look would cost what sampling costs), when a file is added to
or removed from a source folder or glob, when a Hub source moves to a new commit, and when the config's data
section or seed changes. The generated demo data is made from the config, so its digest is the config's.
"""

from __future__ import annotations

import hashlib
import json

from vlmexp.config.schema import Config


def sources_fingerprint(cfg: Config) -> str:
    """The digest of `cfg`'s data sources (train and held-out) as they are now."""
    if cfg.data.demo is not None or cfg.data.zoom_demo is not None:  # zoom demo: calls in the model's frame
        parts: list = [cfg.data.model_dump(mode="json"), cfg.run.seed, cfg.model.family,
                       cfg.model.image_knobs]
    else:
        from vlmexp.data.run_data import config_sources, data_request
        from vlmexp.data.sources import locate

        train, val = config_sources(cfg)
        sources = [*train, *val]
        parts = [data_request(cfg, sources),
                 [hub_commit(s.json_path, s.revision) for s in sources if locate(s.json_path).kind == "hub"]]
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def hub_commit(json_path: str, revision: str | None) -> str:
    """The commit a Hub dataset id (`org/name` or `org/name@split`) resolves to now."""
    from huggingface_hub import HfApi

    return HfApi().dataset_info(json_path.split("@")[0], revision=revision).sha or ""
