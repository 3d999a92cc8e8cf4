"""Decoding constraints on whole words: each word of a summary is one seen in training or in its own source,
and no word comes twice. A word is what the pieces between two word starts (SentencePiece's "▁") spell.

A model that strings subword pieces freely can write words that do not exist ("supercomput", "yitz")
or repeat itself ("heavy heavy turnout", "feb feb."). Here every hypothesis carries the word it is
spelling. A piece may only extend it towards a known word that the hypothesis has not used yet (a prefix
tree over the pieces of every known word, and the words of its source), and the word may only end (at the
next word start, or EOS) once it is complete and unused. Since every allowed piece keeps an unused word
within reach, a hypothesis never spells itself into a dead end (piece n-gram blocking, applied after these
rules, can still take a row's last piece: summarizer/decode/rules.py).

Every rule is tensor arithmetic over all the rows of a step at once, in shapes the host knows, with no value
read back from the device (a GPU never waits on the rules): the tree is stored as sorted edge keys and an
ancestor table (summarizer/decode/lexicon.py), each row's state (its word's pieces, tree node and text hash,
the words it has finished) as tensors that beams reorder by indexing. Words are compared by a 62-bit hash of
their text (two 31-bit polynomial hashes), which a row extends piece by piece. Punctuation at the end of a word does not
make it another word: text normalised without word tokenization keeps "feb." and "cocoa," whole, so words
are compared by their repeat key, the text without its closing punctuation ("feb." is "feb" again), and a
finished word uses up every known word of its key.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from summarizer.data.tokenizer import EOS
from summarizer.decode.lexicon import FEW_CHILDREN, Lexicon, combined


def _both(rows: Tensor, pieces: Tensor) -> Tensor:
    """(R,) & (V,) -> (R, V) bool, computed on bytes: torch's CPU kernel broadcasts bool operands element by
    element, 40x slower than the same bytes as uint8."""
    return (rows[:, None].view(torch.uint8) & pieces.view(torch.uint8)).view(torch.bool)


class WordRules:
    """The rows of one decoding batch: which pieces each may emit next (`mask`), and how each row's word
    moves on when beams are reordered or finished sentences drop out (`advance`, `select`). With
    `known_only` off, only repeats are ruled out. Row r belongs to sentence r // group.

    Every shape is one the host knows (rows, the batch's source words, steps so far) and no value is read back
    from the device, so a GPU never waits on the rules: a row's finished words take one column a step (-1 where
    it finished none), the known words they use up `Lexicon.key_nodes`' M columns a step, and the pieces of the
    word it is spelling as many columns as the batch's longest source word, plus one for any further piece (a
    longer word is no source word). With a `capacity` (steps), those columns are allocated once, -1 until their
    step, and every step updates the state in place: the same tensors each step, which a CUDA graph can replay
    (summarizer/decode/static.py); rows then never reorder or leave."""

    def __init__(self, lexicon: Lexicon, sources: list[list[int]] | np.ndarray, group: int, known_only: bool,
                 no_repeat: bool, device: torch.device | str = "cpu", capacity: int = 0):
        self.lex = lex = lexicon.on(torch.device(device))
        self.known_only, self.no_repeat, self.group = known_only, no_repeat, group
        pieces, lengths, hashes = lex.source_word_arrays(sources)
        longest = pieces.shape[2]
        dev = lex.starts.device
        # (B, W, L) each sentence's words' pieces (-1 after a word's end), (B, W) their lengths and text hashes
        self.src_pieces, self.src_len, self.src_hash = (torch.from_numpy(a).to(dev) for a in (pieces, lengths, hashes))
        rows = len(sources) * group
        # (R, L+1) the pieces of the word being spelled
        self.pieces = torch.full((rows, longest + 1), -1, dtype=torch.long, device=dev)
        self.length = torch.zeros(rows, dtype=torch.long, device=dev)  # (R,) its pieces; 0 = nothing begun
        self.node = torch.zeros(rows, dtype=torch.long, device=dev)  # (R,) its known-tree node, -1 off the tree
        # (R,) its text's hashes (f1, f2) and its repeat key's (h1, h2): Lexicon.extend
        self.f1, self.f2, self.h1, self.h2 = (torch.zeros(rows, dtype=torch.long, device=dev) for _ in range(4))
        # (R, steps) the repeat keys (hashes) of the words each row has finished, and (R, steps * M) the known-tree
        # nodes of every known word with one of those keys (-1 elsewhere: a hash is >= 0, a node > 0)
        self.finished = torch.full((rows, capacity), -1, dtype=torch.long, device=dev)
        self.used = torch.full((rows, capacity * lex.class_nodes.shape[1]), -1, dtype=torch.long, device=dev)
        # with a capacity: the step each advance writes its columns at, counted on the device
        self.fixed, self.column = capacity > 0, torch.zeros((), dtype=torch.long, device=dev)
        self._ends = None  # may_end of the current rows, computed once per state (not with a capacity: see cut)

    # -- what the rows' words are -----------------------------------------------------------------------
    def _source_view(self):
        """(pieces, lengths, hashes) of each row's source words, and which of them the row's word is a prefix of."""
        sentence = torch.arange(len(self.length), device=self.length.device) // self.group
        pieces, lengths, hashes = self.src_pieces[sentence], self.src_len[sentence], self.src_hash[sentence]
        longest = pieces.shape[2]
        inside = torch.arange(longest, device=pieces.device) < self.length[:, None]  # (R, L)
        match = ((pieces == self.pieces[:, None, :longest]) | ~inside[:, None, :]).all(dim=2) \
            & (self.length[:, None] <= lengths) & (lengths > 0)  # (R, W)
        return pieces, lengths, hashes, match

    def _finished_has(self, hashes: Tensor) -> Tensor:
        """(R, ...) hashes -> whether each is among its row's finished words."""
        shape = hashes.shape
        flat = hashes.reshape(shape[0], -1)
        return (flat[:, :, None] == self.finished[:, None, :]).any(dim=2).reshape(shape)

    def _may_end(self, source=None) -> Tensor:
        """(R,) may the word each row is spelling end here (be followed by a word start or EOS)?"""
        if self._ends is not None and not self.fixed:  # a replayed step changes the state behind a cached value
            return self._ends
        begun = self.length > 0
        ok = torch.ones_like(begun)
        if self.no_repeat:
            ok &= ~self._finished_has(combined(self.h1, self.h2)[:, None])[:, 0]
        if self.known_only:
            _, lengths, _, match = source or self._source_view()
            ok &= self.lex.is_word(self.node) | (match & (lengths == self.length[:, None])).any(dim=1)
        self._ends = ~begun | ok
        return self._ends

    def _repeating(self) -> Tensor:
        """(R,) is the word each row is spelling, with some text so far, one the row has finished already?"""
        has_text = (self.h1 != 0) | (self.h2 != 0)
        return has_text & self._finished_has(combined(self.h1, self.h2)[:, None])[:, 0]

    def cut(self, rows: Tensor) -> Tensor:
        """(E,) rows that end -> how many pieces to drop from the end of each one's hypothesis: the word it is
        spelling if that word may not end (only `max_len` cuts a word short), else none."""
        return torch.where(self._may_end()[rows], 0, self.length[rows])

    # -- the mask ------------------------------------------------------------------------------------------
    def _used_up(self, used: Tensor, depth: Tensor | int) -> tuple[Tensor, Tensor]:
        """(R, U) used known words (-1: none) and a `depth` ((R, 1), or one for all) -> (R, U) the used words'
        ancestors at that depth, sorted in each row (-1: none), and whether every word at or under each is among
        the row's used words (counted by its copies in the row)."""
        lex = self.lex
        above = torch.where(used > 0, lex.ancestors[used.clamp(min=0), depth], -1).sort(dim=1).values
        under = torch.searchsorted(above, above, right=True) - torch.searchsorted(above, above)
        return above, (above > 0) & (lex.words_below[above.clamp(min=0)] <= under)

    def mask(self, log_probs: Tensor) -> Tensor:
        """Set -inf on every (row, piece) the rules forbid, in place; a row left with nothing may end (EOS)."""
        lex = self.lex
        vocab = log_probs.shape[1]
        source = self._source_view() if self.known_only else None
        ends = self._may_end(source)
        if not self.known_only:  # only repeats are ruled out: a repeated word may not end, nor add punctuation
            closing = lex.starts | (torch.arange(lex.vocab_size, device=ends.device) == EOS)
            log_probs.masked_fill_(_both(~ends, closing), float("-inf"))
            return log_probs.masked_fill_(_both(self._repeating(), lex.punct), float("-inf"))
        pieces, lengths, hashes, match = source
        begun = self.length > 0
        # (R, V + 1): the last column takes the pieces of entries that allow or forbid none
        allowed = _both(ends, torch.cat([lex.known_starts, lex.known_starts.new_zeros(1)]))
        allowed[:, EOS] |= ends
        word_hash = combined(self.h1, self.h2)
        fresh = ~self._finished_has(hashes) if self.no_repeat else torch.ones_like(match)  # (R, W) source words
        if self.no_repeat:  # a known start whose words are all used (this one's key included) is taken away
            used = torch.cat([self.used, torch.where(begun[:, None], lex.key_nodes(word_hash), -1)], dim=1)
            tops, gone = self._used_up(used, 1)
            allowed.scatter_(1, torch.where(gone & ends[:, None], lex.piece_into[tops.clamp(min=0)], vocab), False)
            fresh_now = fresh & ~((hashes == word_hash[:, None]) & begun[:, None])
        else:
            fresh_now = fresh
        # the known tree's pieces that continue each row's word: its node's children (a row of edges, or a wide
        # node's bitmap), less those whose words are all used
        going = begun & (self.node >= 0)
        node = torch.where(going, self.node, 0)
        first, count = lex.first_edge[node], lex.first_edge[node + 1] - lex.first_edge[node]
        few = going & (count <= FEW_CHILDREN)
        column = torch.arange(FEW_CHILDREN, device=node.device)
        onto = few[:, None] & (column < count[:, None])  # (R, FEW_CHILDREN)
        edges = (first[:, None] + column).clamp(max=max(len(lex.edge_child) - 1, 0))
        children = lex.edge_child[edges] if len(lex.edge_child) else edges  # (no tree: nothing is onto)
        allowed.scatter_(1, torch.where(onto, lex.piece_into[children], vocab), True)
        allowed |= lex.wide_children[lex.wide_index[node]]  # the root's index is 0: no pieces
        left = torch.where(going, count, 0)  # (R,) children allowed
        if self.no_repeat:
            below, full = self._used_up(self.used, lex.depth[node][:, None] + 1)
            full &= (lex.parent[below.clamp(min=0)] == node[:, None]) & going[:, None]  # the row's used-up children
            allowed.scatter_(1, torch.where(full, lex.piece_into[below.clamp(min=0)], vocab), False)
            first_copy = torch.cat([below.new_ones(len(below), min(1, below.shape[1]), dtype=torch.bool),
                                    below[:, 1:] != below[:, :-1]], dim=1)
            left = left - (full & first_copy).sum(dim=1)
        somewhere = ends | (left > 0)  # rows with a piece allowed: every ending row (EOS), and those below
        # the source's pieces that continue a row's word towards an unused source word, and its word starts
        at = self.length.clamp(max=pieces.shape[2] - 1)[:, None, None].expand(-1, pieces.shape[1], 1)
        onward = match & (self.length[:, None] < lengths) & fresh & begun[:, None]  # (R, W)
        starting = (lengths > 0) & fresh_now & ends[:, None]
        allowed.scatter_(1, torch.cat([torch.where(onward, pieces.gather(2, at)[:, :, 0], vocab),
                                       torch.where(starting, pieces[:, :, 0], vocab)], dim=1), True)
        somewhere |= onward.any(dim=1)
        allowed[:, EOS] |= ~somewhere  # only at max_len can a row run out of words
        return log_probs.masked_fill_(allowed[:, :vocab].logical_not(), float("-inf"))

    # -- moving on -------------------------------------------------------------------------------------------
    def advance(self, parents, tokens, group: int | None = None) -> None:
        """Row i now continues row parents[i] with tokens[i]; `group` rows per sentence from now on if given."""
        lex, dev = self.lex, self.length.device
        parents, tokens = torch.as_tensor(parents, device=dev), torch.as_tensor(tokens, device=dev)
        self.group = group or self.group
        pieces, length, node = self.pieces[parents], self.length[parents], self.node[parents]
        h1, h2, f1, f2 = self.h1[parents], self.h2[parents], self.f1[parents], self.f2[parents]
        start = lex.starts[tokens]
        inside = lex.has_text[tokens] & ~start  # a piece inside the word
        ending = start & (length > 0)  # rows whose word is finished by a new one
        ended = combined(h1, h2)
        finished, used = torch.where(ending, ended, -1)[:, None], torch.where(ending[:, None], lex.key_nodes(ended), -1)
        if self.fixed:  # written at this step's columns, in place
            m = used.shape[1]
            self.finished.copy_(self.finished[parents]).scatter_(1, self.column.expand(len(parents), 1), finished)
            at = (self.column * m + torch.arange(m, device=dev)).expand(len(parents), m)
            self.used.copy_(self.used[parents]).scatter_(1, at, used)
            self.column += 1
        else:
            self.finished = torch.cat([self.finished[parents], finished], dim=1)
            # every known word of the ended word's key is used up
            self.used = torch.cat([self.used[parents], used], dim=1)
        key = node * lex.vocab_size + tokens
        at = torch.searchsorted(lex.edge_key, key).clamp(max=len(lex.edge_key) - 1)
        child = torch.where((lex.edge_key[at] == key) & (node >= 0), lex.edge_child[at], -1)
        node = torch.where(start, lex.root_child[tokens], torch.where(inside, child, node))
        old = torch.stack([f1, f2, h1, h2])
        grown = torch.stack(lex.extend(*torch.where(start, 0, old), tokens))  # a word start begins from nothing
        f1, f2, h1, h2 = torch.where(start | inside, grown, old)
        pieces.masked_fill_(start[:, None], -1)
        column = torch.where(start, 0, length).clamp(max=pieces.shape[1] - 1)[:, None]  # the last takes the rest
        pieces.scatter_(1, column, torch.where(start | inside, tokens, pieces.gather(1, column)[:, 0])[:, None])
        moved = {"pieces": pieces, "length": torch.where(start, 1, length + inside), "node": node,
                 "f1": f1, "f2": f2, "h1": h1, "h2": h2}
        for name, value in moved.items():
            if self.fixed:
                getattr(self, name).copy_(value)
            else:
                setattr(self, name, value)
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
