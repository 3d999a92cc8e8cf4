"""Tests for summarizer/train/guard.py and the stop path of the loop: a stop signal checkpoints the step in progress
first (no extra step, no validation), a second one exits at once, a run finished before its final validation was cut
short says finished, workers start deaf to the group's signals, and nothing waits forever on the way out."""
import dataclasses
import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch
from torch.utils.data import Dataset

from summarizer.__main__ import main
from summarizer.config.load import load_config
from summarizer.data.batches import SignalSafeLoader, init_worker
from summarizer.model import checkpoint
from summarizer.train import guard
from summarizer.train import loop as train_mod
from tests.processes import train_process, wait_for

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["model.d_model=32", "model.n_heads=4", "model.encoder_layers=1", "model.decoder_layers=1",
         "model.ffn_dim=64", "data.batch_tokens=400", "data.num_workers=0", "train.log_every=5",
         "train.warmup_steps=10", "train.sample_summaries=0", "train.module_stats=false"]


def overrides(tiny_data, run_dir, *extra):
    return [f"data.dir={tiny_data}", f"run.dir={run_dir}", f"run.tensorboard_dir={run_dir}/tb", *SMALL, *extra]


def records(run_dir, split):
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["split"] == split]


def latest_step(run_dir) -> int:
    return json.loads((Path(run_dir) / checkpoint.LATEST).read_text())["step"]


def signal_after_step(monkeypatch, n: int, pause: float = 0.0) -> list:
    """train_step sends this process SIGTERM as its `n`th call ends (after `pause` s): the calls, counted."""
    real, steps = train_mod.train_step, []

    def signalled(*args, **kwargs):
        out = real(*args, **kwargs)
        steps.append(1)
        if len(steps) == n:
            time.sleep(pause)
            os.kill(os.getpid(), signal.SIGTERM)
        return out

    monkeypatch.setattr(train_mod, "train_step", signalled)
    return steps


def test_a_stop_signal_during_a_step_checkpoints_that_step_without_validating(tiny_data, tmp_path, monkeypatch):
    validated = []
    signal_after_step(monkeypatch, 7)  # arrives while step 7 is in progress
    monkeypatch.setattr(train_mod, "validate", lambda *a: validated.append(a[0].progress["step"]) or False)
    cfg = load_config(ROOT / "configs/tiny.yaml", overrides(tiny_data, tmp_path / "run", "train.max_steps=100",
                                                            "train.eval_every=5", "train.ckpt_every=100"))
    summary = train_mod.train(cfg)
    assert summary["signal"] == signal.SIGTERM and not summary["finished"]
    assert summary["steps"] == 7 and latest_step(tmp_path / "run") == 7  # no step after the signal's
    assert validated == [5]  # none at the stop: the checkpoint comes first, and is all there is


def test_a_stop_signal_during_validation_abandons_it_for_the_checkpoint(tiny_data, tmp_path, monkeypatch):
    finished = []

    def long_validation(session, extra, rouge, stop):
        with stop.interruptible():
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(600):  # a minute of ROUGE on a busy machine: the signal must not wait for it
                time.sleep(0.1)
        finished.append(session.progress["step"])
        return False

    monkeypatch.setattr(train_mod, "validate", long_validation)
    cfg = load_config(ROOT / "configs/tiny.yaml", overrides(tiny_data, tmp_path / "run", "train.max_steps=100",
                                                            "train.eval_every=5", "train.ckpt_every=100"))
    summary = train_mod.train(cfg)
    assert finished == [] and summary["steps"] == 5 and latest_step(tmp_path / "run") == 5
    assert summary["signal"] == signal.SIGTERM


