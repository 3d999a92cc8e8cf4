"""DDP through torchrun (gloo on CPU) and model-parallel placement give the single-device losses."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from summarizer.config.load import load_config
from summarizer.train.loop import train

ROOT = Path(__file__).resolve().parents[1]
EXACT = ["data.vocab_size=150", "data.lowercase=false",  # as tiny_prepared was prepared
         "model.d_model=32", "model.ffn_dim=64", "model.encoder_layers=1", "model.decoder_layers=1",
         "model.dropout=0.0", "train.precision=fp32", "data.num_workers=0", "data.batch_tokens=400",
         "train.max_steps=6", "train.log_every=1", "train.eval_every=3", "train.ckpt_every=3",
         "train.warmup_steps=2", "train.sample_summaries=0"]


def records(run_dir: Path, split: str) -> list[tuple[int, float]]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [(r["step"], r["loss"]) for r in map(json.loads, lines) if r["split"] == split]


def assert_same(a, b):
    assert [s for s, _ in a] == [s for s, _ in b]
    assert all(x == pytest.approx(y, rel=1e-5, abs=1e-6) for (_, x), (_, y) in zip(a, b, strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("compiled", [False, True])
def test_two_gloo_processes_equal_one_process_with_the_same_global_batch(tiny_prepared, tmp_path, compiled):
    """Compiled too: DDP wraps the view whose layers are compiled, and its gradient hooks still average them."""
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    if torchrun is None:
        pytest.skip("torchrun is not installed next to this python")
    common = ["--config", str(ROOT / "configs/tiny.yaml"), f"data.dir={tiny_prepared}",
              f"run.tensorboard_dir={tmp_path / 'tb'}", *EXACT, f"train.compile={str(compiled).lower()}"]
    train(load_config(common[1], common[2:] + [f"run.dir={tmp_path / 'one'}", "run.name=one",
                                               "train.accum_steps=2"]))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([torchrun, "--standalone", "--nproc_per_node=2", "-m", "summarizer", "train", *common,
                           f"run.dir={tmp_path / 'two'}", "run.name=two"], cwd=ROOT, env=env, capture_output=True,
                          text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_same(records(tmp_path / "two", "train"), records(tmp_path / "one", "train"))
    assert_same(records(tmp_path / "two", "valid"), records(tmp_path / "one", "valid"))
    assert (tmp_path / "two" / "ckpt_00000006.pt").exists()


@pytest.mark.slow
def test_two_gloo_ranks_stop_together_when_the_time_is_up(tiny_prepared, tmp_path):
    """The ranks' clocks differ, so each step they sum their "time is up" and read the sum a step later (Consensus):
    both stop after the same step, validate and checkpoint it together, and nobody waits for a rank gone."""
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    if torchrun is None:
        pytest.skip("torchrun is not installed next to this python")
    run = tmp_path / "two"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([torchrun, "--standalone", "--nproc_per_node=2", "-m", "summarizer", "train", "--config",
                           str(ROOT / "configs/tiny.yaml"), f"data.dir={tiny_prepared}", f"run.dir={run}",
                           f"run.tensorboard_dir={tmp_path / 'tb'}", *EXACT, "train.max_steps=100000",
                           "train.max_minutes=0.05", "train.eval_every=100000", "train.rouge_every=0",
                           "train.select_by=loss"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    stopped = [int(line.split()[3].rstrip(":")) for line in proc.stderr.splitlines() if ": time limit" in line]
    step = json.loads((run / "latest.json").read_text())["step"]
    assert stopped == [step] and 0 < step < 100000, proc.stderr[-3000:]  # rank 0 prints; its checkpoint's step
    assert records(run, "valid")[-1][0] == step


@pytest.mark.parametrize("compiled", [False, True])
def test_model_parallel_placement_cpu_cpu_equals_one_device(tiny_prepared, tmp_path, compiled):
    base = [f"data.dir={tiny_prepared}", f"run.tensorboard_dir={tmp_path / 'tb'}", *EXACT,
            f"train.compile={str(compiled).lower()}"]
    train(load_config(ROOT / "configs/tiny.yaml", base + [f"run.dir={tmp_path / 'one'}", "run.name=one"]))
    train(load_config(ROOT / "configs/tiny.yaml", base + [
        f"run.dir={tmp_path / 'split'}", "run.name=split", "placement.encoder_device=cpu:0",
        "placement.decoder_device=cpu", "placement.pipeline_chunks=2"]))
    assert_same(records(tmp_path / "split", "train"), records(tmp_path / "one", "train"))


def _rank_pids(torchrun_pid: int) -> dict[int, int]:
    """RANK -> pid of each training process torchrun started (its children with RANK in their environment)."""
    found = {}
    for task in Path(f"/proc/{torchrun_pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            env = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
            rank = [e.split(b"=", 1)[1] for e in env if e.startswith(b"RANK=")]
            if rank:
                found[int(rank[0])] = int(child)
    return found


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs /proc to find the rank processes")
def test_a_rank_killed_mid_run_ends_the_others_in_one_message(tiny_prepared, tmp_path):
    """One rank SIGKILLed (the OOM killer, a lost node): the other ends without a traceback of the collective
    it was in, either by torchrun's stop signal (a checkpoint, exit 143) or by the failed collective (one
    message, exit 2)."""
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    if torchrun is None:
        pytest.skip("torchrun is not installed next to this python")
    logs = tmp_path / "logs"
    args = [torchrun, "--standalone", "--nproc_per_node=2", "--log-dir", str(logs), "--redirects", "3", "-m",
            "summarizer", "train", "--config", str(ROOT / "configs/tiny.yaml"), f"data.dir={tiny_prepared}",
            f"run.dir={tmp_path / 'run'}", f"run.tensorboard_dir={tmp_path / 'tb'}", *EXACT,
            "train.max_steps=100000", "train.eval_every=100000", "train.ckpt_every=100000"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 300
        while not (tmp_path / "run" / "metrics.jsonl").exists():  # both ranks are in the loop
            assert proc.poll() is None and time.time() < deadline
            time.sleep(0.05)
        os.kill(_rank_pids(proc.pid)[1], signal.SIGKILL)
        proc.wait(timeout=120)  # the fault a hang or a raw traceback: a bounded wait is part of the test
    finally:
        if proc.poll() is None:
            proc.kill()
    rank0 = next(logs.rglob("attempt_0/0/stderr.log")).read_text()
    assert "Traceback" not in rank0, rank0[-3000:]
    assert "another rank of the run stopped" in rank0 or "stopped by SIGTERM" in rank0, rank0[-3000:]


def _rank_resumes_its_own_streams(rank: int, world: int, init_file: str, out_dir: str) -> None:
    """One gloo rank: streams that differ by rank (as each GPU's do, drawing dropout for its own batches) are
    saved by rank 0 for every rank, then each rank restores its own."""
    import random

    import torch
    import torch.distributed as dist

    from summarizer.runtime import Runtime
    from summarizer.train.session import restore_rng, rng_states
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        rt = Runtime(torch.device("cpu"), torch.device("cpu"), "fp32", rank, world)
        torch.manual_seed(0)
        random.seed(0)
        torch.rand(10 + 7 * rank)  # a rank's own number of draws
        saved = rng_states(rt)  # every rank takes part
        if rank == 0:
            torch.save(saved, Path(out_dir) / "rng.pt")
        expected = (torch.rand(3).tolist(), random.random())
        torch.rand(50)
        dist.barrier()
        restore_rng(torch.load(Path(out_dir) / "rng.pt", weights_only=False), rt)
        got = (torch.rand(3).tolist(), random.random())
        restore_rng({"rng": saved["rng"]}, rt)  # a checkpoint with rank 0's streams alone: rank 0's for all
        alone = torch.rand(3).tolist()
        (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps({"same": got == expected, "alone": alone}))
    finally:
        dist.destroy_process_group()


def test_every_rank_resumes_its_own_random_streams(tmp_path):
    import torch.multiprocessing as mp
    mp.spawn(_rank_resumes_its_own_streams, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["same"] for r in ranks] == [True, True]
    assert ranks[0]["alone"] == ranks[1]["alone"]  # both got rank 0's streams


def _rank_trains(rank: int, world: int, port: int, overrides: list[str], signal_in: str, out_dir: str) -> None:
    """One rank of a gloo run, as torchrun starts it; rank 1 sends itself SIGTERM in `signal_in`: "loss" (inside
    validation, before its all-reduce), "rouge" (as ROUGE's decoding starts; the stop checks it made are counted),
    "bookkeeping" (after validation's last check), "last bookkeeping" (that of the run's last validation, after
    which no step's Consensus comes), or never ("")."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    import torch

    from summarizer.train import validation
    torch.set_num_threads(1)
    checks = []
    if rank == 1 and signal_in:
        name = {"loss": "evaluate_loss", "rouge": "decode_all"}.get(signal_in, "improves")
        real, calls = getattr(validation, name), []

        def signalled(*args, **kwargs):
            calls.append(1)
            if signal_in == "rouge":
                kwargs["check"] = lambda check=kwargs["check"]: (checks.append(1), check())
            if len(calls) == (2 if signal_in.startswith("last") else 1):
                os.kill(os.getpid(), signal.SIGTERM)
            return real(*args, **kwargs)

        setattr(validation, name, signalled)
    summary = train(load_config(ROOT / "configs/tiny.yaml", overrides))
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps({"steps": summary["steps"],
                                                                 "signal": summary["signal"], "checks": len(checks)}))


def _train_two_ranks(run: Path, tiny_prepared: Path, signal_in: str = "", rouge: bool = False) -> list[dict]:
    """A 2-rank run of EXACT's settings with dropout (so every rank's random streams matter on resume), with
    validation's ROUGE on 24 pairs in 7 batches where `rouge`: each rank's summary. A run that has not ended in
    300 s is a hang: killed, and the test fails."""
    import socket

    import torch.multiprocessing as mp
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    overrides = [f"data.dir={tiny_prepared}", f"run.dir={run}", f"run.tensorboard_dir={run.parent / 'tb' / run.name}",
                 *EXACT, "model.dropout=0.1", "train.ckpt_every=100", "train.select_by=loss",
                 *(["train.rouge_every=3", "train.rouge_samples=24", "eval.batch_tokens=240", "eval.threads=1"]
                   if rouge else ["train.rouge_every=0"])]
    (out := run.parent / f"{run.name}_summaries").mkdir(exist_ok=True)
    context = mp.start_processes(_rank_trains, args=(2, port, overrides, signal_in, str(out)), nprocs=2, join=False,
                                 start_method="spawn")
    deadline = time.time() + 300
    try:
        while not context.join(timeout=5):
            assert time.time() < deadline, f"the ranks did not end (signal in {signal_in!r}): a hang"
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]


@pytest.mark.slow
@pytest.mark.parametrize("signal_in, stopped_at", [("loss", 3), ("rouge", 3), ("bookkeeping", 5),
                                                   ("last bookkeeping", 6)])
def test_a_signal_to_one_rank_during_validation_stops_every_rank_at_one_step_and_resumes_exactly(
        tiny_prepared, tmp_path, signal_in, stopped_at):
    """A signal to one rank during validation's loss (its all-reduce ahead): every rank abandons the validation at
    the check after it, together, and checkpoints the step with every rank's random streams; after validation's
    last check: every rank finishes it, and the steps' Consensus stops them together two steps on; after the last
    step's: the ranks agree once the loop ends, so all report the signal (exit status, a recipe's next stage). No
    rank is left waiting in a collective, and the resumed run logs what a run never stopped logs. Inside ROUGE's
    decoding the ranks abandon it at the check after its first batch, not at its end."""
    rouge = signal_in == "rouge"
    reference = _train_two_ranks(tmp_path / "reference", tiny_prepared, rouge=rouge)
    assert [r["steps"] for r in reference] == [6, 6]
    cut = _train_two_ranks(tmp_path / "cut", tiny_prepared, signal_in, rouge)
    assert [(r["steps"], r["signal"]) for r in cut] == [(stopped_at, signal.SIGTERM)] * 2  # rank 0 adopted rank 1's
    assert cut[1]["checks"] == (1 if rouge else 0)
    state = torch.load(tmp_path / "cut" / f"ckpt_{stopped_at:08d}.pt", weights_only=False)
    owed = state["progress"].get("owed", {})
    assert len(state["rng_by_rank"]) == 2 and owed.get("validate", False) == (signal_in in ("loss", "rouge"))
    assert ("owed" in state["progress"]) == (signal_in != "last bookkeeping")  # the last step's is all done
    assert [r["steps"] for r in _train_two_ranks(tmp_path / "cut", tiny_prepared, rouge=rouge)] == [6, 6]
    for split in ("train", "valid"):
        assert_same(records(tmp_path / "cut", split), records(tmp_path / "reference", split))
