"""GRPO's dynamic sampling, online (`grpo.online_filter`): drop the prompt groups of each generation batch
that carry no signal, or whose mean lies outside a band, and refill the batch from new prompts.

A group whose completions all score alike has zero advantage, yet its tokens count in the normaliser of TRL's
default `dapo` loss and dilute the step. DAPO's dynamic sampling, EasyR1's `algorithm.online_filtering` and
verl's `algorithm.filter_groups` drop such groups after each generation and generate more; TRL 1.16 has no
such hook (huggingface/trl#3708). The offline `grpo.difficulty_filter` (vlmexp.train.difficulty) judges each
prompt once, with the start model; this filter follows the policy as it trains.

How (trl 1.16): `_generate_and_score_completions` is called once per generation batch (TRL's `_prepare_inputs`
buffers it for steps_per_generation x num_iterations steps). This trainer calls TRL's (through the pairing
guard's) once per round; round 0 on the batch TRL's sampler gave, the next rounds on prompts drawn by a
permutation of the training set seeded by (seed, global step, generation within the step, round) that skips
this step's prompts (so nothing is kept in checkpoints and a resumed run refills alike). A round refills a
whole batch (`refill: whole`, as EasyR1 and verl do) or about the groups still missing (`needed`: the
shortfall over this generation's in-band share so far, `refill_groups`). Each process judges its own groups
(`num_generations` consecutive rows; the per-process generation batch must hold whole groups), keeps the
in-band ones up to the number it was given, and all processes run as many rounds as the one
furthest short (a gathered maximum: TRL's scoring gathers across processes, so every process must call it
the same number of times). The rounds' outputs are merged row-wise by the table below; the loss's
`num_items_in_batch` is recounted. When the rounds run out, the batch is filled with the last round's dropped
groups closest to the band, their advantages and loss masks zeroed (the completion mask; with tools the tool
mask, since the completion mask is also the forward's attention over the crops): they train nothing (under the
`dapo`, `bnpo`, `cispo` losses exactly nothing; `grpo`/`dr_grpo` average over sequences, so there they dilute
the step by their count).

Kept (EasyR1's semantics): key std keeps a group whose overall rewards are not all equal; key overall or a
reward's name keeps a group whose mean lies strictly between low and high (each optional), whatever its
spread.

What TRL logs per call (rewards, frac_reward_zero_std, the completion table's rows and columns) it logs for
every round: those figures describe every group generated, kept or not; the table (a deque of one generation
batch) shows the last round's rows. TRL normalises advantages per group (scale_rewards group, the default) so
a kept group's advantages do not depend on the round it came from; with scale_rewards batch they are
normalised over the round's batch.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
import torch
from accelerate.utils import gather_object
from trl.trainer.utils import pad, split_pixel_values_by_grid, unsplit_pixel_values_by_grid

from vlmexp.config.stages import OnlineFilterConfig
from vlmexp.train.grpo_pairing import EXPECTED, GuardedGRPOTrainer

log = logging.getLogger("vlmexp.train")

ROW_COLUMN = "vlmexp_row"  # each training record's index in the GRPO dataset: which prompts a step used

# How each key of TRL's generation output is merged over rounds. Padded along the sequence: prompt-aligned
# keys on the left (TRL left-pads prompts), completion-aligned ones on the right; the token types span prompt
# and completion and are cut at the prompt's width; per-sample keys (lists once split_pixel_values_by_grid has
# run) and one-value-a-row tensors are selected and joined; num_items_in_batch is recounted. A key TRL adds in
# another version whose shape differs between rounds is refused (tests/test_online_filter.py reads TRL's
# keys).
PAD_SIDE = {"prompt_ids": "left", "prompt_mask": "left",
            "completion_ids": "right", "completion_mask": "right", "old_per_token_logps": "right",
            "ref_per_token_logps": "right", "sampling_per_token_logps": "right",
            "importance_sampling_ratio": "right", "tool_mask": "right",
            "mm_token_type_ids": "prompt|completion", "token_type_ids": "prompt|completion"}
PER_SAMPLE = ("advantages", "pixel_values", "image_grid_thw", "image_position_ids", "pixel_attention_mask",
              "spatial_shapes", "image_sizes", "num_images", "num_tiles", EXPECTED)
RECOUNTED = ("num_items_in_batch",)
COUNTS = ("groups_generated", "groups_kept", "dropped_low", "dropped_high", "dropped_flat", "groups_short")


class OnlineFilterError(RuntimeError):
    """TRL's generation output holds something the merge of rounds does not know how to join."""


