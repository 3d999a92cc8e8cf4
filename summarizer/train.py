"""The visible training loop: `train_step`, `evaluate_loss`, `train(cfg)`; each practice is a config switch."""
from __future__ import annotations

import contextlib
import math
import signal
import time

import torch
from torch import nn

from summarizer import checkpoint, runtime
from summarizer.config import Config, TrainConfig, save_config, to_dict
from summarizer.data import PairDataset, TokenBatchSampler, make_loader
from summarizer.decoding import greedy
from summarizer.errors import UserError
from summarizer.losses import smoothed_nll
from summarizer.model import Seq2Seq, count_parameters
from summarizer.monitor import Monitor, flatten, memory_report, peak_memory_mb, write_manifest
from summarizer.optim import build_optimizer, build_scheduler
from summarizer.prepared import open_tokenizer, read_meta
from summarizer.runtime import Runtime, move
from summarizer.tokenizer import Tokenizer


class TrainingAborted(UserError):
    """Training cannot go on (non-finite losses, out of memory); the message says what to change."""


def to_device(batch: dict, rt: Runtime) -> dict:
    """Source ids to the encoder's device, targets to the decoder's; non-blocking from pinned memory."""
    return {"src_ids": move(batch["src_ids"], rt.device), "tgt_in": move(batch["tgt_in"], rt.decoder_device),
            "tgt_out": move(batch["tgt_out"], rt.decoder_device), "n_src": batch["n_src"], "n_tgt": batch["n_tgt"]}


def train_step(model: nn.Module, optimizer, scaler, micro_batches: list[dict], rt: Runtime,
               cfg: TrainConfig) -> dict:
    """One optimizer step over k micro-batches. Returns tensors: nothing here forces a host sync
    except the single finiteness check of the gradient norm."""
    total = sum(b["n_tgt"] for b in micro_batches)
    if rt.distributed:  # every rank divides by the global token count, so DDP's mean is the exact mean
        total = int(runtime.all_reduce_sum(torch.tensor(total, device=rt.decoder_device), rt))
    loss_sum = torch.zeros((), device=rt.decoder_device)
    nll_sum = torch.zeros((), device=rt.decoder_device)
    for i, batch in enumerate(micro_batches):
        # Gradients are all-reduced only on the last micro-batch; the others accumulate locally.
        sync = rt.distributed and i < len(micro_batches) - 1
        with model.no_sync() if sync else contextlib.nullcontext():
            with rt.autocast():
                log_probs = model(batch["src_ids"], batch["tgt_in"])  # (B, T, V) float32
            loss, nll = smoothed_nll(log_probs, batch["tgt_out"], cfg.label_smoothing)
            scaler.scale(loss * (rt.world_size / total)).backward()
        loss_sum += loss.detach()
        nll_sum += nll
        del log_probs, loss  # drop graph references before the next micro-batch allocates its own
    scaler.unscale_(optimizer)  # clip the true gradients, not the fp16-scaled ones
    grad_norm = nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_norm if cfg.clip_norm > 0 else math.inf)
    finite = bool(torch.isfinite(grad_norm))
    if scaler.is_enabled():
        scaler.step(optimizer)  # skips the update by itself on inf/nan gradients
        scaler.update()
    elif finite:
        optimizer.step()
    optimizer.zero_grad(set_to_none=cfg.set_to_none)
    return {"loss_sum": loss_sum, "nll_sum": nll_sum, "tokens": total / rt.world_size,
            "grad_norm": grad_norm.detach(), "finite": finite}


@torch.inference_mode()
def evaluate_loss(model: nn.Module, loader, rt: Runtime) -> dict:
    """Token-level NLL and perplexity of a split, without dropout or graph building."""
    was_training = model.training
    model.eval()
    nll_sum = torch.zeros((), device=rt.decoder_device, dtype=torch.float64)
    tokens = 0
    for batch in loader:
        batch = to_device(batch, rt)
        with rt.autocast():
            log_probs = model(batch["src_ids"], batch["tgt_in"])
        nll_sum += smoothed_nll(log_probs, batch["tgt_out"], 0.0)[1].double()
        tokens += batch["n_tgt"]
    totals = runtime.all_reduce_sum(torch.stack([nll_sum, torch.tensor(float(tokens), device=nll_sum.device,
                                                                       dtype=torch.float64)]), rt)
    model.train(was_training)
    loss = float(totals[0] / totals[1].clamp_min(1))
    return {"loss": loss, "ppl": math.exp(min(loss, 50.0)), "tokens": int(totals[1])}


