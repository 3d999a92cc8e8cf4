"""What a search may emit at each step (`Rules`: lengths, repeated n-grams, the word rules of
summarizer/decode/constraints.py) and how a hypothesis that ends is kept (`finalise`): shared by the eager search
(search.py) and the static-shape one (static.py)."""
from __future__ import annotations

import torch
from torch import Tensor

from summarizer.config.schema import EvalConfig
from summarizer.data.tokenizer import BOS, EOS, PAD
from summarizer.decode.constraints import WordRules
from summarizer.decode.lexicon import Lexicon


def _block_repeats(log_probs: Tensor, prefixes: Tensor, n: int) -> Tensor:
    """Forbid tokens that would repeat an n-gram already in each prefix. (N, V) scores, (N, L) prefixes.
    Shapes depend only on the inputs' and no value is read back to the host (a GPU never waits on it)."""
    length = prefixes.shape[1]
    if n <= 0 or length < n:
        return log_probs
    # Every n-gram of each prefix as a row; the (n-1)-gram that ends the prefix picks the banned tokens.
    grams = prefixes.unfold(1, n, 1)  # (N, L-n+1, n)
    tail = prefixes[:, length - n + 1:]  # (N, n-1)
    return _ban(log_probs, grams, (grams[:, :, :-1] == tail[:, None, :]).all(dim=-1))  # hits: (N, L-n+1)


def _ban(log_probs: Tensor, grams: Tensor, hits: Tensor) -> Tensor:
    """-inf on the last token of every n-gram in `grams` (N, G, n) that `hits` (N, G), in place."""
    # -inf where an n-gram repeats, +inf (no change under amin) where not: a token may be both in one row
    inf = torch.full(hits.shape, float("inf"), dtype=log_probs.dtype, device=log_probs.device)
    return log_probs.scatter_reduce_(1, grams[:, :, -1], torch.where(hits, -inf, inf), reduce="amin")


def _block_repeats_at(log_probs: Tensor, tokens: Tensor, length: Tensor, n: int) -> Tensor:
    """`_block_repeats` for prefixes in a fixed buffer: (R, C) `tokens` whose first `length` (a 0-d tensor on the
    device) columns are each row's prefix. The same bans, from every n-gram that lies inside the prefix."""
    if n <= 0 or tokens.shape[1] < n:
        return log_probs
    grams = tokens.unfold(1, n, 1)  # (R, C-n+1, n)
    tail = tokens.gather(1, (length - n + 1 + torch.arange(n - 1, device=tokens.device)).clamp(min=0)
                         .expand(len(tokens), n - 1))  # (R, n-1) the prefix's last n-1 tokens
    inside = torch.arange(grams.shape[1], device=tokens.device) + n <= length  # (C-n+1,) grams within the prefix
    return _ban(log_probs, grams, (grams[:, :, :-1] == tail[:, None, :]).all(dim=-1) & inside)


