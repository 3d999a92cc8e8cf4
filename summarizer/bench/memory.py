"""Bench measurements that need a fresh process: memory peaks, and settings a process reads once."""
from __future__ import annotations

import gc
import multiprocessing as mp
import signal

import torch

from summarizer import runtime
from summarizer.config.load import from_dict, to_dict
from summarizer.config.schema import Config
from summarizer.train.watch.monitor import current_memory_mb, peak_memory_mb, reset_peak_memory


def _child(target, args: tuple, queue) -> None:
    try:
        queue.put(target(*args))
    except Exception as exc:  # reported to the parent, which decides what a failure means
        queue.put({"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"})


def in_fresh_process(target, *args) -> dict:
    """target(*args) -> dict, run in a spawned process: its peak memory and process-wide settings
    (read once, like oneDNN's kernel cache size) are its own. {"error": ...} if it raised or died."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=(target, args, queue))
    proc.start()
    proc.join()
    if proc.exitcode != 0:  # killed (e.g. by the kernel's OOM killer) before it could report
        return {"error": f"process exited with code {proc.exitcode}"}
    return queue.get()


def _synthetic_batch(cfg: Config, batch_tokens: int, vocab: int) -> dict:
    """A worst-case batch: every pair at the maximum lengths, as many as the budget allows."""
    s, t = cfg.data.max_source_len, cfg.data.max_target_len + 1
    n = max(1, batch_tokens // (s + t))
    g = torch.Generator().manual_seed(0)
    src = torch.randint(4, vocab, (n, s), generator=g)
    tgt = torch.randint(4, vocab, (n, t), generator=g)
    return {"src_ids": src, "tgt_in": tgt, "tgt_out": tgt, "n_src": n * s, "n_tgt": n * t}


def _measure(cfg_dict: dict, variant: str, steps: int, batch_tokens: int) -> dict:
    """Run `steps` steps of one variant; report the peak memory above the post-setup baseline."""
    from summarizer.data.prepared import read_meta
    from summarizer.runtime import move_batch
    from summarizer.train.losses import smoothed_nll
    from summarizer.train.session import build
    cfg = from_dict(cfg_dict)
    rt = runtime.setup(cfg.system, cfg.placement, cfg.train.precision)
    torch.manual_seed(0)
    meta = read_meta(cfg.data.dir)
    model, optimizer = build(cfg, rt, meta)[:2]
    batch = move_batch(_synthetic_batch(cfg, batch_tokens, meta["vocab_size"]), rt.device)
    for device in rt.devices:  # both GPUs of a split model: the decoder's holds the logits and the loss
        reset_peak_memory(device)
    base = {d: peak_memory_mb(d) if d.type == "cuda" else current_memory_mb(d) for d in rt.devices}
    kept, total = [], 0.0
    for _ in range(steps):
        if variant == "eval_tensor":  # evaluation with autograd on, summing loss tensors
            with rt.compute():
                out = model(batch["src_ids"], batch["tgt_in"])
            kept.append(smoothed_nll(out, batch["tgt_out"], batch["src_ids"], 0.0)[0])  # keeps its graph
            del out
            continue
        if variant == "eval_item":  # evaluation as evaluate_loss does it
            with torch.inference_mode(), rt.compute():
                out = model(batch["src_ids"], batch["tgt_in"])
                total += smoothed_nll(out, batch["tgt_out"], batch["src_ids"], 0.0)[1].item()
            del out
            continue
        with rt.compute():
            out = model(batch["src_ids"], batch["tgt_in"])
        loss, _ = smoothed_nll(out, batch["tgt_out"], batch["src_ids"], 0.1)
        (loss / batch["n_tgt"]).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if variant == "keep_outputs":
            kept = [out, loss]  # last step's outputs stay referenced while the next step allocates
        else:
            del out, loss
    for device in rt.cuda_devices:
        torch.cuda.synchronize(device)
    return {"peak_mb": max(peak_memory_mb(d) - base[d] for d in rt.devices)}


def peak_memory(cfg: Config, variant: str, steps: int, batch_tokens: int | None = None) -> dict:
    """Peak memory (MiB above setup) of `steps` steps of `variant` in a fresh spawned process.

    variants: train (the loop as written), keep_outputs (last step's outputs not deleted),
    eval_tensor (evaluation with autograd on, losses kept as tensors), eval_item (inference_mode + .item()).
    """
    return in_fresh_process(_measure, to_dict(cfg), variant, steps, batch_tokens or cfg.data.batch_tokens)


def fits(cfg: Config, batch_tokens: int, budget_mb: float) -> bool:
    """Does one training step at `batch_tokens` (worst-case lengths) fit? CUDA: no OOM; CPU: under budget. A step
    that failed for another reason than memory raises: it says nothing of the size that fits."""
    result = peak_memory(cfg, "train", 1, batch_tokens)
    if "error" not in result:
        return result["peak_mb"] <= budget_mb
    error = result["error"]
    if error.startswith(("OutOfMemoryError", "MemoryError")) or "out of memory" in error.lower() \
            or "can't allocate memory" in error or error.endswith(f"code {-signal.SIGKILL}"):
        return False  # torch's OutOfMemoryError, its CPU allocator's, MemoryError, the out-of-memory killer's SIGKILL
    raise RuntimeError(f"a training step at data.batch_tokens={batch_tokens} failed: {result['error']}")


def largest_batch_tokens(cfg: Config, budget_mb: float, start: int, limit: int) -> tuple[int, list]:
    """Double from `start` until a step no longer fits (or `limit`), then bisect to within 10%."""
    trials, low, high = [], 0, None
    size = start
    while size <= limit:
        ok = fits(cfg, size, budget_mb)
        trials.append((size, ok))
        if not ok:
            high = size
            break
        low, size = size, size * 2
    if high is None:
        return low, trials
    while high - low > max(low // 10, 64):
        mid = (low + high) // 2
        ok = fits(cfg, mid, budget_mb)
        trials.append((mid, ok))
        low, high = (mid, high) if ok else (low, mid)
    return low, trials


def memory_budget_mb(device: torch.device) -> float:
    """What a step may use: the GPU's free memory, or 80% of the host's available memory. On a GPU, what this
    process's caching allocator holds from the rows before (idle blocks the driver counts as used) is let go
    first."""
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()
        free, _ = torch.cuda.mem_get_info(device)
        return free / 2**20
    with open("/proc/meminfo") as fh:
        info = dict(line.split(":", 1) for line in fh)
    return 0.8 * int(info["MemAvailable"].split()[0]) / 1024
