"""Beam search (and greedy, as beam 1) with static shapes: every step of a batch has the same tensor shapes, so a
GPU replays the decoder's step as one CUDA graph instead of launching its hundred-odd kernels from Python.

What changes against `search.beam_search`, and only in how, not what, it computes: the KV cache has a fixed size
(`max_len + 1` positions, written in place: `Seq2Seq.start_decoding(capacity=...)`); every sentence has `beam_size`
rows from the first step (beams 1..K-1 start at score -inf, so the first step picks from beam 0 alone, as the
widening search does); and a finished sentence keeps its rows to the end of the batch, its candidates ignored,
instead of leaving it. The outputs are the dynamic search's in float32 (tests/test_static_decoding.py; int8
layers scale activations per batch, and this batch keeps its finished rows). On a CPU, where nothing replays
a graph and a finished sentence leaving the batch saves work, `eval.shapes=auto` keeps the dynamic search;
`eval.shapes=static` runs this one there too.
"""
from __future__ import annotations

import functools
import sys

import torch
from torch import Tensor

from summarizer.config.schema import EvalConfig
from summarizer.data.tokenizer import BOS
from summarizer.decode.lexicon import Lexicon
from summarizer.decode.rules import Rules, beam_step, greedy_step


@functools.cache
def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream warm-up steps run on, one per device for the process: memory the caching allocator files
    under a stream is reused only by that stream, so a new stream per batch would strand each one's blocks."""
    return torch.cuda.Stream(device)


class DecoderStep:
    """One step of a fixed-size-cache decode: reorder the cache by `parents`, feed `tokens` at position `step`,
    return the (R, V) log-probabilities. Its inputs are copied into buffers the step reads, so on CUDA, after
    `warmup` eager steps on a side stream (which CUDA graph capture asks for), the step is captured once and
    replayed; its output is then the same tensor every step, valid until the next call. Elsewhere, or where
    capture fails (said once, on stderr), it runs eagerly."""

    warned = False

    def __init__(self, model, state, warmup: int = 2):
        rows, device = state.self_kv[0][0].shape[0], state.memory.device
        self.model, self.state, self.warmup, self.calls = model, state, warmup, 0
        self.tokens = torch.full((rows,), BOS, dtype=torch.long, device=device)
        self.parents = torch.arange(rows, device=device)
        self.graphs = device.type == "cuda"
        self.graph, self.out = None, None

    def _run(self) -> Tensor:
        self.model.reorder(self.state, self.parents)
        return self.model.decode(self.tokens[:, None], self.state.memory, self.state.src_ids, self.state)[:, -1]

    def __call__(self, tokens: Tensor, parents: Tensor, step: int) -> Tensor:
        self.tokens.copy_(tokens)
        self.parents.copy_(parents)
        self.state.position.fill_(step)
        if self.graph is not None:
            self.graph.replay()
            return self.out
        if not self.graphs:
            return self._run()
        device = self.tokens.device  # every stream and the capture on this GPU, whichever is current
        if self.calls < self.warmup:
            self.calls += 1
            side, current = _side_stream(device), torch.cuda.current_stream(device)
            side.wait_stream(current)
            with torch.cuda.stream(side):
                out = self._run()
            current.wait_stream(side)
            return out
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.device(device), torch.cuda.graph(graph):
                self.out = self._run()
        except RuntimeError as exc:  # nothing ran during the capture: the step runs eagerly from here on
            self.graphs = False
            if not DecoderStep.warned:
                DecoderStep.warned = True
                print(f"warning: the decoder step could not be captured as a CUDA graph ({exc}); decoding runs "
                      f"eagerly", file=sys.stderr, flush=True)
            return self._run()
        self.graph = graph
        graph.replay()
        return self.out


@torch.inference_mode()
def static_search(model, src_ids: Tensor, settings: EvalConfig, lexicon: Lexicon | None = None) -> list[list[int]]:
    """(B, S) source ids -> B lists of target ids, as `search.beam_search` (`search.greedy` for beam 1) returns
    them, every step in the same shapes. A sentence's hypotheses are (score, ids) as beam search keeps them;
    greedy keeps its one."""
    batch, k, device = src_ids.shape[0], settings.beam_size, src_ids.device
    rows = batch * k
    state = model.start_decoding(model.encode(src_ids), src_ids, group=k, capacity=settings.max_len + 1)
    step_of = DecoderStep(model, state)
    rules = Rules(src_ids, k, settings, lexicon)
    alive = list(range(batch))
    prefixes = torch.full((rows, 1), BOS, dtype=torch.long, device=device)
    tokens, parents = prefixes[:, 0], torch.arange(rows, device=device)
    scores = torch.full((batch, k), float("-inf"), device=device)
    scores[:, 0] = 0.0  # the first step extends beam 0 only: its K rows are the same BOS
    finished: list[list[tuple[float, list[int]]]] = [[] for _ in range(batch)]
    for step in range(settings.max_len + 1):
        log_probs = rules.apply(step_of(tokens, parents, step).to(device), step, prefixes[:, 1:])  # (R, V)
        if k == 1:  # greedy, as search.greedy; a finished sentence keeps its first ending
            tokens, prefixes, ended_now = greedy_step(log_probs, prefixes, rules)
            for row, ids in ended_now:
                if not finished[row]:
                    finished[row].append((0.0, ids))
        else:
            scores, parents, tokens, prefixes = beam_step(log_probs, scores, k, k, prefixes, rules, finished, alive,
                                                          settings.length_penalty)
        if all(len(f) >= k for f in finished):
            break
    return [max(f, key=lambda item: item[0])[1] if f else [] for f in finished]
