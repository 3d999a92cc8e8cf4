"""A training run's state, opened fresh or from its newest checkpoint: devices, data streams, model,
optimizer, schedule, the weights' moving average, progress; and the snapshot a checkpoint stores."""
from __future__ import annotations

import contextlib
import copy
import sys
from collections.abc import Iterator, Set
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader

from summarizer import runtime
from summarizer.config.load import save_config, to_dict
from summarizer.config.resume import check_resume
from summarizer.config.schema import Config
from summarizer.data.batches import PairDataset, TokenBatchSampler, make_loader, stop_workers
from summarizer.data.noise import SpanMasker, word_starts
from summarizer.data.prepared import (
    META_FILE,
    PREP_ONLY,
    adopt_prep_settings,
    check_data_settings,
    open_tokenizer,
    read_meta,
    source_weights,
    valid_split,
)
from summarizer.data.subwords import SegmentationSampler
from summarizer.data.tokenizer import Tokenizer
from summarizer.errors import ConfigError
from summarizer.model import checkpoint
from summarizer.model.transformer import Seq2Seq, count_parameters
from summarizer.outputs import claim_dir, claim_events_dir, hold_lock, release_lock
from summarizer.runtime import Runtime
from summarizer.runtime.placement import place_model
from summarizer.train import precision
from summarizer.train.ema import MovingAverage, build_ema
from summarizer.train.optim import build_optimizer, build_scheduler
from summarizer.train.watch import spikes
from summarizer.train.watch.monitor import Monitor, read_manifest, write_manifest

# What a run writes to its run dir (besides ckpt_*.pt): what `make overfit` may clear from its own dir.
RUN_FILES = ("config.yaml", "manifest.json", "metrics.jsonl", checkpoint.LATEST, checkpoint.BEST, "profile.txt")



def batches_forever(loader, sampler: TokenBatchSampler, epoch: int, position: int, skip: Set = frozenset()):
    """Yield (batch, epoch, position after it), epoch after epoch, starting mid-epoch if resuming; the
    batches whose (epoch, position) is in `skip` are left out (summarizer/train/watch/spikes.py)."""
    while True:
        sampler.set_epoch(epoch, position)
        for batch in loader:
            position += 1
            if (epoch, position) not in skip:
                yield batch, epoch, position
        epoch, position = epoch + 1, 0


def build(cfg: Config, rt: Runtime, meta: dict, state: dict | None = None, init: dict | None = None):
    """Model, optimizer and scaler, placed on their devices (not yet DDP-wrapped), with a checkpoint's
    `state` restored if given: the model is then built from the checkpoint's own config. Otherwise a new
    model, with the weights `init` (train.init_from's) if given."""
    model = checkpoint.restore_model(state) if state else Seq2Seq(cfg.model, meta["vocab_size"])
    if state is None and init is not None:
        model.load_state_dict(init)
    model = place_model(model, rt, cfg.placement.pipeline_chunks)
    optimizer, scaler = build_optimizer(model, cfg.train), runtime.make_scaler(rt)
    if state:
        restore_optimizer(optimizer, scaler, state)
    return model, optimizer, scaler


def restore_optimizer(optimizer: torch.optim.Optimizer, scaler, state: dict) -> None:
    """A checkpoint's AdamW moments and loss scale, into this run's optimizer and scaler as its settings made them
    (train.fused_optimizer and train.precision may change on resume). load_state_dict takes each group's kernel
    flags from the checkpoint: this run's are put back, with the step counts where a fused kernel reads them (float32,
    on the parameter's device). A scaler saved disabled (fp32, bf16) holds nothing: an fp16 run's starts afresh."""
    kernels = [{k: group[k] for k in ("fused", "foreach", "capturable") if k in group}
               for group in optimizer.param_groups]
    optimizer.load_state_dict(state["optimizer"])
    for group, own in zip(optimizer.param_groups, kernels, strict=True):
        group.update(own)
        if group.get("fused") or group.get("capturable"):
            for p in group["params"]:
                moments = optimizer.state.get(p, {})
                if "step" in moments:
                    moments["step"] = moments["step"].to(device=p.device, dtype=torch.float32)
    if state["scaler"] and scaler.is_enabled():
        scaler.load_state_dict(state["scaler"])


