"""The visible training loop: `train_step`, `evaluate_loss`, `train(cfg)`; each practice is a config switch."""
from __future__ import annotations

import contextlib
import dataclasses
import math
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.data import DataLoader

from summarizer import checkpoint, runtime
from summarizer.config import Config, TrainConfig, save_config, to_dict
from summarizer.data import PairDataset, TokenBatchSampler, make_loader
from summarizer.decoding import decode_all
from summarizer.errors import UserError
from summarizer.losses import smoothed_nll
from summarizer.model import Seq2Seq, count_parameters
from summarizer.monitor import Monitor, Profiler, Window, flatten, memory_report, write_manifest
from summarizer.optim import build_optimizer, build_scheduler
from summarizer.outputs import claim_dir
from summarizer.placement import place_model
from summarizer.prepared import lexicon, open_tokenizer, read_meta, read_pairs, training_words, valid_split
from summarizer.resume import check_resume
from summarizer.runtime import Runtime, move
from summarizer.scoring import ROUGE_TYPES, quality, rouge_report, words
from summarizer.tokenizer import Tokenizer

# What a run writes to its run dir (besides ckpt_*.pt): how a run dir written before the ownership
# marker is recognised, and what `make overfit` may clear.
RUN_FILES = ("config.yaml", "manifest.json", "metrics.jsonl", checkpoint.LATEST, checkpoint.BEST, "profile.txt")


class TrainingAborted(UserError):
    """Training cannot go on (non-finite losses, out of memory); the message says what to change."""


def to_device(batch: dict, rt: Runtime) -> dict:
    """Id tensors to the run's input device (non-blocking from pinned memory); token counts stay ints."""
    return {key: move(value, rt.device) if torch.is_tensor(value) else value for key, value in batch.items()}


def train_step(model: nn.Module, optimizer, scaler, micro_batches: list[dict], rt: Runtime,
               cfg: TrainConfig) -> dict:
    """One optimizer step over k micro-batches. Returns tensors: nothing here forces a host sync
    except the single finiteness check of the gradient norm."""
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
    grad_norm = nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_norm if cfg.clip_norm > 0 else math.inf)
    finite = bool(torch.isfinite(grad_norm))
    if scaler.is_enabled():
        scaler.step(optimizer)  # skips the update by itself on inf/nan gradients
        scaler.update()
    elif finite:
        optimizer.step()
    optimizer.zero_grad(set_to_none=cfg.set_to_none)
    # Local sums; `tokens` is the global target count they are normalised by (Window all-reduces).
    return {"loss_sum": torch.stack(losses).sum(), "nll_sum": torch.stack(nlls).sum(), "tokens": total,
            "grad_norm": grad_norm.detach(), "finite": finite}


@torch.inference_mode()
def evaluate_loss(model: nn.Module, loader, rt: Runtime) -> dict:
    """Token-level NLL and perplexity of a split, without dropout or graph building."""
    nlls, tokens = [], 0
    with runtime.eval_mode(model):
        for batch in loader:
            batch = to_device(batch, rt)
            with rt.compute():
                out = model(batch["src_ids"], batch["tgt_in"])
            nlls.append(smoothed_nll(out, batch["tgt_out"], batch["src_ids"], 0.0)[1].double().to(rt.device))
            tokens += batch["n_tgt"]
    nll_sum = torch.stack(nlls).sum() if nlls else torch.zeros((), dtype=torch.float64, device=rt.device)
    totals = runtime.all_reduce_sum(torch.stack([nll_sum, torch.tensor(float(tokens), device=rt.device,
                                                                       dtype=torch.float64)]), rt)
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


def build(cfg: Config, rt: Runtime, meta: dict, state: dict | None = None):
    """Model, optimizer and scaler, placed on their devices (not yet DDP-wrapped), with a checkpoint's
    `state` restored if given: the model is then built from the checkpoint's own config."""
    model = checkpoint.restore_model(state) if state else Seq2Seq(cfg.model, meta["vocab_size"])
    model = place_model(model, rt, cfg.placement.pipeline_chunks)
    optimizer, scaler = build_optimizer(model, cfg.train), runtime.make_scaler(rt)
    if state:
        optimizer.load_state_dict(state["optimizer"])
        scaler.load_state_dict(state["scaler"])
    return model, optimizer, scaler


