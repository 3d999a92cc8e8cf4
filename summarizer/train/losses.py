"""Label-smoothed, token-summed cross-entropy over the model's output; callers divide by token counts."""
from __future__ import annotations

import torch
from torch import Tensor

from summarizer.model.transformer import PAD_ID, DecoderOutput

CHUNK_ELEMENTS = 1 << 20  # CPU: rows of logits processed together, ~4 MB in float32 (stays in cache)


class VocabStats(torch.autograd.Function):
    """(N, V) logits -> float32 (logsumexp, target logit, mean logit) per row; memory-light both ways.

    Autograd through logsumexp + gather + mean keeps several (N, V) float32 buffers and walks them about eight times
    (logsumexp alone: max, subtract, exp, sum). Here the forward makes one float32 copy of the logits and runs
    log_softmax over it (the target's log-probability gives the logsumexp); it saves the logits as they came (bf16
    under autocast) and the target's (N,) log-probability. The backward writes the gradient softmax * g_lse + g_mean
    / V in the logits' dtype with two kernels, softmax straight from the logits and then addcmul in place, each
    computing in float32. The target's entry, where g_lse * p and g_target nearly cancel once the model is sure of
    it, is then put in from float32. On CPU both directions go through the rows in cache-sized chunks, so what one
    kernel writes the next reads from cache, not memory. On CUDA, with bandwidth to spare, one chunk is the whole
    tensor: bf16 logits are read and written 13 times their size in all, not 39 (float32: 14, not 38).
    Values are float32 whatever the logits' dtype (bench row "fused_loss").
    """

    @staticmethod
    def forward(ctx, logits: Tensor, target: Tensor):
        n, v = logits.shape
        rows = n if logits.is_cuda else max(1, CHUNK_ELEMENTS // v)
        target = target.unsqueeze(-1)
        target_logit = logits.gather(-1, target).squeeze(-1).float()
        log_p_target, mean = torch.empty_like(target_logit), torch.empty_like(target_logit)
        for start in range(0, n, rows):
            part = slice(start, start + rows)
            x = logits[part].float()
            torch.mean(x, dim=-1, out=mean[part])
            torch.gather(x.log_softmax(dim=-1), -1, target[part], out=log_p_target[part, None])
        ctx.save_for_backward(logits, target, log_p_target)
        ctx.rows = rows
        return target_logit - log_p_target, target_logit, mean

    @staticmethod
    def backward(ctx, g_lse: Tensor, g_target: Tensor, g_mean: Tensor):
        logits, target, log_p_target = ctx.saved_tensors
        g_lse, uniform = g_lse.unsqueeze(-1), (g_mean / logits.shape[1]).unsqueeze(-1)
        grad = torch.empty_like(logits)
        for start in range(0, logits.shape[0], ctx.rows):
            part = slice(start, start + ctx.rows)
            torch.softmax(logits[part], dim=-1, out=grad[part])
            torch.addcmul(uniform[part], grad[part], g_lse[part], out=grad[part])
        p_target = log_p_target.exp().unsqueeze(-1)
        at_target = torch.addcmul(uniform + g_target.unsqueeze(-1), p_target, g_lse)
        # index_put_, not scatter_: a CPU's scatter_ into a 16-bit (2048, 8000) tensor takes 70 ms, index_put_ 0.02
        every_row = torch.arange(len(target), device=target.device)
        return grad.index_put_((every_row, target.squeeze(-1)), at_target.squeeze(-1).to(grad.dtype)), None


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