def batches_forever(loader, sampler: TokenBatchSampler, epoch: int, position: int):
    """Yield (batch, epoch, position after it), epoch after epoch, starting mid-epoch if resuming."""
    while True:
        sampler.set_epoch(epoch, position)
        for batch in loader:
            position += 1
            yield batch, epoch, position
        epoch, position = epoch + 1, 0


class StopFlag:
    """SIGINT/SIGTERM ask the loop to checkpoint and exit; a second SIGINT interrupts at once."""

    def __init__(self):
        self.requested = False
        self._previous = {s: signal.signal(s, self._handle) for s in (signal.SIGINT, signal.SIGTERM)}

    def _handle(self, signum, frame):
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = True

    def restore(self):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def build(cfg: Config, rt: Runtime, meta: dict):
    """Model, optimizer, scheduler and scaler, placed on their devices (not yet DDP-wrapped)."""
    model = runtime.place_model(Seq2Seq(cfg.model, meta["vocab_size"]), rt, cfg.placement.pipeline_chunks)
    optimizer = build_optimizer(model, cfg.train)
    return model, optimizer, build_scheduler(optimizer, cfg.train), runtime.make_scaler(rt)


def restore(state: dict, model, optimizer, scheduler, scaler) -> dict:
    runtime.unwrap(model).load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    scaler.load_state_dict(state["scaler"])
    checkpoint.set_rng_state(state["rng"])
    return state["progress"]


def snapshot(cfg: Config, meta: dict, model, optimizer, scheduler, scaler, progress: dict) -> dict:
    """Everything a resumed run needs, from the unwrapped module (never the DDP/placement wrapper)."""
    return {"model": runtime.unwrap(model).state_dict(), "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(), "rng": checkpoint.rng_state(),
            "progress": dict(progress), "step": progress["step"], "config": to_dict(cfg),
            "data_meta": {k: meta.get(k) for k in ("spm_sha256", "vocab_size", "normalization", "fingerprint")}}


def sample_summaries(model, dataset: PairDataset, tokenizer: Tokenizer, rt: Runtime, n: int) -> str:
    if n <= 0:
        return ""
    pairs = [dataset[i] for i in range(min(n, len(dataset)))]
    src = torch.zeros(len(pairs), max(len(s) for s, _ in pairs), dtype=torch.long)
    for row, (s, _) in enumerate(pairs):
        src[row, :len(s)] = torch.from_numpy(s.astype("int64"))
    with rt.autocast():
        hyps = greedy(runtime.decoding_model(model), move(src, rt.device), max_len=dataset.max_target_len)
    return "\n\n".join(f"source: {tokenizer.decode(s.tolist())}  \nreference: {tokenizer.decode(t.tolist())}  \n"
                       f"greedy: {tokenizer.decode(h)}" for (s, t), h in zip(pairs, hyps))


class Window:
    """Sums between two log points, kept as device tensors so logging costs one sync per interval."""

    def __init__(self, device: torch.device):
        self.device = device
        self.reset()

    def reset(self):
        self.steps, self.tokens, self.data_s, self.skipped = 0, 0, 0.0, 0
        self.nll = torch.zeros((), device=self.device)
        self.loss = torch.zeros((), device=self.device)
        self.started = time.perf_counter()

    def add(self, out: dict, micro_batches: list[dict], data_s: float):
        self.steps += 1
        self.tokens += sum(b["n_src"] + b["n_tgt"] for b in micro_batches)
        self.data_s += data_s
        self.skipped += not out["finite"]
        self.nll += out["nll_sum"] / out["tokens"]
        self.loss += out["loss_sum"] / out["tokens"]

    def summary(self, lr: float, grad_norm: torch.Tensor, device: torch.device) -> dict:
        seconds = time.perf_counter() - self.started
        return {"loss": (self.nll / self.steps).item(), "smoothed_loss": (self.loss / self.steps).item(),
                "lr": lr, "grad_norm": grad_norm.item(), "tokens_per_s": self.tokens / seconds,
                "step_s": seconds / self.steps, "data_wait": self.data_s / seconds,
                "skipped_steps": self.skipped, "peak_memory_mb": peak_memory_mb(device)}


