"""Turn a config's `data` section into sampled train.jsonl / val.jsonl under <output_dir>/data."""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
from pathlib import Path

from vlmexp.config import Config, DataSource
from vlmexp.data.sample import SampleResult, content_sha256, sample_sources
from vlmexp.data.sources import load_data_yaml, resolve_relative, sha256_file
from vlmexp.files import atomic_write


@dataclass(frozen=True)
class PreparedData:
    train: Path
    val: Path | None
    manifest_sha256: str  # changes when the sampled data changes; not when the data or the checkout moves


def config_sources(cfg: Config) -> tuple[list[DataSource], list[DataSource]]:
    """(train sources, val sources) named by the config; the demo dataset is generated on first use."""
    d = cfg.data
    cwd = Path.cwd()
    if d.demo is not None:
        from vlmexp.data.demo import make_demo_data

        folder = Path(cfg.run.output_dir) / d.demo.folder_name()
        if not (folder / "train.yaml").is_file():
            make_demo_data(folder, d.demo.train, d.demo.val, d.demo.seed, d.demo.scenes())
        train = load_data_yaml(folder / "train.yaml")
        default_val = load_data_yaml(folder / "val.yaml")
    else:
        train = load_data_yaml(d.data_yaml) if d.data_yaml else [resolve_relative(s, cwd) for s in d.datasets or []]
        default_val = []
    if d.val_datasets is not None:
        val = [resolve_relative(s, cwd) for s in d.val_datasets]
    elif d.val_data_yaml:
        val = load_data_yaml(d.val_data_yaml)
    else:
        val = [] if d.val_fraction else default_val
    return train, val


def prepare_data(cfg: Config) -> PreparedData:
    """Sample train and validation data for a run; with `val_fraction`, hold out a seeded share."""
    out = Path(cfg.run.output_dir) / "data"
    train_src, val_src = config_sources(cfg)
    seed = cfg.run.seed
    train = sample_sources(train_src, out / "train.jsonl", seed)
    val = sample_sources(val_src, out / "val.jsonl", seed) if val_src else None
    if cfg.data.val_fraction:
        train, val = split_holdout(train, cfg.data.val_fraction, seed)
    digest = ":".join(portable_manifest_sha256(r.manifest_path) for r in (train, val) if r is not None)
    return PreparedData(train.path, val.path if val else None, hashlib.sha256(digest.encode()).hexdigest())


LOCAL_SOURCE_FIELDS = ("json_path", "image_root")  # where the data lives, not what it is


def portable_manifest_sha256(manifest_path: Path) -> str:
    """The hash of a manifest without the paths in it: the same data sampled anywhere gives the same hash."""
    manifest = json.loads(Path(manifest_path).read_text())
    manifest.pop("records_sha256", None)  # the file holds absolute image paths; content_sha256 does not
    manifest["sources"] = [{k: v for k, v in s.items() if k not in LOCAL_SOURCE_FIELDS} for s in manifest["sources"]]
    return hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()


def split_holdout(result: SampleResult, fraction: float, seed: int) -> tuple[SampleResult, SampleResult]:
    """Move a seeded `fraction` of the sampled rows (at least one) into a validation file."""
    lines = result.path.read_text().splitlines(keepends=True)
    if len(lines) < 2:
        raise ValueError(f"data.val_fraction needs at least 2 sampled rows, got {len(lines)}")
    n_val = min(len(lines) - 1, max(1, round(len(lines) * fraction)))
    held = set(random.Random(f"{seed}:holdout").sample(range(len(lines)), n_val))
    val_path = result.path.with_name("val.jsonl")
    atomic_write(val_path, "".join(line for i, line in enumerate(lines) if i in held))
    atomic_write(result.path, "".join(line for i, line in enumerate(lines) if i not in held))
    results = []
    for path, rows in ((result.path, len(lines) - n_val), (val_path, n_val)):
        manifest = json.loads(result.manifest_path.read_text())
        content = content_sha256([json.loads(line) for line in path.read_text().splitlines()])
        manifest.update(rows=rows, records_sha256=sha256_file(path), content_sha256=content,
                        holdout={"fraction": fraction, "split": path.stem})
        mpath = path.with_name(path.stem + ".manifest.json")
        atomic_write(mpath, json.dumps(manifest, indent=2) + "\n")
        results.append(SampleResult(path, mpath, result.sources, seed, manifest["records_sha256"], rows, content))
    return results[0], results[1]
