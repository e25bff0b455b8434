"""GRPO stage entry point: seed, data, processor, model, rewards, trainer, train (resuming), save."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vlmexp.config.schema import Config
from vlmexp.modeling import vision_token_ids
from vlmexp.train.stage import load_model, prepare_stage, train_and_save, trl_args


def run_grpo(cfg: Config, model_path: str | None = None, callbacks: Sequence[Any] = (),
             mlflow_run_id: str | None = None) -> Path:
    """Train with trl.GRPOTrainer from the base model or `model_path` (the SFT stage's model or adapter)."""
    trainer, inputs, rows = build_grpo_trainer(cfg, model_path, callbacks, mlflow_run_id)
    return train_and_save(trainer, inputs, rows)


def build_grpo_trainer(cfg: Config, model_path: str | None = None, callbacks: Sequence[Any] = (),
                       mlflow_run_id: str | None = None):
    """(trainer, stage inputs, training rows): the GRPOTrainer `run_grpo` trains, with the pipeline's rewards,
    generation settings and callbacks. Apart so a benchmark can time it against a plain TRL script's
    trainer."""
    from vlmexp.generation import configure_trainer, resolve
    from vlmexp.processor import prefills_think
    from vlmexp.rewards_loader import build_reward
    from vlmexp.scoring import build_scorers
    from vlmexp.tools import grpo_environments, reward_specs, route_rows, tool_settings, zoom_replay
    from vlmexp.tracking.callbacks import CompileCountLog, CompletionTable
    from vlmexp.train.data import build_dataset
    from vlmexp.train.grpo_pairing import GuardedGRPOTrainer, left_pad

    inputs = prepare_stage(cfg, "grpo", model_path, mlflow_run_id)
    generation = dict(cfg.grpo.args.get("generation_kwargs") or {})
    if not cfg.grpo.args.get("use_vllm"):  # HF generate: keep vision placeholders out of completions
        generation.setdefault("suppress_tokens", vision_token_ids(inputs.processor, inputs.family))
    specs = reward_specs(cfg.grpo)  # grpo.rewards (+ the tool reward's metrics when tools are on)
    args = trl_args(inputs, reward_weights=[r.weight for r in specs], generation_kwargs=generation,
                    **tool_settings(cfg.grpo))
    train_dataset = build_dataset(inputs.train_path, cfg.data, inputs.family, inputs.budget, "grpo")
    # before the model loads
    check_rewards_score(cfg, set(train_dataset["task"]), set(train_dataset["accu_reward_method"]))
    # the start model samples first; prompts without signal are dropped
    if cfg.grpo.difficulty_filter.enabled:
        from vlmexp.train.difficulty import kept_rows

        train_dataset = train_dataset.select(kept_rows(inputs, args))
    train_dataset = route_rows(train_dataset, cfg.grpo.tools, cfg.run.seed)  # grpo.tools.without's rows
    model, peft_config = load_model(inputs)
    # completions then start inside <think> (the format reward reads so)
    thinking = prefills_think(inputs.processor)
    rewards = [build_reward(r.name, r.kwargs, inputs.family.box_frame, inputs.budget, thinking)
               for r in specs]
    left_pad(inputs.processor)  # any number of prompts and image sizes per generation batch (grpo_pairing.py)
    if cfg.grpo.tools.names:  # the family's tool template and response parser (vlmexp.families)
        inputs.family.use_tools(inputs.processor)
    trainer_class, extra = GuardedGRPOTrainer, {}
    if cfg.grpo.online_filter.enabled:  # dynamic sampling, online (vlmexp/train/online_filter.py)
        from vlmexp.train.online_filter import OnlineFilterGRPOTrainer

        trainer_class = OnlineFilterGRPOTrainer
        extra = {"online_filter": cfg.grpo.online_filter, "reward_names": [r.name for r in specs]}
    trainer = trainer_class(model=model, reward_funcs=rewards, args=args, train_dataset=train_dataset,
                            processing_class=inputs.processor, peft_config=peft_config,
                            callbacks=list(callbacks), family=inputs.family, budget=inputs.budget,
                            environment_factory=grpo_environments(cfg.grpo.tools, inputs.family,
                                                                  inputs.budget), **extra)
    # TRL's rollouts as every stage generates; the compile count first among the callbacks, so the logs that
    # MLflow's callback and the caller's callbacks see carry it
    settings = resolve(cfg.generation, trainer.accelerator.device.type)
    trainer.callback_handler.callbacks.insert(
        0, CompileCountLog(configure_trainer(trainer, settings), settings.compile, inputs.run))
    # the table's boxes
    scorers = build_scorers(specs, inputs.family.box_frame, inputs.budget, thinking)
    trainer.add_callback(CompletionTable(trainer, inputs.run, cfg.tracking.completions_every,
                                         cfg.tracking.completions_per_table, scorers,
                                         zoom_replay(cfg.grpo.tools, inputs.family, inputs.budget)))
    return trainer, inputs, len(train_dataset)


def check_rewards_score(cfg: Config, tasks: set[str], methods: set[str | None] = frozenset()) -> None:
    """Refuse records whose answers no configured reward scores: they would train on the format reward alone
    (records of VLM-R1's `llm` method are scored by a judge alone)."""
    from vlmexp.data.formats import JUDGED_METHOD, NO_JUDGE
    from vlmexp.errors import ConfigError, Problem
    from vlmexp.rewards_loader import scoring_rewards, unscored_tasks

    names = [r.name for r in cfg.grpo.rewards]
    if JUDGED_METHOD in methods and "judge" not in names:
        raise ConfigError(Problem("grpo.rewards", "", NO_JUDGE, names))
    if missing := unscored_tasks(tasks, names):
        raise ConfigError([Problem("grpo.rewards", "", f"the sampled records hold task {task!r}, whose "
                                   f"answers none of the rewards {names} scores, so they would train on the "
                                   "format alone; add "
                                   f"{' or '.join(scoring_rewards(task)) or 'a module:function reward'} to "
                                   "grpo.rewards, or leave those records out of the data", names)
                           for task in missing])