class Rules:
    """What both searches forbid at each step, for the rows of one batch: PAD and BOS always; EOS before
    `min_len` tokens or the source's own length, whichever is shorter, and, with `truncate_bytes` and a lexicon,
    before the summary fills that many bytes or, for a source shorter than that, as many bytes as the source
    itself (as `min_len` never holds a summary past its source's length, a two-word line is not made to ramble
    on to the budget); anything but EOS at `max_len`; a repeated piece n-gram; and, with `words`, pieces that
    would spell an unknown or a repeated word (summarizer/decode/constraints.py). Both minimums hold from the
    first step and only ever let go: once a row may end, it may end at every later step. Rows
    follow their beams via `advance` and `select`. With a `capacity` (steps), every step keeps the state's tensors
    and updates them in place, and `apply_at` takes the step as a tensor: one CUDA graph replays every step
    (summarizer/decode/static.py)."""

    def __init__(self, src_ids: Tensor, group: int, settings: EvalConfig, lexicon: Lexicon | None,
                 capacity: int = 0):
        self.s = settings
        self.min_bytes = settings.truncate_bytes if lexicon is not None else 0
        # on the search's device once: indexing a CPU table, or with a Python list, would copy it there, and wait
        # for the device, at every step
        self.piece_bytes = lexicon.on(src_ids.device).piece_bytes if lexicon is not None else None
        self.never = torch.tensor([PAD, BOS], device=src_ids.device)
        # (R,) UTF-8 bytes each row must still write before EOS: the minimum, counting the first piece's word-start
        # space (not written), but never more than the row's own source holds (its pieces counted the same way)
        self.owed = torch.zeros(src_ids.shape[0], device=src_ids.device)
        if self.min_bytes:
            self.owed = self.piece_bytes[src_ids].sum(dim=1).clamp(max=self.min_bytes + 1)
        self.owed = self.owed.repeat_interleave(group)
        # (R,) the fewest tokens before EOS: min_len, but never more than the row's own source has.
        self.min_len = (src_ids != PAD).sum(dim=1).clamp(max=settings.min_len).repeat_interleave(group)
        self.words = None
        if lexicon is not None and (settings.known_words or settings.no_repeat_words):
            self.words = WordRules(lexicon, src_ids.cpu().numpy(), group, settings.known_words,
                                   settings.no_repeat_words, src_ids.device, capacity)
        self.fixed = capacity > 0

    def apply(self, log_probs: Tensor, step: int, prefixes: Tensor) -> Tensor:
        """(R, V) scores of the next token (the step's own tensor), every forbidden token set to -inf in place."""
        log_probs.index_fill_(1, self.never, float("-inf"))
        if self.words is not None:
            self.words.mask(log_probs)
        if step < self.s.min_len:
            log_probs[:, EOS].masked_fill_(step < self.min_len, float("-inf"))
        if self.min_bytes:
            log_probs[:, EOS].masked_fill_(self.owed > 0, float("-inf"))
        if step >= self.s.max_len:
            eos = log_probs[:, EOS].clone()
            log_probs.fill_(float("-inf"))
            log_probs[:, EOS] = torch.where(torch.isinf(eos), torch.zeros_like(eos), eos)  # always allowed here
        return _block_repeats(log_probs, prefixes, self.s.no_repeat_ngram)

    def apply_at(self, log_probs: Tensor, step: Tensor, tokens: Tensor) -> Tensor:
        """`apply` with the step a 0-d tensor on the device and the prefixes `tokens` (R, C), their first `step`
        columns: the same tokens forbidden, by arithmetic on the step rather than branches on it."""
        log_probs.index_fill_(1, self.never, float("-inf"))
        if self.words is not None:
            self.words.mask(log_probs)
        log_probs[:, EOS].masked_fill_((step < self.min_len) | (self.owed > 0), float("-inf"))
        eos, last = log_probs[:, EOS].clone(), step >= self.s.max_len
        log_probs.masked_fill_(last, float("-inf"))
        log_probs[:, EOS] = torch.where(last, torch.where(torch.isinf(eos), 0.0, eos), eos)
        return _block_repeats_at(log_probs, tokens, step, self.s.no_repeat_ngram)

    def advance(self, parents: Tensor, tokens: Tensor, group: int | None = None) -> None:
        """Row i now continues row parents[i] with tokens[i]; `group` rows per sentence from now on if given."""
        owed = self.owed[parents] - self.piece_bytes[tokens] if self.piece_bytes is not None else self.owed[parents]
        if self.fixed:
            self.owed.copy_(owed)
            self.min_len.copy_(self.min_len[parents])
        else:
            self.owed, self.min_len = owed, self.min_len[parents]
        if self.words is not None:
            self.words.advance(parents, tokens, group)

    def cuts(self, rows: Tensor) -> Tensor:
        """(E,) rows that end -> how many pieces to drop from each one's hypothesis: the word it is spelling if
        that word may not end (only `max_len` cuts a word short), else none."""
        return self.words.cut(rows) if self.words is not None else torch.zeros_like(rows)

    def select(self, rows: Tensor, sentences: Tensor) -> None:
        self.owed, self.min_len = self.owed[rows], self.min_len[rows]
        if self.words is not None:
            self.words.select(rows, sentences)


def best_tokens(log_probs: Tensor) -> Tensor:
    """(R, V) scores -> (R,) greedy's next tokens: each row's best, or EOS where the rules left it none (n-gram
    blocking can take the only piece the word rules allowed): the row ends there, its unfinished word cut, rather
    than emitting a token it may not (an argmax over nothing but -inf picks PAD, which also dodges the n-gram)."""
    best, tokens = log_probs.max(dim=-1)
    return torch.where(best == float("-inf"), EOS, tokens)


def ended_hypotheses(rows: Tensor, prefixes: Tensor, cuts: Tensor, end: int | None = None,
                     tags: Tensor | None = None) -> list[tuple]:
    """(E,) rows whose hypothesis ends now, and how many pieces to drop from each (`Rules.cuts`) -> (tag, its ids)
    each: the ids are `prefixes`' columns 1..end (BOS left out) less the pieces cut, the tag the row's entry of
    `tags` (default: the row). One read from the device for them all."""
    tags = rows if tags is None else tags
    table = torch.cat([tags[:, None], cuts[:, None], prefixes[rows, 1:end]], dim=1).tolist()
    return [(tag, ids[:len(ids) - cut]) for tag, cut, *ids in table]


