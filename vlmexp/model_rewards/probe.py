"""Model rewards checked before any model loads: is each judge endpoint answering, and is each reward model
there to load?

`vlmexp validate` (and the pipeline's validate step, and `vlmexp train` by hand) runs `probe_rewards` with the
config's other checks; a training stage that scores (`stage_scores`) runs `check_model_rewards` before its
policy model loads, so a judge that is down is found in seconds, not after the model loaded and the first
batch generated. Each problem names the reward entry, the endpoint or path, what happened and the fix.

- a judge endpoint is asked one short question (one token, one try, the judge's own `timeout`): any answer
  of an OpenAI-compatible server counts, a busy one (429, 5xx: the judge retries those) included; no answer,
  or an answer that says the model or the key is wrong, is a problem;
- a reward model is a folder whose config.json names a sequence-classification model, or a Hub id whose
  config.json the Hub (or the local cache, offline) gives.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from vlmexp.config.schema import Config
from vlmexp.config.stages import RewardSpec

Found = tuple[tuple[str | int, ...], Any, str]  # (location in the config, value, problem with its fix)
PROBE_MESSAGES = [{"role": "user", "content": "Reply with the number 0."}]


def probe_rewards(rewards: list[RewardSpec]) -> list[Found]:
    """A problem for each judge endpoint that does not answer and each reward model that is not there."""
    from vlmexp.model_rewards import MODEL_REGISTRY

    out: list[Found] = []
    for i, spec in enumerate(rewards):
        if spec.name not in MODEL_REGISTRY:
            continue
        try:
            reward = MODEL_REGISTRY[spec.name](**spec.kwargs)
        except (TypeError, ValueError):
            continue  # the config's kwargs check reports it
        loc: tuple[str | int, ...] = ("grpo", "rewards", i, "kwargs")
        if spec.name == "judge" and reward.endpoint:
            if (message := probe_endpoint(reward)) is not None:
                out.append(((*loc, "endpoint"), reward.endpoint, message))
        elif spec.name == "reward_model" and (message := probe_reward_model(reward.path)) is not None:
            out.append(((*loc, "path"), reward.path, message))
    return out


def probe_endpoint(judge) -> str | None:
    """Why the judge's endpoint cannot score, or None when it answers (busy counts as answering)."""
    import httpx

    from vlmexp.model_rewards.base import ModelRewardError
    from vlmexp.model_rewards.client import RETRIED_STATUS, ChatClient, chat_url

    url = chat_url(judge.endpoint)
    client = ChatClient(judge.endpoint, judge.model, judge.timeout, 0, 0.0, 1, 1, judge.api_key_env)
    try:
        headers = client.headers()
    except ModelRewardError as e:
        return str(e)
    body = {"model": judge.model, "messages": PROBE_MESSAGES, "temperature": 0.0, "max_tokens": 1}
    fix = "start the judge's server there, or fix kwargs.endpoint"
    try:
        with httpx.Client(timeout=httpx.Timeout(judge.timeout), headers=headers) as http:
            response = http.post(url, json=body)
    except httpx.TimeoutException:
        return (f"the judge endpoint {url} did not answer within {judge.timeout:g} s (kwargs.timeout); "
                f"{fix}, or raise kwargs.timeout")
    except httpx.TransportError as e:
        return f"the judge endpoint {url} could not be reached ({e.__class__.__name__}: {e}); {fix}"
    if response.status_code == 200 or response.status_code in RETRIED_STATUS:
        return None
    return (f"the judge endpoint {url} answered {response.status_code} to a one-token question for model "
            f"{judge.model!r}: {response.text[:300]!r}; check kwargs.model (the served model's name)"
            f"{' and the key in ' + judge.api_key_env if judge.api_key_env else ''}")


def probe_reward_model(path: str) -> str | None:
    """Why `path` is no reward model to load, or None: a folder (or Hub id) whose config.json names a
    sequence-classification architecture (or none, as some configs leave it out)."""
    from vlmexp.paths import is_hub_id

    config = Path(path) / "config.json"
    if not is_hub_id(path) and not config.is_file():
        return None  # the config's path checks name a folder that is not there
    if is_hub_id(path):
        try:
            from huggingface_hub import hf_hub_download

            config = Path(hf_hub_download(path, "config.json"))
        except Exception as e:  # noqa: BLE001 - offline, unknown repo, gated, network: each named below
            return (f"the reward model {path!r} (a Hub id) could not be fetched ({e.__class__.__name__}: "
                    f"{str(e)[:300]}); download it (`hf download {path}`) and give its folder, or fix "
                    "kwargs.path")
    try:
        architectures = json.loads(config.read_text()).get("architectures") or []
    except (OSError, ValueError, AttributeError) as e:
        return (f"{config} cannot be read as a model config ({e.__class__.__name__}: {e}); kwargs.path must "
                "be a sequence-classification model folder (config.json, weights, tokenizer)")
    if architectures and not any(str(a).endswith("ForSequenceClassification") for a in architectures):
        return (f"{config} names {architectures}, not a sequence-classification model; a reward model scores "
                "with one (AutoModelForSequenceClassification): give such a folder")
    return None


def stage_scores(cfg: Config, stage: str) -> bool:
    """Whether `stage` scores with the rewards: GRPO; DPO with pairs from the model's samples; any stage that
    validates during training (eval.every_steps)."""
    samples = stage == "dpo" and cfg.dpo.pairs.from_ == "samples"
    return stage == "grpo" or samples or bool(cfg.eval.every_steps)


def check_model_rewards(cfg: Config, stage: str) -> None:
    """Refuse, before the stage's model loads, a judge endpoint that does not answer or a reward model that is
    not there (ConfigError naming the reward entry, the endpoint or path, and the fix)."""
    if not stage_scores(cfg, stage):
        return
    from vlmexp.errors import ConfigError, Problem

    found = probe_rewards(cfg.grpo.rewards)
    if found:
        raise ConfigError([Problem(f"{stage} stage", ".".join(map(str, loc)), message, value)
                           for loc, value, message in found],
                          title="a model reward cannot score")
