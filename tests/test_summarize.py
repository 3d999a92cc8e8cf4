"""Tests for summarizer/summarize.py: one output line per input line whatever its bytes, and memory bounded by
data.max_source_len, not by the input."""
import io
import random
import re

import pytest

from summarizer import summarize
from summarizer.config.load import load_config


class LargestRead:
    """A binary stream over `data` that remembers the most bytes one call handed out, whichever call it was."""

    def __init__(self, data: bytes):
        self.stream, self.largest = io.BytesIO(data), 0

    def _note(self, got: bytes) -> bytes:
        self.largest = max(self.largest, len(got))
        return got

    def read(self, n=-1):
        return self._note(self.stream.read(n))

    def read1(self, n=-1):
        return self._note(self.stream.read1(n))

    def readline(self, n=-1):
        return self._note(self.stream.readline(n))

    def __iter__(self):
        return iter(self.readline, b"")


def run(trained_run, stdin, *overrides: str) -> list[str]:
    """`summarize` of binary `stdin` (bytes or a stream) in float32 with greedy search: its output lines."""
    _, args = trained_run
    cfg = load_config(args[1], [*args[2:], "eval.quantize=none", "eval.beam_size=1", *overrides])
    out = io.StringIO()
    summarize.summarize_stream(cfg, io.BytesIO(stdin) if isinstance(stdin, bytes) else stdin, out, quiet=True)
    text = out.getvalue()
    assert len(text.splitlines()) == text.count("\n")  # no line break but \n, by splitlines' definition either
    return text.split("\n")[:-1]


@pytest.mark.parametrize("read_bytes", [3, 1 << 16])
def test_input_lines_end_at_newline_only_and_keep_their_first_cap_bytes(monkeypatch, read_bytes):
    """Against the plain definition, with pieces far shorter than a line and as long as the reads are."""
    monkeypatch.setattr(summarize, "READ_BYTES", read_bytes)
    rng = random.Random(0)
    alphabet = [b"a", b"b", b" ", b"\r", b"\n", b"\0", b"\xff", b"\r\n"]
    for _ in range(200):
        data = b"\n" + b"".join(rng.choice(alphabet) for _ in range(rng.randrange(60)))  # a \n: not old Mac
        expected = data.split(b"\n")
        expected = expected[:-1] if expected[-1] == b"" else expected  # a last line needs no \n
        expected = [line[:-1] if line.endswith(b"\r") else line for line in expected]
        got = list(summarize.input_lines(io.BytesIO(data), 5))
        assert got == [(line[:5], len(line) > 5) for line in expected], data


def test_old_mac_input_ends_lines_at_cr(monkeypatch):
    """Text with CRs and no \n; binary data (it holds NULs) with CRs and no \n is one line all the same."""
    monkeypatch.setattr(summarize, "READ_BYTES", 4)
    lines = list(summarize.input_lines(io.BytesIO(b"first line\rsecond\r\rlast"), 100))
    assert lines == [(b"first line", False), (b"second", False), (b"", False), (b"last", False)]
    assert list(summarize.input_lines(io.BytesIO(b"\x93\rA\0\r\xff"), 100)) == [(b"\x93\rA\0\r\xff", False)]


def test_a_long_line_is_read_in_pieces_cut_named_once_and_gives_one_line(trained_run, capsys):
    """A 5 MB line between two short ones: three summaries, one notice naming line 2, no read of more than a
    small piece, and the cut line summarised as its start alone is (data.max_source_len=8 reaches no further)."""
    start = "the mayor of springfield opened a new park on monday . "
    stdin = LargestRead(f"rain fell .\n{start * 100_000}\nrain fell .\n".encode())
    assert len(stdin.stream.getbuffer()) > 5_000_000
    lines = run(trained_run, stdin, "data.max_source_len=8")
    err = capsys.readouterr().err
    assert len(lines) == 3 and lines[0] == lines[2] and lines[1]
    assert err.count("longer than") == 1 and "input line 2 is longer than 2048 bytes" in err
    assert stdin.largest <= 100_000
    assert lines[1] == run(trained_run, f"rain fell .\n{start * 2}\n".encode(), "data.max_source_len=8")[1]
    err = capsys.readouterr().err  # a line the model reads the start of, not cut for its bytes, is named too
    assert re.search(r"warning: input line 2 is \d+ pieces long; the model reads its first 8 \(data.max_source_len\)",
                     err) and "input line 1" not in err


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-le", "utf-16-be", "utf-32", "utf-32-le"])
def test_utf16_or_utf32_input_is_refused_with_how_to_convert_it(encoding):
    """Read as UTF-8, UTF-16 text gives lines of spaced letters and an extra line from each \n's NUL: it is told
    apart (by its byte-order mark, or by NULs in every byte of all lanes but one) and refused before any
    output. Binary data, NULs inside UTF-8 text and lines of NULs are not."""
    from summarizer.errors import DataError
    text = "the storm hit the coast on monday .\nfire kills two in paris .\n"
    with pytest.raises(DataError, match=f"the input is UTF-{encoding[4:6]} text, not UTF-8: convert it first "
                                        f"\\(iconv -f UTF-{encoding[4:6]} -t UTF-8"):
        list(summarize.input_lines(io.BytesIO(text.encode(encoding)), 100))
    binary = bytes(b for b in random.Random(1).randbytes(5200) if b != ord("\n"))
    for data in (binary, b"acme\0fell\0\0 on friday .\n", b"\0\0\0\0\n\0\n"):
        assert summarize.wide_encoding(data) is None


