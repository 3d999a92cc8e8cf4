"""Batched greedy and beam search as free functions over a model's `encode`/`decode`, with the KV cache."""
from __future__ import annotations

import torch
from torch import Tensor

from summarizer.tokenizer import BOS, EOS, PAD


def _block_repeats(log_probs: Tensor, prefixes: Tensor, n: int) -> Tensor:
    """Forbid tokens that would repeat an n-gram already in each prefix. (N, V) scores, (N, L) prefixes."""
    length = prefixes.shape[1]
    if n <= 0 or length < n:
        return log_probs
    # Every n-gram of each prefix as a row; the (n-1)-gram that ends the prefix picks the banned tokens.
    grams = prefixes.unfold(1, n, 1)  # (N, L-n+1, n)
    tail = prefixes[:, length - n + 1:]  # (N, n-1)
    hits = (grams[:, :, :-1] == tail[:, None, :]).all(dim=-1)  # (N, L-n+1)
    rows, cols = hits.nonzero(as_tuple=True)
    if rows.numel():
        log_probs = log_probs.clone()
        log_probs[rows, grams[rows, cols, -1]] = float("-inf")
    return log_probs


@torch.inference_mode()
def greedy(model, src_ids: Tensor, max_len: int = 30, min_len: int = 1, no_repeat_ngram: int = 0,
           use_cache: bool = True) -> list[list[int]]:
    """(B, S) source ids -> B lists of target ids (without BOS/EOS)."""
    memory = model.encode(src_ids)
    batch = src_ids.shape[0]
    out = torch.full((batch, 1), BOS, dtype=torch.long, device=src_ids.device)
    done = torch.zeros(batch, dtype=torch.bool, device=src_ids.device)
    cache: dict | None = {} if use_cache else None
    for step in range(max_len + 1):
        step_in = out[:, -1:] if use_cache else out
        log_probs = model.decode(step_in, memory, src_ids, cache)[:, -1]  # (B, V)
        log_probs = log_probs.to(src_ids.device)
        if step < min_len:
            log_probs[:, EOS] = float("-inf")
        log_probs = _block_repeats(log_probs, out[:, 1:], no_repeat_ngram)
        next_ids = log_probs.argmax(dim=-1).masked_fill(done, PAD)
        out = torch.cat([out, next_ids[:, None]], dim=1)
        done |= next_ids == EOS
        if bool(done.all()):
            break
    return [_strip(row) for row in out[:, 1:].tolist()]


def _strip(ids: list[int]) -> list[int]:
    """Cut at the first EOS and drop padding."""
    if EOS in ids:
        ids = ids[:ids.index(EOS)]
    return [i for i in ids if i != PAD]
