"""How evenly a mixture-of-experts model's experts are used, logged to the stage's run (`ExpertUsage`).

The router's auxiliary (load-balancing) loss is TRL's own metric: SFTTrainer and GRPOTrainer 1.16 add it to
the loss and log it as `aux_loss` when the text config has `output_router_logits` and a non-zero
`router_aux_loss_coef` (Qwen3.5-MoE's tiny model sets both), and `TrainerLogs` carries it into MLflow. What
TRL does not log is where the tokens went: this callback counts, on every training forward (gradients on;
generation's forwards are left out), how many tokens each router sends to each expert, and at each log step
writes `moe/expert_load_cv` (the coefficient of variation of the experts' token counts, mean over the MoE
layers: 0 when every expert takes the same share, sqrt(num_experts - 1) when one takes all) and
`moe/expert_load_max_share` (the busiest expert's share of its layer's routings, worst layer). Imported inside
the stage entry points (transformers is heavy).
"""

from __future__ import annotations

from transformers import TrainerCallback

from vlmexp.tracking.stage_run import StageRun


def routers(model) -> list:
    """The top-k router modules of a mixture-of-experts model (a `top_k` and a `num_experts` attribute), in
    layer order; [] for a dense model."""
    return [m for _, m in model.named_modules()
            if hasattr(m, "top_k") and hasattr(m, "num_experts") and hasattr(m, "weight")]


class ExpertUsage(TrainerCallback):
    """Per-expert token counts of the training forwards since the last log, into the run as two metrics."""

    def __init__(self, model, run: StageRun):
        import torch

        self.run, self.counts, self.window = run, [], []  # this rank's since the last step; all ranks'
        self.top_k = 1
        for router in routers(model):
            self.top_k = router.top_k
            counts = torch.zeros(router.num_experts, dtype=torch.long)
            self.counts.append(counts)
            self.window.append(torch.zeros_like(counts))
            router.register_forward_hook(self._hook(counts))

    @staticmethod
    def _hook(counts):
        import torch

        def hook(module, args, output):
            if torch.is_grad_enabled():  # the loss forward, not generation's
                indices = output[-1].detach().flatten().cpu()  # (tokens x top_k) chosen experts
                counts.add_(torch.bincount(indices, minlength=counts.numel()))

        return hook

    def on_step_end(self, args, state, control, **kwargs):
        """This step's counts of every rank into the log window (every rank gets here once a step)."""
        import torch
        import torch.distributed as dist

        if not self.counts:
            return
        flat = torch.cat(self.counts)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            flat = flat.to(args.device)  # NCCL reduces device tensors only
            dist.all_reduce(flat)
            flat = flat.cpu()
        for window, part in zip(self.window, flat.split([c.numel() for c in self.counts]), strict=True):
            window.add_(part)
        for c in self.counts:
            c.zero_()

    def metrics(self) -> dict[str, float]:
        """This log window's evenness, and the window reset; {} when no training forward routed a token."""
        import torch

        layers = [c.double() for c in self.window if c.sum() > 0]
        for c in self.window:
            c.zero_()
        if not layers:
            return {}
        cv = torch.stack([c.std(unbiased=False) / c.mean() for c in layers]).mean()
        share = max(float(c.max() / c.sum()) for c in layers)
        return {"moe/expert_load_cv": float(cv), "moe/expert_load_max_share": share,
                "moe/routed_tokens": float(layers[0].sum()) / self.top_k}

    def on_log(self, args, state, control, logs=None, **kwargs):
        if (numbers := self.metrics()) and state.is_world_process_zero:
            self.run.log_metrics(numbers, state.global_step)
