"""Rewards computed by a model: a tiny sequence-classification reward model built offline, and a judge asked
over a real OpenAI-compatible HTTP server on 127.0.0.1 (tests/judge_server.py): scores, cost metrics,
unreadable answers counted, a judge that times out or is down stopped with a clear error, never a hang."""

from __future__ import annotations

import base64
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from judge_server import JudgeServer

from vlmexp.model_rewards.base import ModelRewardError
from vlmexp.model_rewards.judge import parse_score
from vlmexp.rewards import RewardError
from vlmexp.rewards_loader import build_reward

REPO = Path(__file__).resolve().parents[1]


class Hooks:
    def __init__(self):
        self.metrics: dict[str, list[float]] = {}
        self.extra: dict[str, list] = {}

    def log_metric(self, name, value):
        self.metrics.setdefault(name, []).append(value)

    def log_extra(self, column, values):
        self.extra.setdefault(column, []).extend(values)


def judge(server: JudgeServer, model: str = "grader", **kwargs):
    return build_reward("judge", {"model": model, "endpoint": server.url, "retries": 0, "timeout": 10,
                                  **kwargs},
                        "pixels", None)


def ask(reward, completions, solutions, hooks=None, **columns):
    prompts = [[{"role": "user", "content": f"question {i}"}] for i in range(len(completions))]
    extra = {"log_metric": hooks.log_metric, "log_extra": hooks.log_extra} if hooks else {}
    return reward(prompts=prompts, completions=[[{"role": "assistant", "content": c}] for c in completions],
                  solution=solutions, **columns, **extra)


def test_the_score_is_one_number_in_range_or_unreadable():
    assert (parse_score(" 7\n", 0, 10) == 7.0 and parse_score("0.5", 0, 1) == 0.5
            and parse_score("+.25", 0, 1) == 0.25)
    for reply, reason in [("7/10", "not_a_number"), ("Score: 7", "not_a_number"), ("", "not_a_number"),
                          ("seven", "not_a_number"), ("7 8", "not_a_number"), ("11", "out_of_range"),
                          ("-1", "out_of_range"), ("nan", "not_a_number")]:
        found = parse_score(reply, 0, 10)
        assert (found.reason, found.said) == (reason, reply), reply


def test_judge_scores_over_the_endpoint_with_its_cost():
    hooks = Hooks()
    with JudgeServer() as server:
        scores = ask(judge(server),
                     ["<think>x</think><answer>a cat</answer>", "<answer>dog</answer>", "", "abcdefg"],
                     ["<answer>a cat</answer>", "cat", "cat", "cat"], hooks, image_path=["", "", "", ""])
        bodies = [r["body"] for r in server.requests]
    # the grader's rule: 10 for the reference's words, else len(answer) % 10; mapped from [0, 10] to [0, 1]
    assert scores == [1.0, 0.3, 0.0, 0.7]
    assert len(bodies) == 3  # the empty answer gets the lowest score without a call
    # requests run concurrently
    [first] = [b for b in bodies if "Question: question 0" in b["messages"][-1]["content"]]
    assert "Reference answer: a cat\nAnswer to grade: a cat" in first["messages"][-1]["content"]
    assert first["model"] == "grader" and first["temperature"] == 0.0
    assert (hooks.metrics["rewards/judge/calls"] == [3.0]
            and 0 < hooks.metrics["rewards/judge/seconds"][0] < 10)
    assert hooks.metrics["rewards/judge/unparsable/not_a_number"] == [0.0]
    assert hooks.extra["judge/unparsable"] == [None] * 4


