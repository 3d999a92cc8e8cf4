"""The training rows' measurements: a variant's own loop timed (`TrainingProbe`), two variants taking turns
(`training_rates`), or in fresh processes in their second epoch (`second_epoch_rates`), and peak memory
(`memory_row`); `stats`, the summary every row reports."""
from __future__ import annotations

import copy
import statistics
import time

import numpy as np
import torch

from summarizer import runtime
from summarizer.bench import memory as bench_memory
from summarizer.config.load import from_dict, to_dict
from summarizer.config.schema import Config
from summarizer.data.batches import PairDataset, TokenBatchSampler, make_loader, padding_fraction
from summarizer.data.prepared import read_meta
from summarizer.runtime import move_batch
from summarizer.train import precision
from summarizer.train.graphs import step_function
from summarizer.train.loop import train_step
from summarizer.train.session import batches_forever, build
from summarizer.train.watch.flops import batch_flops
from summarizer.train.watch.module_stats import ModuleStats


def variant(cfg: Config, *overrides: tuple[str, str, object]) -> Config:
    out = copy.deepcopy(cfg)
    for section, key, value in overrides:
        setattr(getattr(out, section), key, value)
    return out


class FixedSizeSampler(TokenBatchSampler):
    """Random fixed-size batches (no length bucketing): the baseline the token-budget sampler replaces."""

    def __init__(self, n: int, batch_size: int, seed: int):
        self.n, self.batch_size, self.seed, self.epoch, self.start = n, batch_size, seed, 0, 0

    def plan(self, epoch: int) -> list[list[int]]:
        perm = np.random.default_rng([self.seed, epoch]).permutation(self.n)
        return [perm[i:i + self.batch_size].tolist() for i in range(0, self.n, self.batch_size)]


