"""The visible training loop: `train_step`, `train(cfg)` and what happens after each step; each practice is a
config switch. A run's state is session.py, what it measures validation.py, what stops it safely guard.py."""
from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from summarizer import runtime
from summarizer.config.schema import Config, TrainConfig
from summarizer.runtime import Runtime, move_batch
from summarizer.train.graphs import step_function
from summarizer.train.guard import (
    ChildSignals,
    Consensus,
    StopFlag,
    StopRequested,
    TrainingAborted,
    check_run_dir,
    dead_worker,
    out_of_memory,
    rank_failed,
    roll_back_spike,
    run_dir_removed,
    save_now,
    worker_died,
)
from summarizer.train.losses import smoothed_nll
from summarizer.train.optim import step_if_finite
from summarizer.train.session import Session, open_session
from summarizer.train.validation import validate
from summarizer.train.watch.flops import batch_flops, peak_flops
from summarizer.train.watch.module_stats import ModuleStats
from summarizer.train.watch.monitor import Profiler, Window, flatten
from summarizer.train.watch.nonfinite import first_nonfinite


def train_step(model: nn.Module, optimizer, scaler, micro_batches: list[dict], rt: Runtime,
               cfg: TrainConfig, stats: ModuleStats | None = None, scale: torch.Tensor | None = None) -> dict:
    """One optimizer step over k micro-batches. Returns tensors, `finite` among them (the gradients were finite and
    the update was made): nothing here reads the device, so the host queues the next step while this one runs,
    except where `stats` are given (their one read, as out["modules"]) and where the optimizer is not fused (it
    reads `finite` before it steps; so does GradScaler's step with one). `scale`, what the summed losses are
    multiplied by, is world size / the global target tokens unless given (a tensor a CUDA graph reads: graphs.py)."""
    total = sum(b["n_tgt"] for b in micro_batches)
    if rt.distributed:  # every rank divides by the global token count, so DDP's mean is the exact mean; it stays
        # on the device (a tensor), so summing it across ranks costs no host sync
        total = runtime.all_reduce_sum(runtime.device_tensor(float(total), rt.device), rt)
    if scale is None:
        scale = rt.world_size / total
    losses, nlls = [], []
    for i, batch in enumerate(micro_batches):
        # Gradients are all-reduced only on the last micro-batch; the others accumulate locally.
        sync = rt.distributed and i < len(micro_batches) - 1
        with model.no_sync() if sync else contextlib.nullcontext():
            with rt.compute():
                out = model(batch["src_ids"], batch["tgt_in"])  # logits (B, T, V) [+ copy attention, gate]
            loss, nll = smoothed_nll(out, batch["tgt_out"], batch["src_ids"], cfg.label_smoothing, cfg.fused_loss)
            scaler.scale(loss * scale).backward()
        losses.append(loss.detach())
        nlls.append(nll)
        del out, loss  # drop graph references before the next micro-batch allocates its own
    scaler.unscale_(optimizer)  # clip the true gradients, not the fp16-scaled ones
    if stats is not None:
        stats.before_update()
    grad_norm = nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_norm if cfg.clip_norm > 0 else math.inf)
    finite = torch.isfinite(grad_norm)  # on the device: the loop reads it while the next step runs (Unread)
    if scaler.is_enabled():
        scaler.step(optimizer)  # skips the update by itself on inf/nan gradients
        scaler.update()
    else:
        step_if_finite(optimizer, finite, in_kernel={d.type for d in rt.devices} != {"cuda", "cpu"})
    modules = stats.after_update() if stats is not None else {}
    optimizer.zero_grad(set_to_none=cfg.set_to_none)
    # Local sums; `tokens` is the global target count they are normalised by (Window all-reduces).
    return {"loss_sum": torch.stack(losses).sum(), "nll_sum": torch.stack(nlls).sum(), "tokens": total,
            "grad_norm": grad_norm.detach(), "finite": finite, "modules": modules}


@dataclass
class Unread:
    """A finished step whose gradients' finiteness the host has not read yet. It is read after the next step is
    queued (`settle`), so the device never waits for the host between steps."""
    finite: runtime.LateRead
    step: int
    epoch: int
    position: int
    micro_batches: list[dict]  # kept one step longer: a step gone wrong is re-run on them to name its first NaN


