"""Beam search and greedy with static shapes: every step of a batch has the same tensor shapes, so a GPU replays
a step as one CUDA graph instead of launching its hundreds of kernels from Python: at beam K the decoder's step
(`DecoderStep`; the beam's bookkeeping stays eager), in greedy the whole step, the rules and the choice of token
included (`GreedyStep`: the rules keep their state in tensors of fixed size, updated in place, and take the step
as a tensor: `Rules(capacity=...)`, `Rules.apply_at`).

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
from summarizer.data.tokenizer import BOS, EOS
from summarizer.decode.lexicon import Lexicon
from summarizer.decode.rules import Rules, beam_step, best_tokens, ended_hypotheses


@functools.cache
def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream warm-up steps run on, one per device for the process: memory the caching allocator files
    under a stream is reused only by that stream, so a new stream per batch would strand each one's blocks."""
    return torch.cuda.Stream(device)


class Replayed:
    """A step whose tensors keep their place from call to call (`_run`, over buffers its subclass fills): on CUDA,
    after `warmup` eager calls on a side stream (which CUDA graph capture asks for), captured once as a graph and
    replayed; its output is then the same tensor every call, valid until the next one. Elsewhere, or where the
    capture fails (said once, on stderr), it runs eagerly."""

    warned = False

    def __init__(self, device: torch.device, graphs: bool, warmup: int = 2):
        self.device, self.graphs, self.warmup, self.calls = device, graphs and device.type == "cuda", warmup, 0
        self.graph, self.out = None, None

    def _run(self) -> Tensor:
        raise NotImplementedError

    def run(self) -> Tensor:
        if self.graph is not None:
            self.graph.replay()
            return self.out
        if not self.graphs:
            return self._run()
        if self.calls < self.warmup:
            self.calls += 1
            side, current = _side_stream(self.device), torch.cuda.current_stream(self.device)
            side.wait_stream(current)
            with torch.cuda.stream(side):
                out = self._run()
            current.wait_stream(side)
            return out
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.device(self.device), torch.cuda.graph(graph):
                self.out = self._run()
        except RuntimeError as exc:  # nothing ran during the capture: the step runs eagerly from here on
            self.graphs = False
            if not Replayed.warned:
                Replayed.warned = True
                print(f"warning: a decoding step could not be captured as a CUDA graph ({exc}); decoding runs "
                      f"eagerly", file=sys.stderr, flush=True)
            return self._run()
        self.graph = graph
        graph.replay()
        return self.out


class DecoderStep(Replayed):
    """One step of a fixed-size-cache decode: reorder the cache by `parents`, feed `tokens` at position `step`,
    return the (R, V) log-probabilities (beam search: its bookkeeping around the step stays eager)."""

    def __init__(self, model, state, warmup: int = 2):
        rows, device = state.self_kv[0][0].shape[0], state.memory.device
        super().__init__(device, True, warmup)
        self.model, self.state = model, state
        self.tokens = torch.full((rows,), BOS, dtype=torch.long, device=device)
        self.parents = torch.arange(rows, device=device)

    def _run(self) -> Tensor:
        self.model.reorder(self.state, self.parents)
        return self.model.decode(self.tokens[:, None], self.state.memory, self.state.src_ids, self.state)[:, -1]

    def __call__(self, tokens: Tensor, parents: Tensor, step: int) -> Tensor:
        self.tokens.copy_(tokens)
        self.parents.copy_(parents)
        self.state.position.fill_(step)
        return self.run()


class GreedyStep(Replayed):
    """A whole greedy step, the rules and the choice of token included, over buffers it updates in place: the
    decoder's step at the cache's next position, `Rules.apply_at`, the best allowed token of each row written
    into the prefixes, and the rules advanced by it. Returns the (R,) tokens. Nothing is read back and no step
    differs in shape or code from another, so a GPU replays one graph for every step, where the eager search
    launches hundreds of kernels a step from Python."""

    def __init__(self, model, state, rules: Rules, capacity: int, warmup: int = 2):
        device = state.src_ids.device
        super().__init__(device, state.memory.device == device, warmup)
        rows = state.self_kv[0][0].shape[0]
        self.model, self.state, self.rules = model, state, rules
        self.tokens = torch.full((rows,), BOS, dtype=torch.long, device=device)
        self.prefixes = torch.full((rows, capacity + 1), BOS, dtype=torch.long, device=device)  # BOS, then tokens
        self.step, self.rows = torch.zeros((), dtype=torch.long, device=device), torch.arange(rows, device=device)

    def _run(self) -> Tensor:
        log_probs = self.model.decode(self.tokens[:, None], self.state.memory, self.state.src_ids, self.state)[:, -1]
        log_probs = self.rules.apply_at(log_probs.to(self.device), self.step, self.prefixes[:, 1:])
        tokens = best_tokens(log_probs)
        self.tokens.copy_(tokens)
        self.prefixes.scatter_(1, (self.step + 1).expand(len(tokens), 1), tokens[:, None])
        self.rules.advance(self.rows, tokens)
        self.step += 1
        self.state.position += 1
        return self.tokens


def _greedy(model, state, rules: Rules, settings: EvalConfig) -> list[list[int]]:
    """Greedy over a static batch: one `GreedyStep` a step, then the rows that ended now read back (one wait for
    the device a step, and one more when a row ended); a row keeps its first ending."""
    step_of = GreedyStep(model, state, rules, settings.max_len + 1)
    rows = len(step_of.tokens)
    out: list[list[int] | None] = [None] * rows
    done, left = torch.zeros(rows, dtype=torch.bool, device=step_of.device), rows
    for step in range(settings.max_len + 1):
        tokens = step_of.run()
        ended = (tokens == EOS) & ~done
        done |= ended
        now = ended.nonzero().squeeze(1)
        if now.numel():
            for row, ids in ended_hypotheses(now, step_of.prefixes[:, :step + 2], rules, end=-1):
                out[row] = ids
                left -= 1
        if not left:
            break
    return [ids if ids is not None else [] for ids in out]


@torch.inference_mode()
def static_search(model, src_ids: Tensor, settings: EvalConfig, lexicon: Lexicon | None = None) -> list[list[int]]:
    """(B, S) source ids -> B lists of target ids, as `search.beam_search` (`search.greedy` for beam 1) returns
    them, every step in the same shapes. A sentence's hypotheses are (score, ids) as beam search keeps them;
    greedy keeps its one."""
    batch, k, device = src_ids.shape[0], settings.beam_size, src_ids.device
    rows = batch * k
    state = model.start_decoding(model.encode(src_ids), src_ids, group=k, capacity=settings.max_len + 1)
    if k == 1:
        return _greedy(model, state, Rules(src_ids, 1, settings, lexicon, capacity=settings.max_len + 1), settings)
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
        scores, parents, tokens, prefixes = beam_step(log_probs, scores, k, k, prefixes, rules, finished, alive,
                                                      settings.length_penalty)
        if all(len(f) >= k for f in finished):
            break
    return [max(f, key=lambda item: item[0])[1] if f else [] for f in finished]
