"""Naming the first non-finite value: when a training step's loss or gradients are NaN/inf, the step is run once
more (without updating anything, on a forked random stream) with hooks on every module, and the first module
whose output (forward) or output gradient (backward) holds a NaN or inf is named, as fairseq's NanDetector and
Hugging Face's underflow/overflow debugging do. Costs nothing until a step goes wrong."""
from __future__ import annotations

import torch
from torch import Tensor, nn

from summarizer import runtime
from summarizer.config.schema import TrainConfig
from summarizer.runtime import Runtime
from summarizer.train.losses import smoothed_nll


def _tensors(value) -> list[Tensor]:
    if isinstance(value, Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    return []


def _bad(value) -> bool:
    return any(t.is_floating_point() and not bool(torch.isfinite(t).all()) for t in _tensors(value))


def first_nonfinite(model: nn.Module, micro_batches: list[dict], rt: Runtime, cfg: TrainConfig) -> str:
    """'<module path> (forward|backward)' of the first NaN/inf the step's forward and backward produce, 'the
    loss' if only the loss is, or a note that the re-run was finite (a fault that does not repeat). The re-run
    is the model's own, outside DDP: each rank stops at its own first NaN, and a backward through DDP would
    all-reduce gradients with ranks that stopped elsewhere (a hang, or buckets of other sizes)."""
    found: list[str] = []
    model = runtime.unwrap(model)
    names = {module: name or "(the model)" for name, module in model.named_modules()}

    def forward_hook(module, inputs, output):
        if not found and _bad(output):
            found.append(f"{names[module]} (forward: its output)")
        for t in _tensors(output):  # tensor hooks, not module backward hooks: the model edits outputs in place
            if t.requires_grad:
                t.register_hook(lambda grad, name=names[module]: _note_backward(grad, name))

    def _note_backward(grad: Tensor, name: str) -> None:
        if not found and _bad(grad):
            found.append(f"{name} (backward: the gradient of its output)")

    handles = [m.register_forward_hook(forward_hook) for m in names]
    try:
        with torch.random.fork_rng(devices=rt.cuda_devices):
            for batch in micro_batches:
                with rt.compute():
                    out = model(batch["src_ids"], batch["tgt_in"])
                loss, _ = smoothed_nll(out, batch["tgt_out"], batch["src_ids"], cfg.label_smoothing, cfg.fused_loss)
                if not found and not bool(torch.isfinite(loss)):
                    found.append("the loss (every module's output was finite)")
                loss.backward()
                if found:
                    break
    finally:
        for handle in handles:
            handle.remove()
        model.zero_grad(set_to_none=True)
    return found[0] if found else "nothing on a re-run of the same batch (a fault that did not repeat)"