@dataclass
class Loop:
    """What the training loop carries from step to step besides the session."""
    stop: StopFlag
    children: ChildSignals
    window: Window
    profiler: Profiler | None
    started: float  # perf_counter() at the run's step 0, resumed time included
    module_stats: ModuleStats | None = None  # train.module_stats: read on logged steps
    compiling: bool = False  # train.compile: this process's first step compiles the model, and says how long it took
    unread: Unread | None = None
    consensus: Consensus | None = None  # the ranks' agreement to stop (a signal, the time limit)
    alone: bool = False  # this rank left the loop by itself (a dead worker): no collective may follow
    step: Callable[..., dict] = train_step  # or its CUDA graphs (train.cuda_graphs: graphs.py)
    lr: float = 0.0  # the learning rate the last step trained with (the scheduler has moved on to the next's)


def start_loop(session: Session) -> Loop:
    """The loop's instruments and signal handling, for a session about to train."""
    train_cfg, rt = session.cfg.train, session.rt
    profiler = Profiler(train_cfg.profile_steps, session.cfg.tensorboard_dir / "profile",
                        session.cfg.run_dir / "profile.txt", rt.cuda_devices,
                        wait=train_cfg.profile_after) \
        if train_cfg.profile_steps > 0 and rt.is_main else None
    peak, origin = peak_flops(rt.device, rt.precision, train_cfg.peak_flops)
    session.monitor.write(f"peak for MFU: {peak / 1e12:.3g} TFLOP/s per device, {origin}")
    if train_cfg.compile:
        session.monitor.write(f"torch.compile ({train_cfg.compile_mode}): the first step compiles the model, for "
                              f"minutes on a large model; a recompilation is printed with its cause")
    step, note = step_function(train_step, session.model, session.optimizer, rt, train_cfg)
    if note:
        session.monitor.write(note)
    return Loop(StopFlag(rt), ChildSignals(), Window(rt, peak_flops=peak), profiler,
                time.perf_counter() - session.progress["elapsed_s"],
                ModuleStats(session.model) if train_cfg.module_stats else None, compiling=train_cfg.compile,
                consensus=Consensus(rt), step=step)


def train(cfg: Config) -> dict:
    """Train (or resume) the run `cfg.run.name` until max_steps, max_minutes, a stop signal or early stopping."""
    session = open_session(cfg)
    progress, rt = session.progress, session.rt
    loop = start_loop(session)
    try:
        ended = pay(session, loop)  # what a stop left owed: this run's first log row and validation
        ended = ended or time_is_up(progress, cfg.train)  # a run stopped on its time's last step trains no more
        while not ended and progress["step"] < cfg.train.max_steps:
            fetch_started = time.perf_counter()
            try:
                loop.children.deliver()  # a worker's death noticed during the last step raises here
                fetched = [next(session.stream) for _ in range(cfg.train.accum_steps)]
            except (RuntimeError, ConnectionError, EOFError) as exc:
                if not worker_died(exc, cfg.data.num_workers):
                    raise
                settle(session, loop)  # the checkpoint dead_worker writes counts the last step too (save_settled)
                dead_worker(session, loop.stop, exc)
                loop.alone = True
                break
            with loop.children.deferred():  # from here to the next fetch: logging, validation, checkpoints too
                out = step_once(session, fetched, time.perf_counter() - fetch_started, loop)
                if out is None:  # a loss spike rolled the run back to its newest checkpoint
                    continue
                *signals, time_up = loop.consensus(*loop.stop.flags(), time_is_up(progress, cfg.train))
                # a signal to any rank: the finished step's checkpoint first, and nothing else (what it owes waits: owe)
                if loop.stop.agree(signals):  # on the step the time limit ends: the run's last row and validation
                    owe(session, loop, out, log=True, final=time_up)
                    save_settled(session, loop)
                    session.monitor.write(f"stopping at step {progress['step']}: {loop.stop.name}; checkpoint "
                                          f"written")
                    break
                if after_step(session, loop, out, time_up):
                    break
        settle(session, loop)
        if not loop.alone:  # a signal no Consensus read (after the last step's): every rank's, as it is one rank's
            loop.stop.agreed()
        best = progress["best"] or {"metric": cfg.train.select_by, "value": float("nan")}
        session.monitor.hparams(flatten(cfg), {f"best/{best['metric']}": best["value"],
                                               "hparam/steps": progress["step"]})
    except (OSError, RuntimeError) as exc:
        known = run_dir_removed(exc, cfg) or rank_failed(exc, rt, progress["step"])
        if known is None:
            raise
        raise known from None
    finally:
        loop.stop.restore()
        session.close()
    return {"steps": progress["step"], "best": progress["best"], "minutes": progress["elapsed_s"] / 60,
            "run_dir": str(cfg.run_dir), "signal": loop.stop.signum,
            "finished": progress["step"] >= cfg.train.max_steps and "owed" not in progress,
            "owes_validation": progress.get("owed", {}).get("validate", False)}


