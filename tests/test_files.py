"""Files and folders are written whole or not at all (vlmexp.files)."""

from __future__ import annotations

import pytest

from vlmexp.files import MARKER, atomic_write, new_folder


def test_atomic_write_replaces_whole_and_leaves_the_old_file_when_it_fails(tmp_path):
    path = tmp_path / "sub" / "a.json"
    assert atomic_write(path, "one\n") == path and path.read_text() == "one\n"
    atomic_write(path, b"\x00two")
    assert path.read_bytes() == b"\x00two"
    with pytest.raises(UnicodeEncodeError):
        atomic_write(path, "\udcff")  # cannot be encoded: fails before anything is renamed
    assert path.read_bytes() == b"\x00two" and sorted(p.name for p in path.parent.iterdir()) == ["a.json"]


def test_new_folder_appears_complete_or_not_at_all(tmp_path):
    with new_folder(tmp_path / "out") as tmp:
        (tmp / "x.txt").write_text("x")
        assert not (tmp_path / "out").exists()
    assert (tmp_path / "out" / "x.txt").read_text() == "x" and [p.name for p in tmp_path.iterdir()] == ["out"]
    assert '"made_by": "vlmexp"' in (tmp_path / "out" / MARKER).read_text()  # marked as vlmexp's
    with pytest.raises(RuntimeError, match="interrupted"), new_folder(tmp_path / "other") as tmp:
        (tmp / "half.txt").write_text("half")
        raise RuntimeError("interrupted")
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no folder, no temporary left
    with pytest.raises(FileExistsError, match="exists and is not empty"), new_folder(tmp_path / "out"):
        pass
    (tmp_path / "empty").mkdir()
    with new_folder(tmp_path / "empty") as tmp:
        (tmp / "y").write_text("y")
    assert (tmp_path / "empty" / "y").is_file()


def test_new_folder_replace_swaps_the_old_folder_only_when_the_new_one_is_complete(tmp_path):
    with new_folder(tmp_path / "out") as tmp:
        (tmp / "old.txt").write_text("old")
    with pytest.raises(RuntimeError, match="interrupted"), new_folder(tmp_path / "out", replace=True) as tmp:
        (tmp / "new.txt").write_text("half")
        raise RuntimeError("interrupted")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [MARKER, "old.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    with new_folder(tmp_path / "out", replace=True) as tmp:
        (tmp / "new.txt").write_text("new")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [MARKER, "new.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_new_folder_never_replaces_a_folder_vlmexp_did_not_make(tmp_path):
    user = tmp_path / "mine"
    (user / "notes").mkdir(parents=True)
    (user / "todo.txt").write_text("keep")
    (user / "notes" / "a.md").write_text("keep too")
    with pytest.raises(FileExistsError, match=f"{user} holds files vlmexp did not make"):
        with new_folder(user, replace=True):
            raise AssertionError("the block must not run")  # refused before any work
    assert (user / "todo.txt").read_text() == "keep" and (user / "notes" / "a.md").read_text() == "keep too"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]  # no temporary left


def test_a_full_disk_names_the_file_the_save_was_writing_not_the_spool_written_after_it(tmp_path):
    """The stage's MLflow spool goes on appending after a save failed on a full disk: the file a full disk is
    said to have cut is the newest file outside it (the half-written checkpoint's)."""
    import os
    import time

    from vlmexp.disk import WRITTEN_ALL_ALONG, being_written
    from vlmexp.tracking.spool import SPOOL_DIR

    assert SPOOL_DIR in WRITTEN_ALL_ALONG
    weights = tmp_path / "grpo" / "checkpoint-8" / "optimizer.pt"
    records = tmp_path / "grpo" / SPOOL_DIR / "run" / "records.jsonl"
    for path in (weights, records):
        path.parent.mkdir(parents=True)
        path.write_text("x")
    os.utime(weights, (time.time() - 5, time.time() - 5))  # the spool written after the failed save
    assert being_written(RuntimeError("unexpected pos 1279616 vs 1279508"), tmp_path) == str(weights)
