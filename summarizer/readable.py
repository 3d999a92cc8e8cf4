"""A headline for people: the normalised summary the model writes (lower-cased, PTB-tokenized, `<unk>` for
what the tokenizer could not spell) turned back into text a reader expects, from its own raw source.

- each word in the case it had in the source, where it came from there; the first letter capitalised;
- `<unk>` replaced by the source word the tokenizer could not spell (the i-th unknown of the summary by the
  i-th such word of the source, which is exact when the source has one), else dropped;
- PTB tokens back to text (`-lrb-` to `(`, quotes) and detokenized (`'s`, `n't`, punctuation), with NLTK's
  Treebank detokenizer, the inverse of the tokenizer Gigaword's text was made with.

Digits are restored before this (`tokenizer.restore_digits`). Scoring uses the normalised form; this one is
what `summarize` prints by default (eval.readable) and what `eval` writes beside its predictions.
"""
from __future__ import annotations

import functools
import re

from nltk.tokenize.treebank import TreebankWordDetokenizer, TreebankWordTokenizer

from summarizer.tokenizer import UNK, UNK_WORD, Tokenizer

PTB_BRACKETS = {"-lrb-": "(", "-rrb-": ")", "-lsb-": "[", "-rsb-": "]", "-lcb-": "{", "-rcb-": "}"}
_UNKNOWN = re.compile(r"^(<unk>|UNK)$")
_DIGIT = re.compile(r"\d")


@functools.lru_cache(maxsize=1)
def _treebank() -> tuple[TreebankWordTokenizer, TreebankWordDetokenizer]:
    return TreebankWordTokenizer(), TreebankWordDetokenizer()


def source_words(source: str) -> list[str]:
    """The raw source's words as the Treebank tokenizer splits them (punctuation and clitics apart), cased."""
    return _treebank()[0].tokenize(source)


def readable(summary: str, source: str, tokenizer: Tokenizer, normalization: dict) -> str:
    """`summary` (normalised, digits restored) as text for a reader, using its raw `source` (module docstring);
    `normalization` is the prepared data's (meta.json), which tells which source words the tokenizer cannot spell."""
    words = source_words(source)
    cased: dict[str, str] = {}
    for word in words:
        cased.setdefault(word.lower(), word)
        if _DIGIT.search(word):  # "40" of "40%": digits the whitespace-split restoration could not place
            cased.setdefault(_DIGIT.sub("#", word.lower()), word)
    unspellable = iter([w for w in words if UNK_WORD not in w and UNK in tokenizer.encode_raw(w, normalization)])
    out = []
    for word in summary.split():
        if _UNKNOWN.match(word):
            replacement = next(unspellable, None)
            if replacement is not None:
                out.append(replacement)
            continue
        word = PTB_BRACKETS.get(word, word)
        out.append(cased.get(word, word))
    text = _treebank()[1].detokenize(out)
    return text[:1].upper() + text[1:]
