"""`summarize`: raw text on stdin, one per line -> one summary per line on stdout, streamed in input order."""
from __future__ import annotations

import itertools
import re
import sys
import time

from tqdm import tqdm

from summarizer import runtime
from summarizer.config.schema import Config
from summarizer.data.prepared import check_data_settings, open_tokenizer, read_meta
from summarizer.decode.constraints import lexicon
from summarizer.decode.inference import check_beam, eval_checkpoint, load_model, summary_text
from summarizer.decode.quantize import decoding_precision
from summarizer.decode.search import copied_unknowns, decode_all

_LINE_END = re.compile(r"\r\n?|\n")
CHUNK_LINES = 256  # lines read, decoded and written at a time: memory stays constant, output flows


def decode_lines(raw_lines, warn) -> list[str]:
    """Bytes lines -> text; undecodable bytes become U+FFFD and `warn(line_number)` is called for them. A line
    that holds lone CRs (old Mac line ends) is several lines."""
    texts = []
    for number, raw in raw_lines:
        text = raw.decode("utf-8", errors="replace")
        if "\ufffd" in text and "\ufffd".encode() not in raw:
            warn(number)
        texts += _LINE_END.split(text.rstrip("\r\n"))
    return texts


def summarize_stream(cfg: Config, stdin, stdout, quiet: bool = False) -> dict:
    """Summaries of `stdin` (a binary stream) written to `stdout`, normalised the way the training data was.

    Input is read CHUNK_LINES at a time, so a file of any size runs in constant memory; each chunk's
    summaries are written and flushed in input order before the next is read. An empty line gives an
    empty summary; a line with undecodable bytes is summarised with them replaced, and named on stderr.
    `quiet` prints no bar and no summary line.
    """
    rt = runtime.setup(cfg, decoding_precision(cfg))
    meta = read_meta(cfg.data.dir)
    check_beam(cfg, meta)
    check_data_settings(cfg.data, meta)
    tokenizer = open_tokenizer(cfg.data.dir)
    model, _ = load_model(eval_checkpoint(cfg), rt, meta, cfg.eval.quantize)
    norm = meta["normalization"]
    numbered = enumerate(stdin, start=1)
    bar = tqdm(unit=" lines", desc="summarize", file=sys.stderr, disable=True if quiet else None)
    started, lines = time.perf_counter(), 0

    def warn(number: int) -> None:
        bar.write(f"warning: input line {number} is not valid UTF-8; undecodable bytes were replaced", file=sys.stderr)

    while chunk := decode_lines(itertools.islice(numbered, CHUNK_LINES), warn):
        sources = [tokenizer.encode_raw(text, norm)[:cfg.data.max_source_len] for text in chunk]
        hyps = decode_all(model, sources, cfg.eval, rt, lexicon=lexicon(cfg.data.dir))
        copied = copied_unknowns(model, sources, hyps, rt) if cfg.eval.readable else [None] * len(hyps)
        stdout.write("".join((summary_text(h, text, tokenizer, meta, cfg.eval.truncate_bytes, c)
                              if text.strip() else "") + "\n" for text, h, c in zip(chunk, hyps, copied, strict=True)))
        stdout.flush()
        lines += len(chunk)
        bar.update(len(chunk))
    bar.close()
    seconds = time.perf_counter() - started
    if not quiet:
        print(f"summarized {lines} lines in {seconds:.1f} s ({lines / max(seconds, 1e-9):.1f} lines/s)",
              file=sys.stderr)
    return {"lines": lines, "seconds": seconds}
