"""What a run records: TensorBoard events, metrics.jsonl, memory figures, the progress bar, the manifest."""
from __future__ import annotations

import json
import os
import platform
import resource
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from summarizer.config.load import to_dict
from summarizer.config.schema import Config
from summarizer.outputs import atomic_write, code_version
from summarizer.runtime.profiling import per_step


def peak_memory_mb(device: torch.device) -> float:
    """CUDA: peak bytes held by tensors (the caching allocator reserves more; nvidia-smi shows that).
    CPU: the process's peak resident set size. Both since `reset_peak_memory`, else since the process began."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    # VmHWM is this address space's own high-water mark; ru_maxrss survives exec, so a freshly
    # spawned process would report its parent's peak.
    try:
        with open("/proc/self/status") as fh:
            return next(int(line.split()[1]) for line in fh if line.startswith("VmHWM:")) / 1024
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def reset_peak_memory(device: torch.device) -> None:
    """Start `peak_memory_mb`'s peak anew at what is held now: each log interval reports its own peak, not that of
    anything before it (a validation, the precision probe's fp32 steps)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:  # Linux (proc(5), clear_refs): writing 5 resets the peak resident set size to the current one
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
    except OSError:
        pass


def current_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device) / 2**20
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def memory_report(device: torch.device) -> str:
    if device.type == "cuda":
        return (f"allocated {torch.cuda.memory_allocated(device) / 2**20:.0f} MiB, reserved "
                f"{torch.cuda.memory_reserved(device) / 2**20:.0f} MiB, peak "
                f"{torch.cuda.max_memory_allocated(device) / 2**20:.0f} MiB")
    return f"resident {current_memory_mb(device):.0f} MiB, peak {peak_memory_mb(device):.0f} MiB"


def write_manifest(cfg: Config, run_dir: Path, devices: list[torch.device], precision: str,
                   data_meta: dict, world_size: int, changes: list[dict] = (), probe: dict | None = None,
                   step: int = 0) -> dict:
    """Everything needed to say later exactly what produced this run's numbers; `changes` (config keys
    changed on resume: step, key, old, new) are added to those the manifest already records; `probe`, the
    timings that chose `precision` (summarizer/train/precision.py), when a probe did; `step`, the step this
    session starts from (0: a new run, whose earlier sessions' records are gone with their steps)."""
    previous = read_manifest(run_dir)
    history = previous.get("config_changes", [])
    # what this session (a start or a resume) runs on and with: the top level is the latest session's, and
    # "sessions" keeps each one's from the step it started at, so a resume on other code or machine is kept
    session = {
        "python": sys.version.split()[0], "platform": platform.platform(),
        "torch": torch.__version__, "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
        "devices": [torch.cuda.get_device_name(d) if d.type == "cuda" else platform.processor() or "cpu"
                    for d in devices],
        "cpu_threads": torch.get_num_threads(), "world_size": world_size, "precision": precision,
        **code_version(), "command": sys.argv,
    }
    earlier = previous.get("sessions") or ([{"from_step": 0, **{k: previous.get(k) for k in session}}]
                                           if previous else [])
    sessions = [s for s in earlier if s["from_step"] < step] if step else []
    manifest = {
        **session, **({"precision_probe": probe} if probe else {}), "seed": cfg.train.seed,
        "sessions": [*sessions, {"from_step": step, **session}],
        "data": {k: data_meta.get(k) for k in ("spm_sha256", "fingerprint", "vocab_size", "splits")},
        "config": to_dict(cfg), "config_changes": history + list(changes),
        "spike_rollbacks": previous.get("spike_rollbacks", []),  # summarizer/train/watch/spikes.py
    }
    atomic_write(run_dir / "manifest.json", json.dumps(manifest, indent=2, default=str))
    return manifest


def read_manifest(run_dir: Path) -> dict:
    """The run's manifest.json, or {} for a run without a readable one."""
    try:
        manifest = json.loads((run_dir / "manifest.json").read_text())
    except (OSError, ValueError):
        return {}
    return manifest if isinstance(manifest, dict) else {}