def make_profiler(cfg: Config, rt: Runtime):
    if cfg.train.profile_steps <= 0 or not rt.is_main:
        return None
    activities = [torch.profiler.ProfilerActivity.CPU]
    if rt.decoder_device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return torch.profiler.profile(
        activities=activities, record_shapes=True, profile_memory=True,
        schedule=torch.profiler.schedule(wait=1, warmup=1, active=cfg.train.profile_steps, repeat=1),
        on_trace_ready=torch.profiler.tensorboard_trace_handler(str(cfg.tensorboard_dir / "profile")))


def oom_message(exc: BaseException, micro_batches: list[dict], cfg: Config, rt: Runtime, step: int) -> str:
    shapes = ", ".join(f"{tuple(b['src_ids'].shape)}->{tuple(b['tgt_in'].shape)}" for b in micro_batches)
    tokens = sum(b["n_src"] + b["n_tgt"] for b in micro_batches)
    return (f"out of memory at step {step} ({type(exc).__name__}); batch shapes {shapes}, {tokens} tokens; "
            f"{memory_report(rt.decoder_device)}. Lower data.batch_tokens (now {cfg.data.batch_tokens}) and "
            f"raise train.accum_steps (now {cfg.train.accum_steps}) to keep the same effective batch. "
            f"Checkpoints already written are intact; the run resumes from the latest.")


def _agree(flag: bool, rt: Runtime) -> bool:
    """Every rank stops together, or the others would wait forever in the next all-reduce."""
    if not rt.distributed:
        return flag
    return bool(runtime.all_reduce_sum(torch.tensor(float(flag), device=rt.decoder_device), rt) > 0)


