"""Batched greedy and beam search as free functions over a model's `encode`/`decode`, with the KV cache;
`decode_all`, the one entry point every decode in the product goes through.

Only the work that changes is done per step: what the decoder derives from a sentence's memory is
computed once and shared by its beams (model.start_decoding), a sentence leaves the batch (and the
cache) as soon as it is finished, and beams are reordered by one gather of the self-attention cache.
"""
from __future__ import annotations

import contextlib
import gc
import sys
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from torch import Tensor
from tqdm import tqdm

from summarizer import runtime
from summarizer.config.schema import EvalConfig
from summarizer.data.batches import pad_sources
from summarizer.data.tokenizer import BOS, UNK
from summarizer.decode.lexicon import Lexicon
from summarizer.decode.rules import Rules, beam_step, greedy_step
from summarizer.decode.static import static_search


def _step(model, prefixes: Tensor, memory: Tensor, src_ids: Tensor, state, group: int) -> Tensor:
    """(R, V) log-probabilities of each row's next token: from the cache (`state`), or by recomputing the
    whole prefix (state None: the reference the cache is tested against)."""
    if state is not None:
        return model.decode(prefixes[:, -1:], memory, src_ids, state)[:, -1]
    rows = torch.arange(src_ids.shape[0], device=src_ids.device).repeat_interleave(group)
    return model.decode(prefixes, memory.index_select(0, rows.to(memory.device)), src_ids[rows])[:, -1]


@torch.inference_mode()
def greedy(model, src_ids: Tensor, settings: EvalConfig, lexicon: Lexicon | None = None,
           use_cache: bool = True) -> list[list[int]]:
    """(B, S) source ids -> B lists of target ids (without BOS/EOS). A sentence leaves the batch when it ends."""
    memory = model.encode(src_ids)
    state = model.start_decoding(memory, src_ids) if use_cache else None
    rules, device = Rules(src_ids, 1, settings, lexicon), src_ids.device
    alive = list(range(src_ids.shape[0]))  # batch row -> input sentence
    prefixes = torch.full((src_ids.shape[0], 1), BOS, dtype=torch.long, device=device)
    out: list[list[int]] = [[] for _ in range(src_ids.shape[0])]
    for step in range(settings.max_len + 1):
        log_probs = rules.apply(_step(model, prefixes, memory, src_ids, state, 1).to(device), step, prefixes[:, 1:])
        _, prefixes, ended_now = greedy_step(log_probs, prefixes, rules)
        if ended_now:
            ended = set()
            for row, ids in ended_now:
                out[alive[row]] = ids
                ended.add(row)
            if len(ended) == len(alive):
                break
            kept = [row for row in range(len(alive)) if row not in ended]
            keep = torch.tensor(kept, device=device)
            alive, prefixes, src_ids = [alive[row] for row in kept], prefixes[keep], src_ids[keep]
            memory = memory[keep.to(memory.device)]
            rules.select(keep, keep)
            if state is not None:
                model.keep_sentences(state, keep)
    return out


@torch.inference_mode()
def beam_search(model, src_ids: Tensor, settings: EvalConfig, lexicon: Lexicon | None = None,
                use_cache: bool = True) -> list[list[int]]:
    """(B, S) source ids -> B lists of target ids: the best hypothesis by score / length**length_penalty.

    A hypothesis is finalised when it emits EOS (fairseq-style), and the beam keeps `beam_size` live
    hypotheses; a sentence is done once it holds `beam_size` finished ones, and then leaves the batch.
    Scores are sums of log-probabilities; length counts tokens including EOS. A sentence's beams all
    start from BOS, so the first step decodes one row per sentence (`width` 1) and widens to K.
    """
    batch, k, device = src_ids.shape[0], settings.beam_size, src_ids.device
    memory, width = model.encode(src_ids), 1
    state = model.start_decoding(memory, src_ids, group=width) if use_cache else None
    rules = Rules(src_ids, width, settings, lexicon)
    alive = list(range(batch))  # batch sentence -> input sentence
    prefixes = torch.full((batch, 1), BOS, dtype=torch.long, device=device)
    scores = torch.zeros((batch, 1), device=device)
    finished: list[list[tuple[float, list[int]]]] = [[] for _ in range(batch)]
    for step in range(settings.max_len + 1):
        log_probs = _step(model, prefixes, memory, src_ids, state, width).to(device)
        log_probs = rules.apply(log_probs, step, prefixes[:, 1:])  # (R, V)
        scores, parents, _, prefixes = beam_step(log_probs, scores, width, k, prefixes, rules, finished, alive,
                                                 settings.length_penalty)
        width = k
        if state is not None:
            model.reorder(state, parents, group=k)
        kept = [b for b, i in enumerate(alive) if len(finished[i]) < k]
        if len(kept) < len(alive):
            if not kept:
                break
            keep = torch.tensor(kept, device=device)
            rows = (keep[:, None] * k + torch.arange(k, device=device)).view(-1)
            alive, scores, prefixes, src_ids = [alive[b] for b in kept], scores[keep], prefixes[rows], src_ids[keep]
            memory = memory[keep.to(memory.device)]
            rules.select(rows, keep)
            if state is not None:
                model.keep_sentences(state, keep)
    return [max(f, key=lambda item: item[0])[1] if f else [] for f in finished]


