"""Loading a trained model to decode with, for every command that decodes (eval, summarize, bench), and the
text of a decoded summary."""
from __future__ import annotations

from pathlib import Path

import torch

from summarizer.config.schema import Config
from summarizer.data.pairs import read_pairs_file
from summarizer.data.prepared import load_split, read_pairs
from summarizer.data.tokenizer import Tokenizer, masked_numbers, normalize, normalize_as, restore_digits
from summarizer.decode.quantize import decoding_form, resolve_quantize
from summarizer.decode.readable import readable
from summarizer.decode.search import copy_attention
from summarizer.errors import CheckpointError, ConfigError, DataError
from summarizer.model import checkpoint
from summarizer.runtime import Runtime
from summarizer.runtime.placement import place_model


def load_model(path: str | Path, rt: Runtime, meta: dict, quantize: str = "none",
               cfg: Config | None = None) -> tuple[torch.nn.Module, dict]:
    """The checkpoint's own model (its config, not the current one), placed, in eval mode, int8 if
    `quantize` (eval.quantize) says so, and (path, step, quantize as resolved); refused if `meta` (the data
    it will read) has another tokenizer, or if `cfg` would decode longer sequences than it has positions for
    (`check_positions`)."""
    try:
        state = checkpoint.require_model(checkpoint.load(path), path)
    except CheckpointError as exc:
        others = [p for p in checkpoint.step_checkpoints(Path(path).parent) if p != Path(path)]
        if not others:
            raise
        raise CheckpointError(f"{exc}. Checkpoints of the same run that could replace it: "
                              f"{', '.join(str(p) for p in others)}; use one with eval.checkpoint=PATH") from None
    checkpoint.check_tokenizer(state["data_meta"], meta, f"checkpoint {path}")
    quantize = resolve_quantize(quantize, rt)
    model = checkpoint.restore_model(state)
    if cfg is not None:
        check_positions(model.cfg.max_positions, cfg, path)
    model = decoding_form(model, rt, quantize)
    return place_model(model, rt).eval(), {"path": str(path), "step": state["step"], "quantize": quantize}


def check_positions(positions: int, cfg: Config, path: str | Path) -> None:
    """Refuse settings that would feed a model with `positions` positions (the checkpoint's own
    model.max_positions, which the current config's does not change) a longer sequence: a source of
    data.max_source_len pieces, or a summary of eval.max_len pieces after BOS and before EOS."""
    d, e = cfg.data, cfg.eval
    for key, value, needed in (("data.max_source_len", d.max_source_len, d.max_source_len),
                               ("eval.max_len", e.max_len, e.max_len + 2)):
        if needed > positions:
            raise ConfigError(f"{key}={value} needs {needed} positions, but the model of {path} has {positions} "
                              f"(its model.max_positions, fixed at training): set {key} to at most "
                              f"{value - needed + positions}")


def check_beam(cfg: Config, meta: dict) -> None:
    """Beam search keeps the 2K best of the vocabulary at its first step: K can be at most half of it."""
    if 2 * cfg.eval.beam_size > meta["vocab_size"]:
        raise ConfigError(f"eval.beam_size={cfg.eval.beam_size} needs a vocabulary of at least "
                          f"{2 * cfg.eval.beam_size} pieces; this data's has {meta['vocab_size']}: lower "
                          f"eval.beam_size")


def eval_checkpoint(cfg: Config) -> Path:
    """`eval.checkpoint`, or the run's best."""
    return Path(cfg.eval.checkpoint) if cfg.eval.checkpoint else cfg.run_dir / checkpoint.BEST


def summary_text(ids: list[int], source: str, tokenizer: Tokenizer, meta: dict, limit: int,
                 copied: dict[int, int] | None = None, numbers: list[str | None] | None = None) -> str:
    """A decoded summary as scorers see it (or, given `copied` from search.copied_unknowns, as readers do:
    each unknown piece written as the source characters it was copied from, and summarizer/decode/readable.py):
    masked digits put back from its source (where the source holds several numbers of a word's form, the one
    `numbers`, from `copied_numbers`, names; tokenizer.restore_digits), cut to the whole words that fit in
    `limit` bytes (eval.truncate_bytes; 0 = whole)."""
    norm = meta["normalization"]
    if copied is None:
        text = tokenizer.decode(ids)
    else:
        pieces = tokenizer.pieces_raw(source, norm)
        text = tokenizer.decode(ids, {t: pieces[s] for t, s in copied.items() if s < len(pieces)})
    if norm["mask_digits"]:
        text = restore_digits(text, source, numbers)
    if copied is not None:
        text = readable(text, source)
    return truncate_bytes(text.replace("\n", " "), limit, whole_words=True)


