"""Label-smoothed, token-summed cross-entropy; callers divide by the token count they choose."""
from __future__ import annotations

from torch import Tensor

from summarizer.model import PAD_ID


def smoothed_nll(log_probs: Tensor, target: Tensor, smoothing: float) -> tuple[Tensor, Tensor]:
    """(B, T, V) log-probs, (B, T) ids -> (loss_sum, nll_sum) over non-pad tokens, both float32 scalars.

    Sums, not means: the training step divides by the number of target tokens in the whole
    (accumulated, all-rank) batch, so k micro-batches give exactly one big batch's gradient.
    One vectorised expression over all tokens; no Python loop over positions.
    """
    mask = target != PAD_ID  # (B, T)
    nll = -log_probs.gather(-1, target.unsqueeze(-1)).squeeze(-1)  # (B, T)
    nll_sum = nll.masked_fill(~mask, 0.0).sum()
    if smoothing == 0.0:
        return nll_sum, nll_sum.detach()
    # Uniform smoothing over the vocabulary (Szegedy et al. 2016): mean of -log p over V.
    uniform = -log_probs.mean(dim=-1)  # (B, T)
    loss = (1.0 - smoothing) * nll + smoothing * uniform
    return loss.masked_fill(~mask, 0.0).sum(), nll_sum.detach()


def token_count(target: Tensor) -> Tensor:
    return (target != PAD_ID).sum()
