"""Per-module statistics (train.module_stats): where in the model the gradient, the update and the signal are.

Parameters are grouped as a reader of the model thinks of it: `embedding` (shared by source, target and the
output projection), `encoder.<i>`, `decoder.<i>` (self-attention, feed-forward, norms), `decoder.<i>.cross`
(cross-attention), `copy` (the copy head's query, key and gate) and `final_norms`. At each log interval the
train record gains, per group,

- `grad_norm/<group>`: the L2 norm of the group's gradient, after unscaling and before clipping;
- `update_ratio/<group>`: ||w_after - w_before|| / ||w_before|| of that step's optimizer update;
- `weight_norm/<group>`: ||w|| after the step;

and each validation record gains `act_rms/<block>`: the root mean square of each embedding and layer output
over the valid split (padding positions included). Everything is reduced on the device and read with one
host sync per interval; the update ratio keeps one copy of the weights for the logged step only.
"""
from __future__ import annotations

import contextlib

import torch
from torch import Tensor, nn

from summarizer import runtime


def group_of(name: str) -> str:
    """The group a parameter's qualified name belongs to (module docstring)."""
    parts = name.split(".")
    if parts[0] == "encoder_layers":
        return f"encoder.{parts[1]}"
    if parts[0] == "decoder_layers":
        return f"decoder.{parts[1]}.cross" if parts[2] == "cross_attn" else f"decoder.{parts[1]}"
    if parts[0] in ("encoder_norm", "decoder_norm"):
        return "final_norms"
    if parts[0].startswith("copy_"):
        return "copy"
    return parts[0]


class ModuleStats:
    """The statistics of one optimizer step, for the steps that are logged: `before_update` after the
    gradients are final (unscaled), `after_update` once the optimizer has stepped."""

    def __init__(self, model: nn.Module):
        self.groups: dict[str, list[nn.Parameter]] = {}
        inner = runtime.unwrap(model)
        for name, param in getattr(inner, "inner", inner).named_parameters():  # a placed model's own names
            if param.requires_grad:
                self.groups.setdefault(group_of(name), []).append(param)
        self._before: list[Tensor] | None = None
        self._grad_norms: Tensor | None = None

    @staticmethod
    def _norm(tensors: list[Tensor]) -> Tensor:
        norms = torch._foreach_norm([t.float() for t in tensors]) if tensors else [torch.zeros(())]
        return torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms]))

    def before_update(self) -> None:
        with torch.no_grad():
            self._grad_norms = torch.stack([
                self._norm([p.grad for p in params if p.grad is not None]).cpu() for params in self.groups.values()])
            self._before = [p.detach().clone() for params in self.groups.values() for p in params]

    def after_update(self) -> dict[str, float]:
        """{'grad_norm/encoder.0': ..., 'update_ratio/...': ..., 'weight_norm/...': ...} of the step."""
        if self._before is None:
            return {}
        with torch.no_grad():
            before, updates, weights = iter(self._before), [], []
            for params in self.groups.values():
                olds = [next(before) for _ in params]
                updates.append((self._norm(torch._foreach_sub([p.detach() for p in params], olds)) /
                                self._norm(olds).clamp_min(1e-12)).cpu())
                weights.append(self._norm([p.detach() for p in params]).cpu())
            values = torch.stack([self._grad_norms, torch.stack(updates), torch.stack(weights)]).tolist()  # one sync
        self._before = self._grad_norms = None
        return {f"{kind}/{group}": value for kind, row in zip(("grad_norm", "update_ratio", "weight_norm"), values,
                                                              strict=True)
                for group, value in zip(self.groups, row, strict=True)}


def blocks(model: nn.Module) -> dict[str, nn.Module]:
    """The modules whose outputs `activation_rms` measures: the embedding and every encoder and decoder layer."""
    inner = runtime.unwrap(model)
    inner = getattr(inner, "inner", inner)  # a placed model's own modules
    named = {"embedding": inner.embedding}
    named.update({f"encoder.{i}": layer for i, layer in enumerate(inner.encoder_layers)})
    named.update({f"decoder.{i}": layer for i, layer in enumerate(inner.decoder_layers)})
    return named


@contextlib.contextmanager
def activation_rms(model: nn.Module, enabled: bool = True):
    """Within the block, forward hooks sum each block's squared outputs; the yielded dict is filled with
    `act_rms/<block>` on exit (device sums, one sync)."""
    results: dict[str, float] = {}
    if not enabled:
        yield results
        return
    sums: dict[str, list[Tensor]] = {}

    def hook(name):
        def record(module, inputs, output):
            x = (output[0] if isinstance(output, tuple) else output).detach()
            entry = sums.setdefault(name, [torch.zeros((), dtype=torch.float64, device=x.device), 0])
            entry[0] += x.float().pow(2).sum().double()
            entry[1] += x.numel()
        return record

    handles = [module.register_forward_hook(hook(name)) for name, module in blocks(model).items()]
    try:
        yield results
    finally:
        for handle in handles:
            handle.remove()
    if sums:
        totals = torch.stack([s.cpu() for s, _ in sums.values()]).tolist()
        results.update({f"act_rms/{name}": (total / max(count, 1)) ** 0.5
                        for (name, (_, count)), total in zip(sums.items(), totals, strict=True)})
