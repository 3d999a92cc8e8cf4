"""The vocabulary the word rules check a summary against (summarizer/decode/constraints.py): a `Lexicon` of
each piece's text and a prefix tree over the pieces of every known word, stored as tensors, with the 62-bit
text hashes (two 31-bit polynomial hashes) a row extends piece by piece; and `lexicon`, built once per process
from a prepared data dir."""
from __future__ import annotations

import functools
import itertools
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from summarizer.data.prepared import open_tokenizer, training_words
from summarizer.data.tokenizer import BOS, EOS, MASK_PIECE, PAD, TAG_PIECE, UNK, UNK_WORD, Tokenizer

WORD_START = "\u2581"  # SentencePiece's word-start marker
UNKNOWN_TEXT = "\u2047"  # an UNK piece's text in a word (how SentencePiece writes it)
HASH_BASE, HASH_P1, HASH_P2 = 1_000_003, 2_147_483_647, 2_147_483_629  # two primes below 2**31
FEW_CHILDREN = 32  # tree nodes with at most this many children: see Lexicon.wide_children
WORD_KEYS = 1 << 18  # source words whose repeat keys' hashes are kept (~50 MB at most)


@functools.lru_cache(maxsize=1 << 16)
def text_hash(text: str) -> tuple[int, int]:
    """The two polynomial hashes of `text` (code points + 1, base HASH_BASE): the hash of a + b is
    hash(a) * HASH_BASE**len(b) + hash(b), so a row extends its word's hash piece by piece."""
    h1 = h2 = 0
    for ch in text:
        h1, h2 = (h1 * HASH_BASE + ord(ch) + 1) % HASH_P1, (h2 * HASH_BASE + ord(ch) + 1) % HASH_P2
    return h1, h2


def combined(h1, h2):
    """One 62-bit key of the two hashes (ints or int64 tensors)."""
    return (h1 << 31) | h2


