"""Denoising examples from unpaired sentences: text infilling on whole words (BART, Lewis et al. 2020).

A sentence of an unpaired source is prepared as a pair with itself; at training time its encoder side loses
spans of whole words, each span replaced by one mask piece, and the decoder writes the sentence back. Span
lengths are drawn from a Poisson distribution (mean `span`, at least one word) until `ratio` of the words are
masked; spans do not overlap, and spans that touch read as one mask. Draws come from a generator seeded by
(seed, epoch, pair index), so a sentence is masked the same way whichever worker loads it, differently each
epoch, and seeded runs and exact resume are unchanged.
"""
from __future__ import annotations

import numpy as np

from summarizer.data.tokenizer import Tokenizer


def word_starts(tokenizer: Tokenizer) -> np.ndarray:
    """Per piece id: does the piece start a word (SentencePiece's "▁")?"""
    return np.array([tokenizer.sp.id_to_piece(i).startswith("\u2581") for i in range(tokenizer.vocab_size)])


class SpanMasker:
    """Masked encoder input for the source ids of a denoising example."""

    def __init__(self, starts: np.ndarray, mask_id: int, ratio: float, span: float, seed: int, keep: int = 0):
        self.starts, self.mask_id, self.ratio, self.span, self.seed = starts, mask_id, ratio, span, seed
        self.keep = keep  # leading pieces never masked: the source tag's

    def spans(self, words: int, rng: np.random.Generator) -> np.ndarray:
        """Which of `words` words are masked."""
        masked = np.zeros(words, dtype=bool)
        left = int(round(self.ratio * words))
        for _ in range(8 * words):  # tries: a draw that overlaps a masked word is drawn again
            if left <= 0:
                break
            length = int(min(max(rng.poisson(self.span), 1), left))
            start = int(rng.integers(0, words - length + 1))
            if not masked[start:start + length].any():
                masked[start:start + length] = True
                left -= length
        return masked

    def pair(self, src: np.ndarray, tgt: np.ndarray, epoch: int, index: int, limit: int) -> tuple:
        """(masked source, target) of a denoising example whose target holds at most `limit` pieces. A sentence
        cut to `limit` pieces is cut on both sides before its last, possibly partial, word, so the decoder is
        never asked to end a sentence inside a word or to write words its input never had."""
        src, tgt = np.asarray(src, dtype=np.int64), np.asarray(tgt, dtype=np.int64)
        if tgt.size >= limit:
            bounds = np.flatnonzero(self.starts[tgt])
            cut = int(bounds[-1]) if bounds.size and bounds[-1] > 0 else tgt.size
            src, tgt = src[:self.keep + cut], tgt[:cut]
        return self(src, epoch, index), tgt

    def __call__(self, ids: np.ndarray, epoch: int, index: int) -> np.ndarray:
        # A stream of its own: [seed, epoch, index] alone is the subword sampler's.
        rng = np.random.default_rng([self.seed, epoch, index, 1])
        head, body = ids[:self.keep], np.asarray(ids[self.keep:], dtype=np.int64)
        if body.size == 0:
            return np.asarray(ids, dtype=np.int64)
        bounds = np.flatnonzero(self.starts[body])
        if bounds.size == 0 or bounds[0] != 0:
            bounds = np.r_[0, bounds]  # the first piece starts the first word, whatever it is
        masked = self.spans(bounds.size, rng)
        ends = np.r_[bounds[1:], body.size]
        out = [np.asarray(head, dtype=np.int64)]
        for word, (a, b) in enumerate(zip(bounds, ends, strict=True)):
            if not masked[word]:
                out.append(body[a:b])
            elif word == 0 or not masked[word - 1]:
                out.append(np.array([self.mask_id], dtype=np.int64))
        return np.concatenate(out)
