"""Where outputs may go and how they are written: output directories the product owns (never a user's
files, never over an input), and atomic writes (temp file, fsync, rename), so a crash never leaves half a file."""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from summarizer.errors import ConfigError


@contextlib.contextmanager
def atomic_open(path: str | Path, mode: str = "wb"):
    """Write to `<path>.<pid>.tmp`, then rename it over `path`: readers see the old file or the new one, never
    half, and two processes writing the same file never share a temp file.

    On any exception the temp file is removed and `path` is left as it was.
    """
    path = Path(path)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        with _named(path), open(tmp, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)  # atomic on POSIX
    finally:
        tmp.unlink(missing_ok=True)


def atomic_write(path: str | Path, data: str | bytes) -> None:
    with atomic_open(path, "wb" if isinstance(data, bytes) else "w") as fh:
        fh.write(data)


@contextlib.contextmanager
def _named(path: Path):
    """A write error (a full disk, a file-size limit) carries no file name: give it the file being written."""
    try:
        yield
    except OSError as exc:
        if exc.filename is not None or not exc.errno:
            raise
        raise OSError(exc.errno, exc.strerror, str(path)) from None


def write_together(directory: str | Path, files: dict[str, str], last: str) -> None:
    """Write files that must agree (predictions and the report that scores them): each is written in full to a
    temp file first, so a full disk fails before anything is replaced and the earlier set stays whole; then
    `last` (the file naming the others) is removed, the others renamed into place, and `last` renamed last,
    so even a crash among the renames leaves files without their report, never a report beside other files."""
    directory = Path(directory)
    staged = {name: directory / f"{name}.{os.getpid()}.tmp" for name in files}
    try:
        for name, text in files.items():
            with _named(directory / name), open(staged[name], "w", encoding="utf-8") as fh:
                fh.write(text)
                fh.flush()
                os.fsync(fh.fileno())
        (directory / last).unlink(missing_ok=True)
        for name in [n for n in files if n != last] + [last]:
            os.replace(staged[name], directory / name)
    finally:
        for tmp in staged.values():
            tmp.unlink(missing_ok=True)


MARKER = ".summarizer"  # a directory the product made (or was given empty) holds this file, naming its kind
LOCK = ".lock"  # held (flock) by the one process writing a run dir; the kernel releases it on any exit
_held: list = []  # lock files this process holds (forked children close their copies: release_inherited_locks)


def _ours(name: str) -> bool:
    """The product's own bookkeeping files, in any directory it claims (marker, lock, their temp files)."""
    return name in (MARKER, LOCK) or (name.startswith(MARKER + ".") and name.endswith(".tmp"))


