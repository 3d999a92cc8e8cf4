"""The visible training loop: `train_step`, `train(cfg)` and what happens after each step; each practice
is a config switch. A run's state is summarizer/train/session.py, what it measures summarizer/train/validation.py."""
from __future__ import annotations

import contextlib
import math
import signal
import time
from dataclasses import dataclass

import torch
from torch import nn

from summarizer import runtime
from summarizer.config.schema import Config, TrainConfig
from summarizer.errors import UserError
from summarizer.model import checkpoint
from summarizer.outputs import release_lock
from summarizer.runtime import Runtime, move_batch
from summarizer.train.losses import smoothed_nll
from summarizer.train.session import Session, open_session, rollback
from summarizer.train.validation import validate
from summarizer.train.watch import spikes
from summarizer.train.watch.flops import batch_flops, peak_flops
from summarizer.train.watch.module_stats import ModuleStats
from summarizer.train.watch.monitor import Profiler, Window, add_rollback, flatten, memory_report
from summarizer.train.watch.nonfinite import first_nonfinite


class TrainingAborted(UserError):
    """Training cannot go on (non-finite losses, out of memory); the message says what to change."""


def train_step(model: nn.Module, optimizer, scaler, micro_batches: list[dict], rt: Runtime,
               cfg: TrainConfig, stats: ModuleStats | None = None) -> dict:
    """One optimizer step over k micro-batches. Returns tensors: nothing here forces a host sync
    except the single finiteness check of the gradient norm (and, given `stats`, its one read of the
    per-module statistics, as out["modules"])."""
    total = sum(b["n_tgt"] for b in micro_batches)
    if rt.distributed:  # every rank divides by the global token count, so DDP's mean is the exact mean
        total = int(runtime.all_reduce_sum(torch.tensor(total, device=rt.device), rt))
    losses, nlls = [], []
    for i, batch in enumerate(micro_batches):
        # Gradients are all-reduced only on the last micro-batch; the others accumulate locally.
        sync = rt.distributed and i < len(micro_batches) - 1
        with model.no_sync() if sync else contextlib.nullcontext():
            with rt.compute():
                out = model(batch["src_ids"], batch["tgt_in"])  # logits (B, T, V) [+ copy attention, gate]
            loss, nll = smoothed_nll(out, batch["tgt_out"], batch["src_ids"], cfg.label_smoothing, cfg.fused_loss)
            scaler.scale(loss * (rt.world_size / total)).backward()
        losses.append(loss.detach())
        nlls.append(nll)
        del out, loss  # drop graph references before the next micro-batch allocates its own
    scaler.unscale_(optimizer)  # clip the true gradients, not the fp16-scaled ones
    if stats is not None:
        stats.before_update()
    grad_norm = nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_norm if cfg.clip_norm > 0 else math.inf)
    finite = bool(torch.isfinite(grad_norm))
    if scaler.is_enabled():
        scaler.step(optimizer)  # skips the update by itself on inf/nan gradients
        scaler.update()
    elif finite:
        optimizer.step()
    modules = stats.after_update() if stats is not None else {}
    optimizer.zero_grad(set_to_none=cfg.set_to_none)
    # Local sums; `tokens` is the global target count they are normalised by (Window all-reduces).
    return {"loss_sum": torch.stack(losses).sum(), "nll_sum": torch.stack(nlls).sum(), "tokens": total,
            "grad_norm": grad_norm.detach(), "finite": finite, "modules": modules}


class StopFlag:
    """SIGINT/SIGTERM ask the loop to checkpoint and exit; a second SIGINT interrupts at once."""

    def __init__(self):
        self.signum: int | None = None
        self._previous = {s: signal.signal(s, self._handle) for s in (signal.SIGINT, signal.SIGTERM)}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def _handle(self, signum, frame):
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signum = signum

    def restore(self):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def oom_message(exc: BaseException, micro_batches: list[dict], cfg: Config, rt: Runtime, step: int) -> str:
    shapes = ", ".join(f"{tuple(b['src_ids'].shape)}->{tuple(b['tgt_in'].shape)}" for b in micro_batches)
    tokens = sum(b["n_src"] + b["n_tgt"] for b in micro_batches)
    return (f"out of memory at step {step} ({type(exc).__name__}); batch shapes {shapes}, {tokens} tokens; "
            f"{'; '.join(memory_report(d) for d in rt.devices)}. "
            f"Lower data.batch_tokens (now {cfg.data.batch_tokens}) and "
            f"raise train.accum_steps (now {cfg.train.accum_steps}) to keep the same effective batch. "
            f"Checkpoints already written are intact; the run resumes from the latest.")


class ChildSignals:
    """A DataLoader worker's death (SIGCHLD) is acted on between steps, never inside one: the DataLoader's
    handler raises wherever the main thread happens to be, and an error between the optimizer's update and
    the step's bookkeeping would leave weights and data position out of step with each other."""

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


