"""GRPO with images of different sizes: why TRL 1.16 paired completions with the wrong image positions, the
fix, and a guard that stops training if a completion is ever paired with images that are not its prompt's.

Root cause (trl 1.16.0, transformers 5.23, found with the tiny Qwen2.5-VL): the pairing of samples with
their images is right all the way (split_pixel_values_by_grid / shuffle_sequence_dict / split_tensor_dict /
unsplit_pixel_values_by_grid keep `pixel_values`, `image_grid_thw` and `num_images` together per sample).
What goes wrong is the row of image-token TYPES. `GRPOTrainer._generate_and_score_completions` left-pads
`prompt_ids` itself, but takes `mm_token_type_ids` (1 where a token is an image token) from
`processing_class(images=..., text=..., padding=True)`, which pads on the processor's own `padding_side`.
Qwen-VL processors pad on the right; TRL only sets "left" on a processor it loads itself, and the pipeline
passes its own (TRL maintainers: configuring it is the caller's job, huggingface/trl#5785). In a generation
batch whose prompts differ in length (image grids or text), every shorter prompt's image-token types sit
to the left of its image tokens. Qwen-VL's get_rope_index then builds 3D positions from those types: cut by
the attention mask, the count no longer matches the grid ("shape mismatch: value tensor of shape [3, 196]
cannot be broadcast to indexing result of shape [3, 180]"), or, when the padding is shorter than the text
before the image, it silently gives image positions to text tokens. Generation is not affected (TRL
left-pads the per-prompt types it gets from apply_chat_template there): only the log-probabilities the
loss is computed from are. One prompt per generation batch means no padding, hence the old refusal.

Fix: a left-padding processor (`left_pad`), what TRL itself sets up. Any number of prompts and image
sizes per generation batch then train with HF generate. vLLM colocate shares the same scoring path
(`_generate_and_score_completions` builds the same forward inputs whatever generated the completions), so
the fix and the guard hold there too. vLLM has a separate, known fault of its own in trl 1.16: it receives
prompt ids with the image placeholders already expanded plus the raw image and may expand them again
(huggingface/trl#6294, open; fixes proposed in #6718 and #6719); the guard sees the tensors the loss uses, not
vLLM's internal prompt, so check vLLM rollouts against HF generate before trusting them.

InternVL (found with the tiny InternVL, trl 1.16.0): each image is cut into 1 to max_patches + 1 tiles, so
`pixel_values` is tile-indexed ([total tiles, 3, 448, 448]) and samples of one generation batch hold different
numbers of rows. TRL 1.16 handles that itself: `_generate_and_score_completions` asks the image processor for
each image's `num_patches` (with crop_to_patches=True, the image processor's own min/max_patches) whenever
the rows are not one per image, returns them as `num_tiles`, and split_pixel_values_by_grid /
shuffle_sequence_dict / `_get_per_token_logps_and_entropies` cut `pixel_values` by them. InternVLProcessor
pads on the left by default and InternVL's positions are plain 1D ones (no token types, no rope index), so the
right-padding fault above does not arise either. Measured: 8 prompts x 4 completions per step over images of
1 to 7 tiles, 4 micro-batches, every sample's tiles, image tokens and pixels its own. What the pipeline must
keep true is that TRL's tile count and the processor's agree: `set_image_budget` writes the config's
min/max_patches into the image processor (and crop_to_patches=True), the one both read. No fix needed; the
guard below checks it on every micro-batch.

Guard: every micro-batch that reaches the loss is checked per sample against its own record (the image layout
the budget gives the record's `image_sizes`: Qwen-VL's grids, InternVL's tiles; the number of image tokens;
the image-token types) and against the pixels the processor made for it (a checksum taken before TRL shuffles
and splits the generation batch, so two images of one layout cannot trade places unseen). It also catches
TRL's other silent path: when any sample's image-token count does not match its grids,
`_generate_and_score_completions` drops the images of the whole batch ("Drop all images", `has_mismatch`; in
trl 1.16 reachable through tool-returned images) and would train on the text alone. The family module says
what a layout is (`Family.image_layout`, `batch_layouts`, `layout_rows`, `layout_tokens`,
`layout_image_tokens`).

Tools (grpo.tools): a crop the zoom tool returns is one more image of its sample, after the record's, its
placeholders in the completion (TRL's tool turn). The expected layout is then the record's images followed by
the crops the sample's environment made, in order; TRL drops a tool result that would not fit
max_completion_length, so a sample may carry fewer crops than its environment made, never others. Image
tokens are counted over prompt and completion, and each image must show whole, as one run of image-token
types, under the forward's attention mask (`attended_images`): Qwen-VL's rope index gives each run the batch's
next grid, so one image masked out shifts every later sample onto another image's grid.
"""

from __future__ import annotations

import time
from itertools import groupby
from typing import Any

import numpy as np
import torch
from trl import GRPOTrainer

from vlmexp.families import Family