def test_a_signal_on_the_step_the_time_limit_ends_leaves_that_steps_row_and_validation_owed(tiny_data, tmp_path,
                                                                                               monkeypatch, capsys):
    """The step that uses up train.max_minutes is the run's last: a signal during it checkpoints it owing its final
    log row and validation, as a run never stopped logs and validates it; the same command pays them without a
    step more, and the run is then finished."""
    steps = signal_after_step(monkeypatch, 3, pause=3.5)  # past the 3 s limit
    args = ["train", "--config", str(ROOT / "configs/tiny.yaml"),
            *overrides(tiny_data, tmp_path / "run", "train.max_steps=100", "train.max_minutes=0.05",
                       "train.eval_every=100", "train.ckpt_every=100")]
    assert main(args) == 128 + signal.SIGTERM and latest_step(tmp_path / "run") == 3
    assert "run the same command again to resume" in capsys.readouterr().err
    assert main(args) == 0 and len(steps) == 3  # no step after the limit's
    assert [r["step"] for r in records(tmp_path / "run", "train")] == [3]
    assert [r["step"] for r in records(tmp_path / "run", "valid")] == [3]
    assert (tmp_path / "run" / "best.pt").is_file()
    assert main(args) == 0 and "finished" in capsys.readouterr().out


def test_a_run_stopped_on_a_checkpoint_step_between_log_rows_logs_what_a_run_never_stopped_logs(
        tiny_data, tmp_path, monkeypatch):
    """A run never stopped starts its log interval anew after each checkpoint: one stopped on a checkpoint step
    that logs nothing resumes with that interval empty too, so its next row averages the same steps."""
    real_step = train_mod.train_step
    extra = ["train.max_steps=12", "train.log_every=4", "train.eval_every=100", "train.ckpt_every=3"]
    train_mod.train(load_config(ROOT / "configs/tiny.yaml", overrides(tiny_data, tmp_path / "ref", *extra)))
    signal_after_step(monkeypatch, 6)
    cut = load_config(ROOT / "configs/tiny.yaml", overrides(tiny_data, tmp_path / "cut", *extra))
    assert train_mod.train(cut)["steps"] == 6
    monkeypatch.setattr(train_mod, "train_step", real_step)
    train_mod.train(cut)
    rows = [[(r["step"], r["loss"]) for r in records(tmp_path / run, "train")] for run in ("ref", "cut")]
    assert rows[0] == rows[1] and [s for s, _ in rows[0]] == [4, 8, 12]


def test_a_resume_that_crashes_while_paying_what_a_stop_owed_does_not_log_its_rows_twice(tiny_data, tmp_path,
                                                                                            monkeypatch):
    """A stop at a step that logs and validates owes both; the resume writes the row, then crashes in the
    validation (a kill, out of memory): the next resume writes that step's rows once, as a run never stopped."""
    real_step, real_validate = train_mod.train_step, train_mod.validate

    def crashing(*args):
        raise RuntimeError("the process was killed here")

    cfg = load_config(ROOT / "configs/tiny.yaml", overrides(tiny_data, tmp_path / "run", "train.max_steps=10",
                                                            "train.eval_every=5", "train.ckpt_every=100"))
    signal_after_step(monkeypatch, 5)
    assert train_mod.train(cfg)["steps"] == 5
    monkeypatch.setattr(train_mod, "train_step", real_step)
    monkeypatch.setattr(train_mod, "validate", crashing)
    with pytest.raises(RuntimeError, match="killed here"):
        train_mod.train(cfg)
    assert [r["step"] for r in records(tmp_path / "run", "train")] == [5]  # written before the crash
    monkeypatch.setattr(train_mod, "validate", real_validate)
    assert train_mod.train(cfg)["steps"] == 10
    assert [r["step"] for r in records(tmp_path / "run", "train")] == [5, 10]
    assert [r["step"] for r in records(tmp_path / "run", "valid")] == [5, 10]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(tmp_path / "run" / "tb" / "tiny")).Reload()  # the curves too
    assert [e.step for e in events.Scalars("train/loss")] == [5, 10]
    assert [e.step for e in events.Scalars("valid/loss")] == [5, 10]


