"""AdamW with decoupled weight decay (none on biases, norms, embeddings) and a warm-up schedule."""
from __future__ import annotations

import math

import torch
from torch import nn

from summarizer.config.schema import TrainConfig


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        # Decay only matrices of linear layers: decaying norms, biases and the shared embedding
        # pulls rare-token rows to zero, which hurts a small-data model most.
        (decay if p.dim() >= 2 and "embedding" not in name else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    # The fused kernel updates every parameter in one pass per device (CPU and CUDA). torch's
    # default is the multi-tensor path on CUDA but a per-parameter Python loop on CPU, about ten
    # elementwise ops per tensor (bench row "fused_optimizer").
    fused = cfg.fused_optimizer and all(p.device.type in ("cpu", "cuda") and p.is_floating_point()
                                        for group in groups for p in group["params"])
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=1e-8, fused=fused or None)


def step_if_finite(optimizer: torch.optim.Optimizer, finite: torch.Tensor, in_kernel: bool = True) -> None:
    """optimizer.step() unless `finite`, a bool on the device, is False. A fused AdamW is handed the flag as
    GradScaler hands it one (its `found_inf`) and skips the update inside its kernel: weights, moments and step
    count untouched, and nothing read back to the host. Other optimizers read the flag first (one host sync), and
    so does any where not `in_kernel`: for a model split between a GPU and the CPU, whose CPU half would get the
    flag by a non-blocking copy from the GPU, which its kernel could read before the copy lands."""
    if in_kernel and getattr(optimizer, "_step_supports_amp_scaling", False):
        optimizer.found_inf = (~finite).float()
        try:
            optimizer.step()
        finally:
            del optimizer.found_inf
    elif bool(finite):
        optimizer.step()


def lr_factor(step: int, cfg: TrainConfig) -> float:
    """Multiplier of cfg.lr after `step` optimizer steps: linear warm-up, then the chosen decay."""
    warmup = max(cfg.warmup_steps, 1)
    if step < warmup:
        return (step + 1) / warmup
    if cfg.schedule == "constant":
        return 1.0
    if cfg.schedule == "inverse_sqrt":
        return math.sqrt(warmup / (step + 1))
    progress = min((step - warmup) / max(cfg.max_steps - warmup, 1), 1.0)
    if cfg.schedule == "cosine":
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:  # linear
        shape = 1.0 - progress
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * shape


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig,
                    step: int = 0) -> torch.optim.lr_scheduler.LambdaLR:
    """The schedule as of `step` optimizer steps: the lr is a function of (cfg, step) alone, so a resumed
    run rebuilds it from the current config (a changed train.lr or schedule takes effect) instead of
    restoring the base lr its checkpoint held."""
    for group in optimizer.param_groups:
        group["initial_lr"] = cfg.lr
    # LambdaLR's constructor takes one step itself: last_epoch = step - 1 leaves it at `step`.
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, cfg), last_epoch=step - 1)
