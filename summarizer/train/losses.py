"""Label-smoothed, token-summed cross-entropy over the model's output; callers divide by token counts."""
from __future__ import annotations

import torch
from torch import Tensor

from summarizer.model.transformer import PAD_ID, DecoderOutput

CHUNK_ELEMENTS = 1 << 20  # CPU: rows of logits processed together, ~4 MB in float32 (stays in cache)


class VocabStats(torch.autograd.Function):
    """(N, V) logits -> float32 (logsumexp, target logit, mean logit) per row; memory-light both ways.

    Autograd through logsumexp + gather + mean keeps several (N, V) float32 buffers and walks them
    about eight times. Here the forward saves only the logits as they came (bf16 under autocast)
    and the backward rebuilds softmax * g_lse + onehot * g_target + g_mean / V in place, in a
    float32 buffer per chunk of rows. On CPU both directions go through the rows in cache-sized chunks: each
    chunk's float32 copy is read back while still in cache instead of from memory, and the
    (N, V) float32 tensor, tens of MB fresh from the allocator each step, never exists. On CUDA,
    with bandwidth to spare, one chunk is the whole tensor. Values are float32 whatever the
    logits' dtype (bench row "fused_loss").
    """

    @staticmethod
    def forward(ctx, logits: Tensor, target: Tensor):
        n, v = logits.shape
        rows = n if logits.is_cuda else max(1, CHUNK_ELEMENTS // v)
        lse = torch.empty(n, dtype=torch.float32, device=logits.device)
        mean = torch.empty_like(lse)
        for start in range(0, n, rows):
            x = logits[start:start + rows].float()
            torch.logsumexp(x, dim=-1, out=lse[start:start + rows])
            torch.mean(x, dim=-1, out=mean[start:start + rows])
        ctx.save_for_backward(logits, lse, target)
        ctx.rows = rows
        return lse, logits.gather(-1, target.unsqueeze(-1)).squeeze(-1).float(), mean

    @staticmethod
    def backward(ctx, g_lse: Tensor, g_target: Tensor, g_mean: Tensor):
        logits, lse, target = ctx.saved_tensors
        v, rows = logits.shape[1], ctx.rows
        grad = torch.empty_like(logits)
        for start in range(0, logits.shape[0], rows):
            part = slice(start, start + rows)
            x = logits[part].to(torch.float32, copy=True)  # a copy: the in-place ops below must not touch logits
            x.sub_(lse[part].unsqueeze(-1)).exp_().mul_(g_lse[part].unsqueeze(-1))  # softmax * g_lse
            x.add_((g_mean[part] / v).unsqueeze(-1))
            x.scatter_add_(-1, target[part].unsqueeze(-1), g_target[part].unsqueeze(-1))
            grad[part] = x
        return grad, None


def vocab_stats_autograd(logits: Tensor, target: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The same three statistics through plain autograd: the reference VocabStats is tested and benched against."""
    x = logits.float()
    return torch.logsumexp(x, dim=-1), x.gather(-1, target.unsqueeze(-1)).squeeze(-1), x.mean(dim=-1)


def smoothed_nll(out: DecoderOutput, target: Tensor, src_ids: Tensor, smoothing: float,
                 fused: bool = True) -> tuple[Tensor, Tensor]:
    """-> (loss_sum, nll_sum) over non-pad target tokens, float32 scalars; target is (B, T).

    Only the target's probability is formed, never the full (B, T, V) mixture: per position,
    p(y) = g * exp(logit_y - lse) + (1 - g) * sum_{s: src_s = y} attn_s. Label smoothing (Szegedy
    et al. 2016) uses -mean_v log p_vocab(v) = lse - mean(logits): exact for the plain model, and
    for the copy model it smooths the generator's distribution. Sums, not means: the training step
    divides by the tokens of the whole accumulated, all-rank batch. The loss runs where the logits
    are (the decoder's device when the model is split); ids move there, a no-op otherwise.
    """
    target = target.to(out.logits.device)
    mask = target != PAD_ID  # (B, T)
    b, t, v = out.logits.shape
    stats = VocabStats.apply if fused else vocab_stats_autograd
    lse, target_logit, mean_logit = (s.view(b, t) for s in stats(out.logits.reshape(b * t, v), target.reshape(b * t)))
    if out.copy_attn is None:
        nll = lse - target_logit
    else:
        src_ids = src_ids.to(out.logits.device)
        copied = (out.copy_attn * (src_ids[:, None, :] == target[:, :, None])).sum(-1)  # (B, T)
        gate = out.gate.squeeze(-1)
        p_target = gate * torch.exp(target_logit - lse) + (1.0 - gate) * copied
        nll = -torch.log(p_target.clamp_min(1e-12))
    nll_sum = nll.masked_fill(~mask, 0.0).sum()
    if smoothing == 0.0:
        return nll_sum, nll_sum.detach()
    loss = (1.0 - smoothing) * nll + smoothing * (lse - mean_logit)
    return loss.masked_fill(~mask, 0.0).sum(), nll_sum.detach()
