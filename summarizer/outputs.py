"""Where outputs may go and how they are written: output directories the product owns (never a user's
files, never over an input), and atomic writes (temp file, fsync, rename), so a crash never leaves half a file."""
from __future__ import annotations

import contextlib
import os
from pathlib import Path

from summarizer.errors import ConfigError


@contextlib.contextmanager
def atomic_open(path: str | Path, mode: str = "wb"):
    """Write to `<path>.tmp`, then rename it over `path`: readers see the old file or the new one, never half.

    On any exception the temp file is removed and `path` is left as it was.
    """
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)  # atomic on POSIX
    finally:
        tmp.unlink(missing_ok=True)


def atomic_write(path: str | Path, data: str | bytes) -> None:
    with atomic_open(path, "wb" if isinstance(data, bytes) else "w") as fh:
        fh.write(data)


MARKER = ".summarizer"  # a directory the product made (or was given empty) holds this file, naming its kind


def claim_dir(path: str | Path, kind: str, key: str, legacy: tuple[str, ...] = (), also: tuple[str, ...] = ()) -> Path:
    """Create `path` as an output directory of `kind` ("run", "data", "eval"), or accept it as one the
    product already owns; refuse anything else with a message naming `key` (the config key) and the fix.

    A directory is the product's when it holds MARKER of `kind` (or of a kind in `also`), or, when it
    was written before the marker existed, one of the `legacy` files. An empty directory is claimed.
    A non-empty one of anybody else is refused: the product never writes into, overwrites or deletes
    files it did not create.
    """
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{key}={path} is an existing file, not a directory: choose another {key}")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"cannot create {key}={path} ({exc.strerror or exc}): choose a directory you can "
                          f"write, e.g. under the current directory") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"{key}={path} is not writable: choose a directory you can write")
    marker = path / MARKER
    if marker.is_file():
        owner = marker.read_text().strip()
        if owner != kind and owner not in also:
            raise ConfigError(f"{key}={path} is a {owner} directory of this product, not a {kind} directory: "
                              f"choose another {key}")
        return path
    entries = sorted(p.name for p in path.iterdir())
    if entries and not any((path / name).exists() for name in legacy):
        shown = ", ".join(entries[:5]) + (", ..." if len(entries) > 5 else "")
        raise ConfigError(f"{key}={path} already holds files this product did not write ({shown}); nothing was "
                          f"changed. Choose a new or empty directory for {key}")
    atomic_write(marker, kind + "\n")
    return path


def refuse_overlap(output: str | Path, inputs: list[str | Path], key: str) -> None:
    """Refuse an output directory that equals or contains an input (its files could be overwritten)."""
    output = Path(output).resolve()
    for item in inputs:
        item = Path(item).resolve()
        if item == output or output in item.parents:
            raise ConfigError(f"{key}={output} equals or contains the input {item}: outputs written there could "
                              f"overwrite it. Choose a separate directory for {key}")