def resume_state(cfg: Config, meta: dict) -> tuple[dict | None, list[dict]]:
    """The run's newest readable checkpoint (None for a new run) and the config changes it resumes
    with; refuses another tokenizer and changes that cannot take effect mid-run."""
    found = checkpoint.load_latest(cfg.run_dir)
    if found is None:
        return None, []
    state, path, skipped = found
    for problem in skipped:
        print(f"warning: {problem}; resuming from {path.name} instead", file=sys.stderr)
    checkpoint.check_tokenizer(state["data_meta"], meta, f"run {cfg.run_dir}")
    changes = check_resume(state["config"], cfg, cfg.run_dir, state["step"])
    if changes:
        print(f"resuming at step {state['step']} with changed settings: " + ", ".join(
            f"{c['key']} {c['old']!r} -> {c['new']!r}" for c in changes), file=sys.stderr)
    return state, changes


def snapshot(cfg: Config, meta: dict, model, optimizer, scaler, progress: dict) -> dict:
    """Everything a resumed run needs, from the unwrapped module (never the DDP/placement wrapper). The
    schedule is not stored: it is a function of the step and the config (so a new train.lr takes effect)."""
    return {"model": runtime.unwrap(model).state_dict(), "optimizer": optimizer.state_dict(),
            "scaler": scaler.state_dict(), "rng": checkpoint.rng_state(),
            "progress": dict(progress), "step": progress["step"], "config": to_dict(cfg),
            "data_meta": {k: meta.get(k) for k in ("spm_sha256", "vocab_size", "normalization", "fingerprint")}}


def sample_summaries(model, dataset: PairDataset, tokenizer: Tokenizer, rt: Runtime, cfg: Config) -> str:
    """Greedy summaries of the first `train.sample_summaries` valid pairs, as Markdown for TensorBoard."""
    pairs = [dataset[i] for i in range(min(cfg.train.sample_summaries, len(dataset)))]
    hyps = decode_all(model, [s for s, _ in pairs], dataclasses.replace(cfg.eval, beam_size=1), rt,
                      lexicon=lexicon(cfg.data.dir))
    return "\n\n".join(f"source: {tokenizer.decode(s.tolist())}  \nreference: {tokenizer.decode(t.tolist())}  \n"
                       f"greedy: {tokenizer.decode(h)}" for (s, t), h in zip(pairs, hyps, strict=True))


def oom_message(exc: BaseException, micro_batches: list[dict], cfg: Config, rt: Runtime, step: int) -> str:
    shapes = ", ".join(f"{tuple(b['src_ids'].shape)}->{tuple(b['tgt_in'].shape)}" for b in micro_batches)
    tokens = sum(b["n_src"] + b["n_tgt"] for b in micro_batches)
    return (f"out of memory at step {step} ({type(exc).__name__}); batch shapes {shapes}, {tokens} tokens; "
            f"{'; '.join(memory_report(d) for d in rt.devices)}. "
            f"Lower data.batch_tokens (now {cfg.data.batch_tokens}) and "
            f"raise train.accum_steps (now {cfg.train.accum_steps}) to keep the same effective batch. "
            f"Checkpoints already written are intact; the run resumes from the latest.")


def _agree(flag: bool, rt: Runtime) -> bool:
    """Every rank stops together, or the others would wait forever in the next all-reduce."""
    if not rt.distributed:
        return flag
    return bool(runtime.all_reduce_sum(torch.tensor(float(flag), device=rt.device), rt) > 0)


@dataclass
class Session:
    """Everything one training run holds; built by `open_session`, driven by `train`."""
    cfg: Config
    rt: Runtime
    meta: dict
    tokenizer: Tokenizer
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    progress: dict
    stream: Iterator
    valid_ds: PairDataset
    valid_loader: DataLoader
    monitor: Monitor
    resumed: bool
    rouge_pairs: list | None = None  # the valid pairs ROUGE is measured on during training, read once

    def snapshot(self) -> dict:
        return snapshot(self.cfg, self.meta, self.model, self.optimizer, self.scaler, self.progress)


