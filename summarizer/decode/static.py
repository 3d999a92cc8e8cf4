"""Beam search and greedy with static shapes: every step of a batch has the same tensor shapes, so a GPU replays
a whole step as one CUDA graph instead of launching its hundreds of kernels from Python: the decoder's step, every
rule, the choice of tokens and the beam's bookkeeping (`GreedyStep`, `BeamStep`). The rules keep their state in
tensors of fixed size, updated in place, and take the step as a tensor (`Rules(capacity=...)`, `Rules.apply_at`);
the host reads back only the hypotheses that end (greedy: all of them once, when its batch has ended).

What changes against `search.beam_search`, and only in how, not what, it computes: the KV cache has a fixed size
(`max_len + 1` positions, written in place: `Seq2Seq.start_decoding(capacity=...)`); every sentence has `beam_size`
rows from the first step (beams 1..K-1 start at score -inf, so the first step picks from beam 0 alone, as the
widening search does); and a finished sentence keeps its rows to the end of the batch, its candidates ignored,
instead of leaving it. The outputs are the dynamic search's in float32 (tests/test_static_decoding.py; int8
layers scale activations per batch, and this batch keeps its finished rows). `eval.shapes=auto` runs it for
greedy search on a GPU; beam search there, and every search on a CPU, where nothing replays a graph, are faster
dynamic: finished sentences leaving the batch save more work (`search.static_shapes`).
"""
from __future__ import annotations

import sys
import threading

import torch
from torch import Tensor

from summarizer import runtime
from summarizer.config.schema import EvalConfig
from summarizer.data.tokenizer import BOS, EOS
from summarizer.decode.lexicon import Lexicon
from summarizer.decode.rules import (
    Rules,
    best_tokens,
    continuing,
    keep_ended,
    ranked_ends,
    top_candidates,
)


class Replayed:
    """A search step over buffers it updates in place (`_run`): the rows' last tokens, their prefixes (BOS, then
    `capacity` tokens), the step, the cache and the rules. On CUDA, with the whole model on the search's GPU, it is
    captured once as a graph and replayed; its output is then the same tensor every call, valid until the next one.
    Before a thread's first capture on a device, `warmup` eager calls on a side stream set up what a capture cannot
    (the thread's cuBLAS handle, kernels loaded on first use: torch's CUDA graph notes ask for it); once a capture
    there has worked, the thread's later steps are captured at their first call, as training's are
    (summarizer/train/graphs.py), and a capture that fails then falls back to the warm-up. Elsewhere, or where a
    capture after warm-up fails (said once, on stderr), it runs eagerly.

    One capture at a time in the process (torch's rule), whatever the decoding threads (`eval.threads`); and a
    capture forbids only its own thread the calls that would break it (capture_error_mode="thread_local"), so
    another thread's work goes on: another batch's search, or the training DataLoader's pinning thread, whose
    pinned memory the capture's set-up just let go of, so its next batch allocates anew, while a run validates."""

    warned = False
    capturing = threading.Lock()
    ready = threading.local()  # .devices: where this thread has captured a step, its set-up done

    def __init__(self, model, state, rules: Rules, capacity: int, warmup: int = 2):
        self.device = device = state.src_ids.device
        self.graphs, self.warmup, self.calls = device.type == "cuda" and state.memory.device == device, warmup, 0
        self.graph, self.out = None, None
        self.model, self.state, self.rules = model, state, rules
        rows = state.self_kv[0][0].shape[0]
        self.rows = torch.arange(rows, device=device)
        self.tokens = torch.full((rows,), BOS, dtype=torch.long, device=device)
        self.prefixes = torch.full((rows, capacity + 1), BOS, dtype=torch.long, device=device)
        self.step = torch.zeros((), dtype=torch.long, device=device)

    def _run(self) -> Tensor:
        raise NotImplementedError

    def _log_probs(self) -> Tensor:
        """(R, V) scores of each row's next token, every token the rules forbid at -inf."""
        log_probs = self.model.decode(self.tokens[:, None], self.state.memory, self.state.src_ids, self.state)[:, -1]
        return self.rules.apply_at(log_probs.to(self.device), self.step, self.prefixes[:, 1:])

    def _move_on(self, parents: Tensor, tokens: Tensor) -> None:
        """Row i continues row parents[i] (its prefix already there) with tokens[i]: the prefixes, the rules, the
        step and the cache's position follow."""
        self.tokens.copy_(tokens)
        self.prefixes.scatter_(1, (self.step + 1).expand(len(tokens), 1), tokens[:, None])
        self.rules.advance(parents, tokens)
        self.step += 1
        self.state.position += 1

    def run(self) -> Tensor:
        if self.graph is not None:
            self.graph.replay()
            return self.out
        if not self.graphs:
            return self._run()
        ready = getattr(Replayed.ready, "devices", set())
        if self.calls < self.warmup and self.device not in ready:
            self.calls += 1
            return runtime.on_side_stream(self.device, self._run)
        try:
            graph = torch.cuda.CUDAGraph()
            with Replayed.capturing, torch.cuda.device(self.device), runtime.graph_capture(graph, self.device):
                self.out = self._run()
        except RuntimeError as exc:  # nothing ran during the capture
            if self.calls < self.warmup:  # not warmed up: this step warms up, as a thread's first capture does
                Replayed.ready.devices = ready - {self.device}
                return self.run()
            self.graphs = False  # the step runs eagerly from here on
            if not Replayed.warned:
                Replayed.warned = True
                print(f"warning: a decoding step could not be captured as a CUDA graph ({exc}); decoding runs "
                      f"eagerly", file=sys.stderr, flush=True)
            return self._run()
        Replayed.ready.devices = ready | {self.device}
        self.graph = graph
        graph.replay()
        return self.out


