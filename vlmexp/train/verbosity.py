"""Whether transformers speaks on the terminal beyond a stage's progress line (vlmexp.train.progress): its log
level (`--verbose`, `TRANSFORMERS_VERBOSITY=info`, a stage's `args.log_level`), and its progress bar over a
model's save, which is off below that level. Light: transformers' logging module alone, no torch, so that
`vlmexp run`'s own process can quiet its saves (a tiny model's build, the export) before it needs torch."""

from __future__ import annotations

import logging

# the description of transformers' progress bar over the files of a save (PreTrainedModel.save_pretrained):
# at each checkpoint of a stage, its final save, a tiny model's build, the export
SAVE_BAR = "Writing model shards"


def verbose() -> bool:
    """Whether the Trainer's metric dicts are shown: transformers' log level is INFO or lower."""
    from transformers.utils import logging as hf_logging

    return hf_logging.get_verbosity() <= logging.INFO


def quiet_model_saves() -> None:
    """No progress bar for a model's save in this process, unless `verbose()` (then it is shown again);
    transformers' other bars (a model's loading) stay."""
    from transformers.utils import logging as hf_logging

    def hook(factory, args, kwargs):
        if kwargs.get("desc") == SAVE_BAR:
            return hf_logging.EmptyTqdm(*args, **kwargs)
        return factory(*args, **kwargs)

    hf_logging.set_tqdm_hook(None if verbose() else hook)
