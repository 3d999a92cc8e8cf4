import functools
import gzip
import json
import os
import re
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch

from summarizer import runtime
from summarizer.config.load import load_config
from summarizer.config.schema import PlacementConfig, SystemConfig
from summarizer.data.batches import PairDataset, collate
from summarizer.errors import ConfigError, DataError
from summarizer.model import checkpoint
from summarizer.model.transformer import Seq2Seq
from summarizer.runtime import move_batch
from summarizer.train import loop as train_mod
from summarizer.train import validation
from summarizer.train.optim import build_optimizer, step_if_finite
from tests.processes import train_process, wait_for

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["model.d_model=32", "model.n_heads=4", "model.encoder_layers=1", "model.decoder_layers=1",
         "model.ffn_dim=64", "data.batch_tokens=400", "data.num_workers=0", "train.log_every=5",
         "train.eval_every=20", "train.ckpt_every=20", "train.warmup_steps=10", "train.sample_summaries=1"]


# validation with ROUGE, best.pt chosen by it, and a checkpoint every 10 steps: what a resume then compares
ROUGE_EVERY_10 = ["train.eval_every=10", "train.rouge_every=10", "train.rouge_samples=8", "train.select_by=rouge",
                  "train.ckpt_every=10"]


def make_cfg(tiny_data, run_dir, *extra):
    return load_config(ROOT / "configs/tiny.yaml",
                       [f"data.dir={tiny_data}", f"run.dir={run_dir}", f"run.tensorboard_dir={run_dir}/tb",
                        *SMALL, *extra])


def train_losses(run_dir):
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [(r["step"], r["loss"]) for r in map(json.loads, lines) if r["split"] == "train"]


def test_accumulated_micro_batches_equal_one_big_batch(tiny_data):
    cfg = make_cfg(tiny_data, "unused", "model.dropout=0.0", "train.precision=fp32", "train.clip_norm=0")
    rt = runtime.setup(cfg.system, cfg.placement, cfg.train.precision)
    ds = PairDataset.from_dir(tiny_data, "train", cfg.data)
    pairs_a, pairs_b = [ds[i] for i in range(0, 5)], [ds[i] for i in range(5, 12)]
    params = []
    for micro in ([collate(pairs_a), collate(pairs_b)], [collate(pairs_a + pairs_b)]):
        micro = [move_batch(b, rt.device) for b in micro]
        torch.manual_seed(0)
        model = Seq2Seq(cfg.model, 192)
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        train_mod.train_step(model, optimizer, runtime.make_scaler(rt), micro, rt, cfg.train)
        params.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    assert torch.allclose(params[0], params[1], atol=1e-6)


@pytest.mark.parametrize("copy", [False, True])
def test_empty_rows_change_neither_the_loss_nor_the_update(tiny_data, copy):
    """data.pad_rows' empty rows (a lone EOS source, a PAD target) add nothing to the loss and so nothing to any
    gradient: a step over a filled batch updates the weights as one over the pairs alone (plain and copy models)."""
    cfg = make_cfg(tiny_data, "unused", "model.dropout=0.0", "train.precision=fp32", "train.clip_norm=0",
                   f"model.copy={str(copy).lower()}")
    rt = runtime.setup(cfg.system, cfg.placement, cfg.train.precision)
    ds = PairDataset.from_dir(tiny_data, "train", cfg.data)
    pairs = [ds[i] for i in range(6)]
    params, losses = [], []
    for fill in (0, 4000):
        batch = collate(pairs, pad_multiple=4, fill_tokens=fill)
        assert (batch["src_ids"].shape[0] > len(pairs)) == bool(fill)
        torch.manual_seed(0)
        model = Seq2Seq(cfg.model, 192)
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        out = train_mod.train_step(model, optimizer, runtime.make_scaler(rt), [move_batch(batch, rt.device)], rt,
                                   cfg.train)
        losses.append(out["loss_sum"].item())
        params.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)
    assert torch.allclose(params[0], params[1], atol=1e-6)


def test_clipping_bounds_the_update_and_logs_the_raw_norm(tiny_data):
    cfg = make_cfg(tiny_data, "unused", "model.dropout=0.0", "train.precision=fp32", "train.clip_norm=0.01")
    rt = runtime.setup(cfg.system, cfg.placement, cfg.train.precision)
    ds = PairDataset.from_dir(tiny_data, "train", cfg.data)
    torch.manual_seed(0)
    model = Seq2Seq(cfg.model, 192)
    before = torch.cat([p.detach().flatten() for p in model.parameters()])
    out = train_mod.train_step(model, torch.optim.SGD(model.parameters(), lr=1.0), runtime.make_scaler(rt),
                               [move_batch(collate([ds[i] for i in range(8)]), rt.device)], rt, cfg.train)
    after = torch.cat([p.detach().flatten() for p in model.parameters()])
    assert out["grad_norm"] > 0.01 and out["finite"]
    assert (after - before).norm() == pytest.approx(0.01, rel=1e-3)
    assert all(p.grad is None for p in model.parameters())  # zero_grad(set_to_none=True)


@pytest.mark.parametrize("fused", [True, False])
def test_non_finite_gradients_skip_the_step(tiny_data, fused):
    """The fused AdamW skips inside its kernel (told through found_inf), the per-tensor one is not called: either
    way weights, moments and step count are those of a step never taken, and the next step is the first."""
    cfg = make_cfg(tiny_data, "unused", "train.precision=fp32", f"train.fused_optimizer={str(fused).lower()}")
    rt = runtime.setup(cfg.system, cfg.placement, cfg.train.precision)
    ds = PairDataset.from_dir(tiny_data, "train", cfg.data)
    batch = move_batch(collate([ds[i] for i in range(4)]), rt.device)
    torch.manual_seed(0)
    model = Seq2Seq(cfg.model, 192)
    optimizer = build_optimizer(model, cfg.train)
    assert optimizer.defaults["fused"] == (fused or None)
    norm = model.decoder_norm.weight
    with torch.no_grad():
        norm[0] = float("nan")
    before = [p.detach().clone() for p in model.parameters()]
    out = train_mod.train_step(model, optimizer, runtime.make_scaler(rt), [batch], rt, cfg.train)
    assert not out["finite"] and not hasattr(optimizer, "found_inf")
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True) if not a.isnan().any())
    assert all(float(s["step"]) == 0 and not s["exp_avg"].any() for s in optimizer.state.values())
    with torch.no_grad():
        norm[0] = 1.0
    out = train_mod.train_step(model, optimizer, runtime.make_scaler(rt), [batch], rt, cfg.train)
    assert out["finite"] and {float(s["step"]) for s in optimizer.state.values()} == {1.0}
    assert not torch.equal(norm, before[[p is norm for p in model.parameters()].index(True)])


