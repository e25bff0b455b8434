"""Nothing of the user's is ever deleted: vlmexp replaces or clears only folders it made, and refuses any
other before loading a model (exit 2, naming the folder and the fix)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vlmexp.files import new_folder
from vlmexp.paths import check_replaceable_folder

REPO = Path(__file__).resolve().parents[1]


def _snapshot(root: Path) -> dict[str, str]:
    """Every file under `root` (symlinks not followed) with the sha256 of its bytes."""
    out = {}
    for path in sorted(root.rglob("*")):
        if path.is_file() and not path.is_symlink():
            out[str(path.relative_to(root))] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def _user_world(root: Path) -> Path:
    """A user's home-like folder: notes, a hidden-only folder, data with images, a link to the notes."""
    (root / "notes" / "sub").mkdir(parents=True)
    (root / "notes" / "todo.txt").write_text("my plans")
    (root / "notes" / "sub" / "idea.md").write_text("keep this")
    (root / "hidden").mkdir()
    (root / "hidden" / ".secret").write_text("dotfile")
    (root / "data" / "images").mkdir(parents=True)
    (root / "data" / "images" / "x.png").write_bytes(b"\x89PNG not really")
    (root / "data" / "train.json").write_text("[]")
    (root / "empty").mkdir()
    os.symlink(root / "notes", root / "link")
    return root


def _vlmexp(*args, cwd: Path, home: Path):
    """The `vlmexp` command in a process of its own, from `cwd`, with `home` as HOME."""
    env = {**os.environ, "HOME": str(home)}
    return subprocess.run([sys.executable, "-m", "vlmexp.cli", *map(str, args)], capture_output=True,
                          text=True, cwd=cwd, env=env, timeout=300)


@pytest.mark.parametrize("out", [".", "notes", "link", "hidden", "data", "data/images", "..", "~"])
def test_export_refuses_a_folder_of_the_users_and_leaves_it_byte_identical(tmp_path, tiny_models, out,
                                                                          vlmexp_main):
    user = _user_world(tmp_path / "home")
    config = user / "c.yaml"
    config.write_text(f"run:\n  output_dir: {tmp_path / 'run'}\nmodel:\n  path: {tiny_models['qwen2_5_vl']}\n"
                      "tracking:\n  backend: none\ndata:\n  datasets:\n"
                      f"    - {{json_path: {user / 'data/train.json'}, "
                      f"image_root: {user / 'data/images'}}}\n")
    before = _snapshot(user)
    rc, stdout, stderr = vlmexp_main("export", tiny_models["qwen2_5_vl"], "--config", config, "--out", out,
                                     cwd=user / "notes" if out == ".." else user, HOME=user)
    assert rc == 2, (stdout, stderr)
    assert "--out" in stderr and ("choose" in stderr) and "Traceback" not in stderr, stderr
    assert _snapshot(user) == before


def test_export_into_an_empty_or_new_folder_and_again_into_its_own(tmp_path, tiny_models, vlmexp_main):
    """The first export runs the command line in a process of its own (its exit status is the process's), the
    two after it the command's `main` in this one."""
    user = _user_world(tmp_path / "home")
    config = user / "c.yaml"
    config.write_text(f"run:\n  output_dir: {tmp_path / 'run'}\nmodel:\n  path: {tiny_models['qwen2_5_vl']}\n"
                      "tracking:\n  backend: none\ndata:\n  demo: {train: 4, val: 2}\n")
    before = _snapshot(user)
    r = _vlmexp("export", tiny_models["qwen2_5_vl"], "--config", config, "--out", "empty", cwd=user,
                home=tmp_path)
    assert r.returncode == 0, r.stderr
    assert (user / "empty" / "manifest.json").is_file()
    for out in ("models/new", "models/new"):  # the second replaces the folder the first made
        rc, _, stderr = vlmexp_main("export", tiny_models["qwen2_5_vl"], "--config", config, "--out", out,
                                    cwd=user, HOME=tmp_path)
        assert rc == 0, stderr
        assert (user / out / "manifest.json").is_file()
    assert {k: v for k, v in _snapshot(user).items() if k.split("/")[0] not in ("empty", "models")} == before


def test_a_stage_folder_of_the_users_is_refused_before_any_work(tmp_path, tiny_models, vlmexp_main):
    out = tmp_path / "out"
    (out / "sft").mkdir(parents=True)
    (out / "sft" / "mine.txt").write_text("not vlmexp's")
    config = tmp_path / "c.yaml"
    config.write_text(f"run:\n  output_dir: {out}\nmodel:\n  path: {tiny_models['qwen2_5_vl']}\n"
                      "tracking:\n  backend: none\ndata:\n  demo: {train: 4, val: 2}\ngrpo:\n"
                      "  enabled: false\n")
    rc, _, stderr = vlmexp_main("validate", config, cwd=tmp_path, HOME=tmp_path)
    assert rc == 2 and f"{out / 'sft'} holds files that no vlmexp stage wrote" in stderr, stderr
    assert (out / "sft" / "mine.txt").read_text() == "not vlmexp's"


NAMES = st.sampled_from([".", "..", "notes", "notes/sub", "link", "link/sub", "hidden", "empty", "data",
                         "data/images", "fresh", "fresh/deeper", "~", "."])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(parts=st.lists(NAMES, min_size=1, max_size=3))
def test_any_output_path_leaves_the_users_files_as_they_were(tmp_path_factory, parts):
    """Whatever path an output argument names, checking it and then replacing it as export does never
    changes a file of the user's: either the check refuses, or the folder was empty, new or vlmexp's."""
    root = tmp_path_factory.mktemp("world")
    user = _user_world(root / "home")
    protected = {"the data source": user / "data" / "train.json", "the image root": user / "data" / "images"}
    before = _snapshot(user)
    cwd = os.getcwd()
    old_home = os.environ.get("HOME")
    os.chdir(user)
    os.environ["HOME"] = str(user)
    try:
        target = Path(os.path.expanduser("/".join(parts)))
        if (check_replaceable_folder(target, protected) is None
                and not (target.exists() and not target.is_dir())):
            with new_folder(target, replace=True) as tmp:
                (tmp / "model.bin").write_bytes(b"weights")
    finally:
        os.chdir(cwd)
        if old_home is not None:
            os.environ["HOME"] = old_home
    after = _snapshot(user)
    assert all(after.get(name) == digest for name, digest in before.items()), (parts, before, after)