def test_a_final_validation_a_signal_cut_short_is_done_by_the_next_run(tiny_data, tmp_path, monkeypatch, capsys):
    """The training is complete, its final validation (best.pt, the last valid row) is not: the checkpoint owes it,
    the run says so and exits as stopped, and the same command then validates and finishes."""
    real_validate = train_mod.validate

    def signalled_validation(session, extra, rouge, stop):
        with stop.interruptible():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(60)
        return False

    monkeypatch.setattr(train_mod, "validate", signalled_validation)
    args = ["train", "--config", str(ROOT / "configs/tiny.yaml"),
            *overrides(tiny_data, tmp_path / "run", "train.max_steps=10", "train.eval_every=100")]
    rc = main(args)
    err = capsys.readouterr().err
    assert rc == 128 + signal.SIGTERM and "stopped by SIGTERM at step 10 before its validation" in err
    assert latest_step(tmp_path / "run") == 10 and not records(tmp_path / "run", "valid")
    monkeypatch.setattr(train_mod, "validate", real_validate)
    assert main(args) == 0
    assert [r["step"] for r in records(tmp_path / "run", "valid")] == [10]
    assert main(args) == 0 and "the run is finished: nothing to train; `make eval` scores best.pt" in \
        capsys.readouterr().out
    (tmp_path / "run" / "best.pt").unlink()  # a run stopped, then ended by a lower max_steps, validated nowhere
    assert main(args) == 0
    assert f"it holds no best.pt (no validation ran); eval.checkpoint={tmp_path / 'run' / 'ckpt_00000010.pt'} " \
        f"scores its last weights" in capsys.readouterr().out


def test_a_second_signal_exits_at_once(tiny_data, tmp_path, monkeypatch, capsys):
    real_save = checkpoint.save_step

    def save_interrupted(*args):  # the user presses Ctrl-C again while the stop's checkpoint is written
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(60)
        return real_save(*args)

    def signalled_validation(session, extra, rouge, stop):
        os.kill(os.getpid(), signal.SIGINT)
        return False

    monkeypatch.setattr(train_mod, "validate", signalled_validation)
    monkeypatch.setattr(checkpoint, "save_step", save_interrupted)
    started = time.perf_counter()
    rc = main(["train", "--config", str(ROOT / "configs/tiny.yaml"),
               *overrides(tiny_data, tmp_path / "run", "train.max_steps=100", "train.eval_every=5")])
    assert rc == 130 and "second SIGINT" in capsys.readouterr().err
    assert time.perf_counter() - started < 50  # did not sit out the 60 s


class _Mask(Dataset):
    def __len__(self):
        return 1

    def __getitem__(self, i):
        return torch.tensor(sorted(int(s) for s in _STARTED_WITH))


_STARTED_WITH: set = set()


def _record_mask(worker_id):
    _STARTED_WITH.update(signal.pthread_sigmask(signal.SIG_BLOCK, []))
    init_worker(worker_id)


def test_workers_start_with_the_stop_signals_blocked_until_they_ignore_them():
    """A group SIGTERM between a worker's start and its worker_init_fn would kill it (torch's worker handler);
    the stop would then look like a crashed worker."""
    loader = SignalSafeLoader(_Mask(), batch_size=None, num_workers=1, worker_init_fn=_record_mask)
    started_with = set(next(iter(loader)).tolist())
    assert {signal.SIGINT, signal.SIGTERM} <= started_with
    assert signal.SIGTERM not in signal.pthread_sigmask(signal.SIG_BLOCK, [])  # the main process is as it was


def test_a_dead_worker_is_told_from_other_errors_by_what_fetching_a_batch_raised():
    """The loader's own error, or a broken connection to a worker that died handing over a batch (raised before the
    loader saw it exit: its tensors travel by file descriptor); nothing else, and no connection error without
    workers."""
    assert guard.worker_died(RuntimeError("DataLoader worker (pid(s) 123) exited unexpectedly"), 2)
    assert guard.worker_died(RuntimeError("DataLoader worker (pid 9) is killed by signal: Killed."), 2)
    assert guard.worker_died(ConnectionResetError(104, "Connection reset by peer"), 2)
    assert guard.worker_died(EOFError(), 1)
    assert not guard.worker_died(ConnectionResetError(104, "Connection reset by peer"), 0)
    assert not guard.worker_died(RuntimeError("CUDA error: an illegal memory access was encountered"), 2)


