"""`summarize`: raw text on stdin, one per line -> one summary per line on stdout, streamed in input order."""
from __future__ import annotations

import codecs
import itertools
import select
import sys
import time
from collections.abc import Callable, Iterable, Iterator

from tqdm import tqdm

from summarizer import runtime
from summarizer.config.schema import Config
from summarizer.data.pairs import visible
from summarizer.data.prepared import open_tokenizer, read_meta
from summarizer.data.tokenizer import blank_controls
from summarizer.decode.inference import check_beam, copied_numbers, eval_checkpoint, load_model, summary_text
from summarizer.decode.lexicon import lexicon
from summarizer.decode.quantize import decoding_precision
from summarizer.decode.search import copied_unknowns, decode_all
from summarizer.errors import DataError

CHUNK_LINES = 256  # lines read, decoded and written at a time at most: memory stays constant, output flows
WAITING = None  # input_lines: the lines so far are all the input has now (reading on would wait for more)
READ_BYTES = 1 << 16  # read at a time: a line of any length passes through in pieces, never whole
# Bytes of a line kept per source token (data.max_source_len): a vocabulary piece spans at most 16 characters
# (SentencePiece's max_sentencepiece_length) of at most 4 bytes, and this leaves ample room for whitespace.
# What lies past them cannot reach the model, so it is never held, decoded or tokenized.
BYTES_PER_TOKEN = 256
# An input whose first MiB holds a CR but no \n, and no NUL (which text never holds: binary data), has old Mac
# line ends: its lines end at CR instead.
MAC_WINDOW = 1 << 20


def input_lines(stream, cap: int) -> Iterator[tuple[bytes, bool] | None]:
    r"""The lines of binary `stream`, each as (its first `cap` bytes, whether bytes past them were dropped), read
    READ_BYTES at a time, and WAITING wherever the next read would wait for input that has not come yet (a
    person typing, a program waiting for the answer to its line). A line ends at \n (a CR right before it is
    dropped; any other CR is whitespace), or at CR in an input with old Mac line ends (MAC_WINDOW)."""
    read = getattr(stream, "read1", stream.read)  # read1: what a pipe holds now, without waiting for more

    def reads() -> Iterator[bytes | None]:
        while True:
            if not ready(stream):
                yield WAITING
            piece = read(READ_BYTES)
            if not piece:
                return
            yield piece

    pieces = reads()
    head = b""
    for piece in pieces:
        head += piece or b""
        if b"\n" in head or len(head) >= MAC_WINDOW:
            break
    if (wide := wide_encoding(head)) is not None:
        raise DataError(f"the input is {wide} text, not UTF-8: convert it first (iconv -f {wide} -t UTF-8 FILE)")
    end = b"\r" if b"\r" in head and b"\n" not in head and b"\0" not in head else b"\n"
    line, cut = bytearray(), False
    for piece in itertools.chain([head], pieces):
        if piece is WAITING:
            yield WAITING
            continue
        *ended, rest = piece.split(end)
        for part in ended:
            cut = _keep(line, part, cap) or cut
            yield _whole(line, cut, end, cap)
            line, cut = bytearray(), False
        cut = _keep(line, rest, cap) or cut
    if line or cut:
        yield _whole(line, cut, end, cap)


def ready(stream) -> bool:
    """Whether reading `stream` now returns at once (input waiting, or its end); True for a stream without a file
    descriptor (in memory) or a regular file. A BufferedReader's own buffer is not looked at: there a False only
    ends a chunk early."""
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is an OSError and a ValueError
        return True
    return bool(select.select([fd], [], [], 0)[0])


def chunks(lines: Iterable[tuple[bytes, bool] | None], size: int) -> Iterator[list[tuple[int, tuple[bytes, bool]]]]:
    """`input_lines`' lines, numbered from 1, in lists of at most `size`: a list ends early where the input has
    no more lines waiting, so their summaries go out before the process waits for more."""
    chunk, number = [], 0
    for item in lines:
        if item is WAITING:
            if chunk:
                yield chunk
                chunk = []
            continue
        number += 1
        chunk.append((number, item))
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def wide_encoding(head: bytes) -> str | None:
    """"UTF-16" or "UTF-32" where an input starting with `head` is text in one (read as UTF-8, each line would be
    spaced letters, and its \n's NUL would start a line of its own): its byte-order mark, or a NUL in each byte
    of all lanes but one, as a text of mostly ASCII characters has them (binary data has a NUL in 1 byte of 256);
    else None."""
    for bom, name in ((codecs.BOM_UTF32_LE, "UTF-32"), (codecs.BOM_UTF32_BE, "UTF-32"),
                      (codecs.BOM_UTF16_LE, "UTF-16"), (codecs.BOM_UTF16_BE, "UTF-16")):
        if head.startswith(bom):
            return name
    sample = head[:4096]
    for width, name in ((4, "UTF-32"), (2, "UTF-16")):
        if len(sample) >= 4 * width:
            lanes = sorted(sample[lane::width].count(0) / len(sample[lane::width]) for lane in range(width))
            if lanes[0] < 0.1 and lanes[1] > 0.9:
                return name
    return None


