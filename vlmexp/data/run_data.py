"""Turn a config's `data` section into sampled train.jsonl / val.jsonl under <output_dir>/data."""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
from pathlib import Path

from vlmexp.config.schema import Config, DataSource
from vlmexp.data.record import SCHEMA_VERSION, content_sha256, read_sampled
from vlmexp.data.sampling import SampleResult, sample_sources
from vlmexp.data.sources import glob_paths, load_data_yaml, locate, resolve_relative, sha256_file
from vlmexp.files import atomic_write


@dataclass(frozen=True)
class PreparedData:
    train: Path
    val: Path | None
    content_sha256: str  # the sampled records' content digest (train's, with val's when there is one):
    # changes when the sampled data changes, not when the data or the checkout moves


def config_sources(cfg: Config) -> tuple[list[DataSource], list[DataSource]]:
    """(train sources, val sources) named by the config; the demo dataset is generated on first use."""
    d = cfg.data
    cwd = Path.cwd()
    if d.demo is not None:
        from vlmexp.data.demo import annotator_of, demo_folder_name, make_demo_data, scenes_of

        folder = Path(cfg.run.output_dir) / demo_folder_name(d.demo)
        if not (folder / "train.yaml").is_file():
            make_demo_data(folder, d.demo.train, d.demo.val, d.demo.seed, scenes_of(d.demo),
                           annotator_of(d.demo))
        train = load_data_yaml(folder / "train.yaml")
        default_val = load_data_yaml(folder / "val.yaml")
    elif d.zoom_demo is not None:
        train, default_val = _zoom_demo_sources(cfg)
    else:
        train = (load_data_yaml(d.data_yaml) if d.data_yaml
                 else [resolve_relative(s, cwd) for s in d.datasets or []])
        default_val = []
    if d.val_datasets is not None:
        val = [resolve_relative(s, cwd) for s in d.val_datasets]
    elif d.val_data_yaml:
        val = load_data_yaml(d.val_data_yaml)
    else:
        val = [] if d.val_fraction else default_val
    return train, val


def _zoom_demo_sources(cfg: Config) -> tuple[list[DataSource], list[DataSource]]:
    """The zoom dataset's (train, val) sources, generated on first use in the model's box frame."""
    from vlmexp.data.zoom_demo import box_frame_of, make_zoom_demo_data, scenes_of, zoom_folder_name

    demo, frame = cfg.data.zoom_demo, box_frame_of(cfg)
    folder = Path(cfg.run.output_dir) / zoom_folder_name(demo, frame)
    if not (folder / "train.yaml").is_file():
        make_zoom_demo_data(folder, frame, demo.train, demo.val, demo.seed, scenes_of(demo))
    return load_data_yaml(folder / "train.yaml"), load_data_yaml(folder / "val.yaml")


# beside the sampled files: the request (`data_request`) they were sampled for
REQUEST_NAME = "sampled_for.json"


def prepare_data(cfg: Config, reuse: bool = False) -> PreparedData:
    """Sample train and validation data for a run; with `val_fraction`, hold out a seeded share.

    `reuse`: keep the files already in <output_dir>/data when they were sampled for the same request (data
    section, seed, and the sources' files unchanged) and still hold what their manifests record; a stage
    process calls it so, the pipeline's sample task samples afresh."""
    out = Path(cfg.run.output_dir) / "data"
    train_src, val_src = config_sources(cfg)
    request = data_request(cfg, [*train_src, *val_src])
    held_out = bool(val_src) or bool(cfg.data.val_fraction)
    if reuse and (found := _sampled_for(out, request, held_out)) is not None:
        return found
    seed, judged = cfg.run.seed, any(r.name == "judge" for r in cfg.grpo.rewards)
    train = sample_sources(train_src, out / "train.jsonl", seed, judged)
    val = sample_sources(val_src, out / "val.jsonl", seed, judged) if val_src else None
    if cfg.data.val_fraction:
        train, val = split_holdout(train, cfg.data.val_fraction, seed)
    atomic_write(out / REQUEST_NAME, json.dumps({"request": request}) + "\n")
    return _prepared(train.path, val.path if val else None)


def _prepared(train: Path, val: Path | None) -> PreparedData:
    """The run's sampled files and their content digest: each manifest's `content_sha256` (the one digest of
    sampled data, vlmexp.data.record), train's alone or train's and val's together."""
    digests = [json.loads(p.with_name(p.stem + ".manifest.json").read_text())["content_sha256"]
               for p in (train, val) if p is not None]
    digest = digests[0] if len(digests) == 1 else hashlib.sha256(":".join(digests).encode()).hexdigest()
    return PreparedData(train, val, digest)


def data_request(cfg: Config, sources: list[DataSource]) -> str:
    """What sampling reads, as a digest: the sampled-record schema, the data section, the seed, and each local
    source file's path, size and modification time (a Hub source by its name; images are not looked at)."""
    files = []
    for src in sources:
        loc = locate(src.json_path)
        p = Path(loc.path).expanduser()
        found = [p] if p.is_file() else sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else \
            [Path(x) for x in glob_paths(loc.path)] if loc.kind == "shards" else []
        files += [(str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in found]
    parts = [SCHEMA_VERSION, cfg.data.model_dump(mode="json"), cfg.run.seed,
             [s.model_dump(mode="json") for s in sources], files]
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def _sampled_for(out: Path, request: str, held_out: bool) -> PreparedData | None:
    """The sampled data in `out` when it was sampled for `request` and each file matches its manifest."""
    try:
        if json.loads((out / REQUEST_NAME).read_text())["request"] != request:
            return None
        paths = [out / "train.jsonl", *([out / "val.jsonl"] if held_out else [])]
        for path in paths:
            manifest = json.loads(path.with_name(path.stem + ".manifest.json").read_text())
            if sha256_file(path) != manifest["records_sha256"]:
                return None
    except (OSError, ValueError, KeyError):
        return None
    return _prepared(paths[0], paths[1] if held_out else None)


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
        content = content_sha256(read_sampled(path))
        manifest.update(rows=rows, records_sha256=sha256_file(path), content_sha256=content,
                        holdout={"fraction": fraction, "split": path.stem})
        mpath = path.with_name(path.stem + ".manifest.json")
        atomic_write(mpath, json.dumps(manifest, indent=2) + "\n")
        results.append(SampleResult(path, mpath, result.sources, seed, manifest["records_sha256"], rows,
                                    content))
    return results[0], results[1]


def sampled_manifests(cfg: Config) -> dict[str, Path]:
    """The manifests of the run's sampled files by what they are for: "training" and, when there is held-out
    data, "evaluation" (MLflow's dataset contexts)."""
    folder = Path(cfg.run.output_dir) / "data"
    found = {"training": folder / "train.manifest.json", "evaluation": folder / "val.manifest.json"}
    return {context: path for context, path in found.items() if path.is_file()}
