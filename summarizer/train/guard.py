"""What stops or rewinds a run safely: stop signals, dead DataLoader workers, out of memory, a removed run dir,
another rank's failure and loss spikes. Each is acted on between steps, where weights and data position agree."""
from __future__ import annotations

import contextlib
import os
import signal

import torch

from summarizer import runtime
from summarizer.config.schema import Config
from summarizer.errors import Stopped, UserError
from summarizer.model import checkpoint
from summarizer.outputs import MARKER
from summarizer.runtime import Runtime
from summarizer.train.session import Session, rng_states, rollback
from summarizer.train.watch import spikes
from summarizer.train.watch.monitor import add_rollback, memory_report

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class TrainingAborted(UserError):
    """Training cannot go on (non-finite losses, out of memory); the message says what to change."""


class StopRequested(Exception):
    """Raised inside `StopFlag.interruptible` blocks (validation) when a stop signal arrives: abandon them."""


class StopFlag:
    """SIGINT/SIGTERM ask the run to stop. Between steps the loop writes the finished step's checkpoint first and
    exits; inside `interruptible` (validation, which changes no weights) the work is abandoned for that checkpoint;
    a second signal exits at once (errors.Stopped). Schedulers give a stopped job seconds (Slurm's KillWait and
    Kubernetes' grace period: 30 s, `docker stop`: 10 s) before SIGKILL. Under DDP a signal is one rank's until the
    ranks sum their `flags` (Consensus between steps, `check` inside validation): then it is every rank's (`agree`),
    so all stop at the same step and checkpoint it together."""

    def __init__(self, rt: Runtime):
        self.rt, self.signum, self._received = rt, None, False  # received: a signal came to this process itself
        self._pid, self._interruptible = os.getpid(), False
        self._previous = {s: signal.signal(s, self._handle) for s in STOP_SIGNALS}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else ""

    def _handle(self, signum, frame):
        if os.getpid() != self._pid:  # a DataLoader worker forked before init_worker ignores signals: not its call
            return
        if self._received:  # the second to this process (one another rank's stop lent it is not: `agree`)
            raise Stopped(signum)
        self._received, self.signum = True, self.signum or signum
        if self._interruptible:
            raise StopRequested

    def flags(self) -> list[bool]:
        """Which stop signal came to this rank, one flag per signal: what the ranks sum to agree on a stop."""
        return [self.signum == s for s in STOP_SIGNALS]

    def agree(self, sums) -> bool:
        """Act on the ranks' summed `flags`: a signal that came to any rank is this rank's too (the stop's name and
        exit status, and the recipe's next stage not started); True where one came."""
        came = [s for s, n in zip(STOP_SIGNALS, sums, strict=True) if n]
        if came and self.signum is None:
            self.signum = came[0]
        return bool(came)

    def agreed(self) -> bool:
        """Whether a stop signal came to any rank (`agree`), summed now: under DDP a collective every rank calls."""
        flags = self.flags()
        if self.rt.distributed:
            flags = runtime.all_reduce_sum(runtime.device_tensor([float(f) for f in flags], self.rt.device),
                                           self.rt).tolist()
        return self.agree(flags)

    def check(self) -> None:
        """A point of an `interruptible` block where a stop abandons it (StopRequested). Under DDP a collective: every
        rank reaches the same points, and all abandon at the first one after any rank's signal."""
        if self.agreed():
            raise StopRequested

    @contextlib.contextmanager
    def interruptible(self):
        """A block that a stop signal abandons (StopRequested) instead of waiting for it to finish: in one process
        wherever the block is when the signal comes; under DDP at its next `check`, where every rank abandons it
        together (a rank leaving alone would leave the others waiting in a collective it never joins, and could
        not save every rank's random streams)."""
        self.check()
        self._interruptible = not self.rt.distributed
        try:
            yield
        finally:
            self._interruptible = False

    def restore(self):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


class ChildSignals:
    """A DataLoader worker's death (SIGCHLD) is acted on before the next batch is fetched, never elsewhere: the
    DataLoader's handler raises wherever the main thread happens to be. Inside a step, an error between the
    optimizer's update and the step's bookkeeping would leave weights and data position out of step with each
    other; while a step is logged, validated or checkpointed it would end the run with a traceback, not as a
    dead worker (checkpoint, message, exit 2)."""

    def __init__(self):
        self.pending, self._previous = False, None

    @contextlib.contextmanager
    def deferred(self):
        self._previous = signal.signal(signal.SIGCHLD, self._note)
        try:
            yield
        finally:
            signal.signal(signal.SIGCHLD, self._previous)

    def _note(self, signum, frame):
        self.pending = True

    def deliver(self) -> None:
        """Run the DataLoader's own handler for a SIGCHLD that came during a step (it raises if a worker died)."""
        if self.pending and callable(self._previous):
            self.pending = False
            self._previous(signal.SIGCHLD, None)