def test_judge_sends_the_image_and_the_key_it_is_told_and_never_shows_the_key(tmp_path, monkeypatch):
    from conftest import make_png

    image = make_png(tmp_path / "a.png")
    monkeypatch.setenv("JUDGE_TEST_KEY", "sk-secret-123")
    with JudgeServer() as server:
        reward = judge(server, images=True, api_key_env="JUDGE_TEST_KEY", normalise=False)
        assert ask(reward, ["<answer>cat</answer>"], ["cat"], image_path=[str(image)]) == [10.0]
        [request] = server.requests
    assert request["headers"]["Authorization"] == "Bearer sk-secret-123"
    [picture, text] = request["body"]["messages"][-1]["content"]
    assert picture["image_url"]["url"] == ("data:image/png;base64,"
                                           + base64.b64encode(image.read_bytes()).decode())
    assert text["type"] == "text" and "Answer to grade: cat" in text["text"]
    assert "sk-secret" not in repr(reward) and "sk-secret" not in repr(reward.fn)
    monkeypatch.delenv("JUDGE_TEST_KEY")
    with JudgeServer() as server, pytest.raises(ModelRewardError, match="JUDGE_TEST_KEY .* is not set"):
        ask(judge(server, api_key_env="JUDGE_TEST_KEY"), ["<answer>cat</answer>"], ["cat"])


def test_unreadable_answers_are_masked_and_counted_and_too_many_stop_quoting_the_judge():
    hooks = Hooks()
    with JudgeServer() as server:
        scores = ask(judge(server, "chatty", max_unparsable=1.0), ["a", "b"], ["x", "y"], hooks)
        assert scores == [None, None]  # masked, not 0
        assert hooks.metrics["rewards/judge/unparsable/not_a_number"] == [2.0]
        assert hooks.extra["judge/unparsable"] == ["not_a_number", "not_a_number"]
        with pytest.raises(RewardError) as caught:  # through the guarded wrapper, unchanged
            ask(judge(server, "chatty"), ["a", "b", "c"], ["x", "y", "z"])
    message = str(caught.value)
    assert isinstance(caught.value, ModelRewardError)
    assert ("3 of 3 answers" in message and "'I would give it 7 out of 10.'" in message
            and "max_unparsable" in message)


def test_a_judge_that_times_out_or_is_down_stops_with_a_clear_error_in_bounded_time():
    with JudgeServer() as server:
        start = time.monotonic()
        with pytest.raises(ModelRewardError,
                           match=r"did not answer within 0.3 s \(2 tries\).*raise kwargs.timeout"):
            ask(judge(server, "slow", timeout=0.3, retries=1, backoff=0.05), ["a"], ["x"])
        assert time.monotonic() - start < 3
    with socket.socket() as s:  # a port where nothing listens
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    down = build_reward("judge", {"model": "m", "endpoint": f"http://127.0.0.1:{port}/v1", "retries": 2,
                                  "backoff": 0.05, "timeout": 2}, "pixels", None)
    start = time.monotonic()
    with pytest.raises(ModelRewardError, match=rf"127.0.0.1:{port}/v1/chat/completions could not be reached "
                                               r"\(ConnectError.*\(3 tries\); start the server there"):
        ask(down, ["a"], ["x"])
    assert time.monotonic() - start < 3


def test_a_busy_endpoint_is_retried_with_backoff():
    hooks = Hooks()
    with JudgeServer() as server:
        assert ask(judge(server, "busy", retries=2, backoff=0.05), ["abc", "abcd"], ["x", "y"],
                   hooks) == [0.3, 0.4]
        assert len(server.requests) == 4
    assert hooks.metrics["rewards/judge/calls"] == [4.0]


def test_judge_with_records_llm_scores_only_vlm_r1_llm_records():
    with JudgeServer() as server:
        scores = ask(judge(server, records="llm"), ["abc", "abc"], ["x", "y"],
                     accu_reward_method=["llm", "default"])
    assert scores == [0.3, None]


def test_judge_and_reward_model_kwargs_are_checked_when_the_config_loads(tmp_path):
    from vlmexp.checks.loader import load_config
    from vlmexp.errors import ConfigError

    bad = ["grpo.rewards=[{name: judge, kwargs: {model: m, endpoint: 'ftp://x', prompt: '{question}', "
           "colour: 1}}, {name: judge, kwargs: {model: m, prompt: 'no answer here {question}'}}, "
           "{name: reward_model, kwargs: {normalise: tanh}}]"]
    with pytest.raises(ConfigError) as caught:
        load_config(REPO / "configs/demo.yaml", bad)
    text = str(caught.value)
    assert "unknown kwargs ['colour']; the judge reward takes model, endpoint" in text
    assert "prompt must contain {completion}" in text
    assert "path: give the reward model's folder; normalise 'tanh' is not one of none, sigmoid, batch" in text


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory) -> Path:
    from vlmexp.tiny import make_tiny_reward_model

    return make_tiny_reward_model(tmp_path_factory.mktemp("rm") / "model")