def train(cfg: Config) -> dict:
    """Train (or resume) the run `cfg.run.name`; returns a summary of the run."""
    rt = runtime.setup(cfg)
    runtime.seed_everything(cfg.train.seed, cfg.train.deterministic)
    meta = read_meta(cfg.data.dir)
    tokenizer = open_tokenizer(cfg.data.dir)
    run_dir, t = cfg.run_dir, cfg.train
    run_dir.mkdir(parents=True, exist_ok=True)
    model, optimizer, scheduler, scaler = build(cfg, rt, meta)
    progress = {"step": 0, "epoch": 0, "position": 0, "elapsed_s": 0.0, "best": None, "bad_evals": 0}
    latest = checkpoint.latest_path(run_dir)
    if latest is not None:
        state = checkpoint.load(latest)
        checkpoint.check_tokenizer(state["data_meta"], meta, f"run {run_dir}")
        progress = restore(state, model, optimizer, scheduler, scaler)
        del state
    model = runtime.wrap_ddp(model, rt)
    if t.compile:
        model = torch.compile(model)
    train_ds = PairDataset.from_dir(cfg.data.dir, "train", cfg.data, limit=cfg.data.train_limit)
    sampler = TokenBatchSampler(train_ds.src_lens, train_ds.tgt_lens, cfg.data.batch_tokens, cfg.data.bucket_size,
                                shuffle=True, seed=t.seed, rank=rt.rank, world_size=rt.world_size)
    loader = make_loader(train_ds, sampler, cfg.data, rt.device, t.seed)
    valid_split = "valid" if "valid" in meta["splits"] else "train"
    valid_ds = train_ds if valid_split == "train" else PairDataset.from_dir(cfg.data.dir, "valid", cfg.data)
    valid_loader = make_loader(valid_ds, TokenBatchSampler(
        valid_ds.src_lens, valid_ds.tgt_lens, cfg.data.batch_tokens, shuffle=False, rank=rt.rank,
        world_size=rt.world_size, even=False), cfg.data, rt.device, t.seed)
    if rt.is_main:
        save_config(cfg, run_dir / "config.yaml")
        write_manifest(cfg, run_dir, [rt.device, rt.decoder_device], rt.precision, meta, rt.world_size)
    monitor = Monitor(cfg, rt.is_main, progress["step"], t.max_steps)
    monitor.write(f"model {count_parameters(model) / 1e6:.1f}M parameters, precision {rt.precision}, "
                  f"{len(train_ds)} train pairs, {len(valid_ds)} {valid_split} pairs, "
                  f"{'resuming at step ' + str(progress['step']) if latest else 'starting'}")
    stop, profiler = StopFlag(), make_profiler(cfg, rt)
    stream = batches_forever(loader, sampler, progress["epoch"], progress["position"])
    window, last_out = Window(rt.decoder_device), None
    started = time.perf_counter() - progress["elapsed_s"]
    saved_at = evaluated_at = progress["step"]
    bad_in_row = 0
    try:
        if profiler:
            profiler.start()
        while progress["step"] < t.max_steps:
            t0 = time.perf_counter()
            micro = []
            for _ in range(t.accum_steps):
                batch, epoch, position = next(stream)
                micro.append(to_device(batch, rt))
            data_s = time.perf_counter() - t0
            try:
                last_out = train_step(model, optimizer, scaler, micro, rt, t)
            except (torch.OutOfMemoryError, MemoryError) as exc:
                raise TrainingAborted(oom_message(exc, micro, cfg, rt, progress["step"])) from None
            scheduler.step()
            progress.update(step=progress["step"] + 1, epoch=epoch, position=position,
                            elapsed_s=time.perf_counter() - started)
            window.add(last_out, micro, data_s)
            del micro, batch  # free this step's batch before the next one is fetched
            overflow = scaler.is_enabled() and scaler.get_scale() >= 1.0
            bad_in_row = 0 if last_out["finite"] or overflow else bad_in_row + 1
            if bad_in_row >= t.max_bad_steps:
                raise TrainingAborted(
                    f"{bad_in_row} optimizer steps in a row had non-finite loss or gradients (step "
                    f"{progress['step']}); lower train.lr (now {t.lr}), raise train.warmup_steps, keep "
                    f"train.clip_norm > 0, or use train.precision=fp32 to rule out overflow")
            step = progress["step"]
            monitor.advance()
            if profiler:
                profiler.step()
                if step == t.profile_steps + 2:
                    profiler.stop()
                    (run_dir / "profile.txt").write_text(profiler.key_averages().table(
                        sort_by="self_cpu_time_total", row_limit=40))
                    profiler = None
            finished = step >= t.max_steps
            time_up = _agree(bool(t.max_minutes) and progress["elapsed_s"] >= 60 * t.max_minutes
                             or stop.requested, rt)
            if step % t.log_every == 0 or finished or time_up:
                monitor.log(step, "train", window.summary(scheduler.get_last_lr()[0], last_out["grad_norm"],
                                                          rt.decoder_device))
                window.reset()
            early_stop = False
            if step % t.eval_every == 0 or finished or time_up:
                early_stop = validate(cfg, rt, model, valid_loader, valid_ds, tokenizer, monitor, progress,
                                      snapshot_fn=lambda: snapshot(cfg, meta, model, optimizer, scheduler,
                                                                   scaler, progress))
                evaluated_at = step
                window.reset()  # evaluation time is not training throughput
            if step % t.ckpt_every == 0 or finished or time_up or early_stop:
                if rt.is_main:
                    checkpoint.save_step(snapshot(cfg, meta, model, optimizer, scheduler, scaler, progress),
                                         run_dir, t.keep_last)
                saved_at = step
            if time_up or early_stop:
                reason = "signal" if stop.requested else "time limit" if time_up else "early stopping"
                monitor.write(f"stopping at step {step}: {reason}")
                break
    finally:
        stop.restore()
        monitor.close()
    summary = {"steps": progress["step"], "best": progress["best"], "minutes": progress["elapsed_s"] / 60,
               "saved_at": saved_at, "evaluated_at": evaluated_at, "run_dir": str(run_dir)}
    return summary


def validate(cfg: Config, rt: Runtime, model, valid_loader, valid_ds, tokenizer, monitor: Monitor,
             progress: dict, snapshot_fn) -> bool:
    """Validation loss (+ samples), best-checkpoint bookkeeping; returns True when patience runs out."""
    started = time.perf_counter()
    metrics = evaluate_loss(runtime.decoding_model(model), valid_loader, rt)
    metrics["tokens_per_s"] = metrics["tokens"] / (time.perf_counter() - started)
    monitor.log(progress["step"], "valid", metrics)
    if rt.is_main and cfg.train.sample_summaries:
        monitor.text("samples", sample_summaries(model, valid_ds, tokenizer, rt, cfg.train.sample_summaries),
                     progress["step"])
    score = metrics["loss"]
    if progress["best"] is None or score < progress["best"]:
        progress.update(best=score, bad_evals=0)
        if rt.is_main:
            checkpoint.save(snapshot_fn(), cfg.run_dir / checkpoint.BEST)
    else:
        progress["bad_evals"] += 1
    return bool(cfg.train.patience) and progress["bad_evals"] >= cfg.train.patience