def check_processes(trained_by: int, now: int) -> None:
    """A run resumes with the number of processes it trained with: its data position counts each rank's
    batches of an epoch dealt out over that many ranks (TokenBatchSampler), so another count would train some
    batches twice and skip others."""
    if trained_by != now:
        raise ConfigError(f"this run trained in {trained_by} process(es) and resumes in {now}: its place in the data "
                          f"is per process, so it resumes only as it trained (torchrun --nproc_per_node={trained_by}"
                          f"{', or no torchrun' if trained_by == 1 else ''}); a new run (run.name=NEW) may use "
                          f"train.init_from with any count")


def resume_state(cfg: Config, meta: dict) -> tuple[dict | None, list[dict]]:
    """The run's newest readable checkpoint (None for a new run) and the config changes it resumes
    with; refuses another tokenizer and changes that cannot take effect mid-run."""
    found = checkpoint.load_latest(cfg.run_dir)
    if found is None:
        return None, []
    state, path, skipped = found
    for problem in skipped:
        print(f"warning: {problem}; resuming from {path.name} instead", file=sys.stderr)
    changes = changes_from(state, cfg, meta)
    if changes:
        print(f"resuming at step {state['step']} with changed settings: " + ", ".join(
            f"{c['key']} {c['old']!r} -> {c['new']!r}" for c in changes), file=sys.stderr)
    return state, changes


def changes_from(state: dict, cfg: Config, meta: dict) -> list[dict]:
    """The config changes `cfg` (its prep-only keys adopted from `meta`) makes to the run of checkpoint `state`;
    refuses another tokenizer and changes that cannot take effect mid-run (config.resume.check_resume)."""
    checkpoint.check_tokenizer(state["data_meta"], meta, f"run {cfg.run_dir}")
    # the keys only prep reads change on resume only to what the data was made with (adopt_prep_settings), which a
    # meta.json older than its record of them cannot say: there they stay as the run began
    fixed = frozenset() if "settings" in meta else frozenset(f"data.{key}" for key in PREP_ONLY)
    return check_resume(state["config"], cfg, cfg.run_dir, state["step"], fixed)


def check_finished(state: dict, cfg: Config) -> None:
    """A finished run is the run `cfg` asks for only where `cfg` could resume it: another model, data or recipe is
    refused as a resume would refuse it (a new run.name trains it), never answered with this run's weights. Without
    its prepared data (removed once trained), the config alone is compared: a finished run needs no data."""
    if not (Path(cfg.data.dir) / META_FILE).is_file():
        check_resume(state["config"], cfg, cfg.run_dir, state["step"])
        return
    meta = read_meta(cfg.data.dir)
    cfg = copy.deepcopy(cfg)
    adopt_prep_settings(cfg.data, meta)
    changes_from(state, cfg, meta)


def initial_weights(cfg: Config, meta: dict) -> dict | None:
    """train.init_from's weights for a new run: a checkpoint trained on the same tokenizer, with the parameters
    of cfg.model (dropout and other settings without parameters may differ); None when it is unset."""
    path = cfg.train.init_from
    if not path:
        return None
    if not Path(path).is_file():
        raise ConfigError(f"train.init_from={path} does not exist: train the run that writes it first (a recipe's "
                          f"`stages:` do so in order, configs/two_stage.yaml), or name another checkpoint (a run's "
                          f"best.pt or ckpt_*.pt)")
    state = checkpoint.require_model(checkpoint.load(path), path)
    checkpoint.check_tokenizer(state["data_meta"], meta, f"train.init_from={path}")
    with torch.device("meta"):  # the parameters' shapes, without allocating or initialising a model
        want = Seq2Seq(cfg.model, meta["vocab_size"]).state_dict()
    have = state["model"]
    shapes = [k for k in sorted(set(want) | set(have))
              if k not in want or k not in have or want[k].shape != have[k].shape]
    if shapes:
        raise ConfigError(f"train.init_from={path} holds another model than this run's model.* settings (first "
                          f"differences: {', '.join(shapes[:4])}): set model.* as that run had them (its config.yaml)")
    return have


