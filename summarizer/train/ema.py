"""The weights' exponential moving average (train.ema_decay): what validation scores and best.pt holds."""
from __future__ import annotations

import sys

import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel


class MovingAverage(AveragedModel):
    """w_ema <- w_ema + (w - w_ema) * (1 - d) / (1 - d**t) at the t-th update: the exponential average of the
    weights seen so far divided by the total weight they carry (as Adam corrects its moments' bias). torch's own
    EMA update starts at the first step's weights and keeps them at d**t: after 1,000 steps at d = 0.999 still
    37% of the average, which for a fine-tuning (train.init_from) is the pre-trained model. After ~3 / (1 - d)
    steps the two agree within 5%.

    Its state dict is AveragedModel's (`module.*`, `n_averaged`). Unlike AveragedModel.update_parameters, which
    reads `n_averaged` on the host twice per update (on a GPU, two device syncs every training step), the count
    is mirrored on the host, read from the device only when a state dict is loaded."""

    def __init__(self, model: nn.Module, decay: float):
        super().__init__(model, use_buffers=False)
        self.decay, self.count = decay, 0

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        result = super().load_state_dict(state_dict, strict=strict, assign=assign)
        self.count = int(self.n_averaged)
        return result

    @torch.no_grad()
    def update_parameters(self, model: nn.Module) -> None:
        self.count += 1
        weight = (1 - self.decay) / (1 - self.decay ** self.count)  # 1 at the first update: a copy
        pairs = list(zip(self.module.parameters(), model.parameters(), strict=True))
        for device in dict.fromkeys(a.device for a, _ in pairs):  # foreach kernels take one device's tensors
            averaged, current = zip(*((a, p.detach()) for a, p in pairs if a.device == device), strict=True)
            torch._foreach_lerp_(list(averaged), list(current), weight)
        for averaged_buffer, buffer in zip(self.module.buffers(), model.buffers(), strict=True):
            averaged_buffer.copy_(buffer)
        self.n_averaged += 1


def build_ema(model: nn.Module, decay: float, state: dict | None, max_steps: int) -> MovingAverage | None:
    """The moving average of `model`'s weights at train.ema_decay (0 = none), restored from a checkpoint's `state`
    when it holds one. Step checkpoints hold both it and the raw weights (eval.checkpoint=ckpt_*.pt and `average`
    use the raw ones)."""
    if not decay:
        return None
    if max_steps < 3 / (1 - decay):  # after t steps the first weights still count decay**t: > 5% here
        print(f"warning: train.ema_decay={decay} averages the weights over about {round(1 / (1 - decay))} steps, "
              f"but this run has {max_steps}: best.pt (the average) will lag far behind the trained weights. "
              f"For short runs set train.ema_decay=0 or a smaller decay", file=sys.stderr, flush=True)
    ema = MovingAverage(model, decay)
    if state and "ema" in state:
        ema.load_state_dict(state["ema"])
    return ema
