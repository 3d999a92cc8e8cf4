"""SentencePiece training on the cleaned train split: pinned special ids, Gigaword's `<unk>` as one piece."""
from __future__ import annotations

import hashlib
import io
import itertools
from collections.abc import Iterator

import numpy as np
import sentencepiece as spm
from datasets import Dataset

from summarizer.config.schema import DataConfig
from summarizer.data.tokenizer import BOS, EOS, MASK_PIECE, PAD, TAG_PIECE, UNK, UNK_WORD
from summarizer.errors import DataError

SPM_SEED = 20240521  # draws data.spm_input_sentence_size sentences of a larger train split; seeds SentencePiece
# Its unigram training sums statistics per thread, so the pieces depend on the thread count (1, 2, 8 and 16 threads:
# four vocabularies of the Gigaword sample): a fixed count, data.num_proc's default, keeps the vocabulary a function
# of the data and the config's tokenizer keys alone, on any machine
SPM_THREADS = 2


def _sentences(train: Dataset, limit: int) -> Iterator[str]:
    """The train split's sources and targets, in order; of more than `limit`, `limit` drawn with SPM_SEED."""
    texts = (text for batch in train.select_columns(["source", "target"]).iter(batch_size=10_000)
             for side in ("source", "target") for text in batch[side])
    total = 2 * len(train)
    if total <= limit:
        return texts
    keep = np.zeros(total, dtype=bool)
    keep[np.random.default_rng(SPM_SEED).choice(total, size=limit, replace=False)] = True
    return itertools.compress(texts, keep)


def _train(train: Dataset, cfg: DataConfig, hard_vocab_limit: bool, tags: list[str], mask: bool) -> bytes:
    model = io.BytesIO()
    spm.set_random_generator_seed(SPM_SEED)
    spm.SentencePieceTrainer.train(
        sentence_iterator=_sentences(train, cfg.spm_input_sentence_size), model_writer=model,
        model_type=cfg.spm_model_type, vocab_size=cfg.vocab_size, hard_vocab_limit=hard_vocab_limit,
        character_coverage=cfg.spm_character_coverage,
        # never more sentences than this (_sentences drew them), so SentencePiece samples none (its sampling gives
        # another vocabulary in every process); passed so the model file's trainer spec records the limit
        input_sentence_size=cfg.spm_input_sentence_size, shuffle_input_sentence=True,
        num_threads=SPM_THREADS,
        pad_id=PAD, unk_id=UNK, bos_id=BOS, eos_id=EOS,
        pad_piece="<pad>", bos_piece="<s>", eos_piece="</s>",
        # SentencePiece's own unknown piece gets another surface so that Gigaword's `<unk>` word
        # can be a user-defined symbol: always one piece, never split into `<`, `unk`, `>`.
        unk_piece="<sp_unk>",
        user_defined_symbols=[UNK_WORD, *(TAG_PIECE.format(t) for t in tags), *([MASK_PIECE] if mask else [])],
        # `#` (masked digits) is script Common and letters are Latin: splitting by script keeps
        # `##` runs from merging with letters, so `##th` is `##` + `th`.
        split_by_unicode_script=True,
        minloglevel=2)  # its per-iteration log would bury the progress lines
    return model.getvalue()


def train_spm(train: Dataset, cfg: DataConfig, tags: list[str], mask: bool = False) -> tuple[bytes, dict]:
    """Train on the train split's sources and targets, with one piece per source tag in `tags` (and the mask
    piece of denoising examples with `mask`); returns the model file's bytes and its meta."""
    total = 2 * len(train)
    drawn = f"{cfg.spm_input_sentence_size} (data.spm_input_sentence_size) of " \
        if total > cfg.spm_input_sentence_size else ""
    print(f"training SentencePiece ({cfg.spm_model_type}, vocab {cfg.vocab_size}) on {drawn}{total} train sentences",
          flush=True)
    hard_limit = True
    try:
        model = _train(train, cfg, hard_vocab_limit=True, tags=tags, mask=mask)
    except RuntimeError as exc:
        if "Vocabulary size too high" not in str(exc):
            raise DataError(f"SentencePiece training failed ({exc}): check data.vocab_size and "
                            f"data.spm_* settings against the size of the train split") from None
        # Too little text for the requested size: take what the data supports, and say so.
        hard_limit = False
        model = _train(train, cfg, hard_vocab_limit=False, tags=tags, mask=mask)
    vocab_size = spm.SentencePieceProcessor(model_proto=model).get_piece_size()
    if not hard_limit:
        print(f"note: the train split is too small for data.vocab_size={cfg.vocab_size}; trained with "
              f"hard_vocab_limit=false, real vocab size {vocab_size} (recorded in meta.json)", flush=True)
    return model, {"vocab_size": vocab_size, "requested_vocab_size": cfg.vocab_size,
                   "hard_vocab_limit": hard_limit, "sha256": hashlib.sha256(model).hexdigest()}