def rng_states(rt: Runtime, gather: bool = True) -> dict:
    """The random streams a checkpoint keeps: "rng", rank 0's, and under DDP "rng_by_rank", every rank's (each
    rank's GPU draws dropout masks for its own batches, so the ranks' CUDA streams differ). Gathering is a
    collective: every rank calls this with `gather`, or none does (this rank's streams alone, then)."""
    mine = checkpoint.rng_state(rt.cuda_devices)
    if not (gather and rt.distributed):
        return {"rng": mine}
    every = runtime.all_gather_object(mine, rt)
    return {"rng": every[0], "rng_by_rank": every}


def restore_rng(state: dict, rt: Runtime) -> None:
    """This rank's streams from a checkpoint: its own where the checkpoint holds every rank's (same world size),
    else rank 0's."""
    by_rank = state.get("rng_by_rank") or []
    checkpoint.set_rng_state(by_rank[rt.rank] if len(by_rank) == rt.world_size else state["rng"], rt.cuda_devices)


def snapshot(cfg: Config, meta: dict, model, optimizer, scaler, ema, progress: dict, rng: dict) -> dict:
    """Everything a resumed run needs, from the unwrapped module (never the DDP/placement wrapper), with the
    random streams `rng` (`rng_states`). The schedule is not stored: it is a function of the step and the config
    (so a new train.lr takes effect)."""
    state = {"model": runtime.unwrap(model).state_dict(), "optimizer": optimizer.state_dict(),
             "scaler": scaler.state_dict(), **rng,
             "progress": dict(progress), "step": progress["step"], "config": to_dict(cfg),
             "data_meta": {k: meta.get(k) for k in ("spm_sha256", "vocab_size", "normalization", "fingerprint")}}
    if ema is not None:
        state["ema"] = ema.state_dict()
    return state


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
    ema: MovingAverage | None = None
    lock: object | None = None  # the run dir's lock file (outputs.hold_lock): held while this run lives
    rouge_pairs: list | None = None  # the valid pairs ROUGE is measured on during training, read once
    train_loader: DataLoader | None = None  # what `stream` reads, kept to restart it (rollback)
    sampler: TokenBatchSampler | None = None
    skip: set = field(default_factory=set)  # (epoch, position) of batches never trained on (spikes.py)
    rollbacks: list = field(default_factory=list)  # the manifest's spike_rollbacks

    @property
    def eval_model(self) -> nn.Module:
        """The weights validation scores and best.pt keeps: the moving average, if one is kept."""
        return self.ema.module if self.ema is not None else runtime.unwrap(self.model)

    def snapshot(self, rng: dict) -> dict:
        return snapshot(self.cfg, self.meta, self.model, self.optimizer, self.scaler, self.ema, self.progress, rng)

    def close(self) -> None:
        """End the run's data workers, logs and lock on every exit path, an error on the way out included: no
        worker outlives the run (stop_workers) and a removed run dir does not hide the error that ended it."""
        self.stream.close()
        stop_workers(*(loader for loader in (self.train_loader, self.valid_loader) if loader is not None))
        with contextlib.suppress(OSError):
            self.monitor.close()
        if self.lock is not None:
            with contextlib.suppress(OSError):
                release_lock(self.lock)

    def best_snapshot(self) -> dict:
        """best.pt: the validated weights (the average, if kept) as its model; nothing to resume from."""
        return {**{k: v for k, v in self.snapshot(rng_states(self.rt, gather=False)).items()
                   if k not in ("optimizer", "scaler", "ema")},
                "model": self.eval_model.state_dict()}