def _keep(line: bytearray, part: bytes, cap: int) -> bool:
    """Appends what fits of `part` to `line`; whether some did not. One byte past `cap` is kept, so the CR of a
    CR LF right at the cap is no cut."""
    room = max(cap + 1 - len(line), 0)
    line += part[:room]
    return len(part) > room


def _whole(line: bytearray, cut: bool, end: bytes, cap: int) -> tuple[bytes, bool]:
    """A finished line: its CR of a CR LF dropped, cut to `cap` bytes."""
    if end == b"\n" and line.endswith(b"\r"):
        del line[-1]
    return bytes(line[:cap]), cut or len(line) > cap


def decode_lines(numbered: Iterable[tuple[int, tuple[bytes, bool]]], warn: Callable[[str], None],
                 cap: int) -> list[str]:
    """Numbered lines from `input_lines` -> text, control characters as spaces (tokenizer.blank_controls).
    Undecodable bytes become U+FFFD; each such line, and each line cut at `cap` bytes, is named through `warn`."""
    texts = []
    for number, (raw, cut) in numbered:
        # a cut may fall inside a character: its bytes there are dropped, not replaced
        text = codecs.getincrementaldecoder("utf-8")("replace").decode(raw, final=not cut)
        if "\ufffd" in text and "\ufffd".encode() not in raw:
            warn(f"warning: input line {number} is not valid UTF-8; undecodable bytes were replaced")
        if cut:
            warn(f"warning: input line {number} is longer than {cap} bytes; only its first {cap} were read "
                 f"(data.max_source_len tokens fit well within them)")
        texts.append(blank_controls(text))
    return texts


def summarize_stream(cfg: Config, stdin, stdout, quiet: bool = False) -> dict:
    """Summaries of `stdin` (a binary stream) written to `stdout`, normalised the way the training data was.

    Input is read CHUNK_LINES at a time, or fewer where no more are waiting (`chunks`: a line typed or sent
    and waited on is answered at once), and of each line only what data.max_source_len can use
    (BYTES_PER_TOKEN), so a file or a line of any size runs in constant memory; each chunk's summaries are
    written and flushed in input order before the next is read. One input line (`input_lines`) gives one
    output line, whatever its bytes: a line with nothing visible (`visible`) gives an empty summary, control
    characters are spaces, and a line with undecodable bytes, or longer than the model reads, is summarised all
    the same and named on stderr.
    `quiet` prints no bar and no summary line.
    """
    rt = runtime.setup(cfg.system, cfg.placement, decoding_precision(cfg))
    meta = read_meta(cfg.data.dir)
    check_beam(cfg, meta)
    tokenizer = open_tokenizer(cfg.data.dir, meta)
    model, _ = load_model(eval_checkpoint(cfg), rt, meta, cfg.eval.quantize, cfg)
    norm = meta["normalization"]
    cap = BYTES_PER_TOKEN * cfg.data.max_source_len
    bar = tqdm(unit=" lines", desc="summarize", file=sys.stderr, disable=True if quiet else None)
    started, lines = time.perf_counter(), 0

    def warn(message: str) -> None:
        bar.write(message, file=sys.stderr)

    for numbered in chunks(input_lines(stdin, cap), CHUNK_LINES):
        chunk = decode_lines(numbered, warn, cap)
        sources = []
        for (number, (_, cut)), text in zip(numbered, chunk, strict=True):
            ids = tokenizer.encode_raw(text, norm)
            if len(ids) > cfg.data.max_source_len and not cut:  # a cut line was named already
                warn(f"warning: input line {number} is {len(ids)} pieces long; the model reads its first "
                     f"{cfg.data.max_source_len} (data.max_source_len)")
            sources.append(ids[:cfg.data.max_source_len])
        hyps = decode_all(model, sources, cfg.eval, rt, lexicon=lexicon(cfg.data.dir))
        copied = copied_unknowns(model, sources, hyps, rt) if cfg.eval.readable else [None] * len(hyps)
        numbers = copied_numbers(model, sources, hyps, chunk, tokenizer, meta, rt)
        stdout.write("".join((summary_text(h, text, tokenizer, meta, cfg.eval.truncate_bytes, c, n)
                              if visible(text) else "") + "\n"
                             for text, h, c, n in zip(chunk, hyps, copied, numbers, strict=True)))
        stdout.flush()
        lines += len(chunk)
        bar.update(len(chunk))
    bar.close()
    seconds = time.perf_counter() - started
    if not quiet:
        print(f"summarized {lines} lines in {seconds:.1f} s ({lines / max(seconds, 1e-9):.1f} lines/s)",
              file=sys.stderr)
    return {"lines": lines, "seconds": seconds}