def static_shapes(settings: EvalConfig, rt: runtime.Runtime) -> bool:
    """Whether batches decode with static shapes (summarizer/decode/static.py): `eval.shapes`, and for `auto`
    greedy search where the model runs on one GPU (split across devices, the step is not captured). There the
    whole step replays as one CUDA graph: on an H100, 1.09-1.14x the dynamic search's sentences/s at each batch
    size tried, and beam 4 0.68-0.80x (its finished sentences leaving the batch save more than the launches
    cost). On a CPU nothing replays a graph and the dynamic search is faster at both (docs/results.md)."""
    if settings.shapes != "auto":
        return settings.shapes == "static"
    return settings.beam_size == 1 and rt.device.type == "cuda" and rt.decoder_device == rt.device


def decode_batch(model, src_ids: Tensor, settings: EvalConfig, lexicon: Lexicon | None = None,
                 use_cache: bool = True, static: bool = False) -> list[list[int]]:
    """Greedy for beam 1 (cheaper bookkeeping), beam search otherwise; both in static shapes if `static`."""
    if static:
        return static_search(model, src_ids, settings, lexicon)
    search = greedy if settings.beam_size == 1 else beam_search
    return search(model, src_ids, settings, lexicon, use_cache)


def length_batches(lengths: list[int], budget: int) -> list[list[int]]:
    """Indices sorted by length, cut into batches whose padded size (count * longest) fits `budget`."""
    batches, current = [], []
    for i in np.argsort(lengths, kind="stable").tolist():
        if current and (len(current) + 1) * max(lengths[i], 1) > budget:
            batches.append(current)
            current = []
        current.append(i)
    return batches + [current] if current else batches


def decode_threads(settings: EvalConfig, rt: runtime.Runtime) -> int:
    """How many batches decode at once: `eval.threads`, else one per intra-op thread on CPU, one on GPU."""
    if settings.threads:
        return settings.threads
    return torch.get_num_threads() if "cpu" in (rt.device.type, rt.decoder_device.type) else 1


def decode_batch_tokens(settings: EvalConfig, rt: runtime.Runtime) -> int:
    """Padded source tokens x beam_size per batch: `eval.batch_tokens`, else 16,384 on CPU and 2,097,152 on a GPU,
    where a step costs its kernel launches, whatever its rows: on an H100, 2,000 test_dev sentences (one batch)
    decode 1.26x (beam 4) and 1.01x (greedy) the sentences/s of batches of 524,288 (docs/results.md). A batch
    the GPU has no memory for is decoded in halves (`decode_all`)."""
    if settings.batch_tokens:
        return settings.batch_tokens
    return 2_097_152 if "cuda" in (rt.device.type, rt.decoder_device.type) else 16_384


