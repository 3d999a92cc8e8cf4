"""`train.precision=auto` where no rule holds: on a GPU, fp32 (TF32) against 16 bit, timed on the run's own model
(compiled, with `train.compile`) and batch shapes before its first step.

On a CPU a rule decides (runtime.resolve_precision: bf16 where the CPU has AVX-512 BF16 or AMX, else fp32). On a
GPU the answer depends on the model: autocast adds casts and kernel launches to every step, which a large model's
16-bit matmuls repay and a small one's may not (docs/practices.md, "precision"), and a compiled model fuses the
casts into its kernels. So a new run on a GPU times forward and backward of a few of its first epoch's batches in
both precisions, with the model as it will train (its layers compiled once per precision where it trains
compiled; the run reuses the chosen precision's graphs), and trains in the faster; 16 bit wins a tie (half the
activation memory). Where the whole step replays as a CUDA graph (train.cuda_graphs, and the run allows it), a rule
holds instead, and 16 bit is chosen untimed: what an eager probe would time, the host launching autocast's casts, is
gone from a replayed step, and what is left is the GPU's own time, less in 16 bit than in TF32 (the recipe's step on
an H100: 3.0 ms against 3.4, docs/results.md "Where the time goes"). The result is kept in the run's progress and
reused on resume on the same kind of GPU and model (eager, compiled in one mode, or captured), so a run changes
precision between its checkpoints on one machine only where its step changes form: a run launched from Python
(DDP, train.cuda_graphs=false, or any run before train.cuda_graphs became the default) resumed with its step
captured takes 16 bit by the rule, said on stderr with the setting's change."""
from __future__ import annotations

import dataclasses
import time

import torch
from torch import nn

from summarizer import runtime
from summarizer.config.schema import DataConfig, TrainConfig
from summarizer.data.batches import EpochBatch, PairDataset, TokenBatchSampler, batch_collate
from summarizer.runtime import Runtime, move_batch
from summarizer.train.graphs import unsupported
from summarizer.train.losses import smoothed_nll

BATCHES = 4  # first-epoch batches timed, from its shortest to its longest
TIE = 0.03  # 16 bit within this share of fp32's time counts as a tie, and wins it


def candidates(requested: str, rt: Runtime) -> tuple[str, ...]:
    """The precisions a probe compares for `train.precision=requested`: () where it is settled without one."""
    if requested != "auto" or rt.decoder_device.type != "cuda":
        return ()
    return "fp32", rt.precision  # resolve_precision's 16 bit: bf16, or fp16 on a GPU without it


def device_name(rt: Runtime) -> str:
    """The kind of machine a probe's result holds for."""
    return torch.cuda.get_device_name(rt.decoder_device) if rt.decoder_device.type == "cuda" else "cpu"


def compiled(cfg: TrainConfig) -> str | None:
    """How the probe runs the model: None (eager), or torch.compile's mode."""
    return cfg.compile_mode if cfg.compile else None


def captured(cfg: TrainConfig, rt: Runtime) -> bool:
    """Whether the run's step replays as a CUDA graph (train.cuda_graphs, where graphs.unsupported allows it; on one
    GPU the optimizer is fused exactly when train.fused_optimizer asks)."""
    return cfg.cuda_graphs and not unsupported(rt, cfg, fused=cfg.fused_optimizer)


def recorded(progress: dict, cfg: TrainConfig, rt: Runtime) -> str | None:
    """A resumed run's precision from its probe, when this machine's device is the kind it was measured on and the
    model runs as it did then (eager, compiled in the same mode, captured or not)."""
    probe, requested = progress.get("precision_probe"), cfg.precision
    if not candidates(requested, rt) or not probe or probe["device"] != device_name(rt) \
            or probe.get("compile") != compiled(cfg) \
            or probe.get("captured", False) != captured(cfg, rt):  # a probe without the keys timed the eager model
        return None
    return probe["precision"] if probe["precision"] in candidates(requested, rt) else None


def probe_batches(dataset: PairDataset, sampler: TokenBatchSampler, data: DataConfig,
                  count: int = BATCHES) -> list[dict]:
    """`count` batches of this rank's first epoch, spread from its shortest padded length to its longest."""
    plan = sampler.plan(0)
    length = lambda batch: int(dataset.src_lens[batch].max() + dataset.tgt_lens[batch].max())  # noqa: E731
    ordered = sorted(plan, key=length)
    picks = sorted({round(i * (len(ordered) - 1) / max(count - 1, 1)) for i in range(count)})
    return [batch_collate(data)(dataset.__getitems__(EpochBatch(ordered[i], 0))) for i in picks]