# per-sample (record label, images, expected image layout, pixel checksum) that travels with the generation
# batch through TRL's shuffle and split (lists are permuted and sliced in unison with the tensors)
EXPECTED = "vlmexp_expected_images"


class PairingError(RuntimeError):
    """A completion reached the loss with images, grids or image-token positions that are not its prompt's."""


def left_pad(processor) -> None:
    """Pad prompts on the left, as GRPOTrainer's own `prompt_ids` are (see the module docstring)."""
    getattr(processor, "tokenizer", processor).padding_side = "left"


def pixel_checksums(pixel_values: torch.Tensor, rows_per_sample: list[int]) -> list[float]:
    """One number per sample: the sum of every 64th value of its pixel rows (a Qwen-VL patch row, an InternVL
    tile); enough to tell two images of one layout apart, a sixty-fourth of the work of summing them all
    (which took ~1 s per demo step on 2 CPU cores)."""
    device = pixel_values.device
    sample_of_row = torch.repeat_interleave(torch.arange(len(rows_per_sample), device=device),
                                            torch.tensor(rows_per_sample, device=device))
    per_row = pixel_values.flatten(1)[:, ::64].sum(-1, dtype=torch.float64)  # [rows]
    sums = torch.zeros(len(rows_per_sample), dtype=torch.float64, device=device)
    return sums.index_add_(0, sample_of_row, per_row).tolist()


def check_pairing(batch: dict[str, Any], family: Family, budget, image_token_id: int, step: int) -> None:
    """Raise PairingError unless each sample of the micro-batch carries its own record's images."""
    labels, images, expected, checksums = zip(*batch[EXPECTED], strict=True)
    want_rows = [family.layout_rows(e) for e in expected]
    if not sum(images):
        return
    pixels, num_images = batch.get("pixel_values"), [int(n) for n in batch.get("num_images") or []]
    got = family.batch_layouts(batch, num_images) if pixels is not None and num_images else None
    if got is None:
        raise PairingError(
            f"GRPO step {step}: the records of this batch have {sum(images)} image(s) but the batch reaching "
            "the loss has none: TRL dropped the images of the whole batch (GRPOTrainer's 'Drop all images' "
            "fallback when some sample's image-token count does not match its grids, e.g. truncated) "
            "and would train on the text alone; stopped before the update. Raise max_completion_length or "
            "remove the cause of the truncation")
    problems = []
    if num_images != list(images):
        problems.append(f"images per sample {num_images}, records have {list(images)}")
    elif len(got) != len(expected):
        problems.append(f"{len(got)} samples' images, {len(expected)} records")
    else:
        problems += [f"sample {i} ({labels[i]}): {family.layout_name} {g.tolist()}, its record's {e.tolist()}"
                     for i, (g, e) in enumerate(zip(got, expected, strict=True)) if not torch.equal(g, e)]
        if sum(want_rows) == pixels.size(0):
            sums = pixel_checksums(pixels, want_rows)
            problems += [f"sample {i} ({labels[i]}): pixels of another image (checksum {s:.6g}, "
                         f"its own {c:.6g})"
                         for i, (s, c) in enumerate(zip(sums, checksums, strict=True))
                         if abs(s - c) > 1e-6 * max(1.0, abs(c))]
    # the record's image tokens sit in the prompt, a tool's crops in the completion
    is_image = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1) == image_token_id  # [B, P+C]
    want_tokens = torch.tensor([family.layout_tokens(e, budget) for e in expected], device=is_image.device)
    problems += [f"sample {i} ({labels[i]}): {n} image tokens in its prompt, its record's "
                 f"{family.layout_name} need {want_tokens[i].item()}"
                 for i, n in enumerate(is_image.sum(1).tolist()) if n != want_tokens[i]]
    types = batch.get("mm_token_type_ids")
    if types is not None:
        off = ((types[:, : is_image.size(1)] == 1) != is_image).any(1)
        problems += [f"sample {i} ({labels[i]}): image-token types do not line up with its image tokens "
                     "(the processor pads on the other side)" for i in off.nonzero().flatten().tolist()]
        problems += attended_images(batch, types, expected, labels, family, budget)
    if sum(want_rows) != pixels.size(0):
        problems.append(f"{pixels.size(0)} pixel rows for {family.layout_name} needing {sum(want_rows)}")
    if problems:
        raise PairingError(
            f"GRPO step {step}: completions paired with images that are not their prompt's ({len(problems)} "
            f"problem(s)): {'; '.join(problems[:4])}. Training stopped before the update; this TRL version "
            "breaks the pairing (vlmexp/train/grpo_pairing.py explains the one fixed for trl 1.16)")