def test_a_worker_that_died_of_the_stop_signal_is_a_stop_not_an_out_of_memory(tiny_data, tmp_path, monkeypatch):
    from summarizer.train.session import open_session
    cfg = load_config(ROOT / "configs/tiny.yaml", overrides(tiny_data, tmp_path / "run", "train.max_steps=5"))
    session = open_session(cfg)
    try:
        stop = guard.StopFlag(session.rt)
        try:
            died = RuntimeError("DataLoader worker (pid(s) 123) exited unexpectedly")
            with pytest.raises(guard.TrainingAborted, match="out-of-memory killer"):
                guard.dead_worker(session, stop, died)  # no stop signal: a real crash
            with pytest.raises(guard.TrainingAborted, match="died while handing over a batch.*ConnectionResetError"):
                guard.dead_worker(session, stop, ConnectionResetError(104, "Connection reset by peer"))
            local = session.rt
            session.rt = dataclasses.replace(local, rank=1, world_size=2)  # under DDP: that rank's worker alone
            saved = []
            monkeypatch.setattr(guard, "save_now", lambda *a, **k: saved.append(a))
            with pytest.raises(guard.TrainingAborted, match=r"This rank's alone \(rank 1\): the other ranks end at "
                                                            r"their next collective, and the run resumes from its "
                                                            r"latest checkpoint \(.*ckpt_00000000.pt\)"):
                guard.dead_worker(session, stop, died)
            assert saved == []  # rank 0 is in the next step's all-reduce: no checkpoint without every rank's streams
            session.rt = local
            monkeypatch.undo()
            os.kill(os.getpid(), signal.SIGTERM)
            guard.dead_worker(session, stop, died)  # the group's SIGTERM reached the worker too: a stop
        finally:
            stop.restore()
    finally:
        session.close()
    assert (tmp_path / "run" / checkpoint.LATEST).exists()


def _launch(tiny_data, run_dir, *extra):
    return train_process(overrides(tiny_data, run_dir, *extra), new_session=True)


@pytest.mark.slow
@pytest.mark.parametrize("stop", [None, signal.SIGTERM])
def test_a_run_dir_removed_while_training_ends_in_one_message_and_never_hangs(tiny_data, tmp_path, stop):
    """The run dir is gone (or any write on the stop path fails): one message, exit 2, no worker left to wait
    on at exit, with validation workers alive (persistent) when it happens."""
    proc = _launch(tiny_data, tmp_path / "run", "train.max_steps=100000", "train.eval_every=2",
                   "train.rouge_every=0", "train.select_by=loss", "train.ckpt_every=100000",
                   "data.num_workers=1", f"run.tensorboard_dir={tmp_path}/tb")  # the events elsewhere, as by default
    wait_for(tmp_path / "run" / "metrics.jsonl", proc)
    while len([line for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
               if '"valid"' in line]) < 2:  # the validation workers have started
        assert proc.poll() is None
        time.sleep(0.01)
    (tmp_path / "run").rename(tmp_path / "gone")  # at once, whatever the run is writing
    if stop is not None:
        os.killpg(proc.pid, stop)
    try:
        rc = proc.wait(timeout=120)  # the fault was a hang: a wait with a bound is the test
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    output = proc.stdout.read().decode()
    assert "Traceback" not in output, output[-2000:]
    if stop is not None and rc in (128 + stop, -stop):  # the stop's checkpoint made the dir again (resumable), or
        assert rc == -stop or "stopped by SIGTERM" in output  # the signal came as the error was ending the run
    else:
        assert rc == 2 and "was removed while the run trained" in output, output[-2000:]