def test_data_keys_only_prep_reads_are_no_concern_of_decoding(trained_run):
    """Normalisation and vocabulary come from the prepared data and the checkpoint, never from the config's data
    keys: summarize decodes as eval does whatever those say (a config of other data, e.g. tiny.yaml beside
    data/gw), where it used to refuse what eval accepts."""
    line = b"the mayor opened a new park on monday .\n"
    assert run(trained_run, line, "data.vocab_size=999", "data.lowercase=false") == run(trained_run, line)


def test_nul_bytes_inside_a_line_are_spaces(trained_run):
    with_nuls = run(trained_run, b"acme corp shares\0fell 3.5 percent\0\0 on friday .\n")
    with_spaces = run(trained_run, b"acme corp shares fell 3.5 percent   on friday .\n")
    assert with_nuls == with_spaces and "\0" not in with_nuls[0]


def test_a_line_of_nul_bytes_gives_an_empty_line(trained_run):
    assert run(trained_run, b"\0\0\0\0\n\0\n") == ["", ""]


def test_a_random_binary_line_gives_one_line(trained_run, capsys):
    """5 kB of random bytes (CRs, NULs, invalid UTF-8, C1 controls) and no \\n: one line in, one line out."""
    binary = bytes(b for b in random.Random(1).randbytes(5200) if b != ord("\n"))[:5000]
    assert b"\r" in binary and b"\0" in binary and b"\x85" in binary
    lines = run(trained_run, b"rain fell .\n" + binary + b"\nrain fell .\n")
    assert len(lines) == 3 and lines[0] == lines[2] and not any(c < " " for c in lines[1])
    assert "input line 2 is not valid UTF-8" in capsys.readouterr().err
    assert len(run(trained_run, binary)) == 1  # alone, without even a \n: still one line


def test_n_lines_in_give_n_lines_out_whatever_their_bytes(trained_run):
    """Every kind of line break other than \\n is whitespace inside a line: lone CR, vertical tab, form feed,
    the file/group/record separators, NEL, and the Unicode line and paragraph separators."""
    texts = ["the mayor opened a new park on monday .", "", "rain fell\rin paris .", "shares\x0bfell\x0c.",
             "a\x1cb\x1dc\x1ed", "talks\x85resume\u2028today\u2029.", "\r", "x\r\x00\r", "last line"]
    stdin = "\n".join(texts).encode() + b"\r\n"  # the last line ends in CR LF
    lines = run(trained_run, stdin)
    assert len(lines) == len(texts) and lines[1] == "" and lines[6] == ""
    alone = run(trained_run, b"rain fell in paris .\n")
    assert lines[2] == alone[0]


def test_a_line_of_invisible_characters_is_blank(trained_run):
    """A byte-order mark, a zero-width space: kept by str.strip(), dropped by the tokenizer, shown by nothing. Such
    a line gives an empty summary, as a blank one does, not one made up from no words."""
    lines = run(trained_run, "\ufeff\r\n\u200b\n \u2060\ufeff \nrain fell in paris .\n".encode())
    assert lines[:3] == ["", "", ""] and lines[3]
    assert summarize.visible("\ufeffrain") and not summarize.visible("\u200b \x00\u2028")


def test_a_line_sent_and_waited_on_is_answered_before_more_input_comes(trained_run):
    """A program that writes one line to a pipe and waits for its summary (or a person typing) gets it at once,
    not after CHUNK_LINES more lines or the end of the input."""
    import os
    import threading

    _, args = trained_run
    cfg = load_config(args[1], [*args[2:], "eval.quantize=none", "eval.beam_size=1"])
    read_end, write_end = os.pipe()

    class Answers(io.StringIO):
        def __init__(self):
            super().__init__()
            self.first = threading.Event()

        def flush(self):
            super().flush()
            if self.getvalue():
                self.first.set()

    out, stdin = Answers(), os.fdopen(read_end, "rb")
    worker = threading.Thread(target=summarize.summarize_stream, args=(cfg, stdin, out, True), daemon=True)
    worker.start()
    try:
        os.write(write_end, b"police arrest a man in paris on monday .\n")
        answered = out.first.wait(timeout=120)
        lines_then = out.getvalue().count("\n")
        os.write(write_end, b"oil prices rose on friday .\n")
    finally:
        os.close(write_end)  # the end of the input: the worker finishes either way
    worker.join(timeout=120)
    stdin.close()
    assert answered and lines_then == 1, "no summary while the input stayed open"
    assert not worker.is_alive() and out.getvalue().count("\n") == 2
