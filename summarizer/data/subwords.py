"""Subword regularisation (Kudo 2018): train on sampled segmentations of each pair instead of the one best.

Each word of a training pair is segmented by one of its `nbest` best SentencePiece segmentations,
drawn with probability proportional to exp(alpha * log p(segmentation)); alpha -> 0 is uniform over
the n-best, large alpha is the best one. A word gets the same segmentation in the source and the
target of its pair, so the copy head still finds target pieces in the source. Draws come from a
generator seeded by (seed, epoch, pair index): the same pair in the same epoch is segmented the same
way whichever worker loads it, so seeded runs and exact resume are unchanged.
"""
from __future__ import annotations

import functools

import numpy as np

from summarizer.data.tokenizer import Tokenizer


class SegmentationSampler:
    """Sampled ids for the (normalised) text of a pair; one per DataLoader worker (it caches n-best lists)."""

    def __init__(self, tokenizer: Tokenizer, alpha: float, nbest: int, seed: int):
        self.tokenizer, self.alpha, self.nbest, self.seed = tokenizer, alpha, nbest, seed
        self._options = functools.lru_cache(maxsize=200_000)(self._segmentations)

    def _segmentations(self, word: str) -> tuple[tuple[tuple[int, ...], ...], np.ndarray]:
        """A word's n-best segmentations and their sampling probabilities."""
        proto = self.tokenizer.sp.nbest_encode(word, out_type="proto", nbest_size=self.nbest)
        options = [tuple(piece.id for piece in nbest.pieces) for nbest in proto.nbests]
        scores = np.array([nbest.score for nbest in proto.nbests], dtype=np.float64) * self.alpha
        weights = np.exp(scores - scores.max())
        return tuple(options), weights / weights.sum()

    def pair(self, source: str, target: str, epoch: int, index: int) -> tuple[list[int], list[int]]:
        """(source ids, target ids), each word segmented by a draw shared by both sides."""
        rng = np.random.default_rng([self.seed, epoch, index])
        chosen: dict[str, tuple[int, ...]] = {}

        def encode(text: str) -> list[int]:
            ids: list[int] = []
            for word in text.split():
                if word not in chosen:
                    options, probs = self._options(word)
                    chosen[word] = options[rng.choice(len(options), p=probs)] if len(options) > 1 else options[0]
                ids.extend(chosen[word])
            return ids

        return encode(source), encode(target)