def test_the_flag_is_read_first_where_the_kernel_would_get_it_too_late():
    """A model split between a GPU and the CPU: its CPU half's kernel would get the flag by a non-blocking copy, so
    the flag is read first and a non-finite step never reaches the optimizer (its state is never made)."""
    weight = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.AdamW([weight], fused=True)
    weight.grad = torch.ones(3)
    step_if_finite(optimizer, torch.tensor(False), in_kernel=False)
    assert not optimizer.state and not hasattr(optimizer, "found_inf") and torch.equal(weight, torch.ones(3))
    step_if_finite(optimizer, torch.tensor(True), in_kernel=False)
    assert float(optimizer.state[weight]["step"]) == 1 and not torch.equal(weight, torch.ones(3))


def test_a_training_step_reads_nothing_back_from_the_device(tiny_data, monkeypatch):
    """The host queues step n + 1 while step n runs: train_step converts no tensor to a Python value (each such
    read waits for the device to finish everything queued). Logged steps (module statistics) and optimizers
    that are not fused read once, by design; not these. (The CPU's fast dropout draws its seed on the host: off
    here, as it is on a GPU.)"""
    cfg = make_cfg(tiny_data, "unused", "train.precision=fp32", "model.fast_dropout=false")
    rt = runtime.setup(cfg.system, cfg.placement, cfg.train.precision)
    ds = PairDataset.from_dir(tiny_data, "train", cfg.data)
    model = Seq2Seq(cfg.model, 192)
    optimizer, scaler = build_optimizer(model, cfg.train), runtime.make_scaler(rt)
    batches = [move_batch(collate([ds[i] for i in range(j, j + 4)]), rt.device) for j in (0, 4)]
    train_mod.train_step(model, optimizer, scaler, batches[:1], rt, cfg.train)  # the optimizer's state made

    def read(self, *args):
        raise AssertionError("a tensor was read back to the host")
    for name in ("__bool__", "__float__", "__int__", "__index__", "item", "tolist", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, read)
    out = train_mod.train_step(model, optimizer, scaler, batches, rt, cfg.train)
    monkeypatch.undo()
    assert out["finite"] and out["loss_sum"] > 0


@pytest.mark.parametrize("bad", [7, 10])
def test_a_skipped_step_is_named_one_step_later_and_the_run_goes_on(tiny_data, tmp_path, monkeypatch, capsys, bad):
    """The loop reads a step's finiteness once the next step is queued: step 7's NaN is reported as step 7's, with
    its own batch, the log counts it as skipped, and the run trains on to the end. The last step's is read once
    the loop ends."""
    from summarizer.train import losses
    calls = []

    def nan_once(out, *args, **kwargs):
        calls.append(1)
        loss, nll = losses.smoothed_nll(out, *args, **kwargs)
        return (loss * float("nan"), nll) if len(calls) == bad else (loss, nll)
    monkeypatch.setattr(train_mod, "smoothed_nll", nan_once)
    run = tmp_path / "run"
    train_mod.train(make_cfg(tiny_data, run, "train.max_steps=10", "train.eval_every=100", "train.rouge_every=0",
                               "train.select_by=loss"))
    log = capsys.readouterr().err
    assert re.search(rf"step {bad}: non-finite loss or gradients, step skipped \(batch \d+ of epoch 0", log), log
    assert log.count("non-finite") == 1
    rows = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["split"] == "train"]
    assert [(r["step"], r["skipped_steps"]) for r in rows] == [(5, 0), (10, 1)]


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step")
def test_repeated_non_finite_steps_abort_with_advice(tiny_data, tmp_path, monkeypatch):
    monkeypatch.setattr(train_mod, "smoothed_nll",
                        lambda out, t, src, s, fused=True: (out.logits.sum() * float("nan"),) * 2)
    with pytest.raises(train_mod.TrainingAborted, match="lower train.lr"):
        train_mod.train(make_cfg(tiny_data, tmp_path / "run", "train.max_steps=20", "train.max_bad_steps=3"))


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step")
def test_non_finite_steps_in_a_row_are_counted_across_a_resume(tiny_data, tmp_path, monkeypatch):
    """Steps 3 on have a NaN loss and 4 in a row abort: at step 6, whether or not the run stopped at step 4 (its
    checkpoint keeps the count, the last step's included) and resumed."""
    real, calls = train_mod.smoothed_nll, []

    def nan_from_step_3(out, *args, **kwargs):
        loss = real(out, *args, **kwargs)
        if out.logits.requires_grad:  # a training step, not the first-NaN search's forward nor validation
            calls.append(1)
        return tuple(x * float("nan") for x in loss) if len(calls) >= 3 and out.logits.requires_grad else loss
    monkeypatch.setattr(train_mod, "smoothed_nll", nan_from_step_3)
    steps = ["train.max_bad_steps=4", "train.ckpt_every=4", "train.eval_every=100", "train.rouge_every=0",
             "train.select_by=loss"]
    with pytest.raises(train_mod.TrainingAborted, match=r"4 optimizer steps in a row .*\(step 6;"):
        train_mod.train(make_cfg(tiny_data, tmp_path / "whole", "train.max_steps=10", *steps))
    calls.clear()
    train_mod.train(make_cfg(tiny_data, tmp_path / "resumed", "train.max_steps=4", *steps))
    with pytest.raises(train_mod.TrainingAborted, match=r"4 optimizer steps in a row .*\(step 6;"):
        train_mod.train(make_cfg(tiny_data, tmp_path / "resumed", "train.max_steps=10", *steps))


def test_checkpoint_and_validation_time_stay_out_of_the_throughput_window(tiny_data, tmp_path, monkeypatch):
    # A fake clock, so the test depends on what the window counts, never on how fast or idle the machine is:
    # each step takes 0.1 s of it, each checkpoint write and each validation 100 s.
    now = [0.0]

    def taking(seconds, fn):
        def timed(*args, **kwargs):
            now[0] += seconds
            return fn(*args, **kwargs)
        return timed

    monkeypatch.setattr(train_mod, "Window", functools.partial(train_mod.Window, clock=lambda: now[0]))
    monkeypatch.setattr(train_mod, "train_step", taking(0.1, train_mod.train_step))
    monkeypatch.setattr(checkpoint, "save_step", taking(100.0, checkpoint.save_step))
    monkeypatch.setattr(validation, "evaluate_loss", taking(100.0, validation.evaluate_loss))
    train_mod.train(make_cfg(tiny_data, tmp_path / "run", "train.max_steps=30", "train.ckpt_every=10",
                             "train.eval_every=10", "train.rouge_every=0", "train.select_by=loss"))
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    windows = {r["step"]: r["step_s"] for r in rows if r["split"] == "train"}
    assert set(windows) == {5, 10, 15, 20, 25, 30}
    assert all(step_s == pytest.approx(0.1) for step_s in windows.values()), windows


def test_sample_summaries_change_no_training_loss(tiny_data, tmp_path):
    """Samples decode in eval mode and draw nothing from the training RNG streams."""
    extra = ["train.max_steps=30", "train.eval_every=10", "train.rouge_every=0", "train.select_by=loss"]
    train_mod.train(make_cfg(tiny_data, tmp_path / "on", *extra, "train.sample_summaries=3"))
    train_mod.train(make_cfg(tiny_data, tmp_path / "off", *extra, "train.sample_summaries=0"))
    assert train_losses(tmp_path / "on") == train_losses(tmp_path / "off")