@contextlib.contextmanager
def collector_paused():
    """Python's cycle collector off while decoding. A decode makes hundreds of thousands of short-lived objects
    (the word rules' set-up, every step's tensors), and each full collection walks every object the process holds
    (the lexicon, the model): 1.04x beam 4 and 1.09x greedy on a CPU, more where the host bounds a GPU's decode.
    Reference counting frees what a decode leaves; any cycles are collected once it ends."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def decode_all(model, sources: Sequence[Sequence[int]], settings: EvalConfig, rt: runtime.Runtime,
               desc: str = "", lexicon: Lexicon | None = None, use_cache: bool = True,
               check: Callable[[], None] | None = None) -> list[list[int]]:
    """Source id sequences -> hypothesis id lists, in input order, decoded as `settings` (the eval section) says.

    Sources are sorted by length and cut into batches of `decode_batch_tokens` padded source tokens,
    counted once per beam, decoded with dropout off and under inference_mode (so no RNG stream is drawn
    from), and put back in input order; a batch the GPU has no memory for is decoded in halves. On CPU,
    `decode_threads` batches decode at once, each on one core (CTranslate2's inter_threads): at decoding's few
    rows per matmul one core per batch beats two cores on one batch, and the outputs are the same. The word
    rules and the byte minimum (`settings.known_words`, `no_repeat_words`, `truncate_bytes`) need the run's
    `lexicon`. `desc` names a progress bar, shown only when stderr is a terminal. `use_cache=False` recomputes
    every prefix from scratch (the reference the KV cache is tested and benched against). `check` is called after
    each batch (training's stop point: under DDP a collective, which every rank decoding the same `sources` reaches
    as often, a batch that ran out of memory and was decoded in halves counting once).
    """
    if lexicon is None and (settings.known_words or settings.no_repeat_words or settings.truncate_bytes):
        raise ValueError("eval.known_words, no_repeat_words and truncate_bytes need the run's lexicon")
    model = runtime.unwrap(model)
    static = use_cache and static_shapes(settings, rt)
    hyps: list = [None] * len(sources)
    # Each sentence is beam_size rows of the decoder: the budget counts its source tokens once per row.
    batches = length_batches([len(s) for s in sources], max(1, decode_batch_tokens(settings, rt) // settings.beam_size))

    def run(idx: list[int]) -> list[list[int]]:
        src = runtime.move(pad_sources([sources[i] for i in idx]), rt.device)
        # all three are thread-local, so entered in the thread that decodes (the current GPU: streams, graphs)
        gpu = torch.cuda.device(rt.device) if rt.device.type == "cuda" else contextlib.nullcontext()
        with torch.inference_mode(), rt.compute(), gpu:
            return decode_batch(model, src, settings, lexicon, use_cache, static)

    def decode(idx: list[int]) -> tuple[list[int], list[list[int]]]:
        try:
            return idx, run(idx)
        except torch.OutOfMemoryError:
            if len(idx) == 1:
                raise
        # outside the handler, so the failed batch's tensors are gone with its traceback: the batch in halves
        halves = (idx[:len(idx) // 2], idx[len(idx) // 2:])
        if not split_warned.is_set():
            split_warned.set()
            print(f"warning: a batch of {len(idx)} sentences ran out of GPU memory; decoding such batches in "
                  f"halves (a lower eval.batch_tokens, now {decode_batch_tokens(settings, rt)}, avoids the retry)",
                  file=sys.stderr, flush=True)
        torch.cuda.empty_cache()
        return idx, [hyp for half in halves for hyp in decode(half)[1]]

    split_warned = threading.Event()
    threads, intra_op = min(decode_threads(settings, rt), len(batches)), torch.get_num_threads()
    pool = ThreadPoolExecutor(threads) if threads > 1 else None
    bar = tqdm(total=len(batches), desc=desc, unit="batch", file=sys.stderr, disable=None if desc else True)
    with runtime.eval_mode(model), collector_paused(), bar as progress:
        try:
            if pool is not None:
                torch.set_num_threads(1)
            for idx, out in pool.map(decode, batches) if pool is not None else map(decode, batches):
                for i, hyp in zip(idx, out, strict=True):
                    hyps[i] = hyp
                progress.update()
                if check is not None:
                    check()
        finally:
            if pool is not None:
                pool.shutdown(cancel_futures=True)
                torch.set_num_threads(intra_op)
    return hyps


@torch.inference_mode()
def copy_attention(model, source: Sequence[int], hyp: Sequence[int], rt: runtime.Runtime) -> Tensor | None:
    """(T, S) float32 on the CPU: how the copy head weighted each of `source`'s S pieces as it wrote each of
    `hyp`'s T pieces, from `hyp` re-run teacher-forced (the attention the search saw); None for a model without
    a copy head."""
    model = runtime.unwrap(model)
    with runtime.eval_mode(model), rt.compute():
        src = runtime.move(torch.tensor([list(source)]), rt.device)
        tgt_in = runtime.move(torch.tensor([[BOS, *hyp]]), rt.device)
        attn = model.decoder_output(tgt_in, model.encode(src), src).copy_attn  # (1, T + 1, S)
    return None if attn is None else attn[0, :len(hyp)].float().cpu()


def copied_unknowns(model, sources: Sequence[Sequence[int]], hyps: Sequence[Sequence[int]],
                    rt: runtime.Runtime) -> list[dict[int, int]]:
    """Where each hypothesis' unknown pieces (UNK) were copied from: {position in the hypothesis: position
    in its source}, the source UNK that the copy attention weighted most when the piece was produced.

    The hypothesis is re-run teacher-forced (`copy_attention`: one pass, only for the rare hypothesis that holds
    an UNK its source also holds). An UNK the source does not hold came from the vocabulary and is absent; so
    are all of them for a model without a copy head.
    """
    copied: list[dict[int, int]] = [{} for _ in hyps]
    for i, (source, hyp) in enumerate(zip(sources, hyps, strict=True)):
        if UNK not in hyp or UNK not in source:
            continue
        attn = copy_attention(model, source, hyp, rt)
        if attn is None:
            break
        attn = attn.masked_fill(torch.tensor(list(source)) != UNK, -1.0)
        copied[i] = {t: int(attn[t].argmax()) for t, piece in enumerate(hyp) if piece == UNK}
    return copied