class Lexicon:
    """What the rules need from a tokenizer and a vocabulary of known words: each piece's text, whether it
    starts a word and its UTF-8 length, and a prefix tree over the pieces of every known word (node 0 is the
    root), stored as tensors: edges sorted by parent * V + piece, each node's depth and ancestors, whether a
    word ends there and how many words lie at or under it (`words_below`)."""

    def __init__(self, tokenizer: Tokenizer, known_words: Iterable[str]):
        pieces = [tokenizer.sp.id_to_piece(i) for i in range(tokenizer.vocab_size)]
        tag_start, tag_end = TAG_PIECE.split("{}")
        special = {PAD, UNK, BOS, EOS} | {i for i, p in enumerate(pieces) if tokenizer.sp.is_control(i)
                                          or (p.startswith(tag_start) and p.endswith(tag_end))  # source tags
                                          or p == MASK_PIECE}  # denoising input only
        self.vocab_size = v = len(pieces)
        self.starts_word = [p.startswith(WORD_START) and i not in special for i, p in enumerate(pieces)]
        self.text = ["" if i in special else p.replace(WORD_START, "") for i, p in enumerate(pieces)]
        # A character outside the vocabulary is an UNK piece inside its word: a source word holding one may be
        # copied whole (the UNK written back as the source's own character: inference.summary_text), never
        # spelled without it, and no known word holds one.
        self.text[UNK] = UNKNOWN_TEXT
        self._word_hashes: dict[tuple[int, ...], int] = {}  # source words' repeat key hashes, by their pieces
        # (V,) pieces inside a word that write only punctuation: closing a word, left out of its repeat key
        self.punct_inside = [bool(t) and i != UNK and not self.starts_word[i] and not any(c.isalnum() or c == "#"
                                                                                         for c in t)
                             for i, t in enumerate(self.text)]
        self.piece_bytes = torch.tensor([len(p.replace(WORD_START, " ").encode()) if i not in special else 0
                                         for i, p in enumerate(pieces)], dtype=torch.float32)
        hashes = [text_hash(t) for t in self.text]
        self.piece_h1, self.piece_h2 = (torch.tensor([h[k] for h in hashes]) for k in (0, 1))
        self.piece_pow1, self.piece_pow2 = (torch.tensor([pow(HASH_BASE, len(t), p) for t in self.text])
                                            for p in (HASH_P1, HASH_P2))
        self.punct = torch.tensor(self.punct_inside)
        self.starts = torch.tensor(self.starts_word)  # (V,) pieces that start a word
        self.has_text = torch.tensor([bool(t) for t in self.text])  # (V,) pieces that write characters
        self._starts = self.starts.numpy()  # the same, as arrays, for a batch's source words (on the CPU lexicon)
        self._kept = self._starts | self.has_text.numpy()  # pieces a source word keeps
        parent, piece_into, complete = [-1], [-1], [False]
        edges: dict[tuple[int, int], int] = {}
        for ids in tokenizer.encode_batch(sorted(set(known_words))):
            if not ids or not self.starts_word[ids[0]] or UNK in ids or any(not self.text[i] for i in ids[1:]):
                continue  # not a word of pieces (a character outside the vocabulary became UNK)
            node = 0
            for i in ids:
                if (node, i) not in edges:
                    edges[node, i] = len(parent)
                    parent.append(node)
                    piece_into.append(i)
                    complete.append(False)
                node = edges[node, i]
            complete[node] = True
        n = len(parent)
        self.parent, self.piece_into = torch.tensor(parent), torch.tensor(piece_into)
        self.complete = torch.tensor(complete)
        depth = [0] * n
        for node in range(1, n):  # parents come before their children
            depth[node] = depth[parent[node]] + 1
        self.depth = torch.tensor(depth)
        # ancestors[node, d]: the node's ancestor at depth d (itself at its own depth), -1 below it
        self.ancestors = torch.full((n, max(depth) + 2), -1, dtype=torch.long)
        self.ancestors[0, 0] = 0
        # each node's text and repeat key hashes, extended level by level as WordRules.advance extends a row's
        hashes = torch.zeros(4, n, dtype=torch.long)
        for d in range(1, max(depth) + 1):
            level = (self.depth == d).nonzero().squeeze(1)
            self.ancestors[level] = self.ancestors[self.parent[level]]
            self.ancestors[level, d] = level
            hashes[:, level] = torch.stack(self.extend(*hashes[:, self.parent[level]], self.piece_into[level]))
        below = np.asarray(complete, dtype=np.int64)
        for node in range(n - 1, 0, -1):  # children come after their parents
            below[parent[node]] += below[node]
        self.words_below = torch.from_numpy(below)
        keys = sorted((p * v + i, child) for (p, i), child in edges.items())
        self.edge_key = torch.tensor([k for k, _ in keys], dtype=torch.long)
        self.edge_child = torch.tensor([c for _, c in keys], dtype=torch.long)
        self.first_edge = torch.searchsorted(self.edge_key, torch.arange(n + 1) * v)  # (N + 1,) CSR by parent
        # Each node's children as WordRules.mask allows them in one step: a node with at most FEW_CHILDREN as a
        # row of that many edges; the few with more (71 of the Gigaword sample's 49,805) as a (V + 1,) bitmap of
        # their pieces, `wide_children[wide_index[node]]` (row 0: none, for every other node)
        counts = self.first_edge[1:] - self.first_edge[:-1]
        wide = (counts > FEW_CHILDREN).nonzero().squeeze(1)
        wide = wide[wide > 0]  # the root's children are the known starts
        self.wide_index = torch.zeros(n, dtype=torch.long)
        self.wide_index[wide] = torch.arange(1, len(wide) + 1)
        self.wide_children = torch.zeros(len(wide) + 1, v + 1, dtype=torch.bool)
        for row, node in enumerate(wide.tolist(), start=1):
            edges = self.edge_child[self.first_edge[node]:self.first_edge[node + 1]]
            self.wide_children[row, self.piece_into[edges]] = True
        self.root_child = torch.full((v,), -1, dtype=torch.long)  # (V,) the node a word start leads to
        roots = self.edge_key < v
        self.root_child[self.edge_key[roots]] = self.edge_child[roots]
        self.known_starts = self.root_child >= 0  # (V,) first pieces of known words
        # (C,) repeat key hashes, sorted, and (C, M) the nodes of each key's known words (-1 after them); a first
        # entry of hash -1 (no word's) keeps the table non-empty
        words = self.complete.nonzero().squeeze(1)
        word_keys = combined(hashes[2, words], hashes[3, words])
        keys, members = torch.unique(word_keys, return_counts=True)  # sorted
        order = torch.argsort(word_keys, stable=True)
        rank = torch.arange(len(words)) - torch.repeat_interleave(torch.cumsum(members, 0) - members, members)
        self.class_hash = torch.cat([torch.tensor([-1]), keys])
        self.class_nodes = torch.full((len(keys) + 1, int(members.max()) if len(keys) else 1), -1, dtype=torch.long)
        self.class_nodes[1 + torch.repeat_interleave(torch.arange(len(keys)), members), rank] = words[order]
        self._on: dict[torch.device, Lexicon] = {}

    def extend(self, f1: Tensor, f2: Tensor, k1: Tensor, k2: Tensor, pieces: Tensor) -> tuple[Tensor, ...]:
        """A word's text hashes (f1, f2) and repeat key hashes (k1, k2) after one more piece: the key is the
        text up to its last piece that is not punctuation (or its first piece; an empty text hashes to 0, and
        a non-empty one to 0 twice with probability ~1e-19)."""
        f1 = (f1 * self.piece_pow1[pieces] + self.piece_h1[pieces]) % HASH_P1
        f2 = (f2 * self.piece_pow2[pieces] + self.piece_h2[pieces]) % HASH_P2
        keyed = ~(self.punct[pieces] & ((k1 != 0) | (k2 != 0)))
        return f1, f2, torch.where(keyed, f1, k1), torch.where(keyed, f2, k2)

    def key_nodes(self, hashes: Tensor) -> Tensor:
        """(R,) repeat key hashes -> (R, M) the tree nodes of the known words with each key (-1 after them),
        M the most any key has (at least 1)."""
        at = torch.searchsorted(self.class_hash, hashes).clamp(max=len(self.class_hash) - 1)
        return torch.where((self.class_hash[at] == hashes)[:, None], self.class_nodes[at], -1)

    def is_word(self, nodes: Tensor) -> Tensor:
        """Which of the tree `nodes` (-1: off the tree) end a known word."""
        return (nodes >= 0) & self.complete[nodes.clamp(min=0)]

    def on(self, device: torch.device) -> Lexicon:
        """This lexicon with its tensors on `device` (made once per device)."""
        if device.type == "cpu":
            return self
        if device not in self._on:
            moved = object.__new__(Lexicon)
            moved.__dict__ = {k: (t.to(device) if isinstance(t, Tensor) else t) for k, t in self.__dict__.items()}
            self._on[device] = moved
        return self._on[device]

    def repeat_key(self, pieces: list[int]) -> str:
        """What a word of `pieces` is compared by: its text without the punctuation pieces at its end, unless
        that would leave nothing ("feb." and "feb," are "feb"; "u.s." is "u.s"; "#,###" stays; "--" is "-")."""
        key = text = ""
        for p in pieces:
            text += self.text[p]
            key = key if key and self.punct_inside[p] else text
        return key

    def source_word_arrays(self, sources: list[list[int]] | np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The words of each source (id lists, or a (B, S) array padded with PAD, which writes nothing and starts no
        word), as the word rules keep them: (B, W, L) their pieces (-1 after a word's end),
        (B, W) their lengths (0: no word) and (B, W) their repeat keys' hashes (-1: no word), W the most words a
        source has and L the longest word's pieces (at least 1 each). A word starts at a word-start piece or at
        its source's first piece; a piece that writes nothing is left out unless it starts a word, so every piece
        after a word's first writes something. The whole batch at once, in array operations: a decoding batch's
        set-up is host time a GPU waits on. Repeat keys are computed once per distinct word and kept."""
        if isinstance(sources, np.ndarray):
            counts, flat = np.full(len(sources), sources.shape[1], dtype=np.int64), sources.reshape(-1)
        else:
            counts = np.fromiter(map(len, sources), dtype=np.int64, count=len(sources))
            flat = np.fromiter(itertools.chain.from_iterable(sources), dtype=np.int64, count=int(counts.sum()))
        sentence = np.repeat(np.arange(len(sources)), counts)
        kept = self._kept[flat]
        flat, sentence, new = flat[kept], sentence[kept], self._starts[flat[kept]]
        new[1:] |= sentence[1:] != sentence[:-1]
        new[:1] = True  # a source's first piece starts its first word
        first = np.flatnonzero(new)  # each word's first piece
        word = np.cumsum(new) - 1  # each piece's word
        lengths_flat = np.diff(np.append(first, len(flat)))
        owner = sentence[first]  # each word's source, and its place there
        per_source = np.bincount(owner, minlength=len(sources))
        place = np.arange(len(first)) - np.repeat(np.cumsum(per_source) - per_source, per_source)
        position = np.arange(len(flat)) - first[word]  # each piece's place in its word
        most, longest = max(1, int(per_source.max(initial=0))), max(1, int(lengths_flat.max(initial=0)))
        words = np.full((len(first), longest), -1, dtype=np.int64)
        words[word, position] = flat
        # the distinct words, found by a 62-bit key of their pieces (sorting rows is 10x slower), checked exactly
        h1, h2 = np.zeros(len(words), dtype=np.int64), np.zeros(len(words), dtype=np.int64)
        for column in words.T + 2:
            h1, h2 = (h1 * HASH_BASE + column) % HASH_P1, (h2 * HASH_BASE + column) % HASH_P2
        _, first_seen, inverse = np.unique(combined(h1, h2), return_index=True, return_inverse=True)
        distinct = words[first_seen]
        if not np.array_equal(distinct[inverse.reshape(-1)], words):  # two words share a key
            distinct, inverse = np.unique(words, axis=0, return_inverse=True)
        keys = np.fromiter((self._word_hash(tuple(p for p in row if p >= 0)) for row in distinct.tolist()),
                           dtype=np.int64, count=len(distinct))
        pieces = np.full((len(sources), most, longest), -1, dtype=np.int64)
        pieces[owner, place] = words
        lengths = np.zeros((len(sources), most), dtype=np.int64)
        lengths[owner, place] = lengths_flat
        hashes = np.full((len(sources), most), -1, dtype=np.int64)
        hashes[owner, place] = keys[inverse.reshape(-1)]
        return pieces, lengths, hashes

    def _word_hash(self, word: tuple[int, ...]) -> int:
        """The hash of a source word's repeat key, kept (sources repeat their words) up to WORD_KEYS of them:
        `summarize` may read any number of distinct words."""
        key = self._word_hashes.get(word)  # read once: decoding threads share the dict
        if key is None:
            if len(self._word_hashes) >= WORD_KEYS:
                self._word_hashes.clear()
            key = self._word_hashes[word] = combined(*text_hash(self.repeat_key(list(word))))
        return key


def source_only(word: str) -> bool:
    """Words a summary may take from its own source but never from the training text: the unknown-word
    marker and masked numbers ("##.#"). Written without the source, they mean nothing to a reader."""
    return word == UNK_WORD or "#" in word


@functools.lru_cache(maxsize=4)
def lexicon(data_dir: str | Path) -> Lexicon:
    """The dir's tokenizer and training words as the word rules of decoding use them (built once per process):
    every training word except the source-only ones."""
    return Lexicon(open_tokenizer(data_dir), {w for w in training_words(data_dir) if not source_only(w)})