def judge(rewards: torch.Tensor, weights: torch.Tensor, group: int, opts: OnlineFilterConfig,
          column: int | None) -> list[tuple[str, float]]:
    """(verdict, distance to the band) per group of `group` consecutive rows of `rewards` ([rows, n_rewards],
    NaN where a reward gave None). Verdicts: kept, flat (key std), low, high (a NaN mean, every completion
    unscored, counts as low)."""
    overall = (rewards * weights.unsqueeze(0)).nansum(1)  # [rows], as TRL sums them
    overall[torch.isnan(rewards).all(1)] = torch.nan
    if opts.key == "std":
        grouped = overall.view(-1, group)  # unscored completions left out, as TRL's nanstd does
        top, bottom = grouped.nan_to_num(-torch.inf).amax(1), grouped.nan_to_num(torch.inf).amin(1)
        flat = torch.isclose(top, bottom) | torch.isnan(grouped).all(1)
        return [("flat", 0.0) if f else ("kept", 0.0) for f in flat.tolist()]
    values = overall if column is None else rewards[:, column]
    out = []
    for mean in torch.nanmean(values.view(-1, group), 1).tolist():
        if np.isnan(mean):
            out.append(("low", float("inf")))
        elif opts.low is not None and mean <= opts.low:
            out.append(("low", opts.low - mean))
        elif opts.high is not None and mean >= opts.high:
            out.append(("high", mean - opts.high))
        else:
            out.append(("kept", 0.0))
    return out


def take(output: dict[str, Any], rows: list[int]) -> dict[str, Any]:
    """The given rows of one round's output (per-sample image fields split by sample)."""
    split = split_pixel_values_by_grid(output)
    size = split["prompt_ids"].size(0)
    out = {}
    for key, value in split.items():
        if key in RECOUNTED or value is None:
            continue
        if isinstance(value, list) and len(value) == size:
            out[key] = [value[i] for i in rows]
        elif isinstance(value, torch.Tensor) and value.ndim >= 1 and value.size(0) == size:
            out[key] = value[rows]
        else:
            shape = f" of shape {list(value.shape)}" if isinstance(value, torch.Tensor) else ""
            raise OnlineFilterError(
                f"GRPO's generation output holds {key!r} ({type(value).__name__}{shape}) that is not one "
                f"entry a sample ({size} samples): online filtering cannot select its rows; add it to "
                "vlmexp/train/online_filter.py's merge table or set grpo.online_filter.enabled: false")
    return out


def join(parts: list[dict[str, Any]], pad_token_id: int) -> dict[str, Any]:
    """Concatenate rounds' selected rows, padding each key on its side (PAD_SIDE)."""
    keys = set(parts[0])
    if any(set(p) != keys for p in parts):
        raise OnlineFilterError(
            f"GRPO's generation rounds returned different keys ({[sorted(p) for p in parts]}): online "
            "filtering cannot merge them; set grpo.online_filter.enabled: false")
    out: dict[str, Any] = {}
    for key in parts[0]:
        values = [p[key] for p in parts]
        if isinstance(values[0], list):
            out[key] = [v for value in values for v in value]
            continue
        side = PAD_SIDE.get(key)
        if side == "prompt|completion":  # [B, P + C]: the prompt's part left-padded, the completion's right
            widths = [p["prompt_ids"].size(1) for p in parts]
            prompt = _pad_cat([v[:, :w] for v, w in zip(values, widths, strict=True)], "left", 0)
            completion = _pad_cat([v[:, w:] for v, w in zip(values, widths, strict=True)], "right", 0)
            out[key] = torch.cat([prompt, completion], 1)
        elif side is not None:
            fill = pad_token_id if key in ("prompt_ids", "completion_ids") else int(key == "tool_mask")
            out[key] = _pad_cat(values, side, fill)  # tool_mask pads with 1, as TRL's
        elif len({v.shape[1:] for v in values}) == 1:
            out[key] = torch.cat(values)
        else:
            raise OnlineFilterError(
                f"GRPO's generation output key {key!r} has shapes {[list(v.shape) for v in values]} in "
                "different rounds and no padding side in vlmexp/train/online_filter.py's PAD_SIDE: add it "
                "there (prompt-aligned: left, completion-aligned: right), or set "
                "grpo.online_filter.enabled: false")
    return unsplit_pixel_values_by_grid(out)


