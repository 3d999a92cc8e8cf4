"""Decoding constraints on whole words: each word of a summary is one seen in training or in its own source,
and no word comes twice. A word is what the pieces between two word starts (SentencePiece's "▁") spell.

A model that strings subword pieces freely can write words that do not exist ("supercomput", "yitz")
or repeat itself ("heavy heavy turnout"). Here every hypothesis carries the word it is spelling. A piece
may only extend it towards a known word that the hypothesis has not used yet (a prefix tree over the
pieces of every known word, and a small one over its source's words), and the word may only end (at
the next word start, or EOS) once it is complete and unused. Since every allowed piece keeps an unused
word within reach, a hypothesis never spells itself into a dead end.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from summarizer.tokenizer import BOS, EOS, PAD, TAG_PIECE, UNK, Tokenizer

WORD_START = "\u2581"  # SentencePiece's word-start marker
UNKNOWN_TEXT = "\u2047"  # an UNK piece's text in a word (how SentencePiece writes it)


class Lexicon:
    """What the rules need from a tokenizer and a vocabulary of known words: each piece's text, whether it
    starts a word and its UTF-8 length, and a prefix tree over the pieces of every known word (node 0 is
    the root; `words_below[n]` counts the complete words at or under node n)."""

    def __init__(self, tokenizer: Tokenizer, known_words: Iterable[str]):
        pieces = [tokenizer.sp.id_to_piece(i) for i in range(tokenizer.vocab_size)]
        tag_start, tag_end = TAG_PIECE.split("{}")
        special = {PAD, UNK, BOS, EOS} | {i for i, p in enumerate(pieces) if tokenizer.sp.is_control(i)
                                          or (p.startswith(tag_start) and p.endswith(tag_end))}  # source tags
        self.vocab_size = len(pieces)
        self.starts_word = [p.startswith(WORD_START) and i not in special for i, p in enumerate(pieces)]
        self.text = ["" if i in special else p.replace(WORD_START, "") for i, p in enumerate(pieces)]
        # A character outside the vocabulary is an UNK piece inside its word: a source word holding one may be
        # copied whole (the UNK written back as the source's own character: evaluate.summary_text), never
        # spelled without it, and no known word holds one.
        self.text[UNK] = UNKNOWN_TEXT
        self.piece_bytes = torch.tensor([len(p.replace(WORD_START, " ").encode()) if i not in special else 0
                                         for i, p in enumerate(pieces)], dtype=torch.float32)
        self.children: list[dict[int, int]] = [{}]
        self.parent: list[int] = [-1]
        self.piece_into: list[int] = [-1]  # the piece that leads from a node's parent to it
        self.complete: list[bool] = [False]
        for ids in tokenizer.encode_batch(sorted(set(known_words))):
            self._insert(ids)
        self.words_below = [int(c) for c in self.complete]
        for node in range(len(self.children) - 1, 0, -1):  # children come after their parents
            self.words_below[self.parent[node]] += self.words_below[node]
        # The node's ancestor just below the root: the subtree of words sharing its first piece.
        self.top = [0] + [node if self.parent[node] == 0 else 0 for node in range(1, len(self.children))]
        for node in range(1, len(self.children)):
            if self.parent[node] != 0:
                self.top[node] = self.top[self.parent[node]]
        self._child_pieces: dict[int, np.ndarray] = {}  # node -> its children's pieces, built on first use
        self.any_start = torch.tensor(self.starts_word)  # (V,) pieces that start a word
        self.known_starts = torch.zeros(self.vocab_size, dtype=torch.bool)  # (V,) first pieces of known words
        self.known_starts[list(self.children[0])] = True

    def _insert(self, ids: list[int]) -> None:
        if not ids or not self.starts_word[ids[0]] or UNK in ids or any(not self.text[i] for i in ids[1:]):
            return  # not a word of pieces (a character outside the vocabulary became UNK)
        node = 0
        for i in ids:
            if i not in self.children[node]:
                self.children[node][i] = len(self.children)
                self.children.append({})
                self.parent.append(node)
                self.piece_into.append(i)
                self.complete.append(False)
            node = self.children[node][i]
        self.complete[node] = True

    def child_pieces(self, node: int) -> np.ndarray:
        """The pieces that lead from `node` to its children, as an array (cached)."""
        pieces = self._child_pieces.get(node)
        if pieces is None:
            pieces = self._child_pieces[node] = np.fromiter(self.children[node], dtype=np.int64)
        return pieces

    def source_words(self, src_ids: list[int]) -> dict[tuple, dict[int, set]]:
        """A source's words as a prefix tree: each piece prefix of a word (the empty one included) -> next
        piece -> the words that way; a complete word's pieces map EOS to it."""
        tree: dict[tuple, dict[int, set]] = {}
        word: list[int] = []
        for i in [*src_ids, None]:
            if (i is None or self.starts_word[i]) and word:
                if all(self.text[p] for p in word[1:]):
                    text = "".join(self.text[p] for p in word)
                    for cut in range(len(word) + 1):
                        step = word[cut] if cut < len(word) else EOS
                        tree.setdefault(tuple(word[:cut]), {}).setdefault(step, set()).add(text)
                word = []
            if i is not None and (self.text[i] or self.starts_word[i]):
                word.append(i)
        return tree