class Consensus:
    """What every rank must decide alike between steps (a stop signal came, the time is up), or the others would
    wait forever in the next all-reduce: each flag summed across the ranks, any rank's yes everyone's. Without DDP,
    this process's own flags, at once. Under DDP the sums of step n's flags are read once step n + 1 is queued
    (runtime.LateRead), so no rank's host waits for its device between steps; every rank reads the same sums after
    the same step, so all act together, one step after the flag was raised."""

    def __init__(self, rt: Runtime):
        self.rt, self.unread = rt, None

    def __call__(self, *flags: bool) -> list[bool]:
        if not self.rt.distributed:
            return list(flags)
        sums = runtime.all_reduce_sum(runtime.device_tensor([float(f) for f in flags], self.rt.device), self.rt)
        previous, self.unread = self.unread, runtime.LateRead(sums)
        return [False] * len(flags) if previous is None else [v > 0 for v in previous.get().tolist()]


def save_now(session: Session, every_rank: bool = True) -> None:
    """The current step's checkpoint: rank 0 writes it (the others hold the same weights) with every rank's random
    streams, gathered from all of them (`every_rank`: all ranks call this together), or with its own alone (one
    rank on its way out: a gather would wait for the others forever)."""
    rng = rng_states(session.rt, gather=every_rank)
    if session.rt.is_main:
        checkpoint.save_step(session.snapshot(rng), session.cfg.run_dir, session.cfg.train.keep_last)


def worker_died(exc: BaseException, workers: int) -> bool:
    """Is this what fetching a batch raises when one of the DataLoader's `workers` processes died? The loader's own
    error, or, when the worker dies while handing over a batch (its tensors' file descriptors), the broken
    connection to it, raised before the loader has seen the worker exit."""
    text = str(exc)
    return (isinstance(exc, RuntimeError) and "DataLoader worker" in text and (
        "killed by signal" in text or "exited unexpectedly" in text)) or (
        workers > 0 and isinstance(exc, ConnectionError | EOFError))


def dead_worker(session: Session, stop: StopFlag, exc: Exception) -> None:
    """A DataLoader worker died, noticed between steps: checkpoint, then stop as a stop signal does when one came
    (a signal sent to the process group can reach a worker before it ignores signals), or abort clearly (the
    out-of-memory killer's SIGKILL is the usual cause). Under DDP the worker is one rank's, and the others are
    already in the next step's collectives: no checkpoint is written (one rank cannot gather every rank's random
    streams, so a resume from it would not be exact), and the run resumes exactly from its latest one."""
    cfg = session.cfg
    if not session.rt.distributed:
        save_now(session, every_rank=False)
    if stop.requested:
        written = f"no checkpoint under DDP: the run resumes from {checkpoint.latest_path(cfg.run_dir)}" \
            if session.rt.distributed else "checkpoint written"
        session.monitor.write(f"stopping at step {session.progress['step']}: {stop.name} (a DataLoader worker "
                              f"ended with it); {written}")
        return
    what = exc if isinstance(exc, RuntimeError) else \
        f"a DataLoader worker died while handing over a batch ({type(exc).__name__}: {exc})"
    raise TrainingAborted(
        f"{what} (step {session.progress['step']}). When a worker is killed by SIGKILL it is usually the system's "
        f"out-of-memory killer: lower data.num_workers (now {cfg.data.num_workers}) or data.prefetch_factor "
        f"(now {cfg.data.prefetch_factor}), or free memory. "
        + (f"This rank's alone (rank {session.rt.rank}): the other ranks end at their next collective, and the run "
           f"resumes from its latest checkpoint ({checkpoint.latest_path(cfg.run_dir) or 'none yet: from the start'})"
           if session.rt.distributed else "The last completed step was checkpointed")
        + "; run the same command again to resume exactly.") from None


def out_of_memory(exc: BaseException, micro_batches: list[dict], cfg: Config, rt: Runtime, step: int):
    """The message for a step that ran out of memory: its shapes, the devices' memory, and what to change."""
    shapes = ", ".join(f"{tuple(b['src_ids'].shape)}->{tuple(b['tgt_in'].shape)}" for b in micro_batches)
    tokens = sum(b["n_src"] + b["n_tgt"] for b in micro_batches)
    graphs = ("; captured steps (train.cuda_graphs) keep their memory in a pool of their own, beside that of the "
              "eager steps that log per-module statistics: train.cuda_graphs=false, or train.module_stats=false, "
              "frees one of them") if cfg.train.cuda_graphs and rt.device.type == "cuda" else ""
    return TrainingAborted(
        f"out of memory at step {step} ({type(exc).__name__}); batch shapes {shapes}, {tokens} tokens; "
        f"{'; '.join(memory_report(d) for d in rt.devices)}. Lower data.batch_tokens (now {cfg.data.batch_tokens}) "
        f"and raise train.accum_steps (now {cfg.train.accum_steps}) to keep the same effective batch"
        f"{graphs}. Checkpoints already written are intact; the run resumes from the latest.")


