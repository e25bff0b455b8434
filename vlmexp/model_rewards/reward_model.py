"""The reward model: a sequence-classification model scores each (prompt, completion), as TRL's GRPOTrainer
scores with a model in `reward_funcs` (trl/trainer/grpo_trainer.py, `_calculate_rewards`): the prompt's turns
and the completion as an assistant turn through the reward model's own chat template, right-padded, no special
tokens added, and the first logit of each sequence is the score; the pad token is the eos token when the
tokenizer has none, and the model's config learns it (the score is read at the last token that is not
padding).

`{name: reward_model, kwargs: {path: FOLDER}}`; options: `batch_size` (sequences per forward), `normalise`
(none: the logit; sigmoid: into (0, 1); batch: standardised over the call's scores), `dtype` (auto, float32,
bfloat16, float16), `trust_remote_code` (off unless set). A folder with an image processor
(preprocessor_config.json) is a vision-language reward model: its processor gets the record's image with the
turns. Loaded once per process, on the process's device (accelerate's PartialState), in eval mode; scored
under torch.inference_mode.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from vlmexp.model_rewards.base import ModelReward, ModelRewardError, Sample, text_messages

NORMALISE = ("none", "sigmoid", "batch")
DTYPES = ("auto", "float32", "bfloat16", "float16")
_LOADED: dict[tuple, Any] = {}  # reward models of this process, by (folder, dtype, trust_remote_code)


@dataclass
class RewardModelReward(ModelReward):
    name: ClassVar[str] = "reward_model"
    path: str = ""
    batch_size: int = 16
    normalise: str = "none"
    dtype: str = "auto"
    trust_remote_code: bool = False

    def __post_init__(self) -> None:
        problems = []
        if not isinstance(self.path, str) or not self.path:
            problems.append("path: give the reward model's folder")
        if self.normalise not in NORMALISE:
            problems.append(f"normalise {self.normalise!r} is not one of {', '.join(NORMALISE)}")
        if self.dtype not in DTYPES:
            problems.append(f"dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")
        if not isinstance(self.batch_size, int) or self.batch_size < 1:
            problems.append(f"batch_size must be a positive integer, got {self.batch_size!r}")
        if problems:
            raise ValueError("; ".join(problems))

    def score_samples(self, samples: list[Sample], prompts: list[Any]):
        import torch

        model, processor, vision = loaded(self.path, self.dtype, self.trust_remote_code)
        scores: list[float] = []
        calls = 0
        for start in range(0, len(samples), self.batch_size):
            batch = list(range(start, min(start + self.batch_size, len(samples))))
            conversations = [[*text_messages(prompts[i]),
                              {"role": "assistant", "content": samples[i].completion}]
                             for i in batch]
            inputs = encode(processor, conversations,
                            [samples[i].image_path for i in batch] if vision else None)
            with torch.inference_mode():
                logits = model(**inputs.to(model.device)).logits[:, 0]
            scores += logits.float().tolist()
            calls += 1
        return self.normalised(scores), calls

    def normalised(self, scores: list[float]) -> list[float]:
        if self.normalise == "sigmoid":
            import math

            return [1 / (1 + math.exp(-s)) for s in scores]
        if self.normalise == "batch" and len(scores) > 1:
            import statistics

            mean, std = statistics.fmean(scores), statistics.pstdev(scores)
            return [(s - mean) / (std + 1e-4) for s in scores]
        return scores


def encode(processor, conversations: list[list[dict[str, Any]]], images: list[str] | None):
    """The batch as the reward model reads it: its chat template, right padding, no special tokens added; with
    `images`, each record's image at the start of its first user turn."""
    if images is None:
        texts = [processor.apply_chat_template(c, tokenize=False) for c in conversations]
        return processor(texts, return_tensors="pt", padding=True, padding_side="right",
                         add_special_tokens=False)
    from vlmexp.prompts import load_images

    pictures, texts = [], []
    for conversation, path in zip(conversations, images, strict=True):
        if not path:
            raise ModelRewardError("reward_model: a vision-language reward model needs each record's image, "
                                   "and this record has none; use a text reward model for text records")
        first = next(i for i, m in enumerate(conversation) if m["role"] == "user")
        turn = conversation[first]
        conversation[first] = {**turn, "content": [{"type": "image"},
                                                   {"type": "text", "text": turn["content"]}]}
        texts.append(processor.apply_chat_template(conversation, tokenize=False))
        pictures += load_images([path])
    return processor(text=texts, images=pictures, return_tensors="pt", padding=True, padding_side="right",
                     add_special_tokens=False)


def loaded(path: str, dtype: str, trust_remote_code: bool):
    """(model, tokenizer or processor, takes images) for a reward model folder, loaded once per process."""
    key = (path, dtype, trust_remote_code)
    if key not in _LOADED:
        _LOADED[key] = _load(path, dtype, trust_remote_code)
    return _LOADED[key]


def _load(path: str, dtype: str, trust_remote_code: bool):
    import torch
    import transformers
    from accelerate import PartialState

    from vlmexp.paths import is_hub_id

    folder = Path(path)
    if not (folder / "config.json").is_file() and not is_hub_id(path):
        raise ModelRewardError(f"reward_model: {folder / 'config.json'} not found; kwargs.path must be a "
                               "sequence-classification model folder (config.json, weights, tokenizer)")
    vision = (folder / "preprocessor_config.json").is_file()  # a Hub id is read as a text reward model
    loader = transformers.AutoProcessor if vision else transformers.AutoTokenizer
    processor = loader.from_pretrained(path, trust_remote_code=trust_remote_code)
    tokenizer = getattr(processor, "tokenizer", processor)
    if tokenizer.chat_template is None and getattr(processor, "chat_template", None) is None:
        raise ModelRewardError(f"reward_model: {path} has no chat template, and the prompt and completion "
                               "are read through it (as TRL reads them); add one to its "
                               "tokenizer_config.json")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    try:
        model = transformers.AutoModelForSequenceClassification.from_pretrained(
            path, dtype="auto" if dtype == "auto" else getattr(torch, dtype),
            trust_remote_code=trust_remote_code)
    except ValueError as e:
        raise ModelRewardError(f"reward_model: {path} is not a sequence-classification model transformers "
                               f"can load ({str(e)[:300]}); give a folder saved from an "
                               f"AutoModelForSequenceClassification")
    # the score is read before the padding
    model.config.get_text_config().pad_token_id = tokenizer.pad_token_id
    return model.to(PartialState().device).eval(), processor, vision
