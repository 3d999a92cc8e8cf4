import json

import pytest
import torch

from summarizer.errors import CheckpointError, DataError
from summarizer.model import checkpoint


def test_atomic_save_keeps_last_k_and_points_at_latest(tmp_path):
    for step in (10, 20, 30):
        checkpoint.save_step({"step": step, "w": torch.ones(2) * step}, tmp_path, keep_last=2)
    assert sorted(p.name for p in tmp_path.glob("ckpt_*.pt")) == ["ckpt_00000020.pt", "ckpt_00000030.pt"]
    assert json.loads((tmp_path / "latest.json").read_text())["step"] == 30
    assert checkpoint.load(checkpoint.latest_path(tmp_path))["w"][0] == 30
    assert not list(tmp_path.glob("*.tmp"))


def test_a_checkpoint_after_a_resume_from_before_a_torn_one_is_the_one_kept(tmp_path):
    """ckpt 20 torn by a crash: the run resumed from 10 and saves 15 (a stop, or another ckpt_every) with keep_last
    1. The torn file's timeline was left: it goes, and 15 stays."""
    checkpoint.save_step({"step": 10, "w": torch.zeros(1)}, tmp_path, keep_last=1)
    (tmp_path / "ckpt_00000020.pt").write_bytes(b"half a checkpoint")
    assert checkpoint.load_latest(tmp_path)[1].name == "ckpt_00000010.pt"
    checkpoint.save_step({"step": 15, "w": torch.ones(1)}, tmp_path, keep_last=1)
    assert [p.name for p in tmp_path.glob("ckpt_*.pt")] == ["ckpt_00000015.pt"]
    assert checkpoint.load_latest(tmp_path)[0]["step"] == 15


def test_crash_while_writing_leaves_previous_loadable(tmp_path, monkeypatch):
    checkpoint.save_step({"step": 1, "w": torch.zeros(1)}, tmp_path, keep_last=2)

    def crash(obj, fh):
        fh.write(b"half a checkpoint")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(OSError):
        checkpoint.save_step({"step": 2, "w": torch.ones(1)}, tmp_path, keep_last=2)
    monkeypatch.undo()
    latest = checkpoint.latest_path(tmp_path)
    assert latest.name == "ckpt_00000001.pt" and checkpoint.load(latest)["step"] == 1


def test_pointer_to_missing_file_falls_back(tmp_path):
    checkpoint.save_step({"step": 5}, tmp_path, keep_last=3)
    (tmp_path / "latest.json").write_text(json.dumps({"checkpoint": "ckpt_gone.pt", "step": 9}))
    assert checkpoint.latest_path(tmp_path).name == "ckpt_00000005.pt"


def test_clear_errors_for_missing_corrupt_and_foreign_files(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        checkpoint.load(tmp_path / "nope.pt")
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="corrupt"):
        checkpoint.load(tmp_path / "junk.pt")
    torch.save({"format_version": 1}, tmp_path / "old.pt")  # before the recipe became the code's defaults
    with pytest.raises(CheckpointError, match="format version 1, but this code reads version 2; evaluate it with"):
        checkpoint.load(tmp_path / "old.pt")
    torch.save({"format_version": 999}, tmp_path / "future.pt")
    with pytest.raises(CheckpointError, match="format version 999"):
        checkpoint.load(tmp_path / "future.pt")


def test_rng_state_round_trip(tmp_path):
    import random

    import numpy as np
    checkpoint.save({"rng": checkpoint.rng_state()}, tmp_path / "r.pt")
    first = (random.random(), np.random.rand(), torch.rand(1).item())
    checkpoint.set_rng_state(checkpoint.load(tmp_path / "r.pt")["rng"])
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == first


def test_only_the_runs_own_gpus_random_streams_are_kept_and_restored(monkeypatch):
    """A run on cuda:1 keeps cuda:1's stream; a checkpoint holding more GPUs' streams than the resuming machine has
    (an 8-GPU node's, resumed on one GPU) restores the first ones instead of failing. The CUDA calls are recorded
    here, so the GPU branch runs on any machine."""
    got, put = [], []
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device: got.append(device) or torch.tensor([device.index]))
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device: put.append((int(state), device)))
    one = torch.device("cuda", 1)
    state = checkpoint.rng_state([one])
    assert got == [one] and [int(s) for s in state["cuda"]] == [1]
    eight = {**state, "cuda": [torch.tensor([i]) for i in range(8)]}
    checkpoint.set_rng_state(eight, [torch.device("cuda", 0)])
    assert put == [(0, torch.device("cuda", 0))]
    checkpoint.set_rng_state(eight, [])  # resumed on a CPU: the GPUs' streams are not touched
    assert put == [(0, torch.device("cuda", 0))]
    assert "cuda" not in checkpoint.rng_state([])


def test_tokenizer_mismatch_is_refused():
    checkpoint.check_tokenizer({"spm_sha256": "abc"}, {"spm_sha256": "abc"}, "run x")
    with pytest.raises(DataError, match="tokenizer mismatch"):
        checkpoint.check_tokenizer({"spm_sha256": "abc"}, {"spm_sha256": "def"}, "run x")


def test_restore_model_uses_the_checkpoints_own_config():
    from summarizer.config.load import load_config, to_dict
    from summarizer.model.transformer import Seq2Seq
    cfg = load_config(None, ["model.d_model=32", "model.ffn_dim=48", "model.encoder_layers=1"])
    model = Seq2Seq(cfg.model, 30)
    state = {"config": to_dict(cfg), "data_meta": {"vocab_size": 30}, "model": model.state_dict()}
    restored = checkpoint.restore_model(state)
    assert restored.cfg == cfg.model and len(restored.encoder_layers) == 1
    pairs = zip(restored.state_dict().values(), model.state_dict().values(), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)


def test_restoring_a_model_draws_nothing_from_the_random_stream():
    """A training run re-scores best.pt (validation.rescore_best): its dropout, drawn from the CPU's stream, must
    not change with it."""
    from summarizer.config.load import load_config, to_dict
    from summarizer.model.transformer import Seq2Seq
    cfg = load_config(None, ["model.d_model=32", "model.ffn_dim=48"])
    state = {"config": to_dict(cfg), "data_meta": {"vocab_size": 30}, "model": Seq2Seq(cfg.model, 30).state_dict()}
    before = torch.get_rng_state()
    checkpoint.restore_model(state)
    assert torch.equal(torch.get_rng_state(), before)