def _index(values: list[int], device: torch.device) -> Tensor:
    """A Python list of indices as a tensor, through numpy: indexing with the list itself converts it
    element by element, 5x slower at the tens of thousands of (row, piece) pairs a step allows."""
    return torch.from_numpy(np.asarray(values, dtype=np.int64)).to(device)


class Spelling(NamedTuple):
    """One hypothesis: the word it is spelling (pieces, text, node of the known-word tree or -1), the words
    it has finished, and the tree nodes of those that are known words. (A tuple: a beam step makes one per
    row, and a tuple is made 4x faster than a frozen dataclass.)"""
    pieces: tuple = ()
    text: str = ""
    node: int = 0
    words: frozenset = frozenset()
    used: tuple = ()


class WordRules:
    """The rows of one decoding batch: which pieces each may emit next (`mask`), and how each spelling
    moves on when beams are reordered or finished sentences dropped (`advance`, `select`). With
    `known_only` off, only repeats are ruled out."""

    def __init__(self, lexicon: Lexicon, sources: list[list[int]], group: int, known_only: bool, no_repeat: bool):
        self.lexicon, self.known_only, self.no_repeat, self.group = lexicon, known_only, no_repeat, group
        self.sources = [lexicon.source_words(s) for s in sources]  # per sentence
        self.rows = [Spelling() for _ in range(len(sources) * group)]
        self._starts_cache: dict[tuple, list[int]] = {}  # (sentence, words used) -> source word starts

    def _used_below(self, used: tuple, node: int) -> dict[int, int]:
        """Tree node -> how many `used` words lie at or under it, for the nodes under `node` (whose subtree
        holds the words the row may still spell)."""
        below: dict[int, int] = {}
        for u in used:
            if self.lexicon.top[u] != self.lexicon.top[node]:
                continue  # another first piece: never under `node`
            while u > 0:
                below[u] = below.get(u, 0) + 1
                u = self.lexicon.parent[u]
        return below

    def _fresh(self, words: set, used: frozenset) -> bool:
        """Does one of `words` remain unused?"""
        return not words <= used if self.no_repeat else bool(words)

    def may_end(self, row: int, spelling: Spelling) -> bool:
        """May the word this row is spelling end here (be followed by a word start or EOS)?"""
        if not spelling.pieces:
            return True  # nothing begun
        if self.no_repeat and spelling.text in spelling.words:
            return False  # finishing it would repeat a word
        if not self.known_only:
            return True
        lex, source = self.lexicon, self.sources[row // self.group]
        return (spelling.node >= 0 and lex.complete[spelling.node]) or EOS in source.get(spelling.pieces, {})

    def _continuing(self, row: int, spelling: Spelling) -> list:
        """Pieces (lists or arrays of them) that continue the word towards a known or a source word not used yet."""
        lex, source = self.lexicon, self.sources[row // self.group]
        allowed: list = [[p for p, words in source.get(spelling.pieces, {}).items()
                          if p != EOS and self._fresh(words, spelling.words)]]
        if spelling.node >= 0:
            below = self._used_below(spelling.used, spelling.node) if self.no_repeat and spelling.used else {}
            if spelling.node in below:
                allowed.append([p for p, c in lex.children[spelling.node].items()
                                if lex.words_below[c] > below.get(c, 0)])
            else:
                allowed.append(lex.child_pieces(spelling.node))
        return allowed

    def _starting(self, row: int, spelling: Spelling) -> tuple[list[int], list[int]]:
        """(the source's word starts to allow, known word starts to take away) when the word ends here,
        itself counted as used: a start stays only while an unused word begins with it."""
        lex, source = self.lexicon, self.sources[row // self.group]
        words, used = spelling.words, spelling.used
        if spelling.pieces:
            words = words | {spelling.text}
            used = (*used, spelling.node) if spelling.node >= 0 and lex.complete[spelling.node] else used
        key = (row // self.group, words)
        if key not in self._starts_cache:
            starts = source.get((), {})
            self._starts_cache[key] = [p for p, ws in starts.items() if not ws <= words] if self.no_repeat \
                else list(starts)
        blocked = []
        if self.no_repeat and used:
            tops: dict[int, int] = {}
            for u in used:
                tops[lex.top[u]] = tops.get(lex.top[u], 0) + 1
            blocked = [lex.piece_into[t] for t, n in tops.items() if lex.words_below[t] <= n]
        return self._starts_cache[key], blocked

    def mask(self, log_probs: Tensor) -> Tensor:
        """Set -inf on every (row, piece) the rules forbid, in place; a row left with nothing may end (EOS)."""
        if not self.known_only:  # only repeats are ruled out: a repeated word may not end
            blocked = [r for r, s in enumerate(self.rows) if not self.may_end(r, s)]
            if blocked:
                ends = self.lexicon.any_start.to(log_probs.device).clone()
                ends[EOS] = True
                log_probs[blocked] = log_probs[blocked].masked_fill(ends, float("-inf"))
            return log_probs
        allowed = torch.zeros_like(log_probs, dtype=torch.bool)
        ending, stuck, off_rows, off_cols = [], [], [], []
        rows, cols = [], []  # per row: its index, and its allowed pieces (lists or arrays)
        for r, spelling in enumerate(self.rows):
            parts = self._continuing(r, spelling) if spelling.pieces else []
            if self.may_end(r, spelling):
                ending.append(r)
                starts, blocked = self._starting(r, spelling)
                parts.append(starts)
                off_rows += [r] * len(blocked)
                off_cols += blocked
            elif not any(len(part) for part in parts):
                stuck.append(r)  # only at max_len can a row run out of words: it may end
            for part in parts:
                if len(part):
                    rows.append(np.full(len(part), r, dtype=np.int64))
                    cols.append(np.asarray(part, dtype=np.int64))
        if ending:
            ending = _index(ending, allowed.device)
            allowed[ending] = self.lexicon.known_starts.to(allowed.device)
            allowed[ending, EOS] = True
        if off_rows:
            allowed[_index(off_rows, allowed.device), _index(off_cols, allowed.device)] = False
        if rows:
            allowed[torch.from_numpy(np.concatenate(rows)).to(allowed.device),
                    torch.from_numpy(np.concatenate(cols)).to(allowed.device)] = True
        if stuck:
            allowed[_index(stuck, allowed.device), EOS] = True
        return log_probs.masked_fill_(allowed.logical_not_(), float("-inf"))

    def advance(self, parents: list[int], tokens: list[int], group: int | None = None) -> None:
        """Row i now continues row parents[i] with tokens[i]; `group` rows per sentence from now on if given."""
        lex, rows, new, self.group = self.lexicon, self.rows, [], group or self.group
        text, starts_word, children, complete, root = lex.text, lex.starts_word, lex.children, lex.complete, \
            lex.children[0]
        for parent, token in zip(parents, tokens, strict=True):
            old = rows[parent]
            if starts_word[token]:
                words, used = old.words, old.used
                if old.pieces:  # the previous word is finished
                    words = words | {old.text}
                    used = (*used, old.node) if old.node >= 0 and complete[old.node] else used
                new.append(Spelling((token,), text[token], root.get(token, -1), words, used))
            elif text[token]:  # a piece inside the word
                node = children[old.node].get(token, -1) if old.node >= 0 else -1
                new.append(Spelling((*old.pieces, token), old.text + text[token], node, old.words, old.used))
            else:  # EOS, or a piece that writes nothing
                new.append(old)
        self.rows = new

    def select(self, rows: list[int], sentences: list[int]) -> None:
        """Keep only `rows` (and their `sentences`), when finished sentences leave the batch."""
        self.rows = [self.rows[r] for r in rows]
        self.sources = [self.sources[s] for s in sentences]
        self._starts_cache.clear()  # keyed by sentence position