def test_a_run_dir_moved_away_stops_the_run_even_once_a_write_made_it_again(tiny_data, tmp_path, monkeypatch):
    """A moved dir keeps the open metrics file writable, and a checkpoint's write makes the dir again, empty:
    no write fails, so the run checks its ownership marker instead of training on into a dir not its own."""
    def moving_validation(session, extra, rouge, stop):
        if session.progress["step"] == 5:
            (tmp_path / "run").rename(tmp_path / "moved")
            checkpoint.save(session.best_snapshot(), session.cfg.run_dir / checkpoint.BEST)  # makes run/ again
        return False

    monkeypatch.setattr(train_mod, "validate", moving_validation)
    cfg = load_config(ROOT / "configs/tiny.yaml", overrides(tiny_data, tmp_path / "run", "train.max_steps=30",
                                                            "train.eval_every=5", f"run.tensorboard_dir={tmp_path}/tb"))
    with pytest.raises(guard.TrainingAborted, match="was removed while the run trained"):
        train_mod.train(cfg)


def test_under_ddp_a_rank_stops_only_where_every_rank_knows_of_the_stop(monkeypatch):
    """A signal to one rank is that rank's alone until the ranks sum their flags. Validation abandoned is known to
    all (StopFlag.check, a collective): every rank checkpoints together, gathering every rank's random streams. A
    signal after validation's last check is not: the rank goes on, and the next steps' Consensus stops every rank
    (a rank stopping alone would leave the others waiting in the next step's all-reduce). Without DDP a signal
    stops the run after the step it came in."""
    import types

    import summarizer.train.loop as loop_mod
    from summarizer.train.guard import StopRequested
    saved = []
    monkeypatch.setattr(loop_mod, "check_run_dir", lambda session: None)
    monkeypatch.setattr(loop_mod, "save_now", lambda session, every_rank=True: saved.append(every_rank))

    def abandoned_validation(session, extra, rouge, stop):
        stop.signum = signal.SIGTERM  # another rank's, adopted at the check
        raise StopRequested

    def signalled_after_validation(session, extra, rouge, stop):
        stop.signum = signal.SIGTERM  # this rank's, during the bookkeeping after the last check
        return False

    class Stop(types.SimpleNamespace):
        requested = property(lambda self: self.signum is not None)
        name = property(lambda self: signal.Signals(self.signum).name if self.signum else "")

    def after(validation, distributed):
        monkeypatch.setattr(loop_mod, "validate", validation)
        train = types.SimpleNamespace(max_minutes=0, max_steps=100, log_every=1000, rouge_every=0, eval_every=10,
                                      ckpt_every=20)
        session = types.SimpleNamespace(
            cfg=types.SimpleNamespace(train=train), progress={"step": 10, "elapsed_s": 0.0},
            rt=types.SimpleNamespace(distributed=distributed),
            monitor=types.SimpleNamespace(write=lambda message: None))
        loop = types.SimpleNamespace(stop=Stop(signum=None), window=types.SimpleNamespace(reset=lambda: None),
                                     unread=None, lr=1e-3)  # no step left to settle
        saved.clear()
        stopped = loop_mod.after_step(session, loop, {"grad_norm": torch.tensor(1.0), "modules": {}}, time_up=False)
        return stopped, list(saved), "owed" in session.progress

    assert after(abandoned_validation, distributed=True) == (True, [True], True)  # validation owed to the resume
    assert after(signalled_after_validation, distributed=True) == (False, [], False)
    assert after(signalled_after_validation, distributed=False) == (True, [True], False)


