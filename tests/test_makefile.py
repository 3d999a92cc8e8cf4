"""The Makefile's own logic: `make clean` removes only what the product made; targets pass their options on."""
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

MAKEFILE = Path(__file__).resolve().parents[1] / "Makefile"


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_clean_removes_the_products_directories_and_nothing_of_the_users(tmp_path):
    made = {"checkpoints/base": ".summarizer", "runs/base": ".summarizer.run_dir", "data/tiny": ".summarizer",
            "data/overfit": ".summarizer"}
    for path, marker in made.items():
        (tmp_path / path).mkdir(parents=True)
        (tmp_path / path / marker).write_text("run\n")
        (tmp_path / path / "best.pt").write_text("weights")
    (tmp_path / "mine" / "pretrained").mkdir(parents=True)  # a user's models, linked into checkpoints/
    (tmp_path / "mine" / "pretrained" / "best.pt").write_text("precious")
    (tmp_path / "mine" / "pretrained" / ".summarizer").write_text("run\n")  # even a run of ours, behind a link
    (tmp_path / "checkpoints" / "pretrained").symlink_to(tmp_path / "mine" / "pretrained")
    (tmp_path / "checkpoints" / "notes").mkdir()
    (tmp_path / "checkpoints" / "notes" / "todo.txt").write_text("mine")
    (tmp_path / "checkpoints" / ".gitkeep").write_text("")
    (tmp_path / "checkpoints" / "seeds_base.json").write_text("{}")  # a file of seeds': no directory, kept unsaid
    out = subprocess.run(["make", "-s", "-f", str(MAKEFILE), "-C", str(tmp_path), "clean"], capture_output=True,
                         text=True, check=True).stdout
    assert not any((tmp_path / path).exists() for path in made) and not (tmp_path / "runs").exists()
    assert (tmp_path / "mine" / "pretrained" / "best.pt").read_text() == "precious"
    assert (tmp_path / "checkpoints" / "pretrained").is_symlink()
    assert (tmp_path / "checkpoints" / "notes" / "todo.txt").is_file() and (tmp_path / "checkpoints/.gitkeep").exists()
    assert "kept checkpoints/pretrained (not made by this product)" in out and "removed checkpoints/base" in out
    assert (tmp_path / "checkpoints" / "seeds_base.json").is_file() and "seeds_base" not in out


def dry_run(tmp_path: Path, *argv: str) -> list[str]:
    """The commands `make -n` would run for `argv`, in a dir whose install is up to date."""
    for name in ("setup.cfg", "pyproject.toml"):
        (tmp_path / name).write_text("")
    (tmp_path / ".venv").mkdir(exist_ok=True)
    installed = tmp_path / ".venv" / ".installed"
    installed.write_text("")
    os.utime(installed, (time.time() + 60, time.time() + 60))  # newer than its inputs: nothing to install
    out = subprocess.run(["make", "-n", "-s", "-f", str(MAKEFILE), "-C", str(tmp_path), *argv], capture_output=True,
                         text=True, check=True).stdout
    return [line for line in out.splitlines() if " -m summarizer " in line]


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_compare_passes_args_to_the_command(tmp_path):
    [line] = dry_run(tmp_path, "compare", "A=a", "B=b", "REF=r", "ARGS=--truncate-bytes 75 --samples 50 --seed 3")
    assert line.endswith("-m summarizer compare a b --ref r --out . --truncate-bytes 75 --samples 50 --seed 3")


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_report_writes_csv_for_csv_1_and_markdown_for_csv_0(tmp_path):
    for value, csv in (("1", True), ("0", False), ("false", False), ("", False)):
        [line] = dry_run(tmp_path, "report", f"CSV={value}")
        assert line.endswith("--csv") == csv, value
    [line] = dry_run(tmp_path, "report")
    assert not line.endswith("--csv")
