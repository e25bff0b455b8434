"""Tools a model may call in GRPO's rollouts and in evaluation (grpo.tools): what each offers TRL's
GRPOTrainer (`environment_factory`), and the rewards GRPO scores a tool run with. One module per tool
(`zoom`); the tools' names are `vlmexp.config.stages.TOOL_NAMES`."""

from __future__ import annotations

from typing import Any

from vlmexp.config.stages import GRPOStageConfig, RewardSpec, ToolsConfig


def environment_factory(tools: ToolsConfig, family, budget):
    """TRL's `environment_factory` for the configured tools (one fresh environment per rollout), or None
    when grpo.tools offers none."""
    if not tools.names:
        return None
    from vlmexp.tools.zoom import zoom_environment_factory

    return zoom_environment_factory(family.box_frame, budget, tools.min_crop_side)  # names == ["zoom"]


def reward_specs(grpo: GRPOStageConfig) -> list[RewardSpec]:
    """grpo.rewards, with the tool reward told max_turns, and added at weight 0 when tools are on and it is
    not configured: its zoom metrics (zoom/*) are logged in every tool run."""
    specs = list(grpo.rewards)
    if not grpo.tools.names:
        return specs
    if "tool" not in [s.name for s in specs]:
        specs.append(RewardSpec(name="tool", weight=0.0))
    return [s.model_copy(update={"kwargs": {**s.kwargs, "max_turns": grpo.tools.max_turns}})
            if s.name == "tool" else s for s in specs]


def tool_settings(grpo: GRPOStageConfig) -> dict[str, Any]:
    """The TRL GRPOConfig fields grpo.tools sets."""
    return {"max_tool_calling_iterations": grpo.tools.max_turns} if grpo.tools.names else {}