def rank_failed(exc: BaseException, rt: Runtime, step: int) -> TrainingAborted | None:
    """The message for a collective that failed because another rank of the run died; None for other errors."""
    if not rt.distributed or not isinstance(exc, RuntimeError):
        return None
    text = str(exc)
    if not (isinstance(exc, torch.distributed.DistError) or "gloo" in text.lower() or "nccl" in text.lower()
            or "Connection closed by peer" in text or "Connection reset by peer" in text):
        return None
    first = text.strip().splitlines()[0][:200] if text.strip() else type(exc).__name__
    return TrainingAborted(
        f"rank {rt.rank}: another rank of the run stopped during step {step + 1} ({first}); every rank stops. "
        f"Checkpoints already written are intact: run the same command again to resume from the latest.")


def run_dir_removed(exc: BaseException | None, cfg: Config) -> TrainingAborted | None:
    """The message for a run whose dir was removed (or moved) while it trained, noticed by a write that failed
    (`exc`) or by `check_run_dir`; None for other errors. The ownership marker tells: a checkpoint's write makes
    its dir again, empty, and a log file still open follows the dir wherever it was moved."""
    if (exc is not None and not isinstance(exc, FileNotFoundError)) or (cfg.run_dir / MARKER).exists():
        return None
    what = f" ({exc.filename} could not be written)" if exc is not None else ""
    return TrainingAborted(
        f"the run dir {cfg.run_dir} was removed while the run trained{what}: its checkpoints went with it, so "
        f"nothing more can be saved there. Start the run again (it begins anew), or with another run.dir")


def check_run_dir(session: Session) -> None:
    """Stop the run when its dir has gone (rank 0, which owns it): writing on would fill a dir that is no longer
    this run's, and a later resume would find it unmarked and refuse it."""
    if session.rt.is_main:
        removed = run_dir_removed(None, session.cfg)
        if removed is not None:
            raise removed


def roll_back_spike(session: Session, fetched: list, out: dict) -> bool:
    """True when this step's loss was a spike and the run went back to its newest checkpoint, never to train on
    this step's batches again (summarizer/train/watch/spikes.py); the step's loss joins the window otherwise."""
    train_cfg, progress = session.cfg.train, session.progress
    step, loss = progress["step"], spikes.step_loss(out, session.rt)
    threshold = spikes.limit(progress, train_cfg)
    if threshold is None or loss <= threshold:
        spikes.remember(progress, loss, train_cfg)
        return False
    batches = [[epoch, position] for _, epoch, position in fetched]
    recent = spikes.too_many([*session.rollbacks, {"step": step}], step, train_cfg)
    if recent:
        raise TrainingAborted(
            f"loss spike at step {step} ({loss:.3f} > {threshold:.3f}): {len(recent)} rollbacks within "
            f"train.spike_window={train_cfg.spike_window} steps (at steps {', '.join(map(str, recent))}), so the "
            f"spikes are not a few bad batches. Lower train.lr (now {train_cfg.lr}) or raise train.warmup_steps, "
            f"raise train.spike_factor (now {train_cfg.spike_factor}), or set it to 0 to train through them. "
            f"Checkpoints already written are intact; manifest.json lists the rollbacks (spike_rollbacks)")
    spike = (f"loss spike ({loss:.3f} > {threshold:.3f}, mean + {train_cfg.spike_factor} std of the last "
             f"{train_cfg.spike_window} steps)")
    to = rollback(session)
    if to is None:
        session.monitor.write(f"step {step}: {spike}, but no checkpoint to roll back to yet: training on")
        return False
    record = {"step": step, "loss": loss, "threshold": threshold, "batches": batches, "rolled_back_to": to}
    session.rollbacks.append(record)
    session.skip.update(tuple(b) for b in batches)
    if session.rt.is_main:
        add_rollback(session.cfg.run_dir, record)
    session.monitor.write(f"step {step}: {spike}: rolled back to step {to}; the batches at (epoch, position) "
                          f"{', '.join(map(str, map(tuple, batches)))} are skipped from now on (manifest.json)")
    return True
