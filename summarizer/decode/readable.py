"""A headline for people: the normalised summary the model writes (lower-cased, PTB-tokenized) turned back
into text a reader expects, from its own raw source.

- each word in the case it had in the source, where it came from there; the first letter capitalised;
- no unknown marker: a piece the tokenizer cannot spell was already written as the source characters the copy
  head took it from (inference.summary_text, search.copied_unknowns); what is left of them (`<unk>`, `UNK`,
  or a word holding SentencePiece's `⁇`: unknown in the source too, or made up) is dropped, the whole word;
- PTB tokens back to text (`-lrb-` to `(`, quotes) and detokenized (`'s`, `n't`, punctuation), with NLTK's
  Treebank detokenizer, the inverse of the tokenizer Gigaword's text was made with.

Digits are restored before this (`tokenizer.restore_digits`); a masked number it left (its source holds several
of that form, and the copy head did not tell which) stays masked here too. Scoring uses the normalised form; this one is
what `summarize` prints by default (eval.readable) and what `eval` writes beside its predictions.
"""
from __future__ import annotations

import functools
import re

from nltk.tokenize.treebank import TreebankWordDetokenizer, TreebankWordTokenizer

PTB_BRACKETS = {"-lrb-": "(", "-rrb-": ")", "-lsb-": "[", "-rsb-": "]", "-lcb-": "{", "-rcb-": "}"}
_UNKNOWN = re.compile(r"^(<unk>|UNK)$|\u2047")  # \u2047: an UNK piece nothing was copied for
_DIGIT = re.compile(r"\d")
_MASKED = re.compile(r"^[#.,:/-]*#$")  # a number whose digits the data masked (Gigaword's "##", "#.#"), kept apart
_HELD = "\ue000{}\ue000"  # a private-use character: no detokenizer rule touches it


@functools.lru_cache(maxsize=1)
def _treebank() -> tuple[TreebankWordTokenizer, TreebankWordDetokenizer]:
    return TreebankWordTokenizer(), TreebankWordDetokenizer()


def source_words(source: str) -> list[str]:
    """The raw source's words as the Treebank tokenizer splits them (punctuation and clitics apart), cased."""
    return _treebank()[0].tokenize(source)


def readable(summary: str, source: str) -> str:
    """`summary` (normalised, digits restored) as text for a reader, using its raw `source` (module docstring)."""
    words = source_words(source)
    cased: dict[str, str] = {}
    numbers: dict[str, set[str]] = {}
    for word in words:
        cased.setdefault(word.lower(), word)
        if _DIGIT.search(word):
            numbers.setdefault(_DIGIT.sub("#", word.lower()), set()).add(word)
    for masked, found in numbers.items():  # a masked number left: only a source with one such number tells it
        if len(found) == 1:
            cased.setdefault(masked, found.pop())
    out = []
    for word in summary.split():
        if not _UNKNOWN.search(word):
            word = PTB_BRACKETS.get(word, word)
            out.append(cased.get(word, word))
    # the detokenizer joins "#" to the next word ("# 1" -> "#1", "# metoo" -> "#metoo"): a number the data masked
    # stays a word of its own, unless the source joins it to one
    apart = {i for i, word in enumerate(out)
             if _MASKED.match(word) and not re.search(rf"(?<![#\w]){re.escape(word)}\w", source)}
    text = _treebank()[1].detokenize([_HELD.format(i) if i in apart else w for i, w in enumerate(out)])
    for i in apart:
        text = text.replace(_HELD.format(i), out[i])
    return text[:1].upper() + text[1:]
