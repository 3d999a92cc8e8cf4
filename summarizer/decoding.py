"""Batched greedy and beam search as free functions over a model's `encode`/`decode`, with the KV cache;
`decode_all`, the one entry point every decode in the product goes through."""
from __future__ import annotations

import sys
from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor
from tqdm import tqdm

from summarizer import runtime
from summarizer.config import EvalConfig
from summarizer.data import pad_sources
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
        log_probs[rows, grams[rows, cols, -1]] = float("-inf")
    return log_probs


def _constrain(log_probs: Tensor, step: int, prefixes: Tensor, min_len: int, max_len: int,
               no_repeat_ngram: int) -> Tensor:
    """Rules both decoders apply to a step's (N, V) scores: never PAD or BOS; no EOS before min_len;
    only EOS once max_len tokens exist; no repeated n-gram."""
    log_probs = log_probs.clone()
    log_probs[:, [PAD, BOS]] = float("-inf")
    if step < min_len:
        log_probs[:, EOS] = float("-inf")
    if step >= max_len:
        eos = log_probs[:, EOS].clone()
        log_probs.fill_(float("-inf"))
        log_probs[:, EOS] = eos
    return _block_repeats(log_probs, prefixes, no_repeat_ngram)


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
        log_probs = model.decode(step_in, memory, src_ids, cache)[:, -1].to(src_ids.device)  # (B, V)
        log_probs = _constrain(log_probs, step, out[:, 1:], min_len, max_len, no_repeat_ngram)
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


@torch.inference_mode()
def beam_search(model, src_ids: Tensor, beam_size: int = 4, max_len: int = 30, min_len: int = 1,
                length_penalty: float = 1.0, no_repeat_ngram: int = 0, use_cache: bool = True) -> list[list[int]]:
    """(B, S) source ids -> B lists of target ids: the best hypothesis by score / length**length_penalty.

    A hypothesis is finalised when it emits EOS (fairseq-style), and the beam keeps `beam_size` live
    hypotheses; a sentence stops once it holds `beam_size` finished ones, and the search stops when
    every sentence has. Scores are sums of log-probabilities; length counts tokens including EOS.
    """
    batch, k, device = src_ids.shape[0], beam_size, src_ids.device
    memory = model.encode(src_ids)
    rows = torch.arange(batch, device=device).repeat_interleave(k)  # beam row -> sentence
    memory, src = memory.index_select(0, rows.to(memory.device)), src_ids.index_select(0, rows)
    prefixes = torch.full((batch * k, 1), BOS, dtype=torch.long, device=device)
    scores = torch.full((batch, k), float("-inf"), device=device)
    scores[:, 0] = 0.0  # all beams start identical: let only the first one expand
    finished: list[list[tuple[float, list[int]]]] = [[] for _ in range(batch)]
    cache: dict | None = {} if use_cache else None
    for step in range(max_len + 1):
        step_in = prefixes[:, -1:] if use_cache else prefixes
        log_probs = model.decode(step_in, memory, src, cache)[:, -1].to(device)  # (B*K, V)
        log_probs = _constrain(log_probs, step, prefixes[:, 1:], min_len, max_len, no_repeat_ngram)
        vocab = log_probs.shape[-1]
        candidates = (scores.view(-1, 1) + log_probs).view(batch, k * vocab)
        top_scores, top_index = candidates.topk(2 * k, dim=-1)  # (B, 2K): at most K of them end in EOS
        beam, token = top_index // vocab, top_index % vocab
        is_eos = (token == EOS) & torch.isfinite(top_scores)
        # Finalise EOS candidates ranked within the top K; they leave the live beam.
        for b, j in (is_eos & (torch.arange(2 * k, device=device) < k)).nonzero().tolist():
            if len(finished[b]) < k:
                hyp = prefixes[b * k + beam[b, j]].tolist()[1:]
                finished[b].append((top_scores[b, j].item() / (len(hyp) + 1) ** length_penalty, hyp))
        if all(len(f) >= k for f in finished):
            break
        # The K best non-EOS candidates continue.
        live = ~is_eos
        keep = live & (live.cumsum(dim=1) <= k)
        scores = top_scores[keep].view(batch, k)
        source_rows = (torch.arange(batch, device=device)[:, None] * k + beam)[keep]
        prefixes = torch.cat([prefixes[source_rows], token[keep].view(-1, 1)], dim=1)
        done = torch.tensor([len(f) >= k for f in finished], device=device)
        scores = scores.masked_fill(done[:, None], float("-inf"))  # finished sentences stop competing
        if cache is not None:
            cache = model.reorder_cache(cache, source_rows)
    return [max(f, key=lambda item: item[0])[1] if f else [] for f in finished]


def decode_batch(model, src_ids: Tensor, settings: EvalConfig, use_cache: bool = True) -> list[list[int]]:
    """Greedy for beam 1 (cheaper bookkeeping), beam search otherwise."""
    common = dict(max_len=settings.max_len, min_len=settings.min_len, no_repeat_ngram=settings.no_repeat_ngram,
                  use_cache=use_cache)
    if settings.beam_size == 1:
        return greedy(model, src_ids, **common)
    return beam_search(model, src_ids, settings.beam_size, length_penalty=settings.length_penalty, **common)


def decode_all(model, sources: Sequence[Sequence[int]], settings: EvalConfig, rt: runtime.Runtime,
               desc: str = "", use_cache: bool = True) -> list[list[int]]:
    """Source id sequences -> hypothesis id lists, in input order, decoded as `settings` (the eval section) says.

    Sources are sorted by length so batches pad little, decoded `settings.batch_size` at a time with
    dropout off and under inference_mode (so no RNG stream is drawn from), and put back in input
    order. `desc` names a progress bar, shown only when stderr is a terminal. `use_cache=False`
    recomputes every prefix from scratch (the reference the KV cache is tested and benched against).
    """
    model = runtime.unwrap(model)
    order = np.argsort([len(s) for s in sources], kind="stable")
    hyps: list = [None] * len(sources)
    batches = range(0, len(order), settings.batch_size)
    with runtime.eval_mode(model), torch.inference_mode():
        for start in tqdm(batches, desc=desc, unit="batch", file=sys.stderr, disable=None if desc else True):
            idx = order[start:start + settings.batch_size]
            src = runtime.move(pad_sources([sources[i] for i in idx]), rt.device)
            with rt.compute():
                for i, hyp in zip(idx, decode_batch(model, src, settings, use_cache), strict=True):
                    hyps[i] = hyp
    return hyps