def open_session(cfg: Config) -> Session:
    """Devices, seeds, data, model and optimizer state: fresh, or restored from the run's latest checkpoint."""
    rt = runtime.setup(cfg)
    runtime.seed_everything(cfg.train.seed, cfg.train.deterministic)
    meta, tokenizer = read_meta(cfg.data.dir), open_tokenizer(cfg.data.dir)
    if rt.is_main:
        claim_dir(cfg.run_dir, "run", "run.dir", legacy=RUN_FILES, also=("overfit",))
    state, changes = resume_state(cfg, meta)
    model, optimizer, scaler = build(cfg, rt, meta, state)
    progress = {"step": 0, "epoch": 0, "position": 0, "elapsed_s": 0.0, "best": None, "bad_evals": 0}
    if state is not None:
        checkpoint.set_rng_state(state["rng"])
        progress = state["progress"]
    del state  # the weights now live in the model
    scheduler = build_scheduler(optimizer, cfg.train, progress["step"])
    model = runtime.wrap_ddp(model, rt)
    if cfg.train.compile:
        model = torch.compile(model)
    train_ds = PairDataset.from_dir(cfg.data.dir, "train", cfg.data, limit=cfg.data.train_limit)
    sampler = TokenBatchSampler(train_ds.src_lens, train_ds.tgt_lens, cfg.data.batch_tokens, cfg.data.bucket_size,
                                shuffle=True, seed=cfg.train.seed, rank=rt.rank, world_size=rt.world_size,
                                pad_multiple=cfg.data.pad_multiple)
    stream = batches_forever(make_loader(train_ds, sampler, cfg.data, rt.device, cfg.train.seed), sampler,
                             progress["epoch"], progress["position"])
    valid_name = valid_split(meta)
    valid_ds = PairDataset.from_dir(cfg.data.dir, valid_name, cfg.data)
    valid_loader = make_loader(valid_ds, TokenBatchSampler(
        valid_ds.src_lens, valid_ds.tgt_lens, cfg.data.batch_tokens, shuffle=False, rank=rt.rank,
        world_size=rt.world_size, even=False, pad_multiple=cfg.data.pad_multiple), cfg.data, rt.device, cfg.train.seed)
    if rt.is_main:
        save_config(cfg, cfg.run_dir / "config.yaml")
        write_manifest(cfg, cfg.run_dir, rt.devices, rt.precision, meta, rt.world_size, changes)
    monitor = Monitor(cfg, rt.is_main, progress["step"], cfg.train.max_steps)
    monitor.write(f"model {count_parameters(model) / 1e6:.1f}M parameters, precision {rt.precision}, "
                  f"{len(train_ds)} train pairs, {len(valid_ds)} {valid_name} pairs, "
                  f"{'resuming at step ' + str(progress['step']) if progress['step'] else 'starting'}")
    return Session(cfg, rt, meta, tokenizer, model, optimizer, scheduler, scaler, progress, stream,
                   valid_ds, valid_loader, monitor, progress["step"] > 0)


def train(cfg: Config) -> dict:
    """Train (or resume) the run `cfg.run.name` until max_steps, max_minutes, a signal or early stopping."""
    s = open_session(cfg)
    t, rt, progress = cfg.train, s.rt, s.progress
    stop, window, bad_in_row = StopFlag(), Window(rt), 0
    profiler = Profiler(t.profile_steps, cfg.tensorboard_dir / "profile", cfg.run_dir / "profile.txt",
                        any(d.type == "cuda" for d in rt.devices)) if t.profile_steps > 0 and rt.is_main else None
    started = time.perf_counter() - progress["elapsed_s"]
    try:
        while progress["step"] < t.max_steps:
            t0, micro = time.perf_counter(), []
            for _ in range(t.accum_steps):
                batch, epoch, position = next(s.stream)
                micro.append(to_device(batch, rt))
            data_s = time.perf_counter() - t0
            try:
                out = train_step(s.model, s.optimizer, s.scaler, micro, rt, t)
            except (torch.OutOfMemoryError, MemoryError) as exc:
                raise TrainingAborted(oom_message(exc, micro, cfg, rt, progress["step"])) from None
            s.scheduler.step()
            progress.update(step=progress["step"] + 1, epoch=epoch, position=position,
                            elapsed_s=time.perf_counter() - started)
            window.add(out, micro, data_s)
            del micro, batch  # free this step's batch before the next one is fetched
            overflow = s.scaler.is_enabled() and s.scaler.get_scale() >= 1.0  # fp16 scale search, not a fault
            bad_in_row = 0 if out["finite"] or overflow else bad_in_row + 1
            if bad_in_row >= t.max_bad_steps:
                raise TrainingAborted(
                    f"{bad_in_row} optimizer steps in a row had non-finite loss or gradients (step "
                    f"{progress['step']}); lower train.lr (now {t.lr}), raise train.warmup_steps, keep "
                    f"train.clip_norm > 0, or use train.precision=fp32 to rule out overflow")
            s.monitor.advance()
            if profiler:
                profiler.step(progress["step"])
            time_up = _agree(bool(t.max_minutes) and progress["elapsed_s"] >= 60 * t.max_minutes
                             or stop.requested, rt)
            if after_step(s, window, out, time_up):
                reason = "signal" if stop.requested else "time limit" if time_up else "early stopping"
                s.monitor.write(f"stopping at step {progress['step']}: {reason}")
                break
        best = progress["best"] or {"metric": t.select_by, "value": float("nan")}
        s.monitor.hparams(flatten(cfg), {f"best/{best['metric']}": best["value"], "hparam/steps": progress["step"]})
    finally:
        stop.restore()
        s.monitor.close()
    return {"steps": progress["step"], "best": progress["best"], "minutes": progress["elapsed_s"] / 60,
            "run_dir": str(cfg.run_dir), "signal": stop.signum}


