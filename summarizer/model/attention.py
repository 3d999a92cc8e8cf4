"""Multi-head attention, as F.scaled_dot_product_attention or as two batched matmuls (`attention_explicit`),
chosen from outside by the `explicit_attention` context (summarizer/runtime/device.py picks per device). Pure math,
like the rest of the model. Shapes: B = batch, H = heads, Lq / Lk = query / key length, d = head size."""
from __future__ import annotations

import contextlib
import contextvars

import torch
import torch.nn.functional as F
from torch import Tensor, nn

_EXPLICIT_ATTENTION = contextvars.ContextVar("explicit_attention", default=False)
MASK_BIAS = -1e4  # finite: a fully masked row becomes uniform instead of NaN, and fp16 cannot overflow


@contextlib.contextmanager
def explicit_attention(enabled: bool = True):
    """Within this context attention runs `attention_explicit` instead of F.scaled_dot_product_attention.

    Both compute the same function; which is faster depends on the device (summarizer/runtime/device.py
    picks, bench row "attention_kernel" measures).
    """
    token = _EXPLICIT_ATTENTION.set(enabled)
    try:
        yield
    finally:
        _EXPLICIT_ATTENTION.reset(token)


@torch.compiler.assume_constant_result
def _explicit() -> bool:
    """The `explicit_attention` context's choice. Compiled code reads it once, when it is compiled (a ContextVar is
    opaque to torch.compile: reading it there would break every attention call out of the compiled graph); a run
    compiles its model inside the one context it trains in (runtime.Runtime.compute)."""
    return _EXPLICIT_ATTENTION.get()


def attention_explicit(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool,
                       dropout_p: float) -> Tensor:
    """softmax(q k^T / sqrt(d) + bias) v as two batched matmuls, the mask folded into the first.

    (B, H, Lq, d) queries, (B, H, Lk, d) keys/values, mask (B, 1, 1, Lk) True where allowed ->
    (B, H, Lq, d). At sentence lengths on CPU this beats SDPA's math kernel forward and backward: that
    kernel spends most of its time on mask conversion and fully-masked-row checks (bench row
    "attention_kernel").
    """
    b, h, lq, d = q.shape
    lk = k.shape[2]
    bias = q.new_zeros(b if mask is not None else 1, 1, lq if is_causal else 1, lk)
    if mask is not None:
        bias.masked_fill_(~mask, MASK_BIAS)
    if is_causal:  # query i (aligned to the end of the keys) sees keys up to lk - lq + i
        bias.masked_fill_(torch.ones(lq, lk, dtype=torch.bool, device=q.device).triu_(lk - lq + 1), MASK_BIAS)
    scores = torch.baddbmm(bias.expand(b, h, lq, lk).reshape(b * h, lq, lk), q.reshape(b * h, lq, d),
                           k.reshape(b * h, lk, d).transpose(1, 2), alpha=d ** -0.5)  # (B*H, Lq, Lk)
    probs = scores.softmax(dim=-1)
    if dropout_p:
        probs = F.dropout(probs, dropout_p)
    return torch.bmm(probs, v.reshape(b * h, lk, d)).view(b, h, lq, d)


class Attention(nn.Module):
    """Multi-head attention through F.scaled_dot_product_attention, or its explicit form (see above)."""

    def __init__(self, d_model: int, n_heads: int, dropout: float, bias: bool = True):
        super().__init__()
        self.n_heads, self.dropout = n_heads, dropout
        self.q_proj = nn.Linear(d_model, d_model, bias=bias)
        self.kv_proj = nn.Linear(d_model, 2 * d_model, bias=bias)
        self.out_proj = nn.Linear(d_model, d_model, bias=bias)

    def split_heads(self, x: Tensor) -> Tensor:
        b, n, d = x.shape  # (B, N, D) -> (B, H, N, D/H)
        return x.view(b, n, self.n_heads, d // self.n_heads).transpose(1, 2)

    def project_kv(self, x: Tensor) -> tuple[Tensor, Tensor]:
        k, v = self.kv_proj(x).chunk(2, dim=-1)
        return self.split_heads(k), self.split_heads(v)

    def forward(self, x: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None,
                is_causal: bool = False) -> Tensor:
        q = self.split_heads(self.q_proj(x))  # (B, H, Tq, D/H)
        dropout_p = self.dropout if self.training else 0.0
        if _explicit():
            out = attention_explicit(q, k, v, mask, is_causal, dropout_p)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, dropout_p=dropout_p)
        b, _, tq, _ = out.shape
        return self.out_proj(out.transpose(1, 2).reshape(b, tq, -1))  # (B, Tq, D)
