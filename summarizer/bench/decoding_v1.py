"""The decoder of commit 9415323, frozen: the baseline `make bench` measures today's decoder against, and
that a test compares today's outputs with. Self-contained (it imports nothing from today's decoder, so
changing that cannot change this); never used to decode.

Its cache replicates the encoder memory and every layer's cross-attention keys and values for each
beam, copies all of them at every reordering, projects the copy head's keys again at every step, and
keeps finished sentences in the batch until the whole batch is done.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from summarizer.data.tokenizer import BOS, EOS, PAD
from summarizer.model.transformer import DecoderOutput, Seq2Seq


def _block_repeats(log_probs: Tensor, prefixes: Tensor, n: int) -> Tensor:
    """Forbid tokens that would repeat an n-gram already in each prefix. (N, V) scores, (N, L) prefixes."""
    length = prefixes.shape[1]
    if n <= 0 or length < n:
        return log_probs
    grams = prefixes.unfold(1, n, 1)  # (N, L-n+1, n)
    tail = prefixes[:, length - n + 1:]  # (N, n-1)
    hits = (grams[:, :, :-1] == tail[:, None, :]).all(dim=-1)  # (N, L-n+1)
    rows, cols = hits.nonzero(as_tuple=True)
    if rows.numel():
        log_probs[rows, grams[rows, cols, -1]] = float("-inf")
    return log_probs


def _layer_step(layer, x: Tensor, memory_kv, src_mask: Tensor, cache: dict | None, name: str) -> Tensor:
    h = layer.norm1(x)
    k, v = layer.self_attn.project_kv(h)
    if cache is not None and f"{name}.k" in cache:
        k = torch.cat([cache[f"{name}.k"], k], dim=2)
        v = torch.cat([cache[f"{name}.v"], v], dim=2)
    if cache is not None:
        cache[f"{name}.k"], cache[f"{name}.v"] = k, v
    x = x + layer.drop(layer.self_attn(h, k, v, is_causal=x.shape[1] > 1))
    x = x + layer.drop(layer.cross_attn(layer.norm2(x), *memory_kv, mask=src_mask))
    return x + layer.drop(layer.ffn(layer.norm3(x)))


def _log_probs(out: DecoderOutput, src_ids: Tensor) -> Tensor:
    """Release 1's copy mixture, in probability space over the whole (R, T, V) tensor."""
    if out.copy_attn is None:
        return out.logits.float().log_softmax(dim=-1)
    probs = out.logits.float().softmax(dim=-1).mul_(out.gate)
    index = src_ids[:, None, :].expand(-1, out.logits.shape[1], -1)  # (R, T, S)
    probs.scatter_add_(2, index, (1.0 - out.gate) * out.copy_attn)
    return probs.clamp_min_(1e-12).log_()


def _decode(model: Seq2Seq, tgt_in: Tensor, memory: Tensor, src_ids: Tensor, cache: dict | None) -> Tensor:
    past = cache.get("length", 0) if cache is not None else 0
    src_mask = model.source_mask(src_ids)
    if cache is not None and "memory_kv" not in cache:
        cache["memory_kv"] = [layer.cross_attn.project_kv(memory) for layer in model.decoder_layers]
    memory_kvs = cache["memory_kv"] if cache is not None else \
        [layer.cross_attn.project_kv(memory) for layer in model.decoder_layers]
    x = model.embed(tgt_in, offset=past)
    for i, layer in enumerate(model.decoder_layers):
        x = _layer_step(layer, x, memory_kvs[i], src_mask, cache, f"layer{i}")
    h = model.decoder_norm(x)
    if cache is not None:
        cache["length"] = past + tgt_in.shape[1]
    logits = F.linear(h, model.embedding.weight)
    if not model.cfg.copy:
        return _log_probs(DecoderOutput(logits, None, None), src_ids)
    scores = model.copy_query(h) @ model.copy_key(memory).transpose(1, 2)
    scores = scores.float() / math.sqrt(model.cfg.d_model)
    attn = scores.masked_fill(~src_mask[:, 0], float("-inf")).softmax(dim=-1)
    context = attn.to(memory.dtype) @ memory
    gate = torch.sigmoid(model.copy_gate(torch.cat([h, context], dim=-1)).float())
    return _log_probs(DecoderOutput(logits, attn, gate), src_ids)


def _reorder_cache(cache: dict, index: Tensor) -> dict:
    out: dict = {"length": cache["length"]}
    out["memory_kv"] = [(k.index_select(0, index), v.index_select(0, index)) for k, v in cache["memory_kv"]]
    for key, value in cache.items():
        if key not in out:
            out[key] = value.index_select(0, index)
    return out


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
        log_probs = _decode(model, step_in, memory, src_ids, cache)[:, -1].to(src_ids.device)  # (B, V)
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
        log_probs = _decode(model, step_in, memory, src, cache)[:, -1].to(device)  # (B*K, V)
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
            cache = _reorder_cache(cache, source_rows)
    return [max(f, key=lambda item: item[0])[1] if f else [] for f in finished]
