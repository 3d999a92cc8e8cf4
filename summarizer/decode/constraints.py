"""Decoding constraints on whole words: each word of a summary is one seen in training or in its own source,
and no word comes twice. A word is what the pieces between two word starts (SentencePiece's "▁") spell.

A model that strings subword pieces freely can write words that do not exist ("supercomput", "yitz")
or repeat itself ("heavy heavy turnout", "feb feb."). Here every hypothesis carries the word it is
spelling. A piece may only extend it towards a known word that the hypothesis has not used yet (a prefix
tree over the pieces of every known word, and the words of its source), and the word may only end (at the
next word start, or EOS) once it is complete and unused. Since every allowed piece keeps an unused word
within reach, a hypothesis never spells itself into a dead end.

Every rule is tensor arithmetic over all the rows of a step at once: the tree is stored as sorted edge
keys and an ancestor table, each row's state (its word's pieces, tree node and text hash, the words it has
finished) as tensors that beams reorder by indexing. Words are compared by a 62-bit hash of their text
(two 31-bit polynomial hashes), which a row extends piece by piece. Punctuation at the end of a word does not
make it another word: text normalised without word tokenization keeps "feb." and "cocoa," whole, so words
are compared by their repeat key, the text without its closing punctuation ("feb." is "feb" again), and a
finished word uses up every known word of its key.
"""
from __future__ import annotations

import functools
from collections.abc import Iterable

import numpy as np
import torch
from torch import Tensor

from summarizer.data.tokenizer import BOS, EOS, MASK_PIECE, PAD, TAG_PIECE, UNK, Tokenizer

WORD_START = "\u2581"  # SentencePiece's word-start marker
UNKNOWN_TEXT = "\u2047"  # an UNK piece's text in a word (how SentencePiece writes it)
HASH_BASE, HASH_P1, HASH_P2 = 1_000_003, 2_147_483_647, 2_147_483_629  # two primes below 2**31


@functools.lru_cache(maxsize=1 << 16)
def text_hash(text: str) -> tuple[int, int]:
    """The two polynomial hashes of `text` (code points + 1, base HASH_BASE): the hash of a + b is
    hash(a) * HASH_BASE**len(b) + hash(b), so a row extends its word's hash piece by piece."""
    h1 = h2 = 0
    for ch in text:
        h1, h2 = (h1 * HASH_BASE + ord(ch) + 1) % HASH_P1, (h2 * HASH_BASE + ord(ch) + 1) % HASH_P2
    return h1, h2


