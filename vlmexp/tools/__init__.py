"""Tools a model may call in GRPO's rollouts and in evaluation (grpo.tools): what each offers TRL's
GRPOTrainer (`environment_factory`), and the rewards GRPO scores a tool run with. One module per tool
(`zoom`); the tools' names are `vlmexp.config.stages.TOOL_NAMES`."""

from __future__ import annotations

from typing import Any

from vlmexp.config.stages import GRPOStageConfig, RewardSpec, ToolsConfig

WITH_TOOLS, WITHOUT_TOOLS = "tools", "no_tools"  # a GRPO row's environment (grpo.tools.without)


class NoTools:
    """The environment of a GRPO prompt given without the tools (grpo.tools.without): nothing to call, so TRL
    renders its prompt without the tools block, as evaluation without the tool does."""

    def reset(self, **row: Any) -> None:
        return None


def environment_factory(tools: ToolsConfig, family, budget):
    """A callable making one fresh environment of the configured tools (a rollout's, an evaluation
    record's), or None when grpo.tools offers none."""
    if not tools.names:
        return None
    from vlmexp.tools.zoom import zoom_environment_factory

    return zoom_environment_factory(family.box_frame, budget, tools.min_crop_side)  # names == ["zoom"]


def grpo_environments(tools: ToolsConfig, family, budget):
    """What GRPO gives TRL's `environment_factory`: the tools' factory, or with grpo.tools.without a dict of
    it and `NoTools` that each training row picks from by its `environment` column (`route_rows`)."""
    factory = environment_factory(tools, family, budget)
    if factory is None or not tools.without:
        return factory
    return {WITH_TOOLS: factory, WITHOUT_TOOLS: NoTools}


def route_rows(dataset, tools: ToolsConfig, seed: int):
    """`dataset` with the `environment` column TRL routes each row by under grpo.tools.without: that share of
    the rows (rounded; drawn with the run's seed, the same rows at every start) without the tools, the rest
    with them. `dataset` as it is otherwise."""
    if not tools.names or not tools.without:
        return dataset
    import random

    n = len(dataset)
    without = set(random.Random(seed).sample(range(n), round(tools.without * n)))
    return dataset.add_column("environment", [WITHOUT_TOOLS if i in without else WITH_TOOLS
                                              for i in range(n)])


def offered_tools(tools: ToolsConfig, family, budget) -> list:
    """The tools GRPO's rollouts and evaluation show the model (the chat template's tools block): [] when
    grpo.tools offers none."""
    factory = environment_factory(tools, family, budget)
    return tool_methods(factory()) if factory is not None else []


def zoom_replay(tools: ToolsConfig, family, budget):
    """(completion, width, height) -> the completion's zoom boxes in original pixels; None without
    tools."""
    if not tools.names:
        return None
    from functools import partial

    from vlmexp.tools.zoom import replayed_zooms

    return partial(replayed_zooms, frame=family.box_frame, budget=budget, min_side=tools.min_crop_side)


def reward_specs(grpo: GRPOStageConfig) -> list[RewardSpec]:
    """grpo.rewards, with the tool reward told max_turns and the zoom_target reward min_crop_side, and the
    tool reward added at weight 0 when tools are on and it is not configured: its zoom metrics (zoom/*) are
    logged in every tool run."""
    specs = list(grpo.rewards)
    if not grpo.tools.names:
        return specs
    if "tool" not in [s.name for s in specs]:
        specs.append(RewardSpec(name="tool", weight=0.0))
    told = {"tool": {"max_turns": grpo.tools.max_turns},
            "zoom_target": {"min_crop_side": grpo.tools.min_crop_side}}
    return [s.model_copy(update={"kwargs": {**s.kwargs, **told[s.name]}}) if s.name in told else s
            for s in specs]


def tool_settings(grpo: GRPOStageConfig) -> dict[str, Any]:
    """The TRL GRPOConfig fields grpo.tools sets."""
    return {"max_tool_calling_iterations": grpo.tools.max_turns} if grpo.tools.names else {}


def tool_methods(environment) -> list:
    """An environment's tools as TRL finds them: its public methods but reset and get_reward."""
    import inspect

    members = inspect.getmembers(type(environment), inspect.isfunction)
    return [getattr(environment, name) for name, _ in members
            if name not in ("reset", "get_reward") and not name.startswith("_")]


def run_tool_calls(environment, tool_calls: list[dict]) -> list[dict[str, Any]]:
    """The tool turns for an assistant turn's calls, in the form TRL's GRPOTrainer makes them: a tool that
    returns a list of content parts (an image) gives them as the turn's content, an exception (or an unknown
    tool) gives `str({"error": message})`."""
    tools = {fn.__name__: fn for fn in tool_methods(environment)}
    out = []
    for call in tool_calls:
        function = call.get("function", call)
        name = function.get("name", "unknown")
        try:
            if name not in tools:
                raise ValueError(f"Tool {name} not found.")
            result = tools[name](**(function.get("arguments") or {}))
        except Exception as e:  # noqa: BLE001 - as TRL does: the error goes back to the model as the answer
            result = {"error": str(e)}
        content = result if isinstance(result, list) else str(result)
        out.append({"role": "tool", "name": name, "content": content})
    return out