def open_session(cfg: Config) -> Session:
    """Devices, seeds, data, model and optimizer state: fresh, or restored from the run's latest checkpoint."""
    rt = runtime.setup(cfg.system, cfg.placement, cfg.train.precision)
    runtime.seed_everything(cfg.train.seed, cfg.system.deterministic)
    meta = read_meta(cfg.data.dir)
    tokenizer = open_tokenizer(cfg.data.dir, meta)
    check_data_settings(cfg.data, meta)
    adopted = adopt_prep_settings(cfg.data, meta)
    if adopted and rt.is_main:
        print(f"recorded as the prepared data in {cfg.data.dir} was made (keys only prep reads): {', '.join(adopted)}",
              file=sys.stderr)
    # train.init_from of a new run is checked before its run dir is claimed: a wrong path leaves nothing behind
    init = initial_weights(cfg, meta) if checkpoint.latest_path(cfg.run_dir) is None else None
    lock = None
    if rt.is_main:
        claim_dir(cfg.run_dir, "run", "run.dir", also=("overfit",))
        lock = hold_lock(cfg.run_dir, "run.dir")  # held until the run's process ends: one run per run dir
        # a checkpoint's temp file left by a kill mid-write (a model and its optimizer moments: a long preemptible
        # run would fill the disk with them); with the lock held, no other run writes one here
        for left in [*cfg.run_dir.glob("ckpt_*.pt.*.tmp"), *cfg.run_dir.glob(f"{checkpoint.BEST}.*.tmp")]:
            left.unlink(missing_ok=True)
    try:
        if rt.is_main:
            claim_events_dir(cfg.tensorboard_dir, cfg.run_dir)
        return _session(cfg, rt, meta, tokenizer, init, lock)
    except BaseException:  # refused (a resume's changed settings) or failed: the run dir is free again
        if lock is not None:
            with contextlib.suppress(OSError):
                release_lock(lock)
        raise


