"""Pictures of records with boxes (vlmexp.pictures): logged to a real MLflow store by the evaluation report,
read back through MlflowClient, and checked pixel by pixel: each box's colour lies on its edges at the
coordinates of the box in original pixels, whatever frame the family answers in."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import make_png, write_jsonl
from PIL import Image

from vlmexp.coords import to_frame

WIDTH, HEIGHT = 1000, 500
TRUTH = [100, 50, 300, 250]
# original pixels
ANSWERS = {"base": [600, 300, 900, 450], "sft": [80, 40, 360, 300], "grpo": [420, 60, 560, 200]}
# 1000x500 -> 448x224 for 2.5
BUDGETS = {"qwen2_vl": {}, "qwen2_5_vl": {"max_pixels": 102400}, "internvl": {}}


def _family(name: str):
    from vlmexp.families import get_family

    family = get_family(name)
    return family, family.released_budget(BUDGETS[name])


def _records(tmp_path: Path, rows: list[dict]):
    from vlmexp.evaluate import read_predictions

    return read_predictions(write_jsonl(tmp_path / "p.jsonl", [{**r, "completion": ""} for r in rows]))[0]


def _answer(box, family, budget) -> str:
    framed = to_frame(box, WIDTH, HEIGHT, family.box_frame, budget)
    return f"<think>x</think><answer>[{', '.join(f'{v:.1f}' for v in framed)}]</answer>"


def _evaluations(tmp_path: Path, records, completions: dict[str, list[str]], family, budget):
    """Each model's Evaluation, its samples.jsonl written by score_records as `vlmexp.evaluate.evaluate`
    writes it."""
    from vlmexp.results import Evaluation
    from vlmexp.scoring import score_records

    out = []
    for name, texts in completions.items():
        metrics, rows = score_records(records, texts, family.box_frame, budget)
        samples = write_jsonl(tmp_path / name / "samples.jsonl", rows)
        out.append(Evaluation(name=name, model=str(tmp_path / name), metrics=metrics, samples=str(samples),
                              key="k", seconds=1.0))
    return out


def _logged(tmp_path: Path, store, evaluations, pictures: int = 16):
    """(client, eval run id, parent run id) after the evaluation report logged to a fresh sqlite store
    (conftest's `mlflow_store`)."""
    from mlflow.tracking import MlflowClient

    from vlmexp.checks.loader import load_config
    from vlmexp.pipeline.report import log_evaluation_run
    from vlmexp.tracking.tracker import make_tracker

    cfg = load_config(Path(__file__).parents[1] / "configs/demo.yaml",
                      [f"run.output_dir={store(tmp_path / 'run')}"],
                      check_paths=False)
    tracker = make_tracker(cfg)
    parent = tracker.start_pipeline("demo-pipeline", {}, {})
    log_evaluation_run(tracker, parent, evaluations, [], None, None, pictures,
                       tmp_path / "run" / "eval" / "pictures")
    client = MlflowClient(tracker.uri)
    [ev] = [r for r in client.search_runs([tracker.experiment_id]) if r.info.run_name == "eval"]
    return client, ev.info.run_id, parent


def _download(client, run_id: str, path: str, dest: Path) -> Image.Image:
    return Image.open(client.download_artifacts(run_id, path, str(dest))).convert("RGB")


def _on_edges(picture: Image.Image, box, scale: float, colour) -> None:
    """`colour` on the middle of each of the box's four edges (the edge drawn 3 pixels wide, inward)."""
    x1, y1, x2, y2 = (v * scale for v in box)
    mx, my = int((x1 + x2) / 2), int((y1 + y2) / 2)
    points = {"left": (int(x1) + 1, my), "right": (int(x2) - 2, my), "top": (mx, int(y1) + 1),
              "bottom": (mx, int(y2) - 2)}
    for edge, xy in points.items():
        assert picture.getpixel(xy) == colour, (edge, xy, picture.getpixel(xy), colour)
    inside = (int(x1) + 8, int(y1) + 8)
    assert picture.getpixel(inside) != colour, ("inside", inside)


@pytest.mark.parametrize("family_name", ["qwen2_vl", "qwen2_5_vl", "internvl"])
def test_evaluation_pictures_put_each_box_on_its_original_pixels(tmp_path, mlflow_store, family_name):
    from vlmexp.pictures import COLOURS, MAX_SIDE, PANEL

    family, budget = _family(family_name)
    make_png(tmp_path / "wide.png", size=(WIDTH, HEIGHT), color="white")
    make_png(tmp_path / "small.png", size=(200, 100), color="white")
    rec = {"image": "wide.png", "problem": "the box", "solution": TRUTH, "task": "rec"}
    records = _records(tmp_path, [rec, {**rec, "image": "small.png", "solution": [10, 10, 50, 50]}])
    completions = {name: [_answer(box, family, budget), "<think>x</think><answer>no box</answer>"]
                   for name, box in ANSWERS.items()}
    evaluations = _evaluations(tmp_path, records, completions, family, budget)
    client, run_id, parent = _logged(tmp_path, mlflow_store, evaluations)

    files = {a.path: a.file_size for a in client.list_artifacts(run_id, "evaluation/pictures")}
    assert set(files) == {"evaluation/pictures/record_000.png", "evaluation/pictures/record_001.png",
                          "evaluation/pictures/grid.png"}
    assert "evaluation/grid.png" in [a.path for a in client.list_artifacts(parent, "evaluation")]
    picture = _download(client, run_id, "evaluation/pictures/record_000.png", tmp_path / "dl")
    side = MAX_SIDE - PANEL
    assert picture.size == (side + PANEL, side * HEIGHT // WIDTH) and max(picture.size) <= MAX_SIDE
    scale = side / WIDTH
    _on_edges(picture, TRUTH, scale, COLOURS["truth"][1])
    for name, box in ANSWERS.items():
        _on_edges(picture, box, scale, COLOURS[name][1])
    # the legend beside the image: each model's line in its colour
    panel = picture.crop((side, 0, side + PANEL, picture.height))
    for name in ("truth", *ANSWERS):
        assert COLOURS[name][1] in {c for _, c in panel.getcolors(1 << 16)}, name

    grid = _download(client, run_id, "evaluation/pictures/grid.png", tmp_path / "dl")
    assert max(grid.size) <= MAX_SIDE
    rows = [json.loads(x) for x in Path(tmp_path / "sft" / "samples.jsonl").read_text().splitlines()]
    assert rows[0]["truth"] == [{"box": [float(v) for v in TRUTH], "label": ""}]
    # read back to original pixels
    assert rows[0]["boxes"][0]["box"] == pytest.approx(ANSWERS["sft"], abs=0.2)
    assert rows[1]["boxes"] == [] and rows[1]["score"] == 0.0


def test_detection_pictures_draw_every_box_and_text_tasks_their_answers(tmp_path, mlflow_store):
    from vlmexp.pictures import COLOURS, MAX_SIDE, PANEL

    family, budget = _family("qwen2_vl")
    make_png(tmp_path / "wide.png", size=(WIDTH, HEIGHT), color="white")
    gold = [{"bbox_2d": [100, 100, 300, 300], "label": "cat"},
            {"bbox_2d": [500, 200, 900, 450], "label": "dog"}]
    said = [{"bbox_2d": to_frame(o["bbox_2d"], WIDTH, HEIGHT, "grid1000"), "label": o["label"]} for o in
            ({"bbox_2d": [120, 90, 320, 280], "label": "cat"},
             {"bbox_2d": [540, 240, 860, 420], "label": "dog"})]
    det = {"image": "wide.png", "problem": "find them", "task": "detection", "accu_reward_method": "od_ap",
           "solution": f"<answer>```json {json.dumps(gold)}```</answer>"}
    math = {"image": "wide.png", "problem": "2 + 2?", "solution": "4", "task": "math"}
    records = _records(tmp_path, [det, math])
    texts = {"grpo": [f"<think>x</think><answer>```json {json.dumps(said)}```</answer>",
                      "<think>x</think><answer>5</answer>"]}
    evaluations = _evaluations(tmp_path, records, texts, family, budget)
    client, run_id, _ = _logged(tmp_path, mlflow_store, evaluations)

    side = MAX_SIDE - PANEL
    picture = _download(client, run_id, "evaluation/pictures/record_000.png", tmp_path / "dl")
    for item in gold:
        _on_edges(picture, item["bbox_2d"], side / WIDTH, COLOURS["truth"][1])
    for item in ({"bbox_2d": [120, 90, 320, 280]}, {"bbox_2d": [540, 240, 860, 420]}):
        _on_edges(picture, item["bbox_2d"], side / WIDTH, COLOURS["grpo"][1])
    text = _download(client, run_id, "evaluation/pictures/record_001.png", tmp_path / "dl")
    image_part = text.crop((0, 0, side, text.height))
    assert image_part.getcolors(4) == [(side * text.height, (255, 255, 255))]  # no box drawn on a math record
    panel = {c for _, c in text.crop((side, 0, side + PANEL, text.height)).getcolors(1 << 16)}
    assert COLOURS["grpo"][1] in panel and (0, 0, 0) in panel  # the verdict in the model's colour, the answer


def test_no_pictures_when_switched_off(tmp_path, mlflow_store):
    family, budget = _family("qwen2_vl")
    make_png(tmp_path / "wide.png", size=(WIDTH, HEIGHT))
    records = _records(tmp_path, [{"image": "wide.png", "problem": "p", "solution": TRUTH, "task": "rec"}])
    evaluations = _evaluations(tmp_path, records, {"grpo": [_answer(TRUTH, family, budget)]}, family, budget)
    client, run_id, _ = _logged(tmp_path, mlflow_store, evaluations, pictures=0)
    assert client.list_artifacts(run_id, "evaluation/pictures") == []


@pytest.mark.slow
def test_grpo_completion_table_carries_each_drawn_completion(tmp_path, run_inputs):
    """`vlmexp train grpo` into a sqlite store, a completion table every step: the table's `image` column
    holds pictures MLflow's table view shows (PNG artifacts), each the record's image with its ground-truth
    box green, its reward and advantage beside the path, solution, task and sizes of the record."""
    import os
    import subprocess
    import sys

    from conftest import SMALL_BATCHES
    from mlflow.tracking import MlflowClient

    from vlmexp.pictures import COLOURS, MAX_SIDE

    model = run_inputs(tmp_path / "out")  # the shared tiny model, and an empty store as out/mlflow.db
    repo, store = Path(__file__).parents[1], f"sqlite:///{tmp_path / 'out' / 'mlflow.db'}"
    r = subprocess.run([sys.executable, "-m", "vlmexp.cli", "train", "grpo", "--config", "configs/demo.yaml",
                        f"run.output_dir={tmp_path / 'out'}", *model, "data.demo.train=16", "data.demo.val=4",
                        *SMALL_BATCHES, "grpo.args.max_steps=2", "grpo.args.save_steps=100",
                        "grpo.args.logging_steps=1", "grpo.args.per_device_train_batch_size=4",
                        "grpo.args.num_generations=4", "grpo.args.max_completion_length=8",
                        f"tracking.tracking_uri={store}", "tracking.completions_every=1",
                        "tracking.completions_per_table=3"],
                       capture_output=True, text=True, cwd=repo, env={**os.environ, "PYTHONPATH": str(repo)})
    assert r.returncode == 0, r.stderr[-3000:]
    client = MlflowClient(store)
    [run] = client.search_runs([client.get_experiment_by_name("demo").experiment_id])
    table = json.loads(Path(client.download_artifacts(run.info.run_id, "completions/step_000002.json",
                                                      str(tmp_path / "dl"))).read_text())
    rows = [dict(zip(table["columns"], row, strict=True)) for row in table["data"]]
    assert len(rows) == 3
    for row in rows:
        assert (row["image"]["type"] == "image" and row["task"] == "rec"
                and isinstance(row["advantage"], float))
        assert row["reward"] == pytest.approx(0.25 * row["reward/format"] + row["reward/iou"])
        picture = Image.open(client.download_artifacts(run.info.run_id, row["image"]["filepath"],
                                                       str(tmp_path / "dl"))).convert("RGB")
        width, height = row["image_sizes"][0]
        scale = 256 / max(width, height)
        assert (picture.size == (round(width * scale), round(height * scale) + 18)
                and max(picture.size) <= MAX_SIDE)
        x1, y1, _, y2 = (v * scale for v in json.loads(row["solution"]))
        assert picture.getpixel((int(x1) + 1, int((y1 + y2) / 2))) == COLOURS["truth"][1]
        assert Path(row["image_path"]).is_file()