def finalise(finished: list, alive: list[int], prefixes: Tensor, top_scores: Tensor, parents: Tensor,
             is_eos: Tensor, k: int, length_penalty: float, rules: Rules) -> None:
    """Move the EOS candidates ranked within the top K into their sentence's finished list (at most K); `alive`
    maps each of the batch's sentences (the rows of `top_scores`) to its input sentence. Three reads from the
    device when a candidate ends, one when none does."""
    rows, cols = ranked_ends(is_eos, k).nonzero(as_tuple=True)
    if rows.numel():
        keep_ended(finished, alive, rows, cols, prefixes, top_scores, parents, rules.cuts(parents[rows, cols]), k,
                   length_penalty)


def keep_ended(finished: list, alive: list[int], rows: Tensor, cols: Tensor, prefixes: Tensor, top_scores: Tensor,
               parents: Tensor, cuts: Tensor, k: int, length_penalty: float) -> None:
    """The EOS candidates at (rows, cols) of `top_scores` (extending `parents`' rows, less `cuts` pieces each) into
    their sentences' finished lists, at most K each, scored by their length as searched (EOS included)."""
    ended = ended_hypotheses(parents[rows, cols], prefixes, cuts, tags=rows)
    searched = prefixes.shape[1]  # every hypothesis' length as searched, EOS included (before any cut word)
    for (row, hyp), score in zip(ended, top_scores[rows, cols].tolist(), strict=True):
        b = alive[row]
        if len(finished[b]) < k:
            finished[b].append((score / searched ** length_penalty, hyp))


def top_candidates(log_probs: Tensor, scores: Tensor, width: int, k: int) -> tuple[Tensor, ...]:
    """(n * width, V) next-token scores (added to in place) and each row's score so far (n, width) -> each
    sentence's 2K best candidates: (scores, the rows they extend, their tokens, whether each ends in EOS), all
    (n, 2K). At most K of them end, so K always continue."""
    n, vocab = scores.shape[0], log_probs.shape[-1]
    candidates = log_probs.add_(scores.view(-1, 1)).reshape(n, width * vocab)
    top_scores, top_index = candidates.topk(2 * k, dim=-1)
    token = top_index % vocab
    parents = torch.arange(n, device=scores.device)[:, None] * width + top_index // vocab
    return top_scores, parents, token, (token == EOS) & torch.isfinite(top_scores)


def ranked_ends(is_eos: Tensor, k: int) -> Tensor:
    """(n, 2K) -> the candidates that end in EOS and rank within the top K: those a sentence keeps."""
    return is_eos & (torch.arange(is_eos.shape[1], device=is_eos.device) < k)


def continuing(top_scores: Tensor, parents: Tensor, tokens: Tensor, is_eos: Tensor, k: int) -> tuple[Tensor, ...]:
    """The K best candidates of each sentence that do not end in EOS, in rank order: (scores (n, K), parents
    (n * K,), tokens (n * K,)), picked by a stable sort rather than a boolean mask, whose size the device would
    have to report (of 2K candidates at most K end, so K always continue)."""
    pick = torch.sort(is_eos.to(torch.int8), dim=1, stable=True).indices[:, :k]  # the non-EOS ones, in order
    return top_scores.gather(1, pick), parents.gather(1, pick).reshape(-1), tokens.gather(1, pick).reshape(-1)


def greedy_step(log_probs: Tensor, prefixes: Tensor, rules: Rules) -> tuple[Tensor, Tensor, list[tuple]]:
    """One greedy step over R rows: (the next tokens (R,), the prefixes they extend, and (row, ids) of each row
    that ended now). One read from the device, and one more when a row ended."""
    tokens = best_tokens(log_probs)
    prefixes = torch.cat([prefixes, tokens[:, None]], dim=1)
    rules.advance(torch.arange(len(tokens), device=tokens.device), tokens)
    rows = (tokens == EOS).nonzero().squeeze(1)
    return tokens, prefixes, ended_hypotheses(rows, prefixes, rules.cuts(rows), end=-1) if rows.numel() else []


def beam_step(log_probs: Tensor, scores: Tensor, width: int, k: int, prefixes: Tensor, rules: Rules,
              finished: list, alive: list[int], length_penalty: float) -> tuple[Tensor, ...]:
    """One beam step over n sentences of `width` rows each: scores extended, the EOS candidates ranked within the
    top K finalised (into `finished`), the K best others continued. (scores (n, K), parents (n * K,), tokens
    (n * K,), the prefixes they extend); the rules follow the rows."""
    top_scores, parents, token, is_eos = top_candidates(log_probs, scores, width, k)
    finalise(finished, alive, prefixes, top_scores, parents, is_eos, k, length_penalty, rules)
    scores, parents, tokens = continuing(top_scores, parents, token, is_eos, k)  # the K best non-EOS ones
    prefixes = torch.cat([prefixes[parents], tokens[:, None]], dim=1)
    rules.advance(parents, tokens, group=k)
    return scores, parents, tokens, prefixes