def test_a_stop_flag_adopts_another_ranks_signal_and_this_processs_own_is_not_a_second(monkeypatch):
    """`agree`: a signal summed from another rank becomes this rank's stop (its name, exit status, the recipe's next
    stage not started); the signal that then reaches this process itself (the scheduler signals every rank) is its
    first, not a second that exits at once. `check` sums the flags across the ranks and raises where any is up."""
    from summarizer.errors import Stopped
    from summarizer.runtime import Runtime
    cpu = torch.device("cpu")
    monkeypatch.setattr(guard.runtime, "all_reduce_sum", lambda t, rt: t + torch.tensor([0.0, 1.0]))  # rank 1: TERM
    stop = guard.StopFlag(Runtime(cpu, cpu, "fp32", rank=0, world_size=2))
    try:
        assert stop.flags() == [False, False] and not stop.agree([0, 0]) and not stop.requested
        with pytest.raises(guard.StopRequested):
            stop.check()
        assert stop.name == "SIGTERM"
        os.kill(os.getpid(), signal.SIGINT)  # this process's first signal: noted, not raised
        assert stop.name == "SIGTERM"
        with pytest.raises(Stopped):
            os.kill(os.getpid(), signal.SIGINT)
    finally:
        stop.restore()


def test_ranks_agree_on_stopping_one_step_late_under_ddp_and_at_once_without(monkeypatch):
    """Consensus: without DDP a flag is acted on after the step that raised it; under DDP each flag is summed across
    the ranks and the sums of step n are read after step n + 1 (no wait for the device between steps), the same
    step on every rank. Here the collective is the sum over two ranks that raise the same flags."""
    from summarizer.runtime import Runtime
    cpu = torch.device("cpu")
    alone = guard.Consensus(Runtime(cpu, cpu, "fp32"))
    assert alone(True, False) == [True, False] and alone(False, True) == [False, True]
    summed = []
    monkeypatch.setattr(guard.runtime, "all_reduce_sum", lambda t, rt: summed.append(t.tolist()) or t * 2)
    ddp = guard.Consensus(Runtime(cpu, cpu, "fp32", rank=0, world_size=2))
    assert [ddp(True, False), ddp(False, False), ddp(False, True), ddp(False, False)] == [
        [False, False], [True, False], [False, False], [False, True]]
    assert summed == [[1.0, 0.0], [0.0, 0.0], [0.0, 1.0], [0.0, 0.0]]  # one collective a step, every step


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
def test_numbers_reach_the_device_without_draining_its_queue(device):
    from summarizer import runtime
    value = runtime.device_tensor([1.0, 2.5], torch.device(device))
    assert value.device.type == device and value.tolist() == [1.0, 2.5]


@pytest.mark.parametrize("stop_at", [7, 10])  # inside a log interval; the final step, owing its log row and validation
def test_a_run_stopped_and_resumed_logs_and_validates_as_one_never_stopped(tiny_data, tmp_path, monkeypatch, stop_at):
    """A stop checkpoints the finished step before its log row and validation: the checkpoint keeps them owed, with
    the interval's sums so far, and the resumed run does them first. Its metrics and best.pt are an unstopped run's."""
    def run(run_dir, stop=None):
        real_step, steps = train_mod.train_step, []

        def step(*args, **kwargs):
            out = real_step(*args, **kwargs)
            steps.append(1)
            if len(steps) == stop:
                os.kill(os.getpid(), signal.SIGTERM)  # arrives while this step is in progress
            return out

        monkeypatch.setattr(train_mod, "train_step", step)
        cfg = load_config(ROOT / "configs/tiny.yaml", overrides(tiny_data, run_dir, "train.max_steps=10",
                                                                "train.log_every=4", "train.eval_every=5",
                                                                "train.ckpt_every=100", "train.select_by=loss",
                                                                "train.rouge_every=0"))
        return train_mod.train(cfg)

    run(tmp_path / "ref")
    assert run(tmp_path / "cut", stop=stop_at)["steps"] == stop_at
    assert run(tmp_path / "cut")["finished"]
    for split in ("train", "valid"):
        want = [(r["step"], r["loss"]) for r in records(tmp_path / "ref", split)]
        assert [(r["step"], r["loss"]) for r in records(tmp_path / "cut", split)] == want, split
    best = [torch.load(tmp_path / run / "best.pt", weights_only=False)["step"] for run in ("ref", "cut")]
    assert best[0] == best[1]
