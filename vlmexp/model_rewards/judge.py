"""The judge: a generative model asked for a score, through an OpenAI-compatible endpoint or from a local
folder.

`{name: judge, kwargs: {model: ..., endpoint: ..., prompt: ...}}`. The prompt template holds {completion} and
may hold {question} (the prompt's last user turn), {reference} (the record's solution), {low} and {high} (the
score range). With `images: true` the record's image goes with the question (an `image_url` data URL to an
endpoint; the image itself to a local vision-language model). As VLM-R1's `llm` method does, the answer judged
is the last <answer>...</answer> of the completion when it has one, else the whole completion (`answer_only`),
and the reference likewise. An empty answer gets `low` without a call.

The reply is parsed strictly: it must be one number (nothing else but spaces) within [low, high]; the score is
then mapped to [0, 1] (`normalise`, default) or kept. Any other reply is unreadable: masked and counted as
`rewards/judge/unparsable/not_a_number` or `.../out_of_range` (and in the completion table's
`judge/unparsable` column); more than `max_unparsable` of a batch unreadable stops the run, quoting the judge.

Without `endpoint`, `model` is a local model folder (a supported vision-language family, or a causal language
model), loaded once per process on the process's device and run greedily; trust_remote_code only when
`trust_remote_code: true`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, ClassVar

from vlmexp.model_rewards.base import ModelReward, ModelRewardError, Sample, Unreadable

DEFAULT_PROMPT = (
    "You grade answers. Question: {question}\nReference answer: {reference}\nAnswer to grade: {completion}\n"
    "How well does the answer to grade agree with the reference answer? Reply with one number from "
    "{low} (wrong) to {high} (the same meaning) and nothing else."
)
PROMPT_FIELDS = ("completion", "question", "reference", "low", "high")
RECORDS = ("all", "llm")
NUMBER = re.compile(r"[+-]?(\d+(\.\d*)?|\.\d+)")
_LOCAL: dict[tuple, Any] = {}  # local judge models of this process, by (folder, trust_remote_code)


def parse_score(reply: str, low: float, high: float) -> float | Unreadable:
    """The number `reply` is, when it is one number within [low, high]; else Unreadable with the reply."""
    text = reply.strip()
    if not NUMBER.fullmatch(text):
        return Unreadable("not_a_number", reply)
    value = float(text)
    return value if low <= value <= high else Unreadable("out_of_range", reply)


@dataclass
class JudgeReward(ModelReward):
    name: ClassVar[str] = "judge"
    reasons: ClassVar[tuple[str, ...]] = ("not_a_number", "out_of_range")
    model: str = ""  # the served model's name (with endpoint), else a local model folder
    endpoint: str | None = None  # http(s)://host:port/v1
    prompt: str = DEFAULT_PROMPT
    system: str | None = None  # a system message before the prompt
    low: float = 0.0
    high: float = 10.0
    normalise: bool = True
    images: bool = False
    records: str = "all"  # all, or llm: only records whose accu_reward_method is llm (VLM-R1's)
    answer_only: bool = True
    max_unparsable: float = 0.5  # the share of a batch's answers that may be unreadable
    max_tokens: int = 16
    timeout: float = 60.0
    retries: int = 3
    backoff: float = 1.0
    concurrency: int = 8
    api_key_env: str | None = None  # the environment variable holding the endpoint's API key
    batch_size: int = 8  # local model: prompts per generate call
    trust_remote_code: bool = False

    def __post_init__(self) -> None:
        from vlmexp.config.base import check_template

        problems = []
        if not isinstance(self.model, str) or not self.model:
            problems.append("model: give the served model's name (with endpoint) or a local model folder")
        if self.endpoint is not None and not re.match(r"https?://[^/\s]+", str(self.endpoint)):
            problems.append(f"endpoint {self.endpoint!r} is not an http(s) URL such as http://127.0.0.1:8000/v1")
        if self.api_key_env is not None and self.endpoint is None:
            problems.append("api_key_env applies to an endpoint; remove it or set endpoint")
        try:
            check_template(self.prompt, PROMPT_FIELDS, "prompt")
        except ValueError as e:
            problems.append(str(e))
        if not self.low < self.high:
            problems.append(f"low ({self.low}) must be below high ({self.high})")
        if self.records not in RECORDS:
            problems.append(f"records {self.records!r} is not one of {', '.join(RECORDS)}")
        if not 0 <= self.max_unparsable <= 1:
            problems.append(f"max_unparsable {self.max_unparsable} is not a share between 0 and 1")
        for field in ("timeout", "concurrency", "max_tokens", "batch_size"):
            if not getattr(self, field) > 0:
                problems.append(f"{field} must be positive, got {getattr(self, field)!r}")
        if self.retries < 0 or self.backoff < 0:
            problems.append(f"retries ({self.retries}) and backoff ({self.backoff}) cannot be negative")
        if problems:
            raise ValueError("; ".join(problems))

    def applies(self, sample: Sample) -> bool:
        return self.records == "all" or sample.method == "llm"

    def question_text(self, sample: Sample) -> str:
        from vlmexp.answers import extract_answer

        answer, reference = sample.completion, sample.reference
        if self.answer_only:
            answer = extract_answer(answer) or answer
            reference = extract_answer(reference) or reference
        return self.prompt.format(completion=answer.strip(), question=sample.question,
                                  reference=reference.strip(), low=f"{self.low:g}", high=f"{self.high:g}")

    def score_samples(self, samples: list[Sample], prompts: list[Any]):
        asked = [i for i, s in enumerate(samples) if (self.answer_text(s)).strip()]
        texts = [self.question_text(samples[i]) for i in asked]
        if not asked:
            replies, calls = [], 0
        elif self.endpoint is not None:
            replies, calls = self.ask_endpoint(texts, [samples[i].image_path for i in asked])
        else:
            replies, calls = self.ask_local(texts, [samples[i].image_path for i in asked])
        out: list[Any] = [self.scaled(self.low)] * len(samples)
        for i, reply in zip(asked, replies, strict=True):
            value = parse_score(reply, self.low, self.high)
            out[i] = value if isinstance(value, Unreadable) else self.scaled(value)
        return out, calls

    def answer_text(self, sample: Sample) -> str:
        from vlmexp.answers import extract_answer

        return ((extract_answer(sample.completion) or sample.completion) if self.answer_only
                else sample.completion)

    def scaled(self, value: float) -> float:
        return (value - self.low) / (self.high - self.low) if self.normalise else value

    def conversation(self, text: str, image_path: str) -> list[dict[str, Any]]:
        from vlmexp.model_rewards.client import image_part

        content: Any = text
        if self.images and image_path:
            content = [image_part(image_path), {"type": "text", "text": text}]
        return [*([{"role": "system", "content": self.system}] if self.system else []),
                {"role": "user", "content": content}]

    def ask_endpoint(self, texts: list[str], images: list[str]) -> tuple[list[str], int]:
        from vlmexp.model_rewards.client import ChatClient

        client = ChatClient(self.endpoint or "", self.model, self.timeout, self.retries, self.backoff,
                            self.concurrency, self.max_tokens, self.api_key_env)
        return client.complete([self.conversation(t, p) for t, p in zip(texts, images, strict=True)])

    def ask_local(self, texts: list[str], images: list[str]) -> tuple[list[str], int]:
        """Greedy replies of the local judge model through the generation engine (`vlmexp.generation`),
        `batch_size` prompts per generate call."""
        from vlmexp.generation import Generator
        from vlmexp.prompts import load_images

        model, processor, family = local_judge(self.model, self.trust_remote_code)
        system = [{"role": "system", "content": self.system}] if self.system else []
        prompts = [[*system, {"role": "user", "content": t}] for t in texts]
        pictures = [load_images([p]) if self.images and p and family is not None else [] for p in images]
        generate = Generator(model, processor, family)
        calls = -(-len(prompts) // self.batch_size)
        return generate(prompts, pictures, self.max_tokens, 0.0, self.batch_size), calls

    def check_batch(self, unreadable, scored: int) -> None:
        if scored and len(unreadable) > self.max_unparsable * scored:
            quoted = "; ".join(repr(u.said[:200]) for u in unreadable[:3])
            raise ModelRewardError(
                f"judge: {len(unreadable)} of {scored} answers in this batch are not one number in "
                f"[{self.low:g}, {self.high:g}] (over max_unparsable {self.max_unparsable:g}); the judge "
                f"said: {quoted}. Make the prompt ask for the number alone, raise max_tokens, or use another "
                f"judge model")


def local_judge(folder: str, trust_remote_code: bool):
    """(model, processor or tokenizer, family or None for a text-only model) of a local judge folder, loaded
    once per process on its device (`vlmexp.modeling.load_chat_model`)."""
    from pathlib import Path

    from vlmexp.modeling import load_chat_model

    key = (folder, trust_remote_code)
    if key not in _LOCAL:
        if not (Path(folder) / "config.json").is_file():  # a local folder: the judge runs offline
            raise ModelRewardError(f"judge: {Path(folder) / 'config.json'} not found; kwargs.model must be a "
                                   "local model folder, or set kwargs.endpoint to ask a served model")
        _LOCAL[key] = load_chat_model(folder, trust_remote_code)
    return _LOCAL[key]