def claim_dir(path: str | Path, kind: str, key: str, also: tuple[str, ...] = (), note: str = "") -> Path:
    """Create `path` as an output directory of `kind` ("run", "data", "eval"), or accept it as one the
    product already owns; refuse anything else with a message naming `key` (the config key) and the fix.

    A directory is the product's only when it holds MARKER naming `kind` (or a kind in `also`): a file's
    name proves nothing (a user's config.yaml, meta.json or rouge.json has the same names as ours). An empty
    directory is claimed. A non-empty one of anybody else is refused: the product never writes into,
    overwrites or deletes files it did not create. `note` says, in the refusal of another kind's directory,
    when this command may write into one.
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
            raise ConfigError(f"{key}={path} is a {owner} directory of this product, not a {kind} directory"
                              f"{f' ({note})' if note else ''}; nothing was changed. Choose another {key}")
        return path
    entries = sorted(p.name for p in path.iterdir() if not _ours(p.name))
    if entries:
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


def hold_lock(path: str | Path, key: str):
    """Lock directory `path` for this process's life (the open file returned holds it; closing it or exiting,
    however, releases it). Refused with a message naming the holder when another process has it."""
    path = Path(path)
    fh = open(path / LOCK, "a+", encoding="utf-8")
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        fh.seek(0)
        holder = fh.read().strip() or "another process"
        fh.close()
        raise ConfigError(f"{key}={path} is in use by {holder}: two trainings must not write one run. Wait for it "
                          f"to finish, or start another run (run.name=NEW_NAME)") from None
    fh.seek(0)
    previous = fh.read().strip()
    if previous and not _alive(previous):
        print(f"note: {path / LOCK} named {previous}, which is no longer running; taking it over", flush=True)
    fh.seek(0)
    fh.truncate()
    fh.write(f"process {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    fh.flush()
    _held.append(fh)
    return fh


def release_lock(fh) -> None:
    """End a lock hold_lock took, emptying the file first: a lock file that still names a process then means
    that process died holding it (killed), and the next run says so; an empty one means it ended cleanly."""
    fh.seek(0)
    fh.truncate()
    fh.flush()
    fh.close()


def release_inherited_locks() -> None:
    """In a forked child (a DataLoader worker): close the copies of the parent's lock files, so the lock ends with
    the parent. A flock belongs to the open file, which fork shares: a worker outliving a killed parent for a few
    seconds would otherwise keep the run dir locked against its own resume."""
    while _held:
        _held.pop().close()  # closes this process's copy only; the lock is released when the last copy closes


def _alive(holder: str) -> bool:
    """Whether the process a lock file names still runs on this host (unknown hosts count as running)."""
    words = holder.split()
    if len(words) < 4 or not words[1].isdigit() or words[3] != socket.gethostname():
        return True
    try:
        os.kill(int(words[1]), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def claim_events_dir(path: str | Path, run_dir: str | Path) -> Path:
    """The TensorBoard directory of the run `run_dir`: refused when it holds another run dir's events (two
    runs with one run.name and different run.dir would mix their curves, and a resume's purge would cut both)."""
    path, owner = Path(path), str(Path(run_dir).resolve())
    path.mkdir(parents=True, exist_ok=True)
    marker = path / (MARKER + ".run_dir")
    if marker.is_file() and marker.read_text().strip() != owner:
        raise ConfigError(f"TensorBoard dir {path} holds the events of run {marker.read_text().strip()}, not of "
                          f"{owner}: give this run its own run.name (or run.tensorboard_dir)")
    if not marker.is_file():
        atomic_write(marker, owner + "\n")
    return path


def code_version() -> dict:
    """The commit of the code that is running and whether it had uncommitted changes (empty and False outside a
    git checkout): what a run's manifest and an eval's rouge.json record of what produced them."""
    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], capture_output=True, text=True, timeout=10,
                                  cwd=Path(__file__).resolve().parent).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""
    return {"git_commit": git("rev-parse", "HEAD"), "git_dirty": bool(git("status", "--porcelain"))}


WRITTEN_BY = "written_by"  # the key a JSON report of the product names its writer under


def check_report_target(path: str | Path, writer: str, key: str) -> Path:
    """Refuse, before any work, a report path that is a directory, lies under a file or a directory that cannot
    be made, or holds a file that `writer` did not write (the product never replaces a user's file); make its
    directory."""
    path = Path(path)
    if path.parent.exists() and not path.parent.is_dir():
        raise ConfigError(f"{key} {path.parent} is a file, not a directory: give a directory for {path.name}")
    if path.is_dir():
        raise ConfigError(f"{path} is a directory: choose another {key}")
    try:  # now, not after the work: a directory that cannot be made or written (no permission, read-only)
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path.parent):
            pass
    except OSError as exc:
        raise ConfigError(f"cannot write in {key} {path.parent} ({exc.strerror or exc}): give a directory you can "
                          f"write") from None
    if path.exists():
        try:
            owner = json.loads(path.read_text(encoding="utf-8")).get(WRITTEN_BY)
        except (ValueError, UnicodeDecodeError, AttributeError):
            owner = None
        if owner != writer:
            raise ConfigError(f"{path} already exists and was not written by `{writer}`; nothing was changed. "
                              f"Move it, or choose another {key}")
    return path


def write_report(path: str | Path, report: dict, writer: str, key: str) -> dict:
    """Write the JSON `report` to `path` atomically, tagged with its `writer` (e.g. "summarizer compare"). A file
    already at `path` is replaced only if that writer wrote it (check_report_target). Returns what was written."""
    path = check_report_target(path, writer, key)
    path.parent.mkdir(parents=True, exist_ok=True)
    report = {WRITTEN_BY: writer, **report}
    atomic_write(path, json.dumps(report, indent=2) + "\n")
    return report
