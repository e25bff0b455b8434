"""Rewards: small callables with TRL's signature, one registry, YAML picks names, weights and kwargs.

Signature (TRL GRPOTrainer): `f(prompts, completions, **columns) -> list[float | None]`; completions[i]
is a list of messages (or a string). Dataset columns arrive as keyword lists: `solution`, `task`,
`image_sizes`, ... A reward returns None for samples it does not apply to (a math reward on a grounding
record); TRL ignores those in the weighted sum. A reward that raises stops training with its name and the
offending sample (`RewardError`). Evaluation scores with these same objects. A config's reward entry becomes
one of them, or an imported `module:function`, in `vlmexp.rewards_loader` (`build_reward`).

Rewards keep no state between calls. They report through the hooks TRL 1.16 passes to every reward
function: `log_metric(name, value)` and `log_extra(column, values)`. A completion that cannot be parsed
scores 0, and each call logs `rewards/<name>/unparsable/<reason>`: how many completions of the batch had
that problem (every reason the reward knows is logged, zeros included, so the metric's mean over a
logging window is the mean count per generation batch), plus a `<name>/unparsable` column (the reason
or None per completion) for the completion table. Scores that are NaN, inf, or a custom reward's None
are masked (None) and counted the same way as `rewards/<name>/masked/<reason>`. Called without the
hooks (evaluation, DPO's pair scoring), nothing is reported.

The rewards computed by a model, `judge` and `reward_model`, live in `vlmexp.model_rewards` (registered beside
these by `vlmexp.rewards_loader`); a `RewardError` they raise about a whole batch (an endpoint down, too many
unreadable answers) passes the guarded wrapper unchanged.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from vlmexp import answers
from vlmexp.answers import extract_answer
from vlmexp.coords import from_frame, giou, iou, parse_box

Score = float | None


class RewardError(RuntimeError):
    """A reward function raised: training stops, naming the reward and the sample."""


def completion_text(completion: Any) -> str:
    """The assistant text of a TRL completion (list of messages, a message, or a string); of a conversation
    with tool turns (grpo.tools), its final assistant turn: the answer the rewards score. A message's
    `reasoning_content` (where a response parser moved the turn's <think>) is given back in its tags."""
    if isinstance(completion, list) and any(isinstance(m, dict) and m.get("role") == "tool"
                                            for m in completion):
        completion = [m for m in completion if isinstance(m, dict) and m.get("role") == "assistant"][-1:]
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        text = completion_text(completion.get("content", ""))
        reasoning = completion.get("reasoning_content")
        return f"<think>{reasoning}</think>{text}" if reasoning else text
    if isinstance(completion, list):
        return "".join(
            part.get("text", "") if isinstance(part, dict) and "content" not in part
            else completion_text(part)
            for part in completion
        )
    return str(completion)


def column(kwargs: dict[str, Any], name: str, n: int) -> list[Any]:
    values = kwargs.get(name)
    return list(values) if values is not None else [None] * n


@dataclass(frozen=True)
class Unparsable:
    """What `score` returns for a completion it cannot read: it scores 0 and `reason` is counted."""

    reason: str


def report_counts(log_metric: Callable[[str, float], None] | None, prefix: str, counts: Counter,
                  known: Sequence[str] = ()) -> None:
    """Log `prefix/<reason>` for every known reason (zeros included) and every other reason that occurred."""
    if log_metric is not None:
        for reason in dict.fromkeys([*known, *counts]):
            log_metric(f"{prefix}/{reason}", float(counts[reason]))


@dataclass
class Reward:
    """Base class: subclasses implement `score(text, **sample) -> float | Unparsable | None`."""

    name: ClassVar[str] = ""
    tasks: ClassVar[tuple[str, ...]] = ()  # tasks it applies to; () = every task
    reasons: ClassVar[tuple[str, ...]] = ()  # why `score` may find a completion unparsable

    @property
    def __name__(self) -> str:  # TRL names the reward's metrics after __name__
        return self.name

    def __call__(self, prompts: Sequence[Any] | None = None, completions: Sequence[Any] = (),
                 log_metric: Callable[[str, float], None] | None = None,
                 log_extra: Callable[[str, list], None] | None = None, **kwargs: Any) -> list[Score]:
        n = len(completions)
        columns = {k: column(kwargs, k, n) for k, v in kwargs.items() if isinstance(v, (list, tuple))}
        out: list[Score] = []
        why: list[str | None] = []
        for i, completion in enumerate(completions):
            sample = {k: v[i] for k, v in columns.items()}
            value = (None if self.tasks and sample.get("task") not in (None, *self.tasks)
                     else self.score(completion_text(completion), **sample))
            why.append(value.reason if isinstance(value, Unparsable) else None)
            out.append(0.0 if isinstance(value, Unparsable) else value)
        if self.reasons:
            report_counts(log_metric, f"rewards/{self.name}/unparsable", Counter(r for r in why if r),
                          self.reasons)
            if log_extra is not None:
                log_extra(f"{self.name}/unparsable", why)
        return out

    @staticmethod
    def fail(reason: str) -> Unparsable:
        return Unparsable(reason)

    def score(self, text: str, **sample: Any) -> float | Unparsable | None:
        raise NotImplementedError


@dataclass
class FormatReward(Reward):
    """1 when the completion has the asked-for shape.

    style "answer" (VLM-R1): exactly <think>...</think><answer>...</answer> (tags configurable).
    style "boxed" (EasyR1's math format reward, `<think>.*</think>.*\\boxed\\{.*\\}.*`): reasoning in
    <think></think>, then the final answer in \\boxed{}.
    prefilled_think: the chat template's generation prompt already ends in <think> (Qwen3-VL "Thinking"
    templates), so completions start inside the think block; they are scored as if the tag were in them.
    Left unset, build_reward reads it from the loaded template (vlmexp.processor.prefills_think).
    """

    name: ClassVar[str] = "format"
    think_tag: str = "think"
    answer_tag: str = "answer"
    style: str = "answer"
    prefilled_think: bool | None = None

    def __post_init__(self) -> None:
        t, a = re.escape(self.think_tag), re.escape(self.answer_tag)
        patterns = {"answer": rf"\s*<{t}>.*?</{t}>\s*<{a}>.*?</{a}>\s*",
                    "boxed": rf"\s*<{t}>.*</{t}>.*\\boxed\{{.*\}}.*"}
        if self.style not in patterns:
            raise TypeError(f"style {self.style!r} is not one of {sorted(patterns)}")
        self._pattern = re.compile(patterns[self.style], re.DOTALL)

    def score(self, text: str, **sample: Any) -> float:
        if self.prefilled_think:
            text = f"<{self.think_tag}>{text}"
        return 1.0 if self._pattern.fullmatch(text) else 0.0


@dataclass
class IoUReward(Reward):
    """IoU in original pixels after mapping the predicted box from the family's frame.

    `frame` and `budget` come from the model family and its loaded processor (see build_reward).
    """

    name: ClassVar[str] = "iou"
    tasks: ClassVar[tuple[str, ...]] = ("rec",)
    reasons: ClassVar[tuple[str, ...]] = ("no_answer", "non_finite_box", "no_box", "degenerate_box")
    frame: str = "pixels"
    budget: Any = None  # vlmexp.processor.PixelBudget, needed for the "pixels" frame
    answer_tag: str = "answer"

    def score(self, text: str, solution: Any = None, image_sizes: Any = None,
              **sample: Any) -> float | Unparsable | None:
        gold = parse_box(solution)
        if gold is None or not image_sizes:
            raise ValueError(f"record has no ground-truth box or image size (solution={solution!r}, "
                             f"image_sizes={image_sizes!r}); sample it with `vlmexp sample`")
        box = self.box(text, image_sizes)
        return box if isinstance(box, Unparsable) else self.value(box, gold)

    def box(self, text: str, image_sizes: Any) -> list[float] | Unparsable:
        """The completion's box in original pixels of the record's first image, as `score` reads it."""
        answer = extract_answer(text, self.answer_tag)
        if answer is None:
            return self.fail("no_answer")
        try:
            box = parse_box(answer)
        except ValueError:  # NaN or infinity in the model's box
            return self.fail("non_finite_box")
        if box is None:
            return self.fail("no_box")
        if box[2] <= box[0] or box[3] <= box[1]:
            return self.fail("degenerate_box")
        width, height = image_sizes[0]
        return from_frame(box, width, height, self.frame, self.budget)

    def value(self, predicted: list[float], gold: list[float]) -> float:
        return iou(predicted, gold)


@dataclass
class IoUThresholdReward(IoUReward):
    """1 when IoU >= `threshold`, else 0."""

    name: ClassVar[str] = "iou_threshold"
    threshold: float = 0.5

    def value(self, predicted: list[float], gold: list[float]) -> float:
        return float(iou(predicted, gold) >= self.threshold)


@dataclass
class GIoUReward(IoUReward):
    """(GIoU + 1) / 2 in [0, 1]: dense where IoU is 0 everywhere."""

    name: ClassVar[str] = "giou"

    def value(self, predicted: list[float], gold: list[float]) -> float:
        return (giou(predicted, gold) + 1) / 2


@dataclass
class MathReward(Reward):
    """1 when the answer (\\boxed{} or <answer>) equals the solution as `grader` judges it: math_verify
    (default) or mathruler, EasyR1's and verl's grader (the optional extra `vlmexp[mathruler]`)."""

    name: ClassVar[str] = "math"
    tasks: ClassVar[tuple[str, ...]] = ("math",)
    reasons: ClassVar[tuple[str, ...]] = ("no_answer", "unparsable_answer")
    answer_tag: str = "answer"
    grader: str = "math_verify"

    def __post_init__(self) -> None:
        answers.check_math_grader(self.grader)

    def score(self, text: str, solution: Any = None, **sample: Any) -> float | Unparsable | None:
        answer = extract_answer(text, self.answer_tag)
        if answer is None:
            return self.fail("no_answer")
        gold = str(extract_answer(str(solution), self.answer_tag) or solution)
        correct = answers.grade_math(answer, gold, self.grader)
        return self.fail("unparsable_answer") if correct is None else float(correct)


DEFAULT_MATCHES = ("vlm_r1", "exact")  # how the exact reward scores accu_reward_method "default"


@dataclass
class ExactReward(Reward):
    """Text answers, scored per record by its `accu_reward_method` column (vlmexp.answers):
    default: as VLM-R1's default_accuracy_reward (math-verify, then numbers, a choice letter, or the
    Levenshtein ratio: partial credit); with default_match "exact", equal after normalising case, spaces and
    punctuation, or the same choice letter ("B", "(B)").
    mcq / yes_no: the choice letter / yes or no the answer names, against the solution's.
    all_match: equal after VLM-R1's clean_text (lower case, a final '.' dropped)."""

    name: ClassVar[str] = "exact"
    tasks: ClassVar[tuple[str, ...]] = ("exact",)
    reasons: ClassVar[tuple[str, ...]] = ("no_answer", "no_choice")
    answer_tag: str = "answer"
    default_match: str = "vlm_r1"

    def __post_init__(self) -> None:
        if self.default_match not in DEFAULT_MATCHES:
            raise ValueError(f"default_match {self.default_match!r} is not one of "
                             f"{', '.join(DEFAULT_MATCHES)}")

    def score(self, text: str, solution: Any = None, accu_reward_method: Any = None,
              **sample: Any) -> float | Unparsable | None:
        method = accu_reward_method or "default"
        if method == "llm":  # VLM-R1's judge-scored records: the judge reward scores them, not this one
            return None
        if method in answers.CHOICE_METHODS:  # VLM-R1 mcq_reward / yes_no_reward: the first <answer>
            gold = answers.gold_choice(method, str(solution))
            if gold is None:
                raise ValueError(f"the {method} solution {solution!r} names no choice; fix the record")
            said = answers.answer_text(text, self.answer_tag, last=False)
            choice = answers.extract_choice(said) if method == "mcq" else answers.extract_yes_no(said)
            return self.fail("no_choice") if choice is None else float(choice == gold)
        if method == "all_match":  # VLM-R1 all_match_reward
            return float(answers.clean_text(text, self.answer_tag) == answers.clean_text(str(solution)))
        if method != "default":
            raise ValueError(f"unknown answer method {method!r}; sample the records again with "
                             "`vlmexp sample`")
        if self.default_match == "vlm_r1":
            score = answers.vlm_r1_default(text, str(solution), self.answer_tag)
            return self.fail("no_choice") if score is None else score
        answer = extract_answer(text, self.answer_tag)
        if answer is None:
            return self.fail("no_answer")
        gold = extract_answer(str(solution), self.answer_tag) or str(solution)
        return float(answers.exact_match(answer, gold))


@dataclass
class DetectionReward(Reward):
    """Several boxes per answer against several targets (vlmexp.detection), by the `accu_reward_method`
    column: od_ap, od_ap50, map (COCO AP), odLength (AP times a length penalty), weighted_sum (VLM-R1's
    matching score). The model's boxes are read in the family's frame, the solution's in original pixels."""

    name: ClassVar[str] = "detection"
    tasks: ClassVar[tuple[str, ...]] = ("detection",)
    reasons: ClassVar[tuple[str, ...]] = ("no_answer", "no_json_block", "bad_json", "not_a_list")
    frame: str = "pixels"
    budget: Any = None

    def objects(self, text: str, solution: Any, method: Any, image_sizes: Any):
        """(predicted boxes in original pixels, items listed, target boxes) or Unparsable."""
        from vlmexp.detection import Unreadable, gold_objects, predicted_objects

        if method is None or not image_sizes:
            raise ValueError(f"detection record without a method or image size (method={method!r}, "
                             f"image_sizes={image_sizes!r}); sample it with `vlmexp sample`")
        try:
            found, listed = predicted_objects(text, method)
        except Unreadable as e:
            return self.fail(e.reason)
        width, height = image_sizes[0]
        mapped = [(from_frame(box, width, height, self.frame, self.budget), label) for box, label in found]
        return mapped, listed, gold_objects(str(solution), method)

    def score(self, text: str, solution: Any = None, accu_reward_method: Any = None, image_sizes: Any = None,
              **sample: Any) -> float | Unparsable | None:
        from vlmexp.detection import detection_reward

        read = self.objects(text, solution, accu_reward_method, image_sizes)
        return read if isinstance(read, Unparsable) else detection_reward(accu_reward_method, *read)


# the rewards that score a completion's text; those of a tool run (`tool`, `zoom_target`) are
# vlmexp.tools.rewards' TOOL_REWARDS, and the loader's REWARDS joins both with the model rewards
REGISTRY: dict[str, type[Reward]] = {cls.name: cls for cls in (FormatReward, IoUReward, IoUThresholdReward,
                                                                 GIoUReward, MathReward, ExactReward,
                                                                 DetectionReward)}


class guarded:  # noqa: N801 - used like a function; a class so the reward stays picklable
    """Wrap a reward so an exception stops training with the reward's name and the sample that broke it."""

    def __init__(self, fn: Callable[..., list[Score]], name: str):
        self.fn, self.__name__ = fn, name

    def __call__(self, prompts=None, completions=(), **kwargs):
        try:
            scores = self.fn(prompts=prompts, completions=completions, **kwargs)
        except RewardError:
            # about the whole batch (a model reward's endpoint, its unreadable answers): as it is
            raise
        except Exception as batch_error:
            for i in range(len(completions)):
                # find the first sample that raises, to name it (hooks left out)
                one = {k: [v[i]] if isinstance(v, (list, tuple)) and len(v) == len(completions) else v
                       for k, v in kwargs.items() if k not in ("log_metric", "log_extra")}
                try:
                    self.fn(prompts=[prompts[i]] if prompts else None, completions=[completions[i]], **one)
                except Exception as e:
                    text = completion_text(completions[i])[:200]
                    raise RewardError(f"reward {self.__name__!r} raised {e.__class__.__name__}: {e} on "
                                      f"sample {i} (completion {text!r}, "
                                      f"solution {one.get('solution')!r})") from e
            raise RewardError(f"reward {self.__name__!r} raised {batch_error!r} "
                              "on the batch") from batch_error
        scores, masked = self._checked(scores, len(completions))
        custom = not isinstance(self.fn, Reward)  # a built-in's None means "not this sample's task"
        report_counts(kwargs.get("log_metric"), f"rewards/{self.__name__}/masked", masked,
                      ("nan", "inf", "none") if custom else ())
        return scores

    def _checked(self, scores: Any, n: int) -> tuple[list[Score], Counter]:
        """(one float or None per completion, masked counts by reason). NaN and inf become None (masked):
        TRL sums the weighted rewards with nansum, so a masked sample gets no credit from this reward, and a
        NaN never reaches the advantages. A custom reward's None is counted as masked too."""
        if not isinstance(scores, (list, tuple)) or len(scores) != n:
            raise RewardError(f"reward {self.__name__!r} must return a list of {n} scores (one per "
                              f"completion), got {type(scores).__name__} of length "
                              f"{len(scores) if hasattr(scores, '__len__') else '?'}")
        out: list[Score] = []
        masked: Counter = Counter()
        custom = not isinstance(self.fn, Reward)
        for i, value in enumerate(scores):
            if value is None:
                if custom:
                    masked["none"] += 1
                out.append(None)
                continue
            if not isinstance(value, (int, float)) and not hasattr(value, "__float__"):
                raise RewardError(f"reward {self.__name__!r} returned {value!r} for sample {i}; return a "
                                  "float or None")
            value = float(value)
            if math.isfinite(value):
                out.append(value)
            else:
                masked["nan" if math.isnan(value) else "inf"] += 1
                out.append(None)
        return out, masked