def add_rollback(run_dir: Path, record: dict) -> None:
    """Append a spike rollback (summarizer/train/watch/spikes.py) to the manifest's `spike_rollbacks`."""
    manifest = read_manifest(run_dir)
    manifest["spike_rollbacks"] = [*manifest.get("spike_rollbacks", []), record]
    atomic_write(run_dir / "manifest.json", json.dumps(manifest, indent=2, default=str))


class Monitor:
    """Rank 0 writes; other ranks hold a Monitor that does nothing, so the loop has no `if rank` noise.

    On a terminal, progress is a bar; when stderr is a file or pipe (`make train > log 2>&1`, Slurm,
    CI), a bar would write a carriage-return line per update, so each log interval prints one line.
    """

    def __init__(self, cfg: Config, active: bool, start_step: int, total_steps: int,
                 owed_splits: set[str] | frozenset[str] = frozenset()):
        self.active, self.total_steps = active, total_steps
        self.metrics_path, self.events_dir = cfg.run_dir / "metrics.jsonl", cfg.tensorboard_dir
        self.writer = None
        self.bar = None
        if not active:
            return
        _truncate_metrics(self.metrics_path, start_step, owed_splits)
        from torch.utils.tensorboard import SummaryWriter
        # purge_step drops events a killed run wrote after its last checkpoint (or, killed before its first, all of
        # them), so curves do not fold back; and those of its step where the stop owed its train row (no event of
        # that step predates the stop then: the validation comes after the row)
        self.writer = SummaryWriter(str(cfg.tensorboard_dir),
                                    purge_step=start_step + (0 if "train" in owed_splits else 1))
        if sys.stderr.isatty():
            self.bar = tqdm(total=total_steps, initial=start_step, desc=f"train {cfg.run.name}", unit="step",
                            dynamic_ncols=True, mininterval=1.0, file=sys.stderr)

    def log(self, step: int, split: str, values: dict) -> None:
        if not self.active:
            return
        record = {"step": step, "split": split, **{k: _plain(v) for k, v in values.items()}}
        with open(self.metrics_path, "a") as fh:
            fh.write(json.dumps(record) + "\n")
        for key, value in record.items():
            if key not in ("step", "split") and isinstance(value, (int, float)):
                self.writer.add_scalar(f"{split}/{key}", value, step)
        if split == "train" and self.bar is not None:
            self.bar.set_postfix(loss=f"{values['loss']:.3f}", tok_s=f"{values['tokens_per_s']:.0f}")
        elif self.bar is None:
            print(log_line(step, self.total_steps, split, record), file=sys.stderr, flush=True)

    def rewind(self, step: int) -> None:
        """Back to `step` (a spike rollback): what was logged after it leaves metrics.jsonl and TensorBoard."""
        if not self.active:
            return
        _truncate_metrics(self.metrics_path, step)
        self.writer.close()
        from torch.utils.tensorboard import SummaryWriter
        self.writer = SummaryWriter(str(self.events_dir), purge_step=step + 1)
        if self.bar is not None:
            self.bar.n = step
            self.bar.refresh()

    def text(self, tag: str, text: str, step: int) -> None:
        if self.active:
            self.writer.add_text(tag, text, step)

    def advance(self, steps: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(steps)

    def write(self, message: str) -> None:
        if self.active:
            (self.bar.write if self.bar is not None else print)(message, file=sys.stderr)

    def hparams(self, hparams: dict, metrics: dict) -> None:
        if self.active:
            flat = {k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in hparams.items()}
            self.writer.add_hparams(flat, metrics, run_name="hparams")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.writer is not None:
            self.writer.close()


def log_line(step: int, total: int, split: str, record: dict) -> str:
    """One line of a log interval, for logs written to files: `step 50/3000 train loss 6.448 lr 1.2e-04 ...`."""
    formats = {"loss": ".4f", "lr": ".3g", "grad_norm": ".3f", "tokens_per_s": ".0f", "rouge1": ".2f",
               "rouge2": ".2f", "rougeL": ".2f", "ppl": ".2f", "data_wait": ".1%", "memory_mb": ".0f",
               "peak_memory_mb": ".0f", "peak_reserved_mb": ".0f"}
    parts = [f"{key} {record[key]:{fmt}}" for key, fmt in formats.items() if isinstance(record.get(key), (int, float))]
    return f"step {step}/{total} {split} " + " ".join(parts)


def _plain(value):
    """A logged number as metrics.jsonl and TensorBoard keep it: 8 significant digits (a float32's), so a warm-up's
    learning rate of 3.5e-07 or an update ratio of 4e-06 keeps its digits where 6 decimals made them 0."""
    return float(f"{value:.8g}") if isinstance(value, float) else value


def _truncate_metrics(path: Path, start_step: int, owed_splits: set[str] | frozenset[str] = frozenset()) -> None:
    """On resume, drop records past the checkpoint (the resumed run logs those steps again), those of its step in
    `owed_splits` (rows a stop left owed, which a resume killed after writing them had written: logged again),
    and any line a crash or a full disk left torn (an append cut short), saying so."""
    if not path.exists():
        return
    keep, torn = [], 0
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            record = json.loads(line) if line.strip() else None
        except ValueError:
            torn += 1
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int) and (
                record["step"] < start_step or record["step"] == start_step and record.get("split") not in owed_splits):
            keep.append(line)
    if torn:
        print(f"note: {path} held {torn} torn line(s) (a write cut short by a crash or a full disk); dropped",
              file=sys.stderr, flush=True)
    atomic_write(path, "".join(line + "\n" for line in keep))