def _session(cfg: Config, rt: Runtime, meta: dict, tokenizer: Tokenizer, init: dict | None, lock) -> Session:
    """open_session's part once the run dir is held."""
    state, changes = resume_state(cfg, meta)
    kept = precision.recorded(state["progress"], cfg.train, rt) if state else None
    rt.precision = kept or rt.precision  # a resumed run keeps the precision its probe chose on this kind of GPU
    model, optimizer, scaler = build(cfg, rt, meta, state, init)
    ema = build_ema(model, cfg.train.ema_decay, state, cfg.train.max_steps)
    progress = {"step": 0, "epoch": 0, "position": 0, "elapsed_s": 0.0, "best": None, "bad_evals": 0,
                "bad_in_row": 0, "world_size": rt.world_size}
    if state is not None:
        restore_rng(state, rt)
        progress = {"bad_in_row": 0, **state["progress"]}  # a checkpoint from before the count was kept: none
        check_processes(progress.setdefault("world_size", rt.world_size), rt.world_size)
    del state  # the weights now live in the model
    scheduler = build_scheduler(optimizer, cfg.train, progress["step"])
    resample = SegmentationSampler(tokenizer, cfg.data.subword_alpha, cfg.data.subword_nbest, cfg.train.seed) \
        if cfg.data.subword_alpha > 0 else None
    noised = tuple(meta.get("unpaired_tags", ()))
    masker = SpanMasker(word_starts(tokenizer), tokenizer.mask_id(), cfg.data.noise_words, cfg.data.noise_span,
                        cfg.train.seed, keep=1 if meta["normalization"].get("source_tag") else 0) if noised else None
    train_ds = PairDataset.from_dir(cfg.data.dir, "train", cfg.data, limit=cfg.data.train_limit, sampler=resample,
                                    masker=masker, noised=noised)
    sampler = TokenBatchSampler(train_ds.src_lens, train_ds.tgt_lens, cfg.data.batch_tokens, cfg.data.bucket_size,
                                shuffle=True, seed=cfg.train.seed, rank=rt.rank, world_size=rt.world_size,
                                pad_multiple=cfg.data.pad_multiple,
                                weights=source_weights(cfg.data, meta, len(train_ds)))
    probed = None
    if precision.candidates(cfg.train.precision, rt) and kept is None:
        probed = progress["precision_probe"] = precision.choose(model, train_ds, sampler, cfg.data,
                                                                rt, cfg.train)
        if probed["precision"] != rt.precision:
            rt.precision, scaler = probed["precision"], runtime.make_scaler(rt)
    if cfg.train.compile:
        model = runtime.compile_model(model, cfg.train.compile_mode)
    model = runtime.wrap_ddp(model, rt)
    manifest = read_manifest(cfg.run_dir)
    skip, rollbacks = spikes.skipped(manifest, cfg.train), manifest.get("spike_rollbacks", [])
    train_loader = make_loader(train_ds, sampler, cfg.data, rt.device, cfg.train.seed)
    stream = batches_forever(train_loader, sampler, progress["epoch"], progress["position"], skip)
    valid_name = valid_split(meta)
    valid_ds = PairDataset.from_dir(cfg.data.dir, valid_name, cfg.data)
    valid_loader = make_loader(valid_ds, TokenBatchSampler(
        valid_ds.src_lens, valid_ds.tgt_lens, cfg.data.batch_tokens, shuffle=False, rank=rt.rank,
        world_size=rt.world_size, even=False, pad_multiple=cfg.data.pad_multiple), cfg.data, rt.device, cfg.train.seed)
    if rt.is_main:
        save_config(cfg, cfg.run_dir / "config.yaml")
        write_manifest(cfg, cfg.run_dir, rt.devices, rt.precision, meta, rt.world_size, changes,
                       probed or (progress.get("precision_probe") if kept else None), progress["step"])
    owed = progress.get("owed") or {}  # rows the resume logs again at its first step (loop.pay)
    monitor = Monitor(cfg, rt.is_main, progress["step"], cfg.train.max_steps,
                      owed_splits={split for split, key in (("train", "log"), ("valid", "validate")) if owed.get(key)})
    monitor.write(f"model {count_parameters(model) / 1e6:.1f}M parameters, precision {rt.precision}, "
                  f"{len(train_ds)} train pairs, {len(valid_ds)} {valid_name} pairs, "
                  f"{'resuming at step ' + str(progress['step']) if progress['step'] else 'starting'}")
    if probed is not None:
        monitor.write(precision.describe(probed))
    return Session(cfg, rt, meta, tokenizer, model, optimizer, scheduler, scaler, progress, stream,
                   valid_ds, valid_loader, monitor, progress["step"] > 0, ema, lock, train_loader=train_loader,
                   sampler=sampler, skip=skip, rollbacks=rollbacks)


def rollback(s: Session) -> int | None:
    """Back to the run's newest checkpoint, in place: weights, optimizer, scaler, moving average, random
    streams, progress (the wall clock excepted) and the data stream at its position, with what was logged
    after it dropped. Its step, or None when the run has no checkpoint yet."""
    found = checkpoint.load_latest(s.cfg.run_dir)
    if found is None:
        return None
    state = found[0]
    runtime.unwrap(s.model).load_state_dict(state["model"])
    restore_optimizer(s.optimizer, s.scaler, state)
    if s.ema is not None:
        s.ema.load_state_dict(state["ema"])
    restore_rng(state, s.rt)
    elapsed = s.progress["elapsed_s"]
    s.progress.clear()
    s.progress.update(state["progress"], elapsed_s=elapsed)
    for undone in ("owed", "window"):  # a stop's (loop.owe): a rollback trains from there again instead
        s.progress.pop(undone, None)
    s.scheduler = build_scheduler(s.optimizer, s.cfg.train, s.progress["step"])
    s.stream.close()
    s.stream = batches_forever(s.train_loader, s.sampler, s.progress["epoch"], s.progress["position"], s.skip)
    s.monitor.rewind(s.progress["step"])
    return s.progress["step"]


