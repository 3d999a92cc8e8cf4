"""The Makefile's own logic: `make clean` removes only what the product made."""
import shutil
import subprocess
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
    out = subprocess.run(["make", "-s", "-f", str(MAKEFILE), "-C", str(tmp_path), "clean"], capture_output=True,
                         text=True, check=True).stdout
    assert not any((tmp_path / path).exists() for path in made) and not (tmp_path / "runs").exists()
    assert (tmp_path / "mine" / "pretrained" / "best.pt").read_text() == "precious"
    assert (tmp_path / "checkpoints" / "pretrained").is_symlink()
    assert (tmp_path / "checkpoints" / "notes" / "todo.txt").is_file() and (tmp_path / "checkpoints/.gitkeep").exists()
    assert "kept checkpoints/pretrained (not made by this product)" in out and "removed checkpoints/base" in out