@pytest.mark.slow
def test_same_seed_same_losses_with_workers(tiny_data, tmp_path):
    extra = ["train.max_steps=15", "data.num_workers=2"]
    train_mod.train(make_cfg(tiny_data, tmp_path / "a", *extra))
    train_mod.train(make_cfg(tiny_data, tmp_path / "b", *extra))
    train_mod.train(make_cfg(tiny_data, tmp_path / "c", *extra, "train.seed=99"))
    assert train_losses(tmp_path / "a") == train_losses(tmp_path / "b")
    assert train_losses(tmp_path / "a") != train_losses(tmp_path / "c")


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_a_compiled_model_trains_as_the_eager_one_does(tiny_data, tmp_path, mode, capsys):
    """train.compile: the same losses as eager, to float rounding (fp32, no dropout), and a checkpoint that eval's
    plain model loads (the compiled wrapper's key prefix is not saved); the log says that the first step compiles
    and how long it took. reduce-overhead's CUDA graphs are a GPU's: on a CPU it compiles as default does."""
    extra = ["train.max_steps=10", "train.precision=fp32", "model.dropout=0.0", "train.eval_every=10",
             "train.ckpt_every=10", "train.rouge_every=0", "train.select_by=loss"]
    train_mod.train(make_cfg(tiny_data, tmp_path / "eager", *extra))
    train_mod.train(make_cfg(tiny_data, tmp_path / "compiled", *extra, "train.compile=true",
                             f"train.compile_mode={mode}"))
    said = capsys.readouterr().err
    assert f"torch.compile ({mode}): the first step compiles the model" in said
    assert re.search(r"^step 1: compiled and ran in \d+\.\d s$", said, re.M), said[-2000:]
    eager, compiled = train_losses(tmp_path / "eager"), train_losses(tmp_path / "compiled")
    assert [s for s, _ in eager] == [s for s, _ in compiled]
    assert all(abs(a - b) <= 1e-3 * abs(a) for (_, a), (_, b) in zip(eager, compiled, strict=True)), (eager, compiled)
    weights = checkpoint.restore_model(checkpoint.load(tmp_path / "compiled" / "best.pt")).state_dict()
    assert not any(k.startswith("_orig_mod") for k in weights)


def _launch(tiny_data, run_dir, *extra, new_session=False):
    return train_process([f"data.dir={tiny_data}", f"run.dir={run_dir}", f"run.tensorboard_dir={run_dir}/tb", *SMALL,
                          *extra], new_session)


