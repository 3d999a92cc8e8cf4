"""The weights' exponential moving average (train.ema_decay): what validation scores and best.pt holds."""
from __future__ import annotations

import sys
import weakref

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
    is mirrored on the host, read from the device only when a state dict is loaded. The lists of tensors an
    update takes are built once per trained model, not at every step (walking the modules cost more host time
    than the update's kernels: a GPU step is bound by its host)."""

    def __init__(self, model: nn.Module, decay: float):
        super().__init__(model, use_buffers=False)
        self.decay, self.count = decay, 0
        self._lists: tuple = (None, [], [])  # (weakref to the trained model, parameter lists, buffer owners)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        result = super().load_state_dict(state_dict, strict=strict, assign=assign)
        self.count = int(self.n_averaged)
        return result

    def _groups(self, model: nn.Module) -> tuple[list, list]:
        """The averaged and the current parameters as lists per device (foreach kernels take one device's tensors),
        and the buffers as (averaged module, current module, name): built at `model`'s first update. Parameter
        objects stay the same when their data is replaced; a buffer is looked up by name at each update."""
        source, params, buffers = self._lists
        if source is None or source() is not model:
            pairs = list(zip(self.module.parameters(), model.parameters(), strict=True))
            params = [([a for a, _ in pairs if a.device == device], [p for a, p in pairs if a.device == device])
                      for device in dict.fromkeys(a.device for a, _ in pairs)]
            owners = zip(self.module.modules(), model.modules(), strict=True)
            buffers = [(mine, theirs, name) for mine, theirs in owners for name, _ in mine.named_buffers(recurse=False)]
            self._lists = (weakref.ref(model), params, buffers)
        return params, buffers

    @torch.no_grad()
    def update_parameters(self, model: nn.Module) -> None:
        self.count += 1
        weight = (1 - self.decay) / (1 - self.decay ** self.count)  # 1 at the first update: a copy
        params, buffers = self._groups(model)
        for averaged, current in params:
            torch._foreach_lerp_(averaged, current, weight)
        for mine, theirs, name in buffers:
            getattr(mine, name).copy_(getattr(theirs, name))
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