def attended_images(batch: dict[str, Any], types: torch.Tensor, expected, labels, family: Family,
                    budget) -> list[str]:
    """What is wrong with the images the forward's attention mask (prompt_mask, completion_mask) shows: the
    model's rope index (Qwen-VL's get_rope_index) reads each image as one run of image-token types under
    that mask and takes the batch's next grid for it, so each sample must show every one of its images,
    whole. An image whose tokens are masked out (a crop in a completion whose mask was zeroed) keeps its
    grid in the batch, and every later sample takes the wrong grid: a "shape mismatch" in the forward, or,
    where the grids are equal, wrong positions in silence."""
    shown = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1).bool()
    problems = []
    for i, (row, mask) in enumerate(zip((types[:, : shown.size(1)] == 1).tolist(), shown.tolist(),
                                        strict=True)):
        runs = [len(list(run)) for flag, run in groupby(f for f, m in zip(row, mask, strict=True) if m)
                if flag]
        want = family.layout_image_tokens(expected[i], budget)
        if runs != want:
            problems.append(f"sample {i} ({labels[i]}): its images' tokens under the attention mask run "
                            f"{runs}, its images need {want} (an image masked out of the forward)")
    return problems


# image fields of a batch, flattened over the images (not per token)
IMAGE_FIELDS = ("pixel_values", "image_grid_thw")


class GuardedGRPOTrainer(GRPOTrainer):
    """GRPOTrainer with the pairing guard; training itself is TRL's, unchanged.

    `_generate_and_score_completions` attaches each sample's expected image layout (the family's, from its
    `image_sizes` column and the image budget) to the generation batch (and logs its image path and solution
    for the completion table); `_prepare_inputs` checks the micro-batch it returns for the loss.
    `guard_seconds` adds up the time the guard costs (bench/grpo_guard.py reports it per step).
    """

    def __init__(self, *args, family: Family, budget, **kwargs):
        super().__init__(*args, **kwargs)
        self.family, self.budget, self.guard_seconds = family, budget, 0.0
        tokenizer = getattr(self.processing_class, "tokenizer", self.processing_class)
        self.image_token_id = tokenizer.convert_tokens_to_ids(family.image_token)

    def _tokenize_prompts(self, prompts: list):
        """TRL's, with the image fields as tensors. With environments (grpo.tools) TRL 1.16 renders each
        prompt apart without `return_tensors` and merges `pixel_values` and `image_grid_thw` as lists; its
        tool loop then reads `image_grid_thw.prod(-1)` where a turn called a tool that returned no image (a
        malformed call, a box outside the image) and fails ("'list' object has no attribute 'prod'"). As
        tensors, they are what the batched call without environments gives (one array first: torch reads a
        list of arrays element by element, 0.75 s for a batch of 2,048 patch rows against 0.02 s)."""
        prompt_ids, images, fields = super()._tokenize_prompts(prompts)
        for key in IMAGE_FIELDS:
            if isinstance(fields.get(key), list):
                fields[key] = torch.as_tensor(np.asarray(fields[key]))
        return prompt_ids, images, fields

    def _generate_and_score_completions(self, inputs):
        # the record's image, solution, task and sizes as completion-table columns (TRL's log_extra, flushed
        # with the batch): the table draws each completion's boxes from them
        # (vlmexp.tracking.callbacks.CompletionTable)
        for column, key in (("image", "image_path"), ("solution", "solution"), ("task", "task"),
                            ("method", "accu_reward_method"), ("image_sizes", "image_sizes")):
            self._log_completion_extra(column, [x.get(key) for x in inputs])
        output = super()._generate_and_score_completions(inputs)
        if self.model.training and "image_sizes" in inputs[0]:
            start = time.perf_counter()
            sizes = self._image_sizes(inputs, output.get("num_images"))
            layouts = [self.family.image_layout(s, self.budget) for s in sizes]
            rows = [self.family.layout_rows(layout) for layout in layouts]
            pixels = output.get("pixel_values")
            sums = (pixel_checksums(pixels, rows) if pixels is not None and pixels.size(0) == sum(rows)
                    else [0.0] * len(inputs))
            output[EXPECTED] = [(f"record {x.get('source_row', '?')}", len(s), layout, c)
                                for x, s, layout, c in zip(inputs, sizes, layouts, sums, strict=True)]
            self.guard_seconds += time.perf_counter() - start
        return output

    def _image_sizes(self, inputs, num_images) -> list[list[list[int]]]:
        """Each sample's image sizes: its record's, then the crops its tool environment made (as many as
        reached the batch: TRL drops a tool result that would not fit the completion)."""
        sizes = [list(x["image_sizes"] or []) for x in inputs]
        if not self.environments or num_images is None:
            return sizes
        for i, environment in enumerate(self.environments):
            crops = [[x2 - x1, y2 - y1] for x1, y1, x2, y2 in getattr(environment, "crops", [])]
            kept = int(num_images[i]) - len(sizes[i])
            sizes[i] += crops[:kept] if 0 <= kept <= len(crops) else crops
        return sizes

    def _prepare_inputs(self, generation_batch):
        batch = super()._prepare_inputs(generation_batch)
        if EXPECTED in batch:
            start = time.perf_counter()
            check_pairing(batch, self.family, self.budget, self.image_token_id, self.state.global_step)
            self.guard_seconds += time.perf_counter() - start
        return batch
