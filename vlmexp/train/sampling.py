"""Sampling with scoring, for the stages that sample from their start model before training: DPO's pairs from
samples (`vlmexp.train.dpo`) and GRPO's difficulty filter (`vlmexp.train.difficulty`). The model generates
through the one generation engine (`vlmexp.generation.Generator`) and its completions are scored as GRPO
scores them (`vlmexp.scoring.score_group`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vlmexp.config.schema import Config
    from vlmexp.data.record import SampledRecord


def sample_and_score(cfg: Config, model_path: str, family, budget, records: list[SampledRecord],
                     rewards: list[tuple[str, dict, float]], k: int, temperature: float, max_new_tokens: int,
                     batch_size: int, prefilled_think: bool = False):
    """(prompts, [(k completions, their weighted reward sums)] per record, compile count): `model_path`'s
    samples for `records`, scored with `rewards` ((name, kwargs, weight) each) as `score_group` scores them.
    The sampling model is freed before returning."""
    import torch

    from vlmexp.generation import Generator
    from vlmexp.modeling import load_for_inference
    from vlmexp.prompts import build_prompt, load_images
    from vlmexp.rewards_loader import build_reward
    from vlmexp.scoring import score_group

    built = [build_reward(name, kwargs, family.box_frame, budget, prefilled_think)
             for name, kwargs, _ in rewards]
    model, processor, _ = load_for_inference(cfg, model_path)
    prompts = [build_prompt(r, cfg.data, family) for r in records]
    images = [load_images(r.question_images) for r in records]
    generator = Generator.for_config(cfg, model, processor, family)
    completions = generator([p for p in prompts for _ in range(k)], [im for im in images for _ in range(k)],
                            max_new_tokens, temperature, batch_size)
    del model, generator.model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    weights = [w for _, _, w in rewards]
    groups = []
    for i, record in enumerate(records):
        texts = completions[i * k:(i + 1) * k]
        groups.append((texts, score_group(built, weights, prompts[i], texts, record)))
    return prompts, groups, generator.count