def stats(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


class TrainingProbe:
    """One variant's training loop, data loading included, timed `bench.steps` optimizer steps at a time."""

    def __init__(self, cfg: Config, fixed_batches: bool = False, item_every_step: bool = False,
                 observe: bool = False):
        self.cfg, self.item_every_step, self.steps = cfg, item_every_step, 0
        self.rt = runtime.setup(cfg.system, cfg.placement, cfg.train.precision)
        torch.manual_seed(cfg.train.seed)
        model, self.optimizer, self.scaler = build(cfg, self.rt, read_meta(cfg.data.dir))
        self.model = runtime.compile_model(model, cfg.train.compile_mode) if cfg.train.compile else model
        # What the loop adds to see inside a run: model FLOPs of every batch, per-module statistics when logged.
        self.stats = ModuleStats(model) if observe else None
        self.vocab_size = read_meta(cfg.data.dir)["vocab_size"] if observe else 0
        ds = PairDataset.from_dir(cfg.data.dir, "train", cfg.data)
        bucketed = TokenBatchSampler(ds.src_lens, ds.tgt_lens, cfg.data.batch_tokens, cfg.data.bucket_size,
                                     seed=cfg.train.seed, pad_multiple=cfg.data.pad_multiple)
        sampler = FixedSizeSampler(len(ds), max(1, round(len(ds) / len(bucketed.plan(0)))), cfg.train.seed) \
            if fixed_batches else bucketed
        if precision.candidates(cfg.train.precision, self.rt):  # auto on a GPU: what `make train` would choose
            self.rt.precision = precision.choose(model, ds, bucketed, cfg.data, self.rt,
                                                 cfg.train)["precision"]
            self.scaler = runtime.make_scaler(self.rt)
        self.step = step_function(train_step, self.model, self.optimizer, self.rt, cfg.train)[0]
        first_epoch = sampler.plan(0)
        self.padding = padding_fraction(first_epoch, ds.src_lens, ds.tgt_lens)
        self.epoch_steps = len(first_epoch)
        self.stream = batches_forever(make_loader(ds, sampler, cfg.data, self.rt.device, cfg.train.seed),
                                      sampler, 0, 0)

    def repeat(self, steps: int = 0) -> float:
        """tokens/s over the next `steps` (default `bench.steps`) steps."""
        # re-apply this variant's process-wide switches (e.g. cudnn.benchmark)
        runtime.setup(self.cfg.system, self.cfg.placement, self.cfg.train.precision)
        rt, started, tokens = self.rt, time.perf_counter(), 0
        for _ in range(steps or self.cfg.bench.steps):
            fetched = [next(self.stream)[0] for _ in range(self.cfg.train.accum_steps)]
            micro = [move_batch(batch, rt.device) for batch in fetched]
            self.steps += 1
            logged = self.stats is not None and self.steps % self.cfg.train.log_every == 0
            out = self.step(self.model, self.optimizer, self.scaler, micro, rt, self.cfg.train,
                            self.stats if logged else None)
            if self.stats is not None:
                sum(batch_flops(self.cfg.model, self.vocab_size, batch)[0] for batch in fetched)
            tokens += sum(b["n_src"] + b["n_tgt"] for b in micro)
            if self.item_every_step:  # what logging every step costs: host syncs for each value
                out["nll_sum"].item(), out["grad_norm"].item()
        for device in rt.cuda_devices:
            torch.cuda.synchronize(device)
        return tokens / (time.perf_counter() - started)


def training_rates(on: tuple, off: tuple) -> dict:
    """tokens/s of two variants, each (config, probe options), their repeats taken in turn.

    On a shared machine throughput drifts by tens of percent within minutes; measuring all of one
    variant and then all of the other would book that drift as an effect. Alternating repeats
    (on, off, off, on, ...) exposes both variants to the same drift.
    """
    probes = {"on": TrainingProbe(on[0], **on[1]), "off": TrainingProbe(off[0], **off[1])}
    cfg, rates = on[0], {"on": [], "off": []}
    for repeat in range(cfg.bench.warmup + cfg.bench.repeats):
        for key in ("on", "off") if repeat % 2 == 0 else ("off", "on"):
            rate = probes[key].repeat()
            if repeat >= cfg.bench.warmup:
                rates[key].append(rate)
    return {key: {**stats(rates[key]), "padding": probe.padding} for key, probe in probes.items()}


def _second_epoch_rates(cfg_dict: dict, repeats: int, options: dict) -> dict:
    """In a fresh process: train one epoch unmeasured, then `repeats` repeats into the second, whose
    batch shapes the first has already met (as every epoch after the first does)."""
    probe = TrainingProbe(from_dict(cfg_dict), **options)
    probe.repeat(probe.epoch_steps)
    return {"rates": [probe.repeat() for _ in range(repeats)]}


def second_epoch_rates(on: Config | tuple, off: Config | tuple) -> dict:
    """tokens/s of two variants in the second epoch (a config, or (config, probe options)), each in fresh
    processes taking turns (on, off, off, on; `bench.repeats` each): for settings a process reads once
    (oneDNN's kernel-cache size) and for those whose cost is paid once per batch shape (kernel caches, GPU
    attention plans), which a few steps of the first epoch would measure instead of the run's steady state."""
    on, off = (v if isinstance(v, tuple) else (v, {}) for v in (on, off))
    first, second = (on[0].bench.repeats + 1) // 2, on[0].bench.repeats // 2
    rates = {"on": [], "off": []}
    for key, (cfg, options), repeats in (("on", on, first), ("off", off, first), ("off", off, second),
                                         ("on", on, second)):
        if repeats:
            result = bench_memory.in_fresh_process(_second_epoch_rates, to_dict(cfg), repeats, options)
            if "error" in result:
                raise RuntimeError(result["error"])
            rates[key] += result["rates"]
    return {key: stats(values) for key, values in rates.items()}


def memory_row(cfg_on: Config, on: str, cfg_off: Config, off: str, steps: int) -> dict:
    """Peak memory of two variants, each in fresh processes (up to 3 repeats: memory barely varies)."""
    values = {}
    for key, cfg, which in (("on", cfg_on, on), ("off", cfg_off, off)):
        runs = [bench_memory.peak_memory(cfg, which, steps) for _ in range(max(1, min(cfg.bench.repeats, 3)))]
        errors = [r["error"] for r in runs if "error" in r]
        if errors:
            raise RuntimeError(errors[0])
        values[key] = stats([r["peak_mb"] for r in runs])
    return values
