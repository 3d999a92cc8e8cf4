"""Dropout whose CPU masks come from a fast generator; numerically the same operation as torch's.

torch's CPU dropout draws its mask with `bernoulli_` (one Mersenne-Twister draw per element, on one
thread) and then applies it through bool-tensor ops that are not vectorised: at this model's size
the dropouts are a visible share of a CPU step (bench row "fast_dropout"). Here each element gets 16 random bits
from numpy's SFC64 generator, compared with round(p * 2^16) (the drop probability is p to within
2^-17), and numpy turns the comparison straight into the bit pattern of the multiplier: 0 or
1 / (1 - p) in x's dtype (rounded to that dtype, exactly as torch's kernel rounds it). Forward and
backward are then one vectorised multiply each. The generator is seeded by one draw from torch's
default generator, so `torch.manual_seed` and the checkpointed torch RNG state still determine
every mask: seeded runs and exact resume are unchanged. On CUDA, for other dtypes, with `fast=False`, or
inside torch.compile (which fuses its own dropout into the neighbouring ops, where numpy would break the
graph at every dropout), this is `F.dropout`.
"""
from __future__ import annotations

import functools

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

_INT_VIEWS = {torch.bfloat16: (torch.int16, np.int16), torch.float16: (torch.int16, np.int16),
              torch.float32: (torch.int32, np.int32)}


@functools.cache
def _keep_pattern(p: float, dtype: torch.dtype) -> int:
    """The bits of 1 / (1 - p) in `dtype`, as the integer of the same width (computed once per p and dtype)."""
    return int(torch.tensor(1.0 / (1.0 - p), dtype=dtype).view(_INT_VIEWS[dtype][0]))


def dropout_multiplier(shape: torch.Size, p: float, dtype: torch.dtype) -> Tensor:
    """(shape) tensor of `dtype` holding 0 with probability p (to 2^-17) and 1 / (1 - p) otherwise."""
    n = shape.numel()
    seed = int(torch.randint(2**62, ()))  # the only draw from torch's generator
    bits = np.random.SFC64(seed).random_raw((n + 3) // 4).view(np.int16)[:n]  # 4 x 16 bits per draw
    multiplier = (bits >= round(p * 65536) - 32768).astype(_INT_VIEWS[dtype][1])
    multiplier *= _keep_pattern(p, dtype)  # 1 -> the bits of 1 / (1 - p), 0 -> the bits of 0.0
    return torch.from_numpy(multiplier).view(dtype).view(shape)


class _Multiply(torch.autograd.Function):
    """x * m for a constant multiplier m; the backward is grad * m (m is saved, 2 bytes per element in 16 bit)."""

    @staticmethod
    def forward(ctx, x: Tensor, multiplier: Tensor) -> Tensor:
        ctx.save_for_backward(multiplier)
        return x * multiplier

    @staticmethod
    def backward(ctx, grad: Tensor):
        (multiplier,) = ctx.saved_tensors
        return grad * multiplier, None


class Dropout(nn.Module):
    """Drop-in for nn.Dropout: the fast CPU mask when `fast`, torch's kernel otherwise."""

    def __init__(self, p: float, fast: bool = True):
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"dropout probability must be in [0, 1), got {p}")
        self.p, self.fast = p, fast

    def forward(self, x: Tensor) -> Tensor:
        if not self.training or self.p == 0.0:
            return x
        if self.fast and x.device.type == "cpu" and x.dtype in _INT_VIEWS and not torch.compiler.is_compiling():
            return _Multiply.apply(x, dropout_multiplier(x.shape, self.p, x.dtype))
        return F.dropout(x, self.p, training=True)

    def extra_repr(self) -> str:
        return f"p={self.p}, fast={self.fast}"