def _pad_cat(values: list[torch.Tensor], side: str, value: float) -> torch.Tensor:
    """[sum B, max width, ...]: tensors of rows padded along dim 1 on `side`."""
    rows = [row for v in values for row in v]
    return pad(rows, padding_value=value, padding_side=side)


def refill_groups(opts: OnlineFilterConfig, quota: int, short: int, kept: int, generated: int) -> int:
    """Groups each process generates in the next round: a whole batch (`refill: whole`, as EasyR1 and verl
    refill), or (`needed`) the groups the process furthest short still misses divided by the share of in-band
    groups so far in this generation batch (`kept` of `generated`, over every process), at most a batch. Never
    fewer than a process misses (the share is at most 1), so when the rounds run out the last round's dropped
    groups can fill the batch (`_merge`)."""
    if opts.refill == "whole" or kept == 0:
        return quota
    return min(quota, -(-short * generated // kept))


class OnlineFilterGRPOTrainer(GuardedGRPOTrainer):
    """GuardedGRPOTrainer whose generation batches hold only groups in the band (the module docstring)."""

    def __init__(self, *args, online_filter: OnlineFilterConfig, reward_names: list[str], train_dataset,
                 **kwargs):
        if ROW_COLUMN not in train_dataset.column_names:
            train_dataset = train_dataset.add_column(ROW_COLUMN, list(range(len(train_dataset))))
        super().__init__(*args, train_dataset=train_dataset, **kwargs)
        self.online_filter, self.last_rewards = online_filter, None
        self.groups_generated_total = 0  # over every process, this run (bench/online_filter.py's budget)
        self.key_column = reward_names.index(online_filter.key) if online_filter.key in reward_names else None
        batch, steps = self.args.per_device_train_batch_size, self.args.steps_per_generation
        if batch * steps % self.num_generations:
            from vlmexp.errors import ConfigError, Problem

            raise ConfigError(Problem(
                "grpo.args", "per_device_train_batch_size", "grpo.online_filter judges each process's own "
                f"groups, so a process's generation batch (per_device_train_batch_size {batch} x "
                f"steps_per_generation {steps} = {batch * steps}) must be whole groups of num_generations "
                f"{self.num_generations}: make it a multiple of {self.num_generations}, or set "
                "grpo.online_filter.enabled: false",
                batch * steps))

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        # TRL's, keeping the gathered [rows of all processes, rewards] tensor the filter judges groups by
        self.last_rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        return self.last_rewards

    def _generate_and_score_completions(self, inputs):
        if not self.model.training:
            return super()._generate_and_score_completions(inputs)
        start, opts, group = time.perf_counter(), self.online_filter, self.num_generations
        quota = len(inputs) // group
        used = {row for rows in gather_object([[x[ROW_COLUMN] for x in inputs[::group]]]) for row in rows}
        rounds, kept, generated, batch, tally = [], 0, 0, inputs, (quota, 0, 0)
        for extra in range(opts.max_extra_rounds + 1):
            if extra:
                batch = self._refill(refill_groups(opts, quota, *tally) * group, used, extra)
            output = super()._generate_and_score_completions(batch)
            here = slice(self.accelerator.process_index * len(batch), (self.accelerator.process_index + 1)
                         * len(batch))
            verdicts = judge(self.last_rewards[here], self.reward_weights.to(self.last_rewards.device), group,
                             opts, self.key_column)
            rounds.append((output, verdicts))
            kept, generated = kept + sum(v == "kept" for v, _ in verdicts), generated + len(verdicts)
            local = torch.tensor([[max(0, quota - kept), kept, generated]], device=self.accelerator.device)
            every = self.accelerator.gather(local).view(-1, 3)  # [processes, (short, kept, generated)]
            tally = (int(every[:, 0].max()), int(every[:, 1].sum()), int(every[:, 2].sum()))
            if tally[0] == 0:
                break
        # merged even when nothing was dropped: every process then makes the same collective calls
        output, counts = self._merge(rounds, quota)
        self._log_filter(counts, len(rounds) - 1, time.perf_counter() - start, quota)
        return output

    def _merge(self, rounds: list, quota: int) -> tuple[dict[str, Any], dict[str, int]]:
        """The kept groups of every round up to `quota`, filled from the last round's dropped groups closest
        to the band (zeroed), as one output; and this process's counts."""
        group, parts, counts, left = self.num_generations, [], dict.fromkeys(COUNTS, 0), quota
        for n, (output, verdicts) in enumerate(rounds):
            counts["groups_generated"] += len(verdicts)
            for verdict, _ in verdicts:
                counts[f"dropped_{verdict}" if verdict != "kept" else "groups_kept"] += 1
            chosen = [g for g, (v, _) in enumerate(verdicts) if v == "kept"][:left]
            left -= len(chosen)
            fill = []
            if n == len(rounds) - 1 and left:
                dropped = sorted((d, g) for g, (v, d) in enumerate(verdicts) if v != "kept")
                fill = [g for _, g in dropped[:left]]
                counts["groups_short"] = len(fill)
            if not chosen and not fill:
                continue
            part = take(output, [g * group + i for g in chosen + fill for i in range(group)])
            if fill:  # the fill rows train nothing: no advantage, no completion token in the loss
                zero = torch.arange(len(chosen) * group, part["advantages"].size(0))
                part["advantages"][zero] = 0.0
                # with tools, out of the loss through tool_mask: the completion_mask is also the forward's
                # attention mask, and a crop the tool returned sits in the completion; masked there, Qwen-VL's
                # rope index skips its image tokens but not its grid, and every later sample of the
                # micro-batch takes the wrong grid ("shape mismatch" or, with equal grids, wrong positions)
                part["tool_mask" if "tool_mask" in part else "completion_mask"][zero] = 0
            parts.append(part)
        counts["groups_kept"] = min(counts["groups_kept"], quota)  # in-band groups trained on
        merged = join(parts, self._tokenizer.pad_token_id)
        loss_mask = merged["completion_mask"] * merged.get("tool_mask", 1)
        merged["num_items_in_batch"] = self.accelerator.gather(loss_mask.sum()).sum()  # as TRL counts it
        return merged, counts

    def _refill(self, rows: int, used: set[int], extra: int) -> list[dict[str, Any]]:
        """This process's slice of `rows` new rows (whole groups) from prompts this step has not used yet
        (used again only when the training set runs out), the same choice on every process."""
        group, world = self.num_generations, self.accelerator.num_processes
        generation = self._step % self.args.gradient_accumulation_steps  # 0 unless several per optimizer step
        seed = np.random.SeedSequence([self.args.seed, self.state.global_step, generation, extra])
        order = torch.randperm(len(self.train_dataset), generator=torch.Generator().manual_seed(
            int(seed.generate_state(1)[0]))).tolist()
        order = [i for i in order if i not in used] + [i for i in order if i in used]
        chosen = [order[k % len(order)] for k in range(rows // group * world)]
        used.update(chosen)
        mine = chosen[self.accelerator.process_index * (rows // group):][: rows // group]
        return [dict(record) for record in (self.train_dataset[i] for i in mine) for _ in range(group)]

    def _log_filter(self, counts: dict[str, int], extra_rounds: int, seconds: float, quota: int) -> None:
        """The filter's metrics (summed over processes; seconds: the slowest) into TRL's train metrics."""
        local = torch.tensor([float(counts.get(k, 0)) for k in COUNTS] + [seconds],
                             device=self.accelerator.device)
        gathered = self.accelerator.gather(local.unsqueeze(0)).view(-1, len(COUNTS) + 1)
        totals = dict(zip(COUNTS, gathered[:, :-1].sum(0).tolist(), strict=True))
        self.groups_generated_total += int(totals["groups_generated"])
        for key, value in totals.items():
            self._metrics["train"][f"online_filter/{key}"].append(value)
        self._metrics["train"]["online_filter/rounds"].append(float(extra_rounds))
        self._metrics["train"]["online_filter/generation_seconds"].append(gathered[:, -1].max().item())
        if totals["groups_short"] and self.accelerator.is_main_process:
            wanted = quota * self.accelerator.num_processes
            log.warning("online filter: trained on %d of %d groups in band after %d extra rounds (step %d); "
                        "the other %d are dropped groups with their advantages and loss masks zeroed, "
                        "which train nothing (raise grpo.online_filter.max_extra_rounds or widen the band)",
                        wanted - totals["groups_short"], wanted, extra_rounds, self.state.global_step,
                        totals["groups_short"])