def worker_died(exc: RuntimeError) -> bool:
    """Is this the error the DataLoader raises when one of its worker processes died?"""
    return "DataLoader worker" in str(exc) and ("killed by signal" in str(exc) or "exited unexpectedly" in str(exc))


def next_batches(s: Session, cfg: Config, children: ChildSignals) -> list:
    """The step's micro-batches (first acting on a worker's death noticed during the last step)."""
    children.deliver()
    return [next(s.stream) for _ in range(cfg.train.accum_steps)]


def abort_for_dead_worker(s: Session, cfg: Config, exc: RuntimeError) -> None:
    """A DataLoader worker died (the OOM killer's SIGKILL is the usual cause). This is only ever raised between
    steps (ChildSignals), where weights and data position agree: checkpoint them, then abort clearly."""
    if s.rt.is_main:
        checkpoint.save_step(s.snapshot(), cfg.run_dir, cfg.train.keep_last)
    raise TrainingAborted(
        f"{exc} (step {s.progress['step']}). When a worker is killed by SIGKILL it is usually the system's "
        f"out-of-memory killer: lower data.num_workers (now {cfg.data.num_workers}) or data.prefetch_factor "
        f"(now {cfg.data.prefetch_factor}), or free memory. The last completed step was checkpointed; run the "
        f"same command again to resume exactly.") from None


def _agree(flag: bool, rt: Runtime) -> bool:
    """Every rank stops together, or the others would wait forever in the next all-reduce."""
    if not rt.distributed:
        return flag
    return bool(runtime.all_reduce_sum(torch.tensor(float(flag), device=rt.device), rt) > 0)


@dataclass
class Loop:
    """What the training loop carries from step to step besides the session."""
    stop: StopFlag
    window: Window
    profiler: Profiler | None
    started: float  # perf_counter() at the run's step 0, resumed time included
    module_stats: ModuleStats | None = None  # train.module_stats: read on logged steps
    bad_in_row: int = 0


def train(cfg: Config) -> dict:
    """Train (or resume) the run `cfg.run.name` until max_steps, max_minutes, a signal or early stopping."""
    s = open_session(cfg)
    t, rt, progress = cfg.train, s.rt, s.progress
    profiler = Profiler(t.profile_steps, cfg.tensorboard_dir / "profile", cfg.run_dir / "profile.txt",
                        any(d.type == "cuda" for d in rt.devices)) if t.profile_steps > 0 and rt.is_main else None
    stop, children = StopFlag(), ChildSignals()
    peak, origin = peak_flops(rt.device, rt.precision, t.peak_flops)
    s.monitor.write(f"peak for MFU: {peak / 1e12:.3g} TFLOP/s per device, {origin}")
    loop = Loop(stop, Window(rt, peak_flops=peak), profiler, time.perf_counter() - progress["elapsed_s"],
                ModuleStats(s.model) if t.module_stats else None)
    try:
        try:
            while progress["step"] < t.max_steps:
                t0 = time.perf_counter()
                fetched = next_batches(s, cfg, children)
                with children.deferred():
                    if step_once(s, cfg, fetched, time.perf_counter() - t0, loop):
                        break
        except RuntimeError as exc:
            if not worker_died(exc):
                raise
            abort_for_dead_worker(s, cfg, exc)
        best = progress["best"] or {"metric": t.select_by, "value": float("nan")}
        s.monitor.hparams(flatten(cfg), {f"best/{best['metric']}": best["value"], "hparam/steps": progress["step"]})
    finally:
        stop.restore()
        s.monitor.close()
        if s.lock is not None:
            release_lock(s.lock)
    return {"steps": progress["step"], "best": progress["best"], "minutes": progress["elapsed_s"] / 60,
            "run_dir": str(cfg.run_dir), "signal": stop.signum}