def flatten(cfg: Config) -> dict:
    """{'train.lr': 1e-3, ...} for TensorBoard's hparams table."""
    out = {}
    for section, values in to_dict(cfg).items():
        for key, value in values.items():
            out[f"{section}.{key}"] = value
    return out


class Window:
    """Sums between two log points, kept as device tensors so logging costs one sync per interval;
    under DDP every rank calls `summary` at the same step and the sums are all-reduced there."""

    def __init__(self, rt, clock=time.perf_counter, peak_flops: float = 0.0):
        self.rt, self.device, self.clock, self.peak = rt, rt.device, clock, peak_flops
        self.reset()

    def reset(self) -> None:
        self.steps, self.data_s, self.tokens = 0, 0.0, 0
        self.flops, self.padded_flops = 0, 0  # model FLOPs of real tokens; FLOPs computed on padded shapes
        self.sums = torch.zeros(3, device=self.device)  # nll / global tokens, loss / global tokens, skipped steps
        for device in self.rt.devices:
            reset_peak_memory(device)
        self.started = self.clock()

    def add(self, out: dict, micro_batches: list[dict], data_s: float, flops: tuple[int, int] = (0, 0)) -> None:
        self.steps += 1
        self.flops += flops[0]
        self.padded_flops += flops[1]
        self.data_s += data_s
        self.tokens += sum(b["n_src"] + b["n_tgt"] for b in micro_batches)
        losses = torch.stack([out["nll_sum"], out["loss_sum"]]).to(self.device) / out["tokens"]
        skipped = (~out["finite"]).float().to(self.device)
        self.sums += torch.cat([losses, skipped.reshape(1)])

    def _totals(self) -> list[float]:
        """nll, loss, skipped steps, tokens, FLOPs, padded FLOPs of the interval, summed over the ranks: one
        collective and one read of the device."""
        from summarizer.runtime import all_reduce_sum
        counts = torch.tensor([float(self.tokens), float(self.flops), float(self.padded_flops)], device=self.device)
        return all_reduce_sum(torch.cat([self.sums, counts]), self.rt).tolist()

    def state(self) -> dict:
        """The interval so far, its sums over the ranks (a collective: every rank calls it), for a checkpoint a
        stop writes inside it: `restore` on resume makes the next log row the one a run never stopped writes."""
        sums = self._totals()
        return {"steps": self.steps, "sums": sums[:3], "counts": sums[3:], "data_s": self.data_s,
                "seconds": self.clock() - self.started}

    def restore(self, state: dict) -> None:
        """Continue a checkpoint's interval (`state`): the first rank holds the sums, which `summary` adds over
        the ranks, the others none; its seconds so far count, the time the run was stopped does not."""
        main = self.rt.rank == 0
        self.steps, self.data_s = state["steps"], state["data_s"]
        self.sums = torch.tensor(state["sums"] if main else [0.0] * 3, device=self.device)
        self.tokens, self.flops, self.padded_flops = (int(c) if main else 0 for c in state["counts"])
        self.started = self.clock() - state["seconds"]

    def summary(self, lr: float, grad_norm: torch.Tensor) -> dict:
        nll, loss, skipped, tokens, flops, padded = self._totals()
        seconds = self.clock() - self.started
        steps = max(self.steps, 1)
        summary = {"loss": nll / steps, "smoothed_loss": loss / steps, "lr": lr, "grad_norm": grad_norm.item(),
                   "tokens_per_s": tokens / seconds, "step_s": seconds / steps, "data_wait": self.data_s / seconds,
                   "skipped_steps": round(skipped / self.rt.world_size),  # every rank skips the same steps
                   "peak_memory_mb": max(peak_memory_mb(d) for d in self.rt.devices),
                   "memory_mb": max(current_memory_mb(d) for d in self.rt.devices)}
        if self.rt.cuda_devices:  # what the caching allocator holds, CUDA graphs' private pools included: replays
            # allocate nothing, so peak_memory_mb leaves out the graphs' memory that the eager steps cannot use
            summary["peak_reserved_mb"] = max(torch.cuda.max_memory_reserved(d) / 2**20 for d in self.rt.cuda_devices)
        if flops:  # flops.py: FLOPs of the real tokens; MFU against one device's peak, per device
            summary["model_flops_per_s"] = flops / seconds
            devices = self.rt.world_size * (len(self.rt.cuda_devices) or 1)  # a split model: two GPUs a process
            summary["mfu"] = flops / seconds / devices / self.peak if self.peak else 0.0
            summary["pad_flops_share"] = 1.0 - flops / padded if padded else 0.0
            summary["train_flops"] = flops  # of this interval; report sums them
        return summary