def test_reward_model_scores_as_trl_does_batched_in_eval_mode(reward_model):
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from vlmexp.model_rewards.reward_model import loaded

    prompts = [[{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Find the red square."}]] * 3
    completions = ["<answer>[1, 2, 3, 4]</answer>", "no idea", "a much longer answer with many words in it"]
    hooks = Hooks()
    reward = build_reward("reward_model", {"path": str(reward_model), "batch_size": 2}, "pixels", None)
    scores = reward(prompts=prompts, completions=[[{"role": "assistant", "content": c}] for c in completions],
                    log_metric=hooks.log_metric)
    # by hand, as TRL's GRPOTrainer scores with a model in reward_funcs: chat template, right padding,
    # first logit
    tokenizer = AutoTokenizer.from_pretrained(reward_model)
    model = AutoModelForSequenceClassification.from_pretrained(reward_model).eval()
    texts = [tokenizer.apply_chat_template([*p, {"role": "assistant", "content": c}], tokenize=False)
             for p, c in zip(prompts, completions)]
    inputs = tokenizer(texts, return_tensors="pt", padding=True, padding_side="right",
                       add_special_tokens=False)
    with torch.inference_mode():
        expected = model(**inputs).logits[:, 0].tolist()
    assert scores == pytest.approx(expected, abs=1e-5) and len(set(scores)) == 3
    assert hooks.metrics["rewards/reward_model/calls"] == [2.0]  # batches of 2
    one_by_one = build_reward("reward_model", {"path": str(reward_model), "batch_size": 1}, "pixels", None)
    assert one_by_one(prompts=prompts, completions=completions) == pytest.approx(scores, abs=1e-5)
    held, _, vision = loaded(str(reward_model), "auto", False)
    # once a process
    assert held is loaded(str(reward_model), "auto", False)[0] and not held.training and not vision
    squashed = build_reward("reward_model", {"path": str(reward_model), "normalise": "sigmoid"},
                            "pixels", None)
    assert all(0 < s < 1 for s in squashed(prompts=prompts, completions=completions))


def test_reward_model_folder_that_is_not_one_is_refused(tmp_path):
    reward = build_reward("reward_model", {"path": str(tmp_path)}, "pixels", None)
    with pytest.raises(ModelRewardError,
                       match="config.json not found; kwargs.path must be a sequence-classification"):
        reward(prompts=["q"], completions=["a"])


def llm_data(tmp_path: Path) -> Path:
    """VLM-R1 JSONL with one judged (`llm`) record and one exact one."""
    from conftest import make_png

    make_png(tmp_path / "a.png")
    rows = [{"image": "a.png", "conversations": [{"from": "human", "value": "<image>What is shown?"},
                                                 {"from": "gpt", "value": "a red card"}],
             "accu_reward_method": "llm"},
            {"image": "a.png", "conversations": [{"from": "human", "value": "<image>Which colour?"},
                                                 {"from": "gpt", "value": "red"}],
             "accu_reward_method": "default"}]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tmp_path / "d.jsonl"


def test_llm_records_are_kept_for_a_judge_and_scored_by_it(tmp_path):
    from vlmexp.data.record import read_sampled
    from vlmexp.rewards import ExactReward

    (tmp_path / "data.yaml").write_text(
        yaml.safe_dump({"datasets": [{"json_path": str(llm_data(tmp_path))}]}))
    run = subprocess.run([sys.executable, "-m", "vlmexp.cli", "sample", str(tmp_path / "data.yaml"),
                          "--judged", "--out", str(tmp_path / "s.jsonl")],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    llm, exact = read_sampled(tmp_path / "s.jsonl")
    assert (llm.task, llm.method, exact.method) == ("exact", "llm", "default")
    assert ExactReward()(completions=["a red card", "red"], solution=["a red card", "red"],
                         accu_reward_method=["llm", "default"]) == [None, 1.0]


def test_vlmexp_score_with_a_judge_from_the_config(tmp_path):
    data = llm_data(tmp_path)
    lines = [json.loads(line) for line in data.read_text().splitlines()]
    preds = tmp_path / "preds.jsonl"
    preds.write_text("".join(json.dumps({**r, "completion": c}) + "\n"
                             for r, c in zip(lines, ["<answer>a card</answer>", "<answer>red</answer>"])))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-m", "vlmexp.cli", "score", str(preds), "--family", "qwen2_5_vl"]
    refused = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert refused.returncode != 0 and "scored by a judge model" in refused.stderr + refused.stdout
    assert "pass --config with that judge" in refused.stderr + refused.stdout
    with JudgeServer() as server:
        config = tmp_path / "judge.yaml"
        config.write_text(yaml.safe_dump({
            "model": {"path": "tiny:qwen2_5_vl"}, "data": {"demo": {}},
            "grpo": {"rewards": [{"name": "exact"}, {"name": "judge", "kwargs": {"model": "grader",
                                                                                 "endpoint": server.url}}]}}))
        run = subprocess.run([*command, "--config", str(config), "--per-sample",
                              str(tmp_path / "rows.jsonl")],
                             capture_output=True, text=True, timeout=600, env=env)
        assert run.returncode == 0, run.stderr
        questions = [r["body"]["messages"][-1]["content"] for r in server.requests]
    metrics = json.loads(run.stdout)
    # the grader: "a card" is not the reference, len 6 -> 0.6; "red" is -> 1.0
    assert metrics["judge_score"] == pytest.approx(0.8) and metrics["judge_calls"] == 2
    assert metrics["judge_unparsable"] == 0
    # red: 1.0 from the exact reward; the llm record: 0.6
    assert metrics["exact_accuracy"] == pytest.approx(0.8)
    rows = [json.loads(line) for line in (tmp_path / "rows.jsonl").read_text().splitlines()]
    assert [r["score"] for r in rows] == [0.6, 1.0]
    assert any("Question: What is shown?" in q for q in questions)  # the prompt as training builds it


def _train(tmp_path: Path, run_inputs, stage: str, *overrides: str) -> subprocess.CompletedProcess:
    """`vlmexp train STAGE` on the demo config in a process of its own, logging to an MLflow store in
    tmp_path/out (the shared tiny model, and a copy of an empty store: conftest's `run_inputs`)."""
    model = run_inputs(tmp_path / "out")
    store = f"sqlite:///{tmp_path / 'out' / 'mlflow.db'}"
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "vlmexp.cli", "train", stage, "--config",
                           str(REPO / "configs/demo.yaml"), f"run.output_dir={tmp_path / 'out'}", *model,
                           "tracking.backend=mlflow", f"tracking.tracking_uri={store}",
                           "tracking.system_metrics=false", "data.demo.train=4", "data.demo.val=2",
                           *overrides],
                          capture_output=True, text=True, cwd=tmp_path, env=env, timeout=900)


def _run_metrics(tmp_path: Path, name: str):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'out' / 'mlflow.db'}")
    [run] = client.search_runs([client.get_experiment_by_name("demo").experiment_id],
                               f"attributes.run_name = '{name}'")
    return client, run


@pytest.mark.slow
def test_grpo_trains_on_a_reward_model_and_a_judge_endpoint_filter_and_validation_included(tmp_path,
                                                                                           reward_model,
                                                                                           run_inputs):
    """Two GRPO steps whose rewards are the tiny reward model and the judge over HTTP: the difficulty filter
    samples with them first, validation scores with them at step 2, and MLflow holds each reward's mean,
    seconds and calls."""
    with JudgeServer() as server:
        rewards = (f"grpo.rewards=[{{name: format, weight: 0.25}}, "
                   f"{{name: reward_model, kwargs: {{path: '{reward_model}', normalise: sigmoid}}}}, "
                   f"{{name: judge, kwargs: {{model: grader, endpoint: '{server.url}'}}}}]")
        run = _train(tmp_path, run_inputs, "grpo", rewards, "grpo.args.max_steps=2", "grpo.args.save_steps=2",
                     "grpo.args.logging_steps=1", "grpo.args.per_device_train_batch_size=4",
                     "grpo.args.num_generations=4", "grpo.args.max_completion_length=12",
                     "grpo.difficulty_filter.enabled=true", "grpo.difficulty_filter.num_samples=2",
                     "eval.every_steps=2", "eval.during_training_samples=2", "eval.max_new_tokens=8")
        asked = len(server.requests)
    assert run.returncode == 0, run.stderr[-3000:]
    filtered = json.loads((tmp_path / "out" / "grpo" / "difficulty.json").read_text())
    assert filtered["prompts"] == 4 and filtered["kept"] >= 1
    client, found = _run_metrics(tmp_path, "demo-grpo")
    metrics = found.data.metrics
    for name in ("judge", "reward_model"):
        steps = client.get_metric_history(found.info.run_id, f"rewards/{name}/mean")
        assert [m.step for m in steps] == [1, 2], name
        assert all(m.value > 0 for m in client.get_metric_history(found.info.run_id,
                                                                  f"rewards/{name}/seconds"))
        assert [m.value for m in client.get_metric_history(found.info.run_id,
                                                           f"rewards/{name}/calls")][0] >= 1
    assert 0 < metrics["rewards/reward_model/mean"] < 1  # sigmoid of the logits
    assert metrics["rewards/judge/unparsable/not_a_number"] == 0
    assert "val/judge_score" in metrics and "val/reward_model_score" in metrics
    # the filter (4 prompts x 2 samples), two steps of 4 completions and validation all asked the judge (empty
    # answers excepted), so it answered more than the steps' 8 completions
    assert asked > 8


@pytest.mark.slow
def test_dpo_pairs_from_samples_are_scored_by_the_judge(tmp_path, run_inputs):
    """DPO's own samples are scored with grpo.rewards: with the judge alone, each pair's scores are the
    grader's."""
    with JudgeServer() as server:
        run = _train(tmp_path, run_inputs, "dpo", "dpo.enabled=true", "dpo.pairs.from=samples",
                     "dpo.pairs.num_samples=3", "dpo.pairs.max_new_tokens=12", "dpo.pairs.min_margin=0.05",
                     "dpo.args.max_steps=1", "dpo.args.per_device_train_batch_size=2",
                     "dpo.args.save_steps=1",
                     f"grpo.rewards=[{{name: judge, kwargs: {{model: grader, endpoint: '{server.url}'}}}}]")
        assert server.requests
    assert run.returncode == 0, run.stderr[-3000:]
    from vlmexp.answers import extract_answer

    pairs = [json.loads(line) for line in (tmp_path / "out" / "dpo" / "pairs.jsonl").read_text().splitlines()]
    assert pairs
    for pair in pairs:
        for side in ("chosen", "rejected"):
            answer = (extract_answer(pair[side]) or pair[side]).strip()
            assert pair[f"{side}_score"] == pytest.approx(len(answer) % 10 / 10 if answer else 0.0), pair


@pytest.mark.slow
def test_a_local_judge_model_whose_answers_do_not_parse(tiny_models):
    """The tiny random VLM as a local judge: loaded once, asked greedily; its words never parse, so they are
    masked and counted, and with the default max_unparsable they stop the run quoting it."""
    from vlmexp.model_rewards.judge import local_judge

    folder = str(tiny_models["qwen2_5_vl"])
    hooks = Hooks()
    lenient = build_reward("judge", {"model": folder, "max_unparsable": 1.0, "max_tokens": 6}, "pixels", None)
    assert ask(lenient, ["<answer>a</answer>", "<answer>b</answer>"], ["a", "b"], hooks) == [None, None]
    assert sum(hooks.metrics["rewards/judge/unparsable/not_a_number"]) == 2
    assert local_judge(folder, False)[0] is local_judge(folder, False)[0]
    strict = build_reward("judge", {"model": folder, "max_tokens": 6}, "pixels", None)
    with pytest.raises(ModelRewardError, match="2 of 2 answers in this batch are not one number in "
                                               "\\[0, 10\\].*the judge said: '"):
        ask(strict, ["<answer>a</answer>", "<answer>b</answer>"], ["a", "b"])


def test_the_pipeline_samples_llm_records_only_for_a_config_with_a_judge_and_grpo_checks_again(tmp_path):
    from vlmexp.checks.loader import load_config
    from vlmexp.data.run_data import prepare_data
    from vlmexp.errors import ConfigError, DataError
    from vlmexp.train.grpo import check_rewards_score

    data = llm_data(tmp_path)
    common = [f"run.output_dir={tmp_path / 'out'}", "data.demo=null",
              f"data.datasets=[{{json_path: '{data}'}}]", "data.val_fraction=0.5"]
    plain = load_config(REPO / "configs/demo.yaml", [*common, "grpo.rewards=[{name: exact}]"])
    with pytest.raises(DataError, match=r"d.jsonl:1.*accu_reward_method 'llm' is scored by a judge model"):
        prepare_data(plain)
    judged = load_config(REPO / "configs/demo.yaml",
                         [*common, "grpo.rewards=[{name: exact}, {name: judge, kwargs: "
                                   "{model: m, endpoint: 'http://127.0.0.1:9/v1'}}]"])
    prepared = prepare_data(judged)
    methods = [json.loads(line)["method"] for p in (prepared.train, prepared.val)
               for line in p.read_text().splitlines()]
    assert sorted(methods) == ["default", "llm"]
    check_rewards_score(judged, {"exact"}, {"llm", "default"})
    with pytest.raises(ConfigError, match="accu_reward_method 'llm' is scored by a judge model"):
        check_rewards_score(plain, {"exact"}, {"llm", "default"})


def test_validation_takes_the_best_sample_when_a_judge_could_not_read_some():
    from vlmexp.train.validation import validation_metrics

    scores = {"good": 1.0, "bad": 0.0, "unread": None}

    def score(completions):
        rows = [{"score": scores[c]} for c in completions]
        found = [r["score"] for r in rows if r["score"] is not None]
        return {"count": len(rows), "judge_score": sum(found) / max(1, len(found))}, rows

    logs = validation_metrics([["unread", "good"], ["bad", "unread"]], score)
    assert logs["val/judge_score/best_at_2"] == 0.5 and logs["val/judge_score/mean_at_2"] == 0.5


def test_validate_refuses_a_reward_model_or_local_judge_folder_that_is_not_there(tmp_path):
    from vlmexp.checks.loader import load_config
    from vlmexp.errors import ConfigError

    rewards = (f"grpo.rewards=[{{name: reward_model, kwargs: {{path: '{tmp_path / 'none'}'}}}}, "
               f"{{name: judge, kwargs: {{model: '{tmp_path}'}}}}, {{name: judge, kwargs: {{model: served, "
               "endpoint: 'http://127.0.0.1:9/v1'}}]")
    with pytest.raises(ConfigError) as caught:
        load_config(REPO / "configs/demo.yaml", [f"run.output_dir={tmp_path / 'out'}", rewards],
                    check_paths=True)
    text = str(caught.value)
    assert "grpo.rewards.0.kwargs.path" in text and "no model folder with a config.json here" in text
    assert "grpo.rewards.1.kwargs.model" in text and "or set kwargs.endpoint" in text
    assert "grpo.rewards.2" not in text


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_judge_that_is_down_or_a_reward_model_that_is_none_is_found_before_any_model_loads(
        tmp_path, tiny_models, vlmexp_main):
    """`vlmexp validate` asks each judge endpoint one short question and reads each reward model's config; a
    stage does the same before its policy model loads (nothing written, the output folder not even made)."""
    from vlmexp.checks.loader import load_config
    from vlmexp.errors import ConfigError
    from vlmexp.train.grpo import run_grpo

    down = f"http://127.0.0.1:{_free_port()}/v1"
    with JudgeServer() as server:
        wrong_route = server.url.removesuffix("/v1") + "/v2"  # the server answers 404 there
        rewards = (f"grpo.rewards=[{{name: judge, kwargs: {{model: grader, endpoint: '{down}'}}}}, "
                   f"{{name: judge, kwargs: {{model: grader, endpoint: '{wrong_route}'}}}}, "
                   f"{{name: judge, kwargs: {{model: grader, endpoint: '{server.url}'}}}}, "
                   f"{{name: reward_model, kwargs: {{path: '{tiny_models['qwen2_5_vl']}'}}}}]")
        rc, _, err = vlmexp_main("validate", REPO / "configs/demo.yaml", f"run.output_dir={tmp_path / 'o'}",
                                 rewards)
        answered = len(server.requests)
    assert rc == 2, err
    assert (f"grpo.rewards.0.kwargs.endpoint = '{down}': the judge endpoint {down}/chat/completions could "
            "not be reached (ConnectError") in err
    assert "start the judge's server there, or fix kwargs.endpoint" in err
    assert f"grpo.rewards.1.kwargs.endpoint = '{wrong_route}'" in err and "answered 404" in err
    assert "check kwargs.model" in err and "grpo.rewards.2" not in err and answered == 2
    assert "grpo.rewards.3.kwargs.path" in err and "not a sequence-classification model" in err
    # the stage, as the pipeline starts it (its config checked already): refused before anything loads
    cfg = load_config(REPO / "configs/demo.yaml", [f"run.output_dir={tmp_path / 'out'}",
                                                   f"model.path={tiny_models['qwen2_5_vl']}",
                                                   "tracking.backend=none", "grpo.rewards=[{name: judge, "
                                                   f"kwargs: {{model: grader, endpoint: '{down}'}}}}]"])
    with pytest.raises(ConfigError, match=r"a model reward cannot score \(1 problem\):\n  - grpo stage: "
                                          r"grpo\.rewards\.0\.kwargs\.endpoint = .*could not be reached"):
        run_grpo(cfg)
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_a_judge_that_goes_away_mid_run_ends_the_stage_with_its_message_and_no_traceback(tmp_path,
                                                                                        run_inputs):
    """The judge answers the stage's probe and its first requests, then its server stops: the stage ends with
    the judge's message, exit status 1, no traceback, its MLflow run FAILED."""
    import threading

    server = JudgeServer().__enter__()

    def stop_when_asked():  # the probe is one request; the first step's scoring the next ones
        while len(server.requests) < 2:
            time.sleep(0.05)
        server.__exit__(None, None, None)

    watcher = threading.Thread(target=stop_when_asked, daemon=True)
    watcher.start()
    try:
        run = _train(tmp_path, run_inputs, "grpo", "grpo.rewards=[{name: judge, kwargs: {model: grader, "
                     f"endpoint: '{server.url}', retries: 1, backoff: 0.1}}}}]", "grpo.args.max_steps=3",
                     "grpo.args.per_device_train_batch_size=4", "grpo.args.num_generations=4",
                     "grpo.args.max_completion_length=8", "grpo.args.save_strategy='no'")
    finally:
        if watcher.is_alive():
            server.__exit__(None, None, None)
    assert run.returncode == 1, run.stderr[-3000:]
    assert "Traceback" not in run.stderr + run.stdout, run.stderr[-3000:]
    last = run.stderr.strip().splitlines()[-1].partition("error: ")[2]  # after TRL's progress bar
    assert last.startswith(f"judge endpoint {server.url}/chat/completions could not be reached"), last
    assert "(2 tries); start the server there, fix kwargs.endpoint" in last
    _, found = _run_metrics(tmp_path, "demo-grpo")
    assert found.info.status == "FAILED"