def step_once(s: Session, cfg: Config, fetched: list, data_s: float, loop: Loop) -> bool:
    """One optimizer step on `fetched` micro-batches, then logging, validation and checkpoints on their
    intervals; True when training must stop now."""
    t, rt, progress, window = cfg.train, s.rt, s.progress, loop.window
    micro = [move_batch(batch, rt.device) for batch, _, _ in fetched]
    _, epoch, position = fetched[-1]
    try:
        logged = (progress["step"] + 1) % t.log_every == 0
        out = train_step(s.model, s.optimizer, s.scaler, micro, rt, t, loop.module_stats if logged else None)
    except (torch.OutOfMemoryError, MemoryError) as exc:
        raise TrainingAborted(oom_message(exc, micro, cfg, rt, progress["step"])) from None
    s.scheduler.step()
    if s.ema is not None:
        s.ema.update_parameters(runtime.unwrap(s.model))
    progress.update(step=progress["step"] + 1, epoch=epoch, position=position,
                    elapsed_s=time.perf_counter() - loop.started)
    if t.spike_factor and out["finite"] and watch_spikes(s, cfg, fetched, out, loop):
        return False  # rolled back: the loop goes on from the checkpoint
    flops = [batch_flops(s.cfg.model, s.meta["vocab_size"], batch) for batch, _, _ in fetched]  # CPU tensors
    window.add(out, micro, data_s, (sum(f[0] for f in flops), sum(f[1] for f in flops)))
    overflow = s.scaler.is_enabled() and s.scaler.get_scale() >= 1.0  # fp16 scale search, not a fault
    loop.bad_in_row = 0 if out["finite"] or overflow else loop.bad_in_row + 1
    if loop.bad_in_row:
        where = first_nonfinite(s.model, micro, rt, t)
        s.monitor.write(f"step {progress['step']}: non-finite loss or gradients, step skipped (batch {position} of "
                        f"epoch {epoch} in the data order); the first NaN/inf: {where}")
    del micro, fetched  # free this step's batch before the next one is fetched
    if loop.bad_in_row >= t.max_bad_steps:
        raise TrainingAborted(
            f"{loop.bad_in_row} optimizer steps in a row had non-finite loss or gradients (step "
            f"{progress['step']}; the first NaN/inf: {where}); lower train.lr (now {t.lr}), raise "
            f"train.warmup_steps, keep train.clip_norm > 0, or use train.precision=fp32 to rule out overflow")
    s.monitor.advance()
    if loop.profiler:
        loop.profiler.step(progress["step"])
    time_up = _agree(bool(t.max_minutes) and progress["elapsed_s"] >= 60 * t.max_minutes or loop.stop.requested,
                     rt)
    if after_step(s, window, out, time_up):
        reason = "signal" if loop.stop.requested else "time limit" if time_up else "early stopping"
        s.monitor.write(f"stopping at step {progress['step']}: {reason}")
        return True
    return False


def watch_spikes(s: Session, cfg: Config, fetched: list, out: dict, loop: Loop) -> bool:
    """summarizer/train/watch/spikes.py: True when this step's loss was a spike and the run went back to its newest
    checkpoint, never to train on this step's batches again; the step's loss joins the window otherwise."""
    t, progress = cfg.train, s.progress
    step, loss = progress["step"], spikes.step_loss(out, s.rt)
    threshold = spikes.limit(progress, t)
    if threshold is None or loss <= threshold:
        spikes.remember(progress, loss, t)
        return False
    batches = [[epoch, position] for _, epoch, position in fetched]
    recent = spikes.too_many([*s.rollbacks, {"step": step}], step, t)
    if recent:
        raise TrainingAborted(
            f"loss spike at step {step} ({loss:.3f} > {threshold:.3f}): {len(recent)} rollbacks within "
            f"train.spike_window={t.spike_window} steps (at steps {', '.join(map(str, recent))}), so the spikes "
            f"are not a few bad batches. Lower train.lr (now {t.lr}) or raise train.warmup_steps, raise "
            f"train.spike_factor (now {t.spike_factor}), or set it to 0 to train through them. Checkpoints already "
            f"written are intact; manifest.json lists the rollbacks (spike_rollbacks)")
    to = rollback(s)
    if to is None:
        s.monitor.write(f"step {step}: loss spike ({loss:.3f} > {threshold:.3f}, mean + {t.spike_factor} std of "
                        f"the last {t.spike_window} steps), but no checkpoint to roll back to yet: training on")
        return False
    record = {"step": step, "loss": loss, "threshold": threshold, "batches": batches, "rolled_back_to": to}
    s.rollbacks.append(record)
    s.skip.update(tuple(b) for b in batches)
    if s.rt.is_main:
        add_rollback(cfg.run_dir, record)
    loop.window.reset()
    loop.bad_in_row = 0
    s.monitor.write(f"step {step}: loss spike ({loss:.3f} > {threshold:.3f}, mean + {t.spike_factor} std of the "
                    f"last {t.spike_window} steps): rolled back to step {to}; the batches at (epoch, position) "
                    f"{', '.join(map(str, map(tuple, batches)))} are skipped from now on (manifest.json)")
    return True


def after_step(s: Session, window: Window, out: dict, time_up: bool) -> bool:
    """Log, validate and checkpoint on their intervals; True when training must stop now."""
    t, step = s.cfg.train, s.progress["step"]
    final = step >= t.max_steps or time_up
    lr = s.scheduler.get_last_lr()[0]
    if step % t.log_every == 0 or final:
        s.monitor.log(step, "train", {**window.summary(lr, out["grad_norm"]), **out["modules"]})
        window.reset()
    rouge = bool(t.rouge_every) and (step % t.rouge_every == 0 or final)
    evaluate = step % t.eval_every == 0 or final or rouge
    early_stop = evaluate and validate(s, {"lr": lr, "grad_norm": out["grad_norm"].item()}, rouge)
    save = step % t.ckpt_every == 0 or final or early_stop
    if save and s.rt.is_main:
        checkpoint.save_step(s.snapshot(), s.cfg.run_dir, t.keep_last)
    if evaluate or save:
        window.reset()  # evaluation and checkpoint writing are not training throughput
    return time_up or early_stop


