"""`python -m summarizer train` as a child process, the way shells and schedulers run it: for the tests that
signal, kill or starve a real training process."""
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def train_process(overrides: list[str], new_session: bool = False,
                  config: Path = ROOT / "configs/tiny.yaml") -> subprocess.Popen:
    """`config` (configs/tiny.yaml) with `overrides`, stdout and stderr in one pipe; `new_session`: its own process
    group (setsid), as a scheduler's job is, so a signal can go to the whole group."""
    args = [sys.executable, "-m", "summarizer", "train", "--config", str(config), *overrides]
    return subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, start_new_session=new_session)


def wait_for(path: Path, proc: subprocess.Popen, timeout: float = 600) -> None:
    """Until `path` exists; fails if the process ends first. A safety net on a busy machine, not a speed check."""
    deadline = time.time() + timeout
    while not path.exists():
        assert proc.poll() is None, proc.stdout.read().decode()[-2000:]
        assert time.time() < deadline, "timed out"
        time.sleep(0.01)
