"""SentencePiece wrapper with pinned special ids, and the text normalisation shared by prep and inference."""
from __future__ import annotations

import hashlib
import html
import re
from pathlib import Path

import sentencepiece as spm
from nltk.tokenize import TreebankWordTokenizer

from summarizer.errors import DataError

PAD, UNK, BOS, EOS = 0, 1, 2, 3
# Gigaword's own unknown *word*; a user-defined piece (one id), distinct from SentencePiece's UNK.
UNK_WORD = "<unk>"
# The piece of a source tag (data.source_tag): one user-defined piece per tag, first on the encoder input.
TAG_PIECE = "<tag:{}>"
# Stands for a masked span of words in the encoder input of a denoising example (summarizer/data/noise.py).
MASK_PIECE = "<mask>"

# Gigaword writes the unknown word `<unk>` in train/valid but `UNK` in its test set
# (https://github.com/harvardnlp/sent-summary); only a whole-word UNK is that token.
_UNK_UPPER_RE = re.compile(r"(?<!\S)UNK(?!\S)")
_UNK_TAG_RE = re.compile(r"<unk>", re.IGNORECASE)
_DIGIT_RE = re.compile(r"\d")
# C0 and C1 control characters (NUL, stray CRs, escapes from binary input) and the line and paragraph
# separators: whitespace, as tab and newline already are. Left to SentencePiece, some stay inside a word as
# unknown pieces (and come back out in a summary) and others are deleted, joining the words on either side.
_CONTROL_RE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")
# data.word_tokenizer: "ptb" splits words the Penn Treebank way, as Gigaword's text is (`it 's`, `do n't`,
# `-lrb-`, ` `` `), so that raw text and any other source look like it; "none" splits at whitespace only.
_TREEBANK = TreebankWordTokenizer()
# PTB quotes already in the text: Treebank's rules would take a `''` after a space for an opening quote.
_PTB_QUOTES = ((re.compile(r"(?<!\S)``(?!\S)"), "\ue000", "``"), (re.compile(r"(?<!\S)''(?!\S)"), "\ue001", "''"))


def blank_controls(text: str) -> str:
    """`text` with each control character a space (the first step of `normalize`)."""
    return _CONTROL_RE.sub(" ", text)


def ptb_words(text: str, digits_masked: bool) -> str:
    """`text` split into Penn Treebank words, with Gigaword's brackets (`-LRB-`) and quotes; idempotent on text
    already split so (99% of Gigaword's sentences come back unchanged: the rest differ in `&amp;` and `US$`).
    `#` stays inside its word; where digits are masked (`digits_masked`) it is a digit (`##,###` one word)."""
    text = _UNK_TAG_RE.sub(" UNK ", html.unescape(text))  # `<unk>` one word, not `< unk >`
    for pattern, mark, _ in _PTB_QUOTES:
        text = pattern.sub(mark, text)
    hash_as = "0" if digits_masked else "\ue002"  # masked after this, `0` becomes `#` again
    text = " ".join(_TREEBANK.tokenize(text.replace("#", hash_as), convert_parentheses=True))
    for _, mark, quote in _PTB_QUOTES:
        text = text.replace(mark, quote)
    return text.replace("\ue002", "#")


def normalize(text: str, lowercase: bool, mask_digits: bool, words: str = "none") -> str:
    """The one text normalisation, applied at prep and again to `summarize` and `eval.pairs` input."""
    text = blank_controls(text)
    if words == "ptb":
        text = ptb_words(text, mask_digits)
    # UNK before lowercasing: after it, a real word "unk" would be indistinguishable.
    text = _UNK_UPPER_RE.sub(UNK_WORD, text)
    text = _UNK_TAG_RE.sub(UNK_WORD, text)
    if lowercase:
        text = text.lower()
    if mask_digits:
        text = _DIGIT_RE.sub("#", text)
    return " ".join(text.split())


def normalize_as(text: str, normalization: dict) -> str:
    """`normalize` as a prepared dir's data was (its meta.json's `normalization`)."""
    return normalize(text, normalization["lowercase"], normalization["mask_digits"],
                     normalization.get("words", "none"))


def masked_numbers(source: str, lower: bool) -> dict[str, list[str]]:
    """Each masked form (`##.#`) of a word of the raw `source` that holds digits -> the distinct words that mask
    to it, in source order (in lower case if `lower`): the words between spaces (`$75.50,`) and as the Treebank
    tokenizer splits them from their punctuation (`75.50`), so a number is found however the summary's words
    were split."""
    numbers: dict[str, dict[str, None]] = {}  # an insertion-ordered set per form
    if not _DIGIT_RE.search(source):  # most sources of a prepared split: their digits were masked at prep
        return {}
    for word in [*source.split(), *ptb_words(source, digits_masked=False).split()]:
        word = word.lower() if lower else word
        masked = _DIGIT_RE.sub("#", word)
        if masked != word:
            numbers.setdefault(masked, {})[word] = None
    return {masked: list(words) for masked, words in numbers.items()}