class Profiler:
    """torch.profiler over `steps` steps, after `wait` steps of the process and 1 warm-up step: a trace Perfetto
    opens (TensorBoard too, with the torch-tb-profiler package), an operator table in <run_dir>/profile.txt, and
    in <run_dir>/profile.json what a step costs (runtime/profiling.py: wall and operator time, kernel launches,
    values read back, the GPU's busy time)."""

    def __init__(self, steps: int, trace_dir: Path, table_path: Path, gpus: list[torch.device], wait: int = 1):
        activities = [torch.profiler.ProfilerActivity.CPU]
        if gpus:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.steps, self.seen, self.table_path, self.gpus = steps, 0, table_path, gpus
        self.first, self.last = wait + 1, wait + 1 + steps  # steps seen when the window opens and closes
        self.prof = torch.profiler.profile(
            activities=activities, record_shapes=True, profile_memory=True,
            schedule=torch.profiler.schedule(wait=wait, warmup=1, active=steps, repeat=1),
            on_trace_ready=torch.profiler.tensorboard_trace_handler(str(trace_dir)))
        self.prof.start()
        self.active_from = 0.0
        self.done = False

    def step(self) -> None:
        """After each training step (counted from the run's start or resume)."""
        if self.done:
            return
        self.seen += 1
        edge = self.seen in (self.first, self.last)
        if edge:  # the window starts and ends with every GPU idle (no wait inside: that is measured)
            for gpu in self.gpus:  # a split model's decoder GPU too: synchronize() waits for the current one only
                torch.cuda.synchronize(gpu)
        if self.seen == self.first:
            self.active_from = time.perf_counter()
        wall = time.perf_counter() - self.active_from
        self.prof.step()
        if self.seen == self.last:
            self.prof.stop()
            averages = self.prof.key_averages()
            sort = "self_cuda_time_total" if self.gpus else "self_cpu_time_total"
            self.table_path.write_text(averages.table(sort_by=sort, row_limit=40))
            atomic_write(self.table_path.with_suffix(".json"), json.dumps(per_step(averages, self.steps, wall)))
            self.done = True
