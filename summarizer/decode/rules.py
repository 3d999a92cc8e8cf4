"""What a search may emit at each step (`Rules`: lengths, repeated n-grams, the word rules of
summarizer/decode/constraints.py) and how a hypothesis that ends is kept (`finalise`): shared by the eager search
(search.py) and the static-shape one (static.py)."""
from __future__ import annotations

import torch
from torch import Tensor

from summarizer.config.schema import EvalConfig
from summarizer.data.tokenizer import BOS, EOS, PAD
from summarizer.decode.constraints import Lexicon, WordRules


def _block_repeats(log_probs: Tensor, prefixes: Tensor, n: int) -> Tensor:
    """Forbid tokens that would repeat an n-gram already in each prefix. (N, V) scores, (N, L) prefixes.
    Shapes depend only on the inputs' and no value is read back to the host (a GPU never waits on it)."""
    length = prefixes.shape[1]
    if n <= 0 or length < n:
        return log_probs
    # Every n-gram of each prefix as a row; the (n-1)-gram that ends the prefix picks the banned tokens.
    grams = prefixes.unfold(1, n, 1)  # (N, L-n+1, n)
    tail = prefixes[:, length - n + 1:]  # (N, n-1)
    hits = (grams[:, :, :-1] == tail[:, None, :]).all(dim=-1)  # (N, L-n+1)
    banned = torch.zeros_like(log_probs).scatter_add_(1, grams[:, :, -1], hits.to(log_probs.dtype))
    return log_probs.masked_fill_(banned > 0, float("-inf"))


class Rules:
    """What both searches forbid at each step, for the rows of one batch: PAD and BOS always; EOS before
    `min_len` tokens or the source's own length, whichever is shorter (and, with `min_bytes`, before the
    summary fills that many bytes); anything but EOS at `max_len`; a repeated piece n-gram; and, with
    `words`, pieces that would spell an unknown or a repeated word (summarizer/decode/constraints.py). Rows
    follow their beams via `advance` and `select`."""

    def __init__(self, src_ids: Tensor, group: int, settings: EvalConfig, lexicon: Lexicon | None):
        self.s, self.lexicon = settings, lexicon
        self.min_bytes = settings.truncate_bytes if lexicon is not None else 0
        self.bytes = torch.zeros(src_ids.shape[0] * group, device=src_ids.device)  # (R,) UTF-8 bytes so far
        # (R,) the fewest tokens before EOS: min_len, but never more than the row's own source has.
        self.min_len = (src_ids != PAD).sum(dim=1).clamp(max=settings.min_len).repeat_interleave(group)
        self.words = None
        if lexicon is not None and (settings.known_words or settings.no_repeat_words):
            self.words = WordRules(lexicon, [row[row != PAD].tolist() for row in src_ids.cpu()], group,
                                   settings.known_words, settings.no_repeat_words, src_ids.device)

    def apply(self, log_probs: Tensor, step: int, prefixes: Tensor) -> Tensor:
        """(R, V) scores of the next token (the step's own tensor), every forbidden token set to -inf in place."""
        log_probs[:, [PAD, BOS]] = float("-inf")
        if self.words is not None:
            self.words.mask(log_probs)
        if step < self.s.min_len:
            log_probs[:, EOS].masked_fill_(step < self.min_len, float("-inf"))
        elif self.min_bytes:  # the first piece's word-start space is not written
            log_probs[:, EOS].masked_fill_(self.bytes < self.min_bytes + 1, float("-inf"))
        if step >= self.s.max_len:
            eos = log_probs[:, EOS].clone()
            log_probs.fill_(float("-inf"))
            log_probs[:, EOS] = torch.where(torch.isinf(eos), torch.zeros_like(eos), eos)  # always allowed here
        return _block_repeats(log_probs, prefixes, self.s.no_repeat_ngram)

    def advance(self, parents: Tensor, tokens: Tensor, group: int | None = None) -> None:
        """Row i now continues row parents[i] with tokens[i]; `group` rows per sentence from now on if given."""
        self.bytes, self.min_len = self.bytes[parents], self.min_len[parents]
        if self.lexicon is not None:
            self.bytes += self.lexicon.piece_bytes.to(tokens.device)[tokens]
        if self.words is not None:
            self.words.advance(parents, tokens, group)

    def finish(self, row: int, hyp: list[int]) -> list[int]:
        """Row `row` ends with `hyp`: without the word it is spelling if that word may not end (only
        `max_len` cuts a word short)."""
        if self.words is None:
            return hyp
        return self.words.finish(row, hyp)

    def select(self, rows: Tensor, sentences: Tensor) -> None:
        self.bytes, self.min_len = self.bytes[rows], self.min_len[rows]
        if self.words is not None:
            self.words.select(rows, sentences)


def finalise(finished: list, alive: Tensor, prefixes: Tensor, top_scores: Tensor, parents: Tensor,
              is_eos: Tensor, k: int, length_penalty: float, rules: Rules) -> None:
    """Move the EOS candidates ranked within the top K into their sentence's finished list (at most K)."""
    ranked = is_eos & (torch.arange(is_eos.shape[1], device=is_eos.device) < k)
    rows, cols = ranked.nonzero(as_tuple=True)
    if not rows.numel():
        return
    ended = parents[rows, cols]
    hyps = prefixes[ended, 1:].tolist()
    for b, parent, score, hyp in zip(alive[rows].tolist(), ended.tolist(), top_scores[rows, cols].tolist(), hyps,
                                     strict=True):
        if len(finished[b]) < k:  # the score counts the length as searched, before any cut word
            finished[b].append((score / (len(hyp) + 1) ** length_penalty, rules.finish(parent, hyp)))
