"""The vocabulary the word rules check a summary against, built once per process from a prepared data dir."""
from __future__ import annotations

import functools
from pathlib import Path

from summarizer.data.prepared import open_tokenizer, training_words
from summarizer.data.tokenizer import UNK_WORD
from summarizer.decode.constraints import Lexicon


def source_only(word: str) -> bool:
    """Words a summary may take from its own source but never from the training text: the unknown-word
    marker and masked numbers ("##.#"). Written without the source, they mean nothing to a reader."""
    return word == UNK_WORD or "#" in word


@functools.lru_cache(maxsize=4)
def lexicon(data_dir: str | Path) -> Lexicon:
    """The dir's tokenizer and training words as the word rules of decoding use them (built once per process):
    every training word except the source-only ones."""
    return Lexicon(open_tokenizer(data_dir), {w for w in training_words(data_dir) if not source_only(w)})