def time_is_up(progress: dict, train_cfg: TrainConfig) -> bool:
    """Whether the run has trained train.max_minutes (0: no limit)."""
    return train_cfg.max_minutes > 0 and progress["elapsed_s"] >= 60 * train_cfg.max_minutes


def step_once(session: Session, fetched: list, data_s: float, loop: Loop) -> dict | None:
    """One optimizer step on `fetched` micro-batches and its bookkeeping: the step's outputs, or None when a
    loss spike rolled the run back."""
    train_cfg, rt, progress = session.cfg.train, session.rt, session.progress
    micro = [move_batch(batch, rt.device) for batch, _, _ in fetched]
    _, epoch, position = fetched[-1]
    started = time.perf_counter()
    try:
        logged = (progress["step"] + 1) % train_cfg.log_every == 0
        out = loop.step(session.model, session.optimizer, session.scaler, micro, rt, train_cfg,
                        loop.module_stats if logged else None)
    except (torch.OutOfMemoryError, MemoryError) as exc:
        raise out_of_memory(exc, micro, session.cfg, rt, progress["step"]) from None
    if loop.compiling:
        loop.compiling = False
        session.monitor.write(f"step {progress['step'] + 1}: compiled and ran in {time.perf_counter() - started:.1f} s")
    settle(session, loop)  # the previous step's, read now that this one is queued behind it
    loop.lr = session.scheduler.get_last_lr()[0]  # the rate this step trained with, which its row reports
    session.scheduler.step()
    if session.ema is not None:
        session.ema.update_parameters(runtime.unwrap(session.model))
    progress.update(step=progress["step"] + 1, epoch=epoch, position=position,
                    elapsed_s=time.perf_counter() - loop.started)
    loop.unread = Unread(runtime.LateRead(out["finite"]), progress["step"], epoch, position, micro)
    if train_cfg.spike_factor and bool(out["finite"]) and roll_back_spike(session, fetched, out):
        loop.window.reset()
        progress["bad_in_row"], loop.unread = 0, None
        return None
    flops = [batch_flops(session.cfg.model, session.meta["vocab_size"], batch) for batch, _, _ in fetched]
    loop.window.add(out, micro, data_s, (sum(f[0] for f in flops), sum(f[1] for f in flops)))
    del micro, fetched  # the step's batches live on in loop.unread alone, until the next step settles it
    session.monitor.advance()
    if loop.profiler:
        loop.profiler.step()
    return out


def due(train_cfg: TrainConfig, step: int, final: bool) -> tuple[bool, bool, bool]:
    """What after_step does at `step`: (log, validate, with ROUGE), each on its interval, and all at the run's end
    (max_steps, or `final`: the time limit)."""
    final = final or step >= train_cfg.max_steps
    rouge = bool(train_cfg.rouge_every) and (step % train_cfg.rouge_every == 0 or final)
    return step % train_cfg.log_every == 0 or final, step % train_cfg.eval_every == 0 or final or rouge, rouge


def owe(session: Session, loop: Loop, out: dict, log: bool, final: bool = False) -> None:
    """Keep in the progress a stop checkpoints what after_step has not done for the finished step: its log row
    (`log`: a stop before after_step; the interval's sums so far go along, Window.state) and its validation,
    with best.pt and patience. `pay` does them when the run resumes, so its logs, validations and best.pt are
    those of a run never stopped."""
    progress = session.progress
    logged, validated, rouge = due(session.cfg.train, progress["step"], final)
    owed = {"log": log and logged, "validate": validated, "rouge": rouge,
            "lr": loop.lr, "grad_norm": float(out["grad_norm"]), "modules": out["modules"]}
    # the stop branch, where every rank is (a collective, on a condition every rank shares); after a log row the
    # window is empty anyway, and a run never stopped empties it after a checkpoint too (after_step)
    if log and (owed["log"] or progress["step"] % session.cfg.train.ckpt_every):
        progress["window"] = loop.window.state()
    if owed["log"] or owed["validate"]:
        progress["owed"] = owed


