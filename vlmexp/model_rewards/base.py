"""What the model rewards share: one batched call per generation batch, its cost and its unreadable answers
counted.

A model reward receives the batch as every reward does (TRL's signature, `vlmexp.rewards.Reward`) and hands
`score_samples` the samples it applies to, at once, so the model or endpoint sees them batched. Each call
reports through TRL's hooks, beside TRL's own `rewards/<name>/mean`:

- `rewards/<name>/seconds` and `rewards/<name>/calls`: the wall time spent and the model calls made (forward
  batches or requests) for this generation batch;
- `rewards/<name>/unparsable/<reason>` for every reason the reward knows (zeros included), and a
  `<name>/unparsable` column for the completion table.

An answer the model gives that cannot be read is masked (None: TRL's nansum gives the sample no credit from
this reward) and counted, never scored 0: the policy is not punished for the judge's failure. Errors that
concern the whole batch (an endpoint that is down, too many unreadable answers) raise `ModelRewardError`,
which the guarded wrapper passes on as it is instead of retrying sample by sample.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from vlmexp.errors import ReportedError
from vlmexp.rewards import Reward, RewardError, Unparsable, completion_text, report_counts


class ModelRewardError(RewardError, ReportedError):
    """A model reward cannot score the batch: training stops with this message (the guarded wrapper keeps
    it; the command line shows it without a traceback)."""


@dataclass(frozen=True)
class Unreadable(Unparsable):
    """A model's answer that does not parse: `said` is the answer, quoted when too many fail."""

    said: str = ""


@dataclass(frozen=True)
class Sample:
    """What a model reward sees of one completion."""

    question: str  # the last user turn of the prompt the policy answered
    completion: str
    reference: str  # the record's solution
    image_path: str  # the record's first image, "" when it has none
    method: str | None  # the record's accu_reward_method


def message_text(content: Any) -> str:
    """The text of a message's content: a string, or the text parts of a list of parts (images left out)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text") or "" for p in content
                       if isinstance(p, dict) and p.get("type", "text") == "text")
    return "" if content is None else str(content)


def question_of(prompt: Any) -> str:
    """The last user turn's text of a prompt (a list of messages, or a plain string)."""
    if isinstance(prompt, str):
        return prompt
    users = [m for m in prompt or [] if isinstance(m, dict) and m.get("role") == "user"]
    return message_text(users[-1].get("content")) if users else ""


def text_messages(prompt: Any) -> list[dict[str, str]]:
    """A prompt as messages with plain string contents (a string prompt becomes one user turn)."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    return [{"role": m["role"], "content": message_text(m.get("content"))} for m in prompt or []]


@dataclass
class ModelReward(Reward):
    """Base of the model rewards: subclasses implement `score_samples` and may narrow `applies`."""

    def applies(self, sample: Sample) -> bool:
        return True

    def score_samples(self, samples: list[Sample],
                      prompts: list[Any]) -> tuple[list[float | Unparsable], int]:
        """(a score or Unparsable per sample, the model calls made)."""
        raise NotImplementedError

    def __call__(self, prompts: Sequence[Any] | None = None, completions: Sequence[Any] = (),
                 log_metric: Callable[[str, float], None] | None = None,
                 log_extra: Callable[[str, list], None] | None = None, **kwargs: Any) -> list[float | None]:
        n = len(completions)
        column = {k: list(v) if isinstance(v, (list, tuple)) else [None] * n for k, v in kwargs.items()}
        empty = [None] * n
        samples = [Sample(question_of(prompts[i]) if prompts else "", completion_text(completions[i]),
                          "" if (column.get("solution") or empty)[i] is None else str(column["solution"][i]),
                          (column.get("image_path") or empty)[i] or "",
                          (column.get("accu_reward_method") or empty)[i])
                   for i in range(n)]
        chosen = [i for i, s in enumerate(samples) if self.applies(s)]
        start = time.perf_counter()
        values, calls = self.score_samples([samples[i] for i in chosen],
                                           [prompts[i] if prompts else "" for i in chosen])
        seconds = time.perf_counter() - start
        out: list[float | None] = [None] * n
        why: list[str | None] = [None] * n
        for i, value in zip(chosen, values, strict=True):
            if isinstance(value, Unparsable):
                why[i] = value.reason
            else:
                out[i] = value
        if log_metric is not None:
            log_metric(f"rewards/{self.name}/seconds", seconds)
            log_metric(f"rewards/{self.name}/calls", float(calls))
        report_counts(log_metric, f"rewards/{self.name}/unparsable", Counter(r for r in why if r),
                      self.reasons)
        if log_extra is not None and self.reasons:
            log_extra(f"{self.name}/unparsable", why)
        self.check_batch([v for v in values if isinstance(v, Unparsable)], len(chosen))
        return out

    def check_batch(self, unreadable: list[Unparsable], scored: int) -> None:
        """Raise ModelRewardError when the batch's unreadable answers are too many (the judge's rule)."""