@pytest.mark.slow
@pytest.mark.parametrize("sampling", [[], ["data.subword_alpha=0.2", "data.num_workers=2"]])
def test_resume_after_sigkill_logs_exactly_the_uninterrupted_losses(tiny_data, tmp_path, sampling):
    """With or without sampled segmentations (drawn per seed, epoch and pair, in worker processes)."""
    extra = ["train.max_steps=80", "train.ckpt_every=20", "train.eval_every=40", "train.ema_decay=0.95", *sampling]
    reference = _launch(tiny_data, tmp_path / "ref", *extra)
    assert reference.wait(timeout=600) == 0
    killed = _launch(tiny_data, tmp_path / "killed", *extra)
    wait_for(tmp_path / "killed" / "ckpt_00000040.pt", killed)
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    assert not (tmp_path / "killed" / "ckpt_00000080.pt").exists(), "the run finished before the kill"
    resumed = _launch(tiny_data, tmp_path / "killed", *extra)
    assert resumed.wait(timeout=600) == 0, resumed.stdout.read().decode()[-2000:]
    assert train_losses(tmp_path / "killed") == train_losses(tmp_path / "ref")
    assert [s for s, _ in train_losses(tmp_path / "ref")] == list(range(5, 81, 5))
    final = [torch.load(tmp_path / run / "ckpt_00000080.pt", weights_only=True) for run in ("ref", "killed")]
    for key in ("model", "ema"):  # the weights and their moving average resume exactly too
        assert all(torch.equal(a, b) for a, b in zip(final[0][key].values(), final[1][key].values(), strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("sig, workers", [(signal.SIGTERM, 0), (signal.SIGINT, 2), (signal.SIGTERM, 2)])
def test_signal_to_the_process_group_checkpoints_then_exits_as_interrupted(tiny_data, tmp_path, sig, workers):
    # Ctrl-C and batch schedulers signal every process of the group, DataLoader workers included. The run
    # checkpoints, says how to resume, and exits 128 + signal (130, 143) so scripts do not go on as if it finished.
    proc = _launch(tiny_data, tmp_path / "run", "train.max_steps=100000", "train.ckpt_every=100000",
                   "train.eval_every=100000", f"data.num_workers={workers}", new_session=True)
    wait_for(tmp_path / "run" / "metrics.jsonl", proc)
    os.killpg(proc.pid, sig)
    assert proc.wait(timeout=600) == 128 + sig, proc.stdout.read().decode()[-2000:]
    output = proc.stdout.read().decode()
    assert f"stopped by {signal.Signals(sig).name}" in output and "again to resume" in output
    # stderr is a pipe, not a terminal: one line per log interval, no progress bar's carriage returns
    assert "\r" not in output and "step 5/100000 train loss" in output
    pointer = json.loads((tmp_path / "run" / "latest.json").read_text())
    assert pointer["step"] >= 5 and (tmp_path / "run" / pointer["checkpoint"]).exists()


def test_a_worker_that_dies_handing_over_a_batch_is_a_dead_worker_too(tiny_data, tmp_path, monkeypatch):
    """A worker killed while its batch's file descriptors are in transit breaks the connection before the loader
    notices the exit: the same checkpoint and the same message as the loader's own error, not a traceback."""
    from summarizer.train import guard
    opened = train_mod.open_session

    def breaking(cfg):
        session = opened(cfg)
        stream = session.stream

        def batches():
            for i, item in enumerate(stream):
                if i == 6:
                    raise ConnectionResetError(104, "Connection reset by peer")
                yield item
        session.stream = batches()
        return session
    monkeypatch.setattr(train_mod, "open_session", breaking)
    cfg = make_cfg(tiny_data, tmp_path / "run", "train.max_steps=100", "data.num_workers=1")
    with pytest.raises(guard.TrainingAborted, match="died while handing over a batch.*ConnectionResetError"):
        train_mod.train(cfg)
    assert json.loads((tmp_path / "run" / "latest.json").read_text())["step"] == 6


def test_a_worker_that_dies_while_a_step_is_logged_is_a_dead_worker_too(tiny_data, tmp_path, monkeypatch):
    """SIGCHLD comes whenever a worker dies, and the DataLoader's handler raises wherever the main thread is: one
    that comes while a step is logged (or validated, or checkpointed) is acted on at the next fetch, as one that
    comes during the step: the checkpoint, the message, no traceback."""
    from summarizer.train import guard
    logged = train_mod.after_step

    def killing(session, loop, out, time_up):
        if session.progress["step"] == 6:
            os.kill(session.train_loader._iterator._workers[0].pid, signal.SIGKILL)
            time.sleep(0.5)  # SIGCHLD arrives here (not reaped: the DataLoader's handler must see the worker)
        return logged(session, loop, out, time_up)
    monkeypatch.setattr(train_mod, "after_step", killing)
    cfg = make_cfg(tiny_data, tmp_path / "run", "train.max_steps=100", "data.num_workers=2")
    with pytest.raises(guard.TrainingAborted, match="DataLoader worker .* is killed by signal"):
        train_mod.train(cfg)
    assert json.loads((tmp_path / "run" / "latest.json").read_text())["step"] == 6


def _children(pid: int) -> list[int]:
    tasks = Path(f"/proc/{pid}/task")
    return [int(c) for t in tasks.iterdir() for c in (t / "children").read_text().split()]


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs /proc to find the worker processes")
def test_a_worker_killed_by_sigkill_checkpoints_and_exits_instead_of_hanging(tiny_data, tmp_path):
    """What the OOM killer does to a DataLoader worker: the run writes a checkpoint of its last completed step,
    says what happened and what to do, and exits non-zero promptly (it used to wait forever at exit)."""
    proc = _launch(tiny_data, tmp_path / "run", "train.max_steps=100000", "train.ckpt_every=100000",
                   "train.eval_every=100000", "data.num_workers=2", "data.persistent_workers=true")
    wait_for(tmp_path / "run" / "metrics.jsonl", proc)
    workers = _children(proc.pid)
    assert len(workers) >= 2, workers
    os.kill(workers[0], signal.SIGKILL)
    rc = proc.wait(timeout=120)  # the bug was a hang: a wait with a bound is the test
    output = proc.stdout.read().decode()
    assert rc == 2, output[-2000:]
    assert "DataLoader worker" in output and "out-of-memory killer" in output and "resume" in output
    assert "Traceback" not in output
    pointer = json.loads((tmp_path / "run" / "latest.json").read_text())
    assert pointer["step"] >= 5 and (tmp_path / "run" / pointer["checkpoint"]).exists()
    assert not [c for c in workers[1:] if Path(f"/proc/{c}").exists()
                and Path(f"/proc/{c}/stat").read_text().split()[2] != "Z"]  # no worker left behind


def test_a_run_dir_is_locked_while_its_run_lives(tmp_path, capsys):
    from summarizer.errors import ConfigError
    from summarizer.outputs import hold_lock, release_lock
    held = hold_lock(tmp_path, "run.dir")
    with pytest.raises(ConfigError, match=rf"in use by process {os.getpid()} on .*start another run"):
        hold_lock(tmp_path, "run.dir")
    held.close()  # the run ended (any exit closes it): the dir is free again
    hold_lock(tmp_path, "run.dir").close()
    (tmp_path / ".lock").write_text(f"process 999999999 on {os.uname().nodename} since 2026-01-01 00:00:00\n")
    hold_lock(tmp_path, "run.dir").close()  # a dead holder's lock is taken over, with a note
    assert "no longer running; taking it over" in capsys.readouterr().out
    (tmp_path / ".lock").write_text(f"process 999999999 on {os.uname().nodename} since 2026-01-01 00:00:00\n")
    release_lock(hold_lock(tmp_path, "run.dir"))  # a run that ends cleanly leaves no holder named ...
    capsys.readouterr()
    hold_lock(tmp_path, "run.dir").close()  # ... so the next run has nothing to take over
    assert "taking it over" not in capsys.readouterr().out


@pytest.mark.slow
def test_a_second_training_on_a_running_run_dir_is_refused(tiny_data, tmp_path):
    first = _launch(tiny_data, tmp_path / "run", "train.max_steps=100000", "train.ckpt_every=100000",
                    "train.eval_every=100000")
    try:
        wait_for(tmp_path / "run" / "metrics.jsonl", first)
        second = _launch(tiny_data, tmp_path / "run", "train.max_steps=100000", "train.lr=0.002")
        assert second.wait(timeout=300) == 2
        output = second.stdout.read().decode()
        assert f"in use by process {first.pid}" in output and "Traceback" not in output
    finally:
        first.terminate()
        first.wait(timeout=300)


def test_runs_sharing_a_name_do_not_share_tensorboard_curves(tiny_data, tmp_path):
    from summarizer.errors import ConfigError
    train_mod.train(make_cfg(tiny_data, tmp_path / "a", "train.max_steps=2", f"run.tensorboard_dir={tmp_path}/tb"))
    with pytest.raises(ConfigError, match="holds the events of run .*/a, not of .*/b: give this run its own run.name"):
        train_mod.train(make_cfg(tiny_data, tmp_path / "b", "train.max_steps=2", f"run.tensorboard_dir={tmp_path}/tb"))
    # refused, it let go of its run dir: the same process trains it with a dir of its own
    assert train_mod.train(make_cfg(tiny_data, tmp_path / "b", "train.max_steps=2",
                                    f"run.tensorboard_dir={tmp_path}/tb_b"))["steps"] == 2


def test_a_run_killed_before_its_first_checkpoint_leaves_no_curve_past_what_its_restart_logs(tiny_data, tmp_path):
    """Its restart starts at step 0: TensorBoard purges every step the killed run logged, as metrics.jsonl is
    emptied, so the curves show the restart's steps alone."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    run = tmp_path / "run"
    train_mod.train(make_cfg(tiny_data, run, "train.max_steps=20", "train.log_every=5", "train.ckpt_every=100"))
    for written in [*run.glob("ckpt_*.pt"), run / checkpoint.LATEST, run / checkpoint.BEST]:
        written.unlink()  # as if killed at step 20, before any checkpoint
    train_mod.train(make_cfg(tiny_data, run, "train.max_steps=10", "train.log_every=5", "train.ckpt_every=100"))
    events = EventAccumulator(str(run / "tb" / "tiny")).Reload()  # every events file of the run's dir, in order
    assert [e.step for e in events.Scalars("train/loss")] == [5, 10]
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()
            if json.loads(line)["split"] == "train"] == [5, 10]


def test_resuming_on_data_with_another_tokenizer_is_refused(tiny_data, tmp_path):
    from data_prep.__main__ import main as prep
    run = tmp_path / "run"
    train_mod.train(make_cfg(tiny_data, run, "train.max_steps=5"))
    other = tmp_path / "other"
    assert prep(["--config", str(ROOT / "configs/tiny.yaml"), f"data.dir={other}", "data.vocab_size=120"]) == 0
    cfg = make_cfg(tiny_data, run, "train.max_steps=10")
    cfg.data.dir, cfg.data.vocab_size = str(other), 120
    with pytest.raises(DataError, match="tokenizer mismatch"):
        train_mod.train(cfg)


def test_a_run_resumes_only_with_the_number_of_processes_it_trained_with(tiny_data, tmp_path):
    """Its data position counts each rank's batches: a run of 2 processes resumed by 1 would train half of what
    they trained again."""
    from summarizer.errors import ConfigError
    run = tmp_path / "run"
    train_mod.train(make_cfg(tiny_data, run, "train.max_steps=5"))
    path = run / "ckpt_00000005.pt"
    state = torch.load(path, weights_only=False)
    assert state["progress"]["world_size"] == 1
    state["progress"]["world_size"] = 2
    torch.save(state, path)
    with pytest.raises(ConfigError, match="trained in 2 process.*--nproc_per_node=2"):
        train_mod.train(make_cfg(tiny_data, run, "train.max_steps=10"))


def test_run_dir_records_config_manifest_and_tensorboard(tiny_data, tmp_path):
    train_mod.train(make_cfg(tiny_data, tmp_path / "run", "train.max_steps=10", "train.profile_steps=2"))
    run = tmp_path / "run"
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["torch"] == torch.__version__ and manifest["seed"] == 1234 and manifest["data"]["spm_sha256"]
    assert load_config(run / "config.yaml").train.max_steps == 10
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for key in ("step", "split", "loss", "lr", "grad_norm", "tokens_per_s"):
        assert all(key in r for r in records)
    assert {r["split"] for r in records} == {"train", "valid"}
    train = [r for r in records if r["split"] == "train"]
    assert all(0 < r["memory_mb"] <= r["peak_memory_mb"] for r in train)
    assert list((run / "tb" / "tiny").glob("events.out.tfevents.*"))
    assert (run / "profile.txt").read_text().strip() and list((run / "tb" / "tiny" / "profile").glob("*.json*"))


def test_a_resumed_run_profiles_the_steps_after_its_resume(tiny_data, tmp_path):
    """train.profile_steps counts from where the process starts: a run resumed at step 6 profiles steps 9-10 (after
    one wait and one warm-up step), and profile.json says what each cost."""
    run = tmp_path / "run"
    train_mod.train(make_cfg(tiny_data, run, "train.max_steps=6", "train.ckpt_every=6"))
    assert not (run / "profile.json").exists()
    train_mod.train(make_cfg(tiny_data, run, "train.max_steps=12", "train.ckpt_every=6", "train.profile_steps=2"))
    figures = json.loads((run / "profile.json").read_text())
    assert figures["steps"] == 2 and figures["wall_ms"] > 0 and figures["host_reads"] >= 0
    assert "aten::" in (run / "profile.txt").read_text()


def test_profile_after_moves_the_profiled_window(tiny_data, tmp_path):
    """train.profile_after: the steps of the process before the warm-up step and the profiled ones, so a profile can
    see a run past its first shapes: 5 steps, a warm-up, then steps 7-8 in the trace."""
    run = tmp_path / "run"
    train_mod.train(make_cfg(tiny_data, run, "train.max_steps=9", "train.profile_steps=2", "train.profile_after=5"))
    trace = next((run / "tb" / "tiny" / "profile").glob("*.json*"))
    opened = gzip.open(trace, "rt") if trace.suffix == ".gz" else trace.open()
    with opened as f:
        names = {e["name"] for e in json.load(f)["traceEvents"] if e.get("name", "").startswith("ProfilerStep#")}
    assert names == {"ProfilerStep#6", "ProfilerStep#7"}, names  # torch numbers steps from 0: the 7th and 8th
    assert json.loads((run / "profile.json").read_text())["steps"] == 2


@pytest.mark.slow
def test_an_overfit_check_stopped_by_a_signal_gives_no_verdict(tiny_data, tmp_path, monkeypatch, capsys):
    """A half-trained model would pass or fail for nothing: the check exits as stopped (128 + signal)."""
    from summarizer import overfit
    monkeypatch.setattr(overfit, "train", lambda cfg: {"signal": 15, "steps": 3})
    monkeypatch.setattr(overfit, "load_model", lambda *a: pytest.fail("scored a stopped run"))
    cfg = load_config(ROOT / "configs/overfit.yaml", [f"data.dir={tiny_data}", f"run.dir={tmp_path / 'run'}"])
    assert overfit.overfit_check(cfg) == 143
    assert "no verdict" in capsys.readouterr().err


def test_overfit_check_memorises_the_fixture(tiny_data, tmp_path, capsys):
    from summarizer.overfit import overfit_check
    cfg = load_config(ROOT / "configs/overfit.yaml", [f"data.dir={tiny_data}", f"run.dir={tmp_path / 'of'}",
                                                      f"run.tensorboard_dir={tmp_path / 'tb'}"])
    assert overfit_check(cfg) == 0, capsys.readouterr().out
    assert "PASSED" in capsys.readouterr().out


def test_a_run_resumed_with_other_rouge_settings_scores_its_best_again_with_them(tiny_data, tmp_path, capsys):
    """best.pt's validation ROUGE, measured with eval.max_len=30, is not what later validations with 4 measure:
    resumed so, the run decodes best.pt again with the new settings before it compares."""
    rouge = [*ROUGE_EVERY_10, "eval.min_len=2"]
    run, short = tmp_path / "run", ["eval.max_len=4"]
    train_mod.train(make_cfg(tiny_data, run, "train.max_steps=10", "eval.max_len=30", *rouge))
    capsys.readouterr()
    summary = train_mod.train(make_cfg(tiny_data, run, "train.max_steps=20", *short, *rouge))
    err = capsys.readouterr().err
    said = re.search(r"best.pt \(ROUGE-1 ([\d.]+)\) was scored with other settings \(eval.max_len 30 -> 4\): ([\d.]+) "
                     r"with these", err)
    assert said, err
    # the same weights scored with max_len 4 from the start: a run that trained its first 10 steps so
    alike = tmp_path / "alike"
    train_mod.train(make_cfg(tiny_data, alike, "train.max_steps=10", *short, *rouge))
    at_10 = [json.loads(line) for line in (alike / "metrics.jsonl").read_text().splitlines()
             if json.loads(line)["split"] == "valid"][0]["rouge1"]
    assert float(said.group(2)) == pytest.approx(at_10, abs=1e-4) and float(said.group(1)) != float(said.group(2))
    at_20 = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()
             if json.loads(line)["split"] == "valid" and json.loads(line)["step"] == 20][-1]["rouge1"]
    assert summary["best"]["value"] == pytest.approx(max(at_10, at_20), abs=1e-4)
    assert summary["best"]["settings"]["eval.max_len"] == 4
    # the record says what each ROUGE was measured under, and best.pt's step and ROUGE re-measured
    valid = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()
             if json.loads(line)["split"] == "valid"]
    assert [r["rouge_settings"]["eval.max_len"] for r in valid] == [30, 4]
    assert valid[1]["best_step"] == 10 and valid[1]["best_rouge1"] == pytest.approx(float(said.group(2)), abs=1e-4)


def test_a_run_records_the_keys_only_prep_reads_as_its_data_was_prepared(tiny_data, tmp_path, capsys):
    """data.max_source_words and the SentencePiece keys change nothing once the data is prepared: the run's
    config says what its data was made with, and the run says where the command line said otherwise."""
    from summarizer.data.prepared import read_meta
    made = read_meta(tiny_data)["settings"]
    run = tmp_path / "run"
    train_mod.train(make_cfg(tiny_data, run, "train.max_steps=2", "train.eval_every=2", "train.rouge_every=0",
                             "train.select_by=loss", f"data.max_source_words={made['max_source_words'] + 7}",
                             "data.spm_model_type=bpe"))
    err = capsys.readouterr().err
    assert f"data.max_source_words {made['max_source_words'] + 7} -> {made['max_source_words']}" in err
    assert f"data.spm_model_type 'bpe' -> {made['spm_model_type']!r}" in err
    recorded = load_config(run / "config.yaml").data
    assert (recorded.max_source_words, recorded.spm_model_type) == (made["max_source_words"], made["spm_model_type"])


def test_a_run_on_data_prepared_before_meta_recorded_its_settings_may_not_change_them_on_resume(tiny_data, tmp_path):
    """Without meta.json's record of them, the keys only prep reads cannot be taken from the data: a changed one
    would be recorded as if it had applied. Refused on resume, as every key that shapes the data."""
    data = tmp_path / "data"
    shutil.copytree(tiny_data, data)
    meta = json.loads((data / "meta.json").read_text())
    del meta["settings"]
    (data / "meta.json").write_text(json.dumps(meta))
    run, few = tmp_path / "run", ["train.eval_every=2", "train.rouge_every=0", "train.select_by=loss"]
    train_mod.train(make_cfg(data, run, "train.max_steps=2", *few))
    with pytest.raises(ConfigError, match=r"data.max_source_words: 120 in the checkpoint, 7 now"):
        train_mod.train(make_cfg(data, run, "train.max_steps=4", "data.max_source_words=7", *few))
    assert train_mod.train(make_cfg(data, run, "train.max_steps=4", *few))["steps"] == 4


def test_a_run_resumed_in_another_precision_scores_its_best_again_in_it(tiny_data, tmp_path, capsys):
    """Validation decodes in the run's precision, which may change on resume: best.pt is decoded again in it."""
    rouge = ROUGE_EVERY_10
    run = tmp_path / "run"
    train_mod.train(make_cfg(tiny_data, run, "train.max_steps=10", "train.precision=fp32", *rouge))
    capsys.readouterr()
    summary = train_mod.train(make_cfg(tiny_data, run, "train.max_steps=20", "train.precision=bf16", *rouge))
    assert "was scored with other settings (precision 'fp32' -> 'bf16')" in capsys.readouterr().err
    assert summary["best"]["settings"]["precision"] == "bf16"


def test_rouge_during_training_selects_the_best_checkpoint(tiny_data, tmp_path):
    run = tmp_path / "run"
    summary = train_mod.train(make_cfg(tiny_data, run, "train.max_steps=20", "train.eval_every=5",
                                       "train.rouge_every=10", "train.rouge_samples=8", "train.select_by=rouge"))
    valid = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()
             if json.loads(line)["split"] == "valid"]
    with_rouge = [r for r in valid if "rouge1" in r]
    assert [r["step"] for r in with_rouge] == [10, 20] and [r["step"] for r in valid] == [5, 10, 15, 20]
    assert summary["best"]["metric"] == "rouge1"  # the metric's own name and sign
    assert summary["best"]["value"] == pytest.approx(max(r["rouge1"] for r in with_rouge), abs=1e-5)  # logs round
    assert (run / "best.pt").exists()


def test_best_checkpoint_holds_the_moving_average_of_the_weights(tiny_data, tmp_path):
    run = tmp_path / "run"
    train_mod.train(make_cfg(tiny_data, run, "train.max_steps=20", "train.eval_every=20", "train.ckpt_every=20",
                             "train.rouge_every=0", "train.select_by=loss", "train.ema_decay=0.9"))
    best, step = torch.load(run / "best.pt", weights_only=True), torch.load(run / "ckpt_00000020.pt", weights_only=True)
    assert best["step"] == 20 and "optimizer" not in best
    assert int(step["ema"]["n_averaged"]) == 20
    for name, tensor in best["model"].items():
        assert torch.equal(tensor, step["ema"][f"module.{name}"])  # what validation scored
    assert any(not torch.equal(best["model"][k], step["model"][k]) for k in best["model"])  # not the raw weights


def test_resume_trims_a_torn_last_line_of_metrics(tiny_data, tmp_path, capsys):
    """A full disk during an append leaves half a record; the resume drops it (saying so) instead of failing."""
    run = tmp_path / "run"
    train_mod.train(make_cfg(tiny_data, run, "train.max_steps=10", "train.ckpt_every=10"))
    with open(run / "metrics.jsonl", "a") as fh:
        fh.write('{"step": 41, "split"')
    train_mod.train(make_cfg(tiny_data, run, "train.max_steps=15"))
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert max(r["step"] for r in records) == 15
    assert "1 torn line(s)" in capsys.readouterr().err


def test_a_checkpoint_half_written_when_the_run_was_killed_is_removed_when_it_resumes(tiny_data, tmp_path):
    """SIGKILL during a checkpoint's write skips the temp file's removal: the run's next start removes it (a model
    and its optimizer moments each time), and nothing of another name."""
    run = tmp_path / "run"
    train_mod.train(make_cfg(tiny_data, run, "train.max_steps=5", "train.ckpt_every=5"))
    left = [run / "ckpt_00000010.pt.4242.tmp", run / "best.pt.4242.tmp"]
    kept = [run / "notes.tmp", run / "predictions.txt.4242.tmp"]  # not a checkpoint: another program's, or eval's
    for path in left + kept:
        path.write_bytes(b"half")
    train_mod.train(make_cfg(tiny_data, run, "train.max_steps=10", "train.ckpt_every=5"))
    assert not any(path.exists() for path in left) and all(path.exists() for path in kept)


def test_data_without_a_valid_split_is_refused_not_validated_on_train(tmp_path):
    """Otherwise validation, and the choice of best.pt, would measure the training pairs labelled valid."""
    from data_prep.__main__ import main as prep
    data = tmp_path / "data"
    assert prep(["--config", str(ROOT / "configs/tiny.yaml"), f"data.dir={data}", "data.splits={train: [train]}"]) == 0
    with pytest.raises(DataError, match="no valid split.*data.valid_holdout=500"):
        train_mod.train(make_cfg(data, tmp_path / "run", "train.max_steps=2"))


def test_a_moving_average_longer_than_the_run_is_warned_about(tiny_data, tmp_path, capsys):
    train_mod.train(make_cfg(tiny_data, tmp_path / "run", "train.max_steps=4", "train.ema_decay=0.999"))
    assert "averages the weights over about 1000 steps, but this run has 4" in capsys.readouterr().err
    train_mod.train(make_cfg(tiny_data, tmp_path / "run2", "train.max_steps=4", "train.ema_decay=0.2"))
    assert "averages the weights" not in capsys.readouterr().err


def test_data_settings_that_contradict_the_prepared_data_are_refused(tiny_data, tmp_path):
    with pytest.raises(ConfigError, match=r"data.lowercase=False \(prepared with True\).*contradicts the prepared"):
        train_mod.train(make_cfg(tiny_data, tmp_path / "run", "data.lowercase=false", "data.vocab_size=160"))
    assert not (tmp_path / "run" / "config.yaml").exists()  # nothing recorded as if it had been used


def test_the_first_non_finite_value_is_named_by_module(tiny_data, tmp_path, monkeypatch):
    """An injected fault: one feed-forward block's output turns NaN. The step is skipped, the log names the module
    and the batch's place in the data order, and the abort (max_bad_steps) repeats it."""
    from summarizer.train import session as session_mod
    from summarizer.train.loop import TrainingAborted
    build = session_mod.build

    def poisoned(*args, **kwargs):
        model, optimizer, scaler = build(*args, **kwargs)
        model.decoder_layers[-1].ffn.register_forward_hook(lambda m, i, out: out * float("nan"))
        return model, optimizer, scaler
    monkeypatch.setattr(session_mod, "build", poisoned)
    run = tmp_path / "run"
    with pytest.raises(TrainingAborted, match=r"the first NaN/inf: decoder_layers\.\d\.ffn \(forward: its output\)"):
        train_mod.train(make_cfg(tiny_data, run, "train.max_steps=5", "train.max_bad_steps=2"))
    assert not (run / "latest.json").exists()  # nothing trained, nothing written as if it had


def test_a_nan_gradient_is_traced_to_its_module_in_backward():
    from summarizer.config.schema import Config, ModelConfig
    from summarizer.model.transformer import Seq2Seq
    from summarizer.train.watch.nonfinite import first_nonfinite
    model = Seq2Seq(ModelConfig(d_model=16, n_heads=2, encoder_layers=1, decoder_layers=1, ffn_dim=32), 30)
    def poison(module, inputs, output):  # the gradient reaching the encoder's first layer's output turns NaN
        output.register_hook(lambda grad: grad * float("nan"))
    model.encoder_layers[0].register_forward_hook(poison)
    src, tgt = torch.randint(4, 30, (2, 6)), torch.randint(4, 30, (2, 5))
    batch = {"src_ids": src, "tgt_in": tgt[:, :-1], "tgt_out": tgt[:, 1:]}
    rt = runtime.setup(SystemConfig(device="cpu"), PlacementConfig(), "fp32")
    where = first_nonfinite(model, [batch], rt, Config().train)
    assert where == "encoder_layers.0 (backward: the gradient of its output)"
    assert all(p.grad is None for p in model.parameters())  # nothing left behind for the optimizer

    class ThroughDDP(torch.nn.Module):  # what DDP is to the loop: the model as `module`, collectives in between
        def __init__(self, module):
            super().__init__()
            self.module = module

        def forward(self, *args):
            raise AssertionError("re-run through DDP: its all-reduces would pair with other ranks' other buckets")

    assert first_nonfinite(ThroughDDP(model), [batch], rt, Config().train) == where


def test_denoising_examples_are_masked_in_training_and_resume_exactly(tmp_path, monkeypatch):
    """Unpaired sentences in the train split: their sources reach the model masked (and only theirs), drawn per
    (seed, epoch, pair), so a run resumed from a checkpoint logs the losses of an uninterrupted one."""
    from data_prep import prepare
    from summarizer.data import noise
    records = [json.loads(line) for line in (ROOT / "tests/assets/tiny/train.jsonl").read_text().splitlines()]
    text = tmp_path / "text.jsonl"
    text.write_text("".join(json.dumps({"text": r["source"]}) + "\n" for r in records[:150]))
    data = load_config(ROOT / "configs/tiny.yaml", [f"data.dir={tmp_path / 'data'}", "data.source_tag=tiny"]).data
    data.source = {split: [{"path": str(ROOT / f"tests/assets/tiny/{split}.jsonl"), "tag": "tiny"}]
                   for split in ("train", "valid", "test")}
    data.source["train"].append({"path": str(text), "unpaired": True, "tag": "text"})
    assert prepare(data)["unpaired_tags"] == ["text"]
    masked = []
    real = noise.SpanMasker.pair
    monkeypatch.setattr(noise.SpanMasker, "pair", lambda self, *a: masked.append(a[3]) or real(self, *a))
    extra = [f"data.source={json.dumps(data.source)}", "data.source_tag=tiny", "data.source_weights={text: 0.5}",
             "train.eval_every=10", "train.ckpt_every=10"]
    train_mod.train(make_cfg(tmp_path / "data", tmp_path / "ref", *extra, "train.max_steps=20"))
    assert masked and all(i >= 300 for i in masked)  # the 150 sentences follow the 300 pairs
    train_mod.train(make_cfg(tmp_path / "data", tmp_path / "resumed", *extra, "train.max_steps=10"))
    train_mod.train(make_cfg(tmp_path / "data", tmp_path / "resumed", *extra, "train.max_steps=20"))
    assert train_losses(tmp_path / "resumed") == train_losses(tmp_path / "ref")


def test_init_from_starts_a_new_run_from_a_checkpoints_weights_with_a_fresh_optimizer(tiny_data, tmp_path):
    """train.init_from: a new run's model starts as the checkpoint's (dropout may differ), its optimizer and
    schedule from step 0; a resumed run ignores it; another model or a missing file is refused by name."""
    from summarizer.model import checkpoint
    from summarizer.train.session import initial_weights
    train_mod.train(make_cfg(tiny_data, tmp_path / "pre", "train.max_steps=20", "train.ema_decay=0"))
    pre = tmp_path / "pre" / "ckpt_00000020.pt"
    extra = [f"train.init_from={pre}", "train.max_steps=5", "train.log_every=1", "train.lr=1e-9", "train.ema_decay=0"]
    train_mod.train(make_cfg(tiny_data, tmp_path / "tuned", *extra, "model.dropout=0.3"))
    train_mod.train(make_cfg(tiny_data, tmp_path / "fresh", *extra[1:]))
    tuned, fresh = train_losses(tmp_path / "tuned"), train_losses(tmp_path / "fresh")
    assert [s for s, _ in tuned] == [1, 2, 3, 4, 5]  # its own steps, from 0
    assert tuned[0][1] < fresh[0][1] - 0.5  # it starts where the checkpoint was
    state = checkpoint.load(tmp_path / "tuned" / "ckpt_00000005.pt")
    assert state["optimizer"]["state"][0]["step"].item() == 5  # a fresh AdamW: its own five steps
    weights = checkpoint.load(pre)["model"]
    assert all(torch.allclose(state["model"][k].float(), v.float(), atol=1e-5) for k, v in weights.items())
    # Resumed, the run goes on from its own checkpoint (another init_from, even a missing one, is not read).
    train_mod.train(make_cfg(tiny_data, tmp_path / "tuned", *extra[1:], "train.init_from=/nowhere.pt",
                             "model.dropout=0.3", "train.max_steps=6"))
    assert [s for s, _ in train_losses(tmp_path / "tuned")] == [1, 2, 3, 4, 5, 6]
    with pytest.raises(ConfigError, match="does not exist: train the run that writes it first"):
        train_mod.train(make_cfg(tiny_data, tmp_path / "x", "train.init_from=/nowhere.pt"))
    assert not (tmp_path / "x").exists()  # refused before the run dir was claimed
    meta = json.loads((tiny_data / "meta.json").read_text())
    with pytest.raises(ConfigError, match=r"another model than this run's model.\* settings"):
        initial_weights(make_cfg(tiny_data, tmp_path / "x", f"train.init_from={pre}", "model.ffn_dim=48"), meta)


def test_each_log_interval_reports_its_own_peak_memory(monkeypatch):
    """A peak since the process began would show a validation's (or the precision probe's fp32 steps') forever."""
    from summarizer.train.watch.monitor import peak_memory_mb, reset_peak_memory
    cpu = torch.device("cpu")
    big = torch.ones(256 * 2**18)  # 256 MiB, touched
    del big
    before = peak_memory_mb(cpu)
    reset_peak_memory(cpu)
    assert peak_memory_mb(cpu) < before - 200
    reset = []
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", reset.append)
    reset_peak_memory(torch.device("cuda", 1))
    assert reset == [torch.device("cuda", 1)]


def test_a_validation_worker_that_dies_during_validation_is_a_dead_worker_too(tiny_data, tmp_path, monkeypatch):
    """The validation loader's workers die as the training loader's do (the out-of-memory killer): during a
    validation that is the same checkpoint and message, not a traceback."""
    from summarizer.train import guard
    measured = validation.evaluate_loss

    class Killing:
        """The validation loader, one of whose workers is killed after its first batch."""
        def __init__(self, loader):
            self.loader = loader

        def __len__(self):
            return len(self.loader)

        def __iter__(self):
            for i, batch in enumerate(self.loader):
                if i == 1:
                    os.kill(self.loader._iterator._workers[0].pid, signal.SIGKILL)
                yield batch

    def killing(model, loader, *args):
        return measured(model, Killing(loader), *args)
    monkeypatch.setattr(validation, "evaluate_loss", killing)
    cfg = make_cfg(tiny_data, tmp_path / "run", "train.max_steps=100", "train.eval_every=6", "data.num_workers=2",
                   "data.batch_tokens=200", "train.rouge_every=0", "train.select_by=loss")
    with pytest.raises(guard.TrainingAborted, match="DataLoader worker"):
        train_mod.train(cfg)
    assert json.loads((tmp_path / "run" / "latest.json").read_text())["step"] == 6


def test_a_resume_may_change_the_precision_and_the_fused_optimizer(tiny_data, tmp_path):
    """Both are resume-time settings: a scaler saved disabled (fp32) leaves an fp16 resume's scaler fresh, and the
    optimizer keeps this run's kernel (fused or not) with the checkpoint's moments."""
    run, steps = tmp_path / "run", iter(range(4, 20, 4))

    def resume(*settings):
        step = next(steps)
        cfg = make_cfg(tiny_data, run, f"train.max_steps={step}", "train.ckpt_every=4", "train.eval_every=4",
                       "train.ema_decay=0", *settings)
        assert train_mod.train(cfg)["steps"] == step
        return torch.load(run / f"ckpt_{step:08d}.pt", weights_only=False)

    resume("train.precision=fp32", "train.fused_optimizer=true")
    saved = resume("train.precision=fp16", "train.fused_optimizer=false")
    assert saved["scaler"]["scale"] > 0 and not any(g.get("fused") for g in saved["optimizer"]["param_groups"])
    saved = resume("train.precision=fp16", "train.fused_optimizer=true")
    assert all(g["fused"] for g in saved["optimizer"]["param_groups"])
    assert all(s["step"] == 12 for s in saved["optimizer"]["state"].values())  # the moments went on, not anew


def test_the_loss_pass_checks_for_a_stop_as_often_on_every_rank(tiny_data, tmp_path, monkeypatch):
    """validation.evaluate_loss calls its `check` every CHECK_EVERY batches, and as many times as the longest
    rank's share needs (a shorter share pads its checks: under DDP each is a collective); a stop at a check
    abandons the pass."""
    from summarizer.train.guard import StopRequested
    from summarizer.train.session import open_session
    monkeypatch.setattr(validation, "CHECK_EVERY", 2)
    session = open_session(make_cfg(tiny_data, tmp_path / "run", "data.batch_tokens=200"))
    try:
        n = len(session.valid_loader)
        assert n >= 4
        calls = []
        loss = validation.evaluate_loss(session.eval_model, session.valid_loader, session.rt,
                                        check=lambda: calls.append(1))
        assert len(calls) == n // 2
        assert loss == validation.evaluate_loss(session.eval_model, session.valid_loader, session.rt)
        monkeypatch.setattr(validation.runtime, "all_gather_object", lambda value, rt: [value, value + 5])
        calls.clear()
        validation.evaluate_loss(session.eval_model, session.valid_loader, session.rt, check=lambda: calls.append(1))
        assert len(calls) == (n + 5) // 2  # another rank's share is 5 batches longer

        def stop():
            raise StopRequested
        with pytest.raises(StopRequested):
            validation.evaluate_loss(session.eval_model, session.valid_loader, session.rt, check=stop)
    finally:
        session.close()


def test_each_row_logs_the_learning_rate_its_step_trained_with_in_full(tiny_data, tmp_path):
    """The scheduler has moved on to the next step's rate when a row is written; and a warm-up's first rates
    (3.3e-07 here) lost their digits to a rounding at 6 decimals."""
    from summarizer.train.optim import lr_factor
    cfg = make_cfg(tiny_data, tmp_path / "run", "train.max_steps=3", "train.log_every=1", "train.lr=1e-5",
                   "train.warmup_steps=30", "train.eval_every=3", "train.ckpt_every=3", "train.rouge_every=0",
                   "train.select_by=loss")
    train_mod.train(cfg)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    logged = {r["step"]: r["lr"] for r in rows if r["split"] == "train"}
    assert logged == {k: pytest.approx(1e-5 * lr_factor(k - 1, cfg.train), rel=1e-7) for k in (1, 2, 3)}


def test_a_resume_on_other_code_keeps_the_earlier_sessions_record(tiny_data, tmp_path):
    """manifest.json's top level is the latest session's: a resume on other code (or threads, or a machine)
    replaced what trained the first steps. Each session is kept from the step it started at; report shows both."""
    from summarizer.harness.report import _commit, collect, commit_cell
    from summarizer.outputs import code_version
    run = tmp_path / "run"
    train_mod.train(make_cfg(tiny_data, run, "train.max_steps=10", "train.ckpt_every=10", "train.eval_every=10"))
    manifest = json.loads((run / "manifest.json").read_text())
    assert [s["from_step"] for s in manifest["sessions"]] == [0]
    manifest["sessions"][0].update(git_commit="0ld" * 13 + "0", git_dirty=False, cpu_threads=7)  # trained elsewhere
    (run / "manifest.json").write_text(json.dumps(manifest))
    train_mod.train(make_cfg(tiny_data, run, "train.max_steps=20", "train.ckpt_every=10", "train.eval_every=10"))
    manifest = json.loads((run / "manifest.json").read_text())
    first, second = manifest["sessions"]
    assert (first["from_step"], first["git_commit"], first["cpu_threads"]) == (0, "0ld" * 13 + "0", 7)
    assert second["from_step"] == 10 and second["git_commit"] == manifest["git_commit"] == code_version()["git_commit"]
    [row] = collect([str(run)])
    assert commit_cell(row) == f"0: 0ld0ld0l; 10: {_commit(manifest['git_commit'], manifest['git_dirty'])}"