def pay(session: Session, loop: Loop) -> bool:
    """On resume, what a stop left owed (owe): the interval so far, the log row, then the validation and its
    checkpoint. True when the run must not go on: that validation ran out of patience, or a stop came in it."""
    progress = session.progress
    if (window := progress.pop("window", None)) is not None:
        loop.window.restore(window)
    owed = progress.pop("owed", None)
    if owed is None:
        return False
    step = progress["step"]
    if owed["log"]:
        session.monitor.log(step, "train", {**loop.window.summary(owed["lr"], torch.tensor(owed["grad_norm"])),
                                            **owed["modules"]})
        loop.window.reset()
    if not owed["validate"]:
        save_now(session)  # the step's checkpoint again, owing nothing: a crash now must not log the row twice
        return False
    try:
        early_stop = validate(session, {"lr": owed["lr"], "grad_norm": owed["grad_norm"]}, owed["rouge"], loop.stop)
    except StopRequested:
        progress["owed"] = {**owed, "log": False}
        save_now(session)
        return True
    loop.window.reset()
    save_now(session)
    if early_stop:
        session.monitor.write(f"stopping at step {step}: early stopping")
    return early_stop


def save_settled(session: Session, loop: Loop) -> None:
    """The step's checkpoint (guard.save_now, every rank together), its finiteness read first (settle), so the count
    of non-finite steps in a row that the checkpoint keeps includes it, as a run that goes on counts it at its next
    step."""
    settle(session, loop)
    save_now(session)


def settle(session: Session, loop: Loop) -> None:
    """Act on the unread step's finiteness: a skipped step is named, with its batch and its first NaN/inf, and
    `max_bad_steps` of them in a row abort the run. fp16's scale search skips steps on overflow by design: not a
    fault (get_scale reads the device: only then)."""
    unread, loop.unread = loop.unread, None
    if unread is None:
        return
    train_cfg = session.cfg.train
    finite = bool(unread.finite.get())
    overflow = not finite and session.scaler.is_enabled() and session.scaler.get_scale() >= 1.0
    bad = session.progress["bad_in_row"] = 0 if finite or overflow else session.progress["bad_in_row"] + 1
    if not bad:
        return
    where = first_nonfinite(session.model, unread.micro_batches, session.rt, train_cfg)
    session.monitor.write(f"step {unread.step}: non-finite loss or gradients, step skipped (batch {unread.position} "
                          f"of epoch {unread.epoch} in the data order); the first NaN/inf: {where}")
    if bad >= train_cfg.max_bad_steps:
        raise TrainingAborted(
            f"{bad} optimizer steps in a row had non-finite loss or gradients (step {unread.step}; the "
            f"first NaN/inf: {where}); lower train.lr (now {train_cfg.lr}), raise train.warmup_steps, keep "
            f"train.clip_norm > 0, or use train.precision=fp32 to rule out overflow")


def after_step(session: Session, loop: Loop, out: dict, time_up: bool) -> bool:
    """Log, validate and checkpoint on their intervals; True when training must stop now (`time_up`: the ranks agree
    train.max_minutes is spent). A stop signal during validation abandons it for the checkpoint. Under DDP only what
    every rank knows decides (the step, `time_up`, validation abandoned on every rank at once): a signal that came to
    this rank alone is acted on at the next steps' Consensus, with every rank."""
    train_cfg, step, window = session.cfg.train, session.progress["step"], loop.window
    check_run_dir(session)
    final = step >= train_cfg.max_steps or time_up
    logged, validated, rouge = due(train_cfg, step, final)
    lr = loop.lr
    if logged:
        session.monitor.log(step, "train", {**window.summary(lr, out["grad_norm"]), **out["modules"]})
        window.reset()
    early_stop = abandoned = False
    if validated:
        try:
            early_stop = validate(session, {"lr": lr, "grad_norm": out["grad_norm"].item()}, rouge, loop.stop)
        except StopRequested:
            abandoned = True
            session.monitor.write(f"step {step}: validation abandoned for the checkpoint ({loop.stop.name}); it runs "
                                  f"when the run resumes")
            owe(session, loop, out, log=False, final=final)
        except (RuntimeError, ConnectionError, EOFError) as exc:  # the validation loader's workers die too
            if not worker_died(exc, session.cfg.data.num_workers):
                raise
            settle(session, loop)
            dead_worker(session, loop.stop, exc)  # raises, or returns where a stop signal killed the worker
            loop.alone = True
            return True
        window.reset()  # evaluation is not training throughput
    stopping = abandoned or (loop.stop.requested and not session.rt.distributed)
    if step % train_cfg.ckpt_every == 0 or final or early_stop or stopping:
        save_settled(session, loop)
        window.reset()  # nor is checkpoint writing
    if time_up or early_stop or stopping:
        reason = loop.stop.name or ("time limit" if time_up else "early stopping")
        session.monitor.write(f"stopping at step {step}: {reason}")
        return True
    return False