def restore_digits(summary: str, source: str, picks: list[str | None] | None = None) -> str:
    """Undo digit masking where the source tells how: each masked word of `summary` (`##.#`) becomes the word of
    the raw `source` that masks to it (`12.5`; `masked_numbers`), in the summary's case. Where the source holds
    one such number, that one; where it holds several (`15` and `12` for `##`), the one `picks` names for it (the
    k-th entry for the summary's k-th word holding `#`: the number the copy head took it from,
    inference.copied_numbers), and with no pick the word stays masked rather than take a number that may be the
    wrong one. Words the source cannot explain stay as they are, so text whose digits were
    masked before it came in is left unchanged."""
    numbers = masked_numbers(source, lower=summary == summary.lower()) if "#" in summary else {}
    if not numbers:
        return summary
    words, k = summary.split(" "), 0
    for i, word in enumerate(words):
        if "#" not in word:
            continue
        found, pick = numbers.get(word, []), picks[k] if picks and k < len(picks) else None
        k += 1
        if len(found) == 1:
            words[i] = found[0]
        elif pick in found:
            words[i] = pick
    return " ".join(words)


def file_sha256(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


class Tokenizer:
    """Text <-> ids. Sequences carry no BOS/EOS: the data loader adds them where the model needs them."""

    def __init__(self, model_path: str | Path):
        path = Path(model_path)
        if not path.is_file():
            raise DataError(f"SentencePiece model {path} does not exist: run `make prep CONFIG=...` "
                            f"(python -m data_prep --config ...) to create it")
        self.path = path
        self.sha256 = file_sha256(path)
        self.sp = spm.SentencePieceProcessor(model_file=str(path))
        pinned = (self.sp.pad_id(), self.sp.unk_id(), self.sp.bos_id(), self.sp.eos_id())
        if pinned != (PAD, UNK, BOS, EOS):
            raise DataError(f"{path} has special ids pad/unk/bos/eos = {pinned}, expected "
                            f"{(PAD, UNK, BOS, EOS)}: re-run prep to train a model with pinned ids")

    @property
    def vocab_size(self) -> int:
        return self.sp.get_piece_size()

    def encode(self, text: str) -> list[int]:
        return self.sp.encode(text, out_type=int)

    def tag_id(self, tag: str) -> int:
        """The id of source tag `tag`'s piece."""
        piece = TAG_PIECE.format(tag)
        if self.sp.piece_to_id(piece) == self.sp.unk_id():
            raise DataError(f"{self.path} has no piece {piece}: the data was prepared without that source tag")
        return self.sp.piece_to_id(piece)

    def mask_id(self) -> int:
        """The id of the mask piece, which data with unpaired sentences is prepared with."""
        if self.sp.piece_to_id(MASK_PIECE) == self.sp.unk_id():
            raise DataError(f"{self.path} has no piece {MASK_PIECE}: the data was prepared without unpaired sentences")
        return self.sp.piece_to_id(MASK_PIECE)

    def encode_raw(self, text: str, normalization: dict) -> list[int]:
        """Raw text (as a user types it) -> ids, normalised as the training data was (meta.json's `normalization`),
        after the piece of its `source_tag` where the data has tags."""
        tag = normalization.get("source_tag")
        ids = self.encode(normalize_as(text, normalization))
        return [self.tag_id(tag), *ids] if tag else ids

    def pieces_raw(self, text: str, normalization: dict) -> list[str]:
        """The pieces of `encode_raw(text, normalization)`, one per id."""
        tag = normalization.get("source_tag")
        pieces = self.pieces(normalize_as(text, normalization))
        return [TAG_PIECE.format(tag), *pieces] if tag else pieces

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self.sp.encode(list(texts), out_type=int)

    def pieces(self, text: str) -> list[str]:
        """`text`'s pieces as strings, one per id of `encode(text)`; an unknown piece (UNK) is the characters
        it stands for."""
        return self.sp.encode(text, out_type=str)

    def decode(self, ids, unknown: dict[int, str] | None = None) -> str:
        """Stops at the first EOS; PAD and BOS are skipped wherever they appear. With `unknown`, the UNK at
        position t of `ids` is written as `unknown[t]` (the characters it was copied from), else as SentencePiece
        writes any UNK, `\u2047`."""
        kept = []
        for i in ids:
            i = int(i)
            if i == EOS:
                break
            kept.append(i)
        if unknown is None:
            return self.sp.decode([i for i in kept if i not in (PAD, BOS)])
        text = "".join(unknown.get(t, "\u2047") if i == UNK else self.sp.id_to_piece(i)
                       for t, i in enumerate(kept) if i not in (PAD, BOS))
        return " ".join(text.replace("\u2581", " ").split())

    def decode_batch(self, batch) -> list[str]:
        return [self.decode(ids) for ids in batch]

    def __repr__(self) -> str:
        return f"Tokenizer({str(self.path)!r}, vocab_size={self.vocab_size}, sha256={self.sha256[:12]})"