class GreedyStep(Replayed):
    """A whole greedy step, the rules and the choice of token included: the decoder's step at the cache's next
    position, `Rules.apply_at`, the best allowed token of each row written into the prefixes, the rules advanced
    by it, and for each row that ends now (its first EOS) the step it ended at and the pieces to cut
    (`Rules.cuts`). Returns (R,) those steps (-1: not ended yet). Nothing is read back and no step differs in shape
    or code from another, so a GPU replays one graph for every step, where the eager search launches hundreds of
    kernels a step from Python."""

    def __init__(self, model, state, rules: Rules, capacity: int, warmup: int = 2):
        super().__init__(model, state, rules, capacity, warmup)
        self.ended_at = torch.full_like(self.tokens, -1)  # (R,) the prefix column of each row's EOS
        self.cut = torch.zeros_like(self.tokens)  # (R,) the pieces its hypothesis drops, as the rules said then

    def _run(self) -> Tensor:
        self._move_on(self.rows, best_tokens(self._log_probs()))
        now = (self.tokens == EOS) & (self.ended_at < 0)
        self.cut.copy_(torch.where(now, self.rules.cuts(self.rows), self.cut))
        self.ended_at.copy_(torch.where(now, self.step, self.ended_at))
        return self.ended_at


class BeamStep(Replayed):
    """A whole beam step: the cache reordered by the last step's parents, the decoder's step, `Rules.apply_at`,
    the 2K best candidates of each sentence, and the K best that do not end continued (scores, parents, tokens,
    prefixes, the rules). What the host needs of the candidates that end is kept aside before the rows move on:
    which are ranked within the top K (`ranked`, the step's output), their scores and parent rows, and every row's
    prefix and cut (`Rules.cuts`) as they were. So a GPU replays one graph for every step and the host reads back
    only the candidates that end."""

    def __init__(self, model, state, rules: Rules, capacity: int, k: int, warmup: int = 2):
        super().__init__(model, state, rules, capacity, warmup)
        rows, device = len(self.rows), self.device
        self.k = k
        self.parents = self.rows.clone()  # the rows each continues: the cache is reordered by them at the next step
        self.scores = torch.full((rows // k, k), float("-inf"), device=device)
        self.scores[:, 0] = 0.0  # the first step extends beam 0 only: its K rows are the same BOS
        # the candidates that end, as the step left them for the host
        self.ranked = torch.zeros((rows // k, 2 * k), dtype=torch.bool, device=device)
        self.top_scores = torch.zeros((rows // k, 2 * k), device=device)
        self.top_parents = torch.zeros((rows // k, 2 * k), dtype=torch.long, device=device)
        self.before = torch.empty_like(self.prefixes)
        self.cuts = torch.zeros(rows, dtype=torch.long, device=device)

    def _run(self) -> Tensor:
        k = self.k
        self.model.reorder(self.state, self.parents)
        top_scores, parents, token, is_eos = top_candidates(self._log_probs(), self.scores, k, k)
        self.ranked.copy_(ranked_ends(is_eos, k))
        self.top_scores.copy_(top_scores)
        self.top_parents.copy_(parents)
        self.before.copy_(self.prefixes)
        self.cuts.copy_(self.rules.cuts(self.rows))
        scores, parents, tokens = continuing(top_scores, parents, token, is_eos, k)
        self.scores.copy_(scores)
        self.parents.copy_(parents)
        self.prefixes.copy_(self.prefixes[parents])
        self._move_on(parents, tokens)
        return self.ranked


def _beam(model, state, rules: Rules, settings: EvalConfig) -> list[list[int]]:
    """Beam search over a static batch: one `BeamStep` a step, then the candidates that end read back (one wait
    for the device a step, three when one ended) into their sentences' finished lists; a finished sentence's
    later candidates are ignored."""
    k = settings.beam_size
    step_of = BeamStep(model, state, rules, settings.max_len + 1, k)
    finished: list[list[tuple[float, list[int]]]] = [[] for _ in range(step_of.scores.shape[0])]
    alive = list(range(len(finished)))
    for step in range(settings.max_len + 1):
        rows, cols = step_of.run().nonzero(as_tuple=True)
        if rows.numel():
            parents = step_of.top_parents
            keep_ended(finished, alive, rows, cols, step_of.before[:, :step + 1], step_of.top_scores, parents,
                       step_of.cuts[parents[rows, cols]], k, settings.length_penalty)
        if all(len(f) >= k for f in finished):
            break
    return [max(f, key=lambda item: item[0])[1] if f else [] for f in finished]


def _greedy(model, state, rules: Rules, settings: EvalConfig) -> list[list[int]]:
    """Greedy over a static batch: one `GreedyStep` a step until every row has ended, then every hypothesis read
    back at once. On a GPU whether all have ended is read one step late (runtime.LateRead), while the next step
    runs, so the device never waits for the host. A row keeps its first ending; a row
    that never ends gets nothing."""
    step_of = GreedyStep(model, state, rules, settings.max_len + 1)
    late, pending = step_of.device.type == "cuda", None
    for _ in range(settings.max_len + 1):
        answer = runtime.LateRead((step_of.run() >= 0).all())
        ready, pending = (pending, answer) if late else (answer, None)  # on a GPU, the step before's: given by now
        if ready is not None and bool(ready.get()):
            break
    table = torch.cat([step_of.ended_at[:, None], step_of.cut[:, None], step_of.prefixes], dim=1).tolist()
    return [ids[1:end][:end - 1 - cut] if end > 0 else [] for end, cut, *ids in table]


@torch.inference_mode()
def static_search(model, src_ids: Tensor, settings: EvalConfig, lexicon: Lexicon | None = None) -> list[list[int]]:
    """(B, S) source ids -> B lists of target ids, as `search.beam_search` (`search.greedy` for beam 1) returns
    them, every step in the same shapes. A sentence's hypotheses are (score, ids) as beam search keeps them;
    greedy keeps its one."""
    k = settings.beam_size
    state = model.start_decoding(model.encode(src_ids), src_ids, group=k, capacity=settings.max_len + 1)
    rules = Rules(src_ids, k, settings, lexicon, capacity=settings.max_len + 1)
    return (_greedy if k == 1 else _beam)(model, state, rules, settings)