def measure(model: nn.Module, batches: list[dict], precisions: tuple[str, ...], rt: Runtime,
            cfg: TrainConfig) -> dict[str, float]:
    """Seconds that forward and backward over `batches` take in each precision: one untimed step each, then the
    batches twice (their shapes new, then seen), precisions in turn (A B, then B A) so a drifting clock charges
    both alike. A precision that runs out of memory takes infinitely long. The weights, their gradients (none
    after) and every random stream are left as they were."""
    batches = [move_batch(batch, rt.device) for batch in batches]
    seconds = dict.fromkeys(precisions, 0.0)
    cuda = rt.cuda_devices

    def run(precision: str, chosen: list[dict]) -> float:
        setting = dataclasses.replace(rt, precision=precision)
        for device in cuda:
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        try:
            for batch in chosen:
                with setting.compute():
                    out = model(batch["src_ids"], batch["tgt_in"])
                loss, _ = smoothed_nll(out, batch["tgt_out"], batch["src_ids"], cfg.label_smoothing, cfg.fused_loss)
                (loss / batch["n_tgt"]).backward()
                del out, loss
            for device in cuda:
                torch.cuda.synchronize(device)
        except torch.OutOfMemoryError:
            model.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
            return float("inf")
        return time.perf_counter() - started

    with torch.random.fork_rng(devices=[d.index or 0 for d in cuda]):
        for precision in precisions:
            run(precision, batches[:1])
        for order in (precisions, precisions[::-1]):
            for precision in order:
                seconds[precision] += run(precision, batches)
    model.zero_grad(set_to_none=True)
    return seconds


def pick(seconds: dict[str, float]) -> str:
    """The faster precision; 16 bit within TIE of fp32 wins."""
    half = next(p for p in seconds if p != "fp32")
    return half if seconds[half] <= seconds["fp32"] * (1 + TIE) else "fp32"


def choose(model: nn.Module, dataset: PairDataset, sampler: TokenBatchSampler, data: DataConfig, rt: Runtime,
           cfg: TrainConfig) -> dict:
    """Probe the precisions `candidates` names and agree on rank 0's choice: what `recorded` reads back. A captured
    step is not timed: 16 bit, by rule (the module's docstring)."""
    precisions = candidates("auto", rt)
    if captured(cfg, rt):  # one GPU, one process: no ranks to agree
        return {"precision": precisions[1], "device": device_name(rt), "compile": compiled(cfg), "captured": True,
                "ms": {}}
    timed = runtime.unwrap(model)  # without DDP: a rank's own steps, no gradients exchanged
    if cfg.compile:  # as the run trains it: the run's own compile reuses the chosen precision's graphs
        timed = runtime.compile_model(timed, cfg.compile_mode)
    seconds = measure(timed, probe_batches(dataset, sampler, data), precisions, rt, cfg)
    choice = pick(seconds)
    if rt.distributed:  # every rank must train in one precision: rank 0's
        index = torch.tensor(float(precisions.index(choice) if rt.is_main else 0), device=rt.device)
        choice = precisions[int(runtime.all_reduce_sum(index, rt))]
    return {"precision": choice, "device": device_name(rt), "compile": compiled(cfg),
            "ms": {p: round(1000 * s, 1) if s != float("inf") else None for p, s in seconds.items()}}


def timings(probe: dict) -> str:
    """A probe's times, as its log line and the GPU check's table give them: "fp32 118.8 ms, bf16 283.4 ms"."""
    if probe.get("captured"):
        return "not timed: the step is captured"
    return ", ".join(f"{p} {'out of memory' if ms is None else f'{ms} ms'}" for p, ms in probe["ms"].items())


def describe(probe: dict) -> str:
    how = f", compiled ({probe['compile']})" if probe.get("compile") else ""
    if probe.get("captured"):
        return (f"train.precision=auto: {probe['precision']} on {probe['device']} (by rule: the step replays as a "
                f"CUDA graph{how}, so 16 bit's casts add no launches, and its kernels take less GPU time than "
                f"TF32's); set train.precision to choose")
    return (f"train.precision=auto: {probe['precision']} on {probe['device']} (forward and backward of {BATCHES} "
            f"first-epoch batches{how}, twice: {timings(probe)}); set train.precision to choose")