def _combined(h1, h2):
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
        # copied whole (the UNK written back as the source's own character: evaluate.summary_text), never
        # spelled without it, and no known word holds one.
        self.text[UNK] = UNKNOWN_TEXT
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
        self.root_child = torch.full((v,), -1, dtype=torch.long)  # (V,) the node a word start leads to
        roots = self.edge_key < v
        self.root_child[self.edge_key[roots]] = self.edge_child[roots]
        self.known_starts = self.root_child >= 0  # (V,) first pieces of known words
        # (C,) repeat key hashes, sorted, and (C, M) the nodes of each key's known words (-1 after them); a first
        # entry of hash -1 (no word's) keeps the table non-empty
        words = self.complete.nonzero().squeeze(1)
        word_keys = _combined(hashes[2, words], hashes[3, words])
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
        M the most any of them has (at least 1)."""
        at = torch.searchsorted(self.class_hash, hashes).clamp(max=len(self.class_hash) - 1)
        nodes = torch.where((self.class_hash[at] == hashes)[:, None], self.class_nodes[at], -1)
        return nodes[:, :max(1, int((nodes >= 0).sum(dim=1).max()))] if len(nodes) else nodes[:, :1]

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

    def source_words(self, src_ids: list[int]) -> list[tuple[list[int], str]]:
        """A source's words: (pieces, repeat key) each, in order; a word holding a piece that writes nothing
        after its first is left out."""
        words, word = [], []
        for i in [*src_ids, None]:
            if (i is None or self.starts_word[i]) and word:
                if all(self.text[p] for p in word[1:]):
                    words.append((word, self.repeat_key(word)))
                word = []
            if i is not None and (self.text[i] or self.starts_word[i]):
                word.append(i)
        return words


def _widen(t: Tensor, columns: int) -> Tensor:
    """`t` (R, C) with at least `columns` columns, new ones -1."""
    if t.shape[1] >= columns:
        return t
    return torch.cat([t, t.new_full((t.shape[0], max(columns, 2 * t.shape[1]) - t.shape[1]), -1)], dim=1)


class WordRules:
    """The rows of one decoding batch: which pieces each may emit next (`mask`), and how each row's word
    moves on when beams are reordered or finished sentences drop out (`advance`, `select`). With
    `known_only` off, only repeats are ruled out. Row r belongs to sentence r // group."""

    def __init__(self, lexicon: Lexicon, sources: list[list[int]], group: int, known_only: bool, no_repeat: bool,
                 device: torch.device | str = "cpu"):
        self.lex = lex = lexicon.on(torch.device(device))
        self.known_only, self.no_repeat, self.group = known_only, no_repeat, group
        words = [lex.source_words(s) for s in sources]
        most, longest = max([1, *map(len, words)]), max([1] + [len(p) for ws in words for p, _ in ws])
        pieces = np.full((len(sources), most, longest), -1, dtype=np.int64)
        lengths = np.zeros((len(sources), most), dtype=np.int64)
        hashes = np.full((len(sources), most), -1, dtype=np.int64)
        for b, ws in enumerate(words):
            for w, (ids, text) in enumerate(ws):
                pieces[b, w, :len(ids)], lengths[b, w], hashes[b, w] = ids, len(ids), _combined(*text_hash(text))
        dev = lex.starts.device
        # (B, W, L) each sentence's words' pieces (-1 after a word's end), (B, W) their lengths and text hashes
        self.src_pieces, self.src_len, self.src_hash = (torch.from_numpy(a).to(dev) for a in (pieces, lengths, hashes))
        rows = len(sources) * group
        self.pieces = torch.full((rows, 4), -1, dtype=torch.long, device=dev)  # (R, .) the word being spelled
        self.length = torch.zeros(rows, dtype=torch.long, device=dev)  # (R,) its pieces; 0 = nothing begun
        self.node = torch.zeros(rows, dtype=torch.long, device=dev)  # (R,) its known-tree node, -1 off the tree
        # (R,) its text's hashes (f1, f2) and its repeat key's (h1, h2): Lexicon.extend
        self.f1, self.f2, self.h1, self.h2 = (torch.zeros(rows, dtype=torch.long, device=dev) for _ in range(4))
        # (R, .) the repeat keys (hashes) of the words each row has finished, and the known-tree nodes of every
        # known word with one of those keys, in order from column 0 (-1 after them: a hash is >= 0, a node > 0)
        self.finished = torch.full((rows, 4), -1, dtype=torch.long, device=dev)
        self.used = torch.full((rows, 4), -1, dtype=torch.long, device=dev)
        self._ends = None  # may_end of the current rows, computed once per state

    # -- what the rows' words are -----------------------------------------------------------------------
    def _source_view(self):
        """(pieces, lengths, hashes) of each row's source words, and which of them the row's word is a prefix of."""
        sentence = torch.arange(len(self.length), device=self.length.device) // self.group
        pieces, lengths, hashes = self.src_pieces[sentence], self.src_len[sentence], self.src_hash[sentence]
        mine = _widen(self.pieces, pieces.shape[2])[:, None, :pieces.shape[2]]
        inside = torch.arange(pieces.shape[2], device=pieces.device) < self.length[:, None]  # (R, L)
        match = ((pieces == mine) | ~inside[:, None, :]).all(dim=2) & (self.length[:, None] <= lengths) \
            & (lengths > 0)  # (R, W)
        return pieces, lengths, hashes, match

    def _finished_has(self, hashes: Tensor) -> Tensor:
        """(R, ...) hashes -> whether each is among its row's finished words."""
        shape = hashes.shape
        flat = hashes.reshape(shape[0], -1)
        return (flat[:, :, None] == self.finished[:, None, :]).any(dim=2).reshape(shape)

    def _may_end(self, source=None) -> Tensor:
        """(R,) may the word each row is spelling end here (be followed by a word start or EOS)?"""
        if self._ends is not None:
            return self._ends
        begun = self.length > 0
        ok = torch.ones_like(begun)
        if self.no_repeat:
            ok &= ~self._finished_has(_combined(self.h1, self.h2)[:, None])[:, 0]
        if self.known_only:
            _, lengths, _, match = source or self._source_view()
            ok &= self.lex.is_word(self.node) | (match & (lengths == self.length[:, None])).any(dim=1)
        self._ends = ~begun | ok
        return self._ends

    def _repeating(self) -> Tensor:
        """(R,) is the word each row is spelling, with some text so far, one the row has finished already?"""
        has_text = (self.h1 != 0) | (self.h2 != 0)
        return has_text & self._finished_has(_combined(self.h1, self.h2)[:, None])[:, 0]

    def finish(self, row: int, hyp: list[int]) -> list[int]:
        """Row `row` ends with `hyp`: without the word it is spelling if that word may not end (only
        `max_len` cuts a word short)."""
        return hyp if bool(self._may_end()[row]) else hyp[:len(hyp) - int(self.length[row])]

    # -- the mask ------------------------------------------------------------------------------------------
    def _over_used(self, used: Tensor, nodes: Tensor, rows: Tensor) -> Tensor:
        """For tree `nodes` (one per entry, of row `rows`; each row's at one depth): are all the words at or
        under it among the row's `used` words? Counted per (row, ancestor) over the used words at once."""
        lex, n = self.lex, len(self.lex.parent)
        if not len(nodes):
            return torch.zeros(0, dtype=torch.bool, device=nodes.device)
        depth = torch.zeros(len(used), dtype=torch.long, device=nodes.device)
        depth[rows] = lex.depth[nodes]
        r, c = (used > 0).nonzero(as_tuple=True)
        above = lex.ancestors[used[r, c], depth[r]]  # each used word's ancestor at its row's depth (-1: none)
        keys, counts = torch.unique((r * n + above)[above >= 0], return_counts=True)  # sorted
        want = rows * n + nodes
        at = torch.searchsorted(keys, want).clamp(max=max(len(keys) - 1, 0))
        under = torch.where(keys[at] == want, counts[at], 0) if len(keys) else torch.zeros_like(want)
        return lex.words_below[nodes] <= under

    def mask(self, log_probs: Tensor) -> Tensor:
        """Set -inf on every (row, piece) the rules forbid, in place; a row left with nothing may end (EOS)."""
        lex = self.lex
        source = self._source_view() if self.known_only else None
        ends = self._may_end(source)
        if not self.known_only:  # only repeats are ruled out: a repeated word may not end, nor add punctuation
            if not bool(ends.all()):
                log_probs[~ends] = log_probs[~ends].masked_fill(lex.starts | (torch.arange(
                    lex.vocab_size, device=ends.device) == EOS), float("-inf"))
                repeating = self._repeating()
                log_probs[repeating] = log_probs[repeating].masked_fill(lex.punct, float("-inf"))
            return log_probs
        pieces, lengths, hashes, match = source
        begun = self.length > 0
        allowed = torch.zeros_like(log_probs, dtype=torch.bool)
        allowed[ends] = lex.known_starts
        allowed[ends, EOS] = True
        word_hash = _combined(self.h1, self.h2)
        fresh = ~self._finished_has(hashes) if self.no_repeat else torch.ones_like(match)  # (R, W) source words
        if self.no_repeat:  # a known start whose words are all used (this one's key included) is taken away
            used = torch.cat([self.used, torch.where(begun[:, None], lex.key_nodes(word_hash), -1)], dim=1)
            rows, cols = (used > 0).nonzero(as_tuple=True)
            tops = lex.ancestors[used[rows, cols], 1]
            gone = ends[rows] & self._over_used(used, tops, rows)
            allowed[rows[gone], lex.piece_into[tops[gone]]] = False
            fresh_now = fresh & ~((hashes == word_hash[:, None]) & begun[:, None])
        else:
            fresh_now = fresh
        # the known tree's pieces that continue each row's word towards a word not used up
        going = (begun & (self.node >= 0)).nonzero().squeeze(1)
        first = lex.first_edge[self.node[going]]
        counts = lex.first_edge[self.node[going] + 1] - first
        rows = going.repeat_interleave(counts)
        edges = first.repeat_interleave(counts) + torch.arange(len(rows), device=rows.device) - \
            (counts.cumsum(0) - counts).repeat_interleave(counts)
        children = lex.edge_child[edges]
        if self.no_repeat and len(rows):
            keep = ~self._over_used(self.used, children, rows)
            rows, children = rows[keep], children[keep]
        allowed[rows, lex.piece_into[children]] = True
        somewhere = ends.clone()  # rows with a piece allowed: every ending row (EOS), and those below
        somewhere[rows] = True
        # the source's pieces that continue a row's word towards an unused source word, and its word starts
        at = self.length.clamp(max=pieces.shape[2] - 1)[:, None, None].expand(-1, pieces.shape[1], 1)
        onward = match & (self.length[:, None] < lengths) & fresh & begun[:, None]
        rows, cols = onward.nonzero(as_tuple=True)
        allowed[rows, pieces.gather(2, at)[rows, cols, 0]] = True
        somewhere[rows] = True
        rows, cols = ((lengths > 0) & fresh_now & ends[:, None]).nonzero(as_tuple=True)
        allowed[rows, pieces[rows, cols, 0]] = True
        allowed[~somewhere, EOS] = True  # only at max_len can a row run out of words
        return log_probs.masked_fill_(allowed.logical_not_(), float("-inf"))

    # -- moving on -------------------------------------------------------------------------------------------
    def advance(self, parents, tokens, group: int | None = None) -> None:
        """Row i now continues row parents[i] with tokens[i]; `group` rows per sentence from now on if given."""
        lex, dev = self.lex, self.length.device
        parents, tokens = torch.as_tensor(parents, device=dev), torch.as_tensor(tokens, device=dev)
        self.group = group or self.group
        pieces, length, node = self.pieces[parents], self.length[parents], self.node[parents]
        h1, h2, f1, f2 = self.h1[parents], self.h2[parents], self.f1[parents], self.f2[parents]
        finished, used = self.finished[parents], self.used[parents]
        start = lex.starts[tokens]
        inside = lex.has_text[tokens] & ~start  # a piece inside the word
        ending = (start & (length > 0)).nonzero().squeeze(1)  # rows whose word is finished by a new one
        if len(ending):  # appended at each row's first free column
            count = (finished >= 0).sum(dim=1)
            finished = _widen(finished, int(count.max()) + 1)
            ended = _combined(h1[ending], h2[ending])
            finished[ending, count[ending]] = ended
            block = lex.key_nodes(ended)  # every known word of the ended word's key
            count = (used >= 0).sum(dim=1)[ending]
            used = _widen(used, int(count.max()) + block.shape[1])
            used[ending[:, None], count[:, None] + torch.arange(block.shape[1], device=dev)] = block
        key = node * lex.vocab_size + tokens
        at = torch.searchsorted(lex.edge_key, key).clamp(max=len(lex.edge_key) - 1)
        child = torch.where((lex.edge_key[at] == key) & (node >= 0), lex.edge_child[at], -1)
        self.node = torch.where(start, lex.root_child[tokens], torch.where(inside, child, node))
        old = torch.stack([f1, f2, h1, h2])
        grown = torch.stack(lex.extend(*torch.where(start, 0, old), tokens))  # a word start begins from nothing
        self.f1, self.f2, self.h1, self.h2 = torch.where(start | inside, grown, old)
        pieces = _widen(pieces, int(length.max()) + 1) if len(length) else pieces
        pieces[start] = -1
        self.length = torch.where(start, 1, length + inside)
        where = torch.where(start, 0, length)
        grow = start | inside
        rows = grow.nonzero().squeeze(1)
        pieces[rows, where[rows]] = tokens[rows]
        self.pieces, self.finished, self.used = pieces, finished, used
        self._ends = None

    def select(self, rows, sentences) -> None:
        """Keep only `rows` (and their `sentences`), when finished sentences leave the batch."""
        dev = self.length.device
        rows, sentences = torch.as_tensor(rows, device=dev), torch.as_tensor(sentences, device=dev)
        for name in ("pieces", "length", "node", "f1", "f2", "h1", "h2", "finished", "used"):
            setattr(self, name, getattr(self, name)[rows])
        self.src_pieces, self.src_len, self.src_hash = (t[sentences] for t in (self.src_pieces, self.src_len,
                                                                                 self.src_hash))
        self._ends = None