def copied_numbers(model, sources: list[list[int]], hyps: list[list[int]], texts: list[str], tokenizer: Tokenizer,
                   meta: dict, rt: Runtime) -> list[list[str | None] | None]:
    """For each hypothesis whose raw source (`texts`) holds several numbers of one of its masked words' form (`15`
    and `12` for `##`), the number each of its words holding `#` was copied from, in order (None for the others,
    and for a word the copy head does not tell: tokenizer.restore_digits leaves it masked); None for a
    hypothesis that needs no choice, most of them, which cost no model pass. The choice is the source word the
    copy attention weighted most, summed over the pieces it wrote the word with (search.copy_attention, run
    only for these hypotheses); with no copy head, or a source whose words and pieces do not line up, none."""
    out: list[list[str | None] | None] = [None] * len(hyps)
    if not meta["normalization"]["mask_digits"]:
        return out
    for i, (source, hyp, text) in enumerate(zip(sources, hyps, texts, strict=True)):
        if not any(ch.isdigit() for ch in text):  # a prepared split's source: its digits were masked at prep
            continue
        summary = tokenizer.decode(hyp)
        if "#" not in summary:
            continue
        numbers = masked_numbers(text, lower=summary == summary.lower())
        if any(len(numbers.get(w, [])) > 1 for w in summary.split(" ")):
            out[i] = _attended_numbers(model, source, hyp, text, summary, numbers, tokenizer, meta, rt)
    return out


def _attended_numbers(model, source: list[int], hyp: list[int], text: str, summary: str,
                      numbers: dict[str, list[str]], tokenizer: Tokenizer, meta: dict,
                      rt: Runtime) -> list[str | None] | None:
    """`copied_numbers` for one hypothesis whose summary needs a choice."""
    norm = meta["normalization"]
    masked = normalize_as(text, norm).split()
    digits = normalize(text, norm["lowercase"], False, norm.get("words", "none")).split()  # the same words
    src_word, src_words = _word_of(tokenizer.pieces_raw(text, norm))
    hyp_word, hyp_words = _word_of([tokenizer.sp.id_to_piece(int(i)) for i in hyp])
    if (len(digits) != len(masked) or not _same_numbers(src_words, masked)
            or _numbers(hyp_words) != _numbers(summary.split(" "))):
        return None  # the pieces do not line up with the words (SentencePiece's own normalisation): no choice
    attn = copy_attention(model, source, hyp, rt)  # (T, S)
    if attn is None:
        return None
    if summary == summary.lower():
        digits = [w.lower() for w in digits]
    picks: list[str | None] = []
    for k in (k for k, word in enumerate(hyp_words) if "#" in word):
        weight = dict.fromkeys(numbers.get(hyp_words[k], []), 0.0)
        wrote = attn[[t for t, w in enumerate(hyp_word) if w == k]].sum(dim=0)  # (S,) over the word's pieces
        for s, j in enumerate(src_word[:len(wrote)]):
            if j >= 0 and masked[j] == hyp_words[k] and digits[j] in weight:
                weight[digits[j]] += float(wrote[s])
        ranked = sorted(weight.values(), reverse=True)
        picks.append(max(weight, key=weight.get) if len(ranked) > 1 and ranked[0] > ranked[1] else None)
    return picks


def _numbers(words: list[str]) -> list[str]:
    return [w for w in words if "#" in w]


def _same_numbers(a: list[str], b: list[str]) -> bool:
    """Whether word lists `a` and `b` line up: as many words, and the same wherever either holds `#`."""
    return len(a) == len(b) and all(x == y for x, y in zip(a, b, strict=True) if "#" in x + y)


def _word_of(pieces: list[str]) -> tuple[list[int], list[str]]:
    """SentencePiece pieces -> (each piece's word index, -1 before the first word: a source tag; the words)."""
    index, words = [], []
    for piece in pieces:
        if piece.startswith("\u2581"):
            words.append("")
        if words:
            words[-1] += piece.replace("\u2581", "")
        index.append(len(words) - 1)
    return index, words


def truncate_bytes(text: str, limit: int, whole_words: bool = False) -> str:
    """The first `limit` bytes of `text` in UTF-8, never cutting a character in two (0 = no limit).

    Like ROUGE-1.5.5's `-b`, the cut may fall inside a word and keep part of it; with `whole_words`, a
    word the cut would split is dropped instead, so a summary shown to a reader holds no broken word.
    """
    if limit <= 0 or len(text.encode("utf-8")) <= limit:
        return text
    cut = text.encode("utf-8")[:limit].decode("utf-8", errors="ignore")
    if whole_words and not text[len(cut)].isspace():
        cut = cut[:cut.rfind(" ") + 1] if " " in cut else ""
    return cut.rstrip() if whole_words else cut


def read_eval_pairs(cfg: Config, meta: dict, tokenizer: Tokenizer) -> tuple[str, list[dict], list[list[int]]]:
    """(name, pairs, source ids) of what `eval` scores: `eval.pairs` (a pairs file of raw text, normalised and
    tokenized here as the run's training data was) or the prepared split `eval.split`."""
    e = cfg.eval
    if e.pairs:
        pairs = read_pairs_file(e.pairs)[:e.limit or None]
        ids = [tokenizer.encode_raw(p["source"], meta["normalization"])[:cfg.data.max_source_len] for p in pairs]
        return Path(e.pairs).name, pairs, ids
    if e.split not in meta["splits"]:
        raise DataError(f"split '{e.split}' was not prepared in {cfg.data.dir} (prepared: "
                        f"{', '.join(meta['splits'])}); map it in data.splits and re-run prep, set eval.split, "
                        f"or score a pairs file with eval.pairs=PATH")
    pairs = read_pairs(cfg.data.dir, e.split, e.limit or None)
    arrays = load_split(cfg.data.dir, e.split)
    ids = [arrays.src[arrays.src_offsets[i]:arrays.src_offsets[i + 1]][:cfg.data.max_source_len].tolist()
           for i in range(len(pairs))]
    return e.split, pairs, ids