def after_step(s: Session, window: Window, out: dict, time_up: bool) -> bool:
    """Log, validate and checkpoint on their intervals; True when training must stop now."""
    t, step = s.cfg.train, s.progress["step"]
    final = step >= t.max_steps or time_up
    lr = s.scheduler.get_last_lr()[0]
    if step % t.log_every == 0 or final:
        s.monitor.log(step, "train", window.summary(lr, out["grad_norm"]))
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


def validate(s: Session, extra: dict, rouge: bool) -> bool:
    """Validation loss, ROUGE on a fixed valid subset when due, samples, and best-checkpoint
    bookkeeping by `train.select_by`; True when patience runs out."""
    started = time.perf_counter()
    metrics = evaluate_loss(runtime.unwrap(s.model), s.valid_loader, s.rt)
    metrics["tokens_per_s"] = metrics["tokens"] / (time.perf_counter() - started)
    if rouge:
        # Every rank decodes the same subset deterministically, so all agree on the best without talking.
        metrics.update(valid_rouge(s))
    s.monitor.log(s.progress["step"], "valid", {**metrics, **extra})
    if s.rt.is_main and s.cfg.train.sample_summaries:
        s.monitor.text("samples", sample_summaries(s.model, s.valid_ds, s.tokenizer, s.rt, s.cfg), s.progress["step"])
    metric = "rouge1" if s.cfg.train.select_by == "rouge" else "loss"
    if metric not in metrics:
        return False  # the best is judged only where ROUGE was measured
    if improves(metric, metrics[metric], s.progress["best"]):
        s.progress.update(best={"metric": metric, "value": metrics[metric]}, bad_evals=0)
        if s.rt.is_main:
            checkpoint.save(s.snapshot(), s.cfg.run_dir / checkpoint.BEST)
    else:
        s.progress["bad_evals"] += 1
    return bool(s.cfg.train.patience) and s.progress["bad_evals"] >= s.cfg.train.patience


def improves(metric: str, value: float, best: dict | None) -> bool:
    """Is `value` of `metric` better than the best so far? Loss falls, ROUGE rises."""
    if best is None:
        return True
    return value < best["value"] if metric == "loss" else value > best["value"]


def valid_rouge(s: Session) -> dict:
    """Greedy ROUGE-1/2/L F and the quality rates (non-words, repeats, length) on the first
    `train.rouge_samples` valid pairs: fast, and comparable across steps."""
    if s.rouge_pairs is None:
        s.rouge_pairs = read_pairs(s.cfg.data.dir, valid_split(s.meta))[:s.cfg.train.rouge_samples]
    pairs = s.rouge_pairs
    hyps = decode_all(s.model, [s.valid_ds[i][0] for i in range(len(pairs))],
                      dataclasses.replace(s.cfg.eval, beam_size=1), s.rt, lexicon=lexicon(s.cfg.data.dir))
    predictions = [s.tokenizer.decode(h) for h in hyps]
    references = [p.get("references") or [p["target"]] for p in pairs]
    report = rouge_report(predictions, references, samples=0)
    rates = quality(predictions, [[words(p["source"])] for p in pairs], references, training_words(s.cfg.data.dir))
    return {**{kind: report[kind]["f"] for kind in ROUGE_TYPES}, **rates}
