"""A partial-credit reward for training tests: a random tiny model scores 0 on IoU, so groups would
have zero variance and zero gradient; this one varies with the completion, so GRPO has signal."""

from vlmexp.rewards import completion_text


def char_variety(prompts, completions, **kwargs):
    """Distinct characters in the completion, scaled to about [0, 1]."""
    return [len(set(completion_text(c))) / 20 for c in completions]


def one_second_a_call(prompts=None, completions=(), **kwargs):
    """Scores 0 after sleeping one second: a run paced so that it lasts a known time on any machine."""
    import time

    time.sleep(1.0)
    return [0.0 for _ in completions]


def fail_once(prompts=None, completions=(), **kwargs):
    """Raises on its second call in the first process that finds no marker file (a stage that fails once)."""
    import os
    from pathlib import Path

    marker = Path(os.environ["VLMEXP_TEST_FAIL_MARKER"])
    fail_once.calls = getattr(fail_once, "calls", 0) + 1
    if fail_once.calls == 2 and not marker.exists():
        marker.write_text("failed once\n")
        raise RuntimeError("planted failure")
    return [0.0 for _ in completions]


def sometimes_broken(prompts, completions, **kwargs):
    """char_variety, except every 4th sample is NaN, inf or None, in turn across calls (a reward with
    holes)."""
    holes = (float("nan"), float("inf"), None)
    sometimes_broken.calls = getattr(sometimes_broken, "calls", -1) + 1
    return [holes[(sometimes_broken.calls + i // 4) % 3] if i % 4 == 0 else len(set(completion_text(c))) / 20
            for i, c in enumerate(completions)]


def record_check(prompts, completions, source_row, image_sizes, solution, **kwargs):
    """1.0 where the sample's prompt image, text, image size and solution are all its record's (looked up by
    `source_row` in `record_check.records`, set by the test), else 0.0 with the sample noted in
    `.mismatches`."""
    import json

    import numpy as np
    from PIL import Image

    scores = []
    for prompt, row, sizes, sol in zip(prompts, source_row, image_sizes, solution, strict=True):
        record = record_check.records[row]
        images = [p["image"] for m in prompt if isinstance(m["content"], list) for p in m["content"]
                  if p["type"] == "image"]
        with Image.open(record.images[0]) as im:
            own = np.asarray(im.convert("RGB"))
        ok = (len(images) == 1 and np.array_equal(np.asarray(images[0]), own) and sizes == record.image_sizes
              and record.problem in prompt[-1]["content"][-1]["text"] and json.loads(sol) == record.solution)
        if not ok:
            record_check.mismatches.append(row)
        scores.append(float(ok))
    record_check.seen += len(scores)
    return scores


def odd_rows_vary(prompts, completions, source_row, **kwargs):
    """No signal for records of even `source_row` (0.5 for every completion), a sure one for odd rows: 0, 1,
    0, 1 along the call (a group's completions are consecutive, in GRPO and in DPO-style sampling alike)."""
    return [float(i % 2) if row % 2 else 0.5 for i, row in enumerate(source_row)]


TRL_ARGUMENTS = ("prompts", "completions", "completion_ids", "trainer_state", "log_metric", "log_extra",
                 "images")


def columns_seen(prompts, completions, **kwargs):
    """Appends each sample's keyword columns (all but TRL's arguments and the images) as a JSON line to the
    file named by VLMEXP_TEST_COLUMNS_FILE; scores 1.0 where the sample received a source column other than
    vlmexp's own (REWARD_COLUMNS) that is not None, else 0.0."""
    import json
    import os

    from vlmexp.data.record import REWARD_COLUMNS

    columns = {k: v for k, v in kwargs.items() if k not in TRL_ARGUMENTS}
    rows = [{k: v[i] for k, v in columns.items()} for i in range(len(completions))]
    with open(os.environ["VLMEXP_TEST_COLUMNS_FILE"], "a") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    return [float(any(v is not None for k, v in row.items() if k not in REWARD_COLUMNS)) for row in rows]


def band_by_row(prompts, completions, source_row, **kwargs):
    """A group's mean set by its record: source_row % 4 gives 0.05, 0.3, 0.55 or 0.8, each group with a spread
    (0 and 0.1 along the call, whose groups are consecutive), so every group has signal and a known mean."""
    return [(row % 4) / 4 + 0.1 * (i % 2) for i, row in enumerate(source_row)]
