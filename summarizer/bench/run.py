"""The practices benchmark: each practice measured on and off on short fixed workloads, on this machine."""
from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable

import torch

from summarizer import runtime
from summarizer.bench import memory as bench_memory
from summarizer.bench.decoding import (
    check_weights,
    decode_rate,
    decode_row,
    file_row,
    profile_row,
    summarize_row,
    weights,
)
from summarizer.bench.training import memory_row, second_epoch_rates, training_rates, variant
from summarizer.config.schema import Config
from summarizer.errors import ConfigError
from summarizer.outputs import atomic_write, claim_dir, claim_events_dir


def rows(cfg: Config) -> dict[str, tuple[str, str, str, Callable[[], dict]]]:
    """name -> (what is compared, unit, higher_is_better, measure() -> {"on": stats, "off": stats})."""
    cuda = runtime.resolve_device(cfg.system.device).type == "cuda"
    best = runtime.resolve_precision("auto", runtime.resolve_device(cfg.system.device))
    t = lambda *o, **kw: (variant(cfg, *o), kw)  # noqa: E731  (a training variant: config, probe options)
    pair = lambda on, off: (lambda: training_rates(on, off))  # noqa: E731
    on_off = lambda on, off: (lambda: {"on": on(), "off": off()})  # noqa: E731
    steady = lambda on, off: (lambda: second_epoch_rates(on, off))  # noqa: E731
    # 16-bit tensor cores want multiples of 8; a CPU's oneDNN kernel cache, fewer shapes (4 measured there)
    padded = max(cfg.data.pad_multiple, 8 if cuda else 4)
    quarter = max(cfg.data.batch_tokens // 4, cfg.data.max_source_len + cfg.data.max_target_len)
    # rows whose "off" cannot be captured as a CUDA graph (graphs.unsupported) time both sides launched from Python,
    # or a GPU's row would measure the captured step (bench row "cuda_graphs") instead of the practice
    launched, eager = ("train", "cuda_graphs", False), (", steps launched from Python" if cuda else "")
    table = {
        "workers": (f"num_workers {max(cfg.data.num_workers, 2)} vs 0", "tokens/s", "higher", pair(
            t(("data", "num_workers", max(cfg.data.num_workers, 2))), t(("data", "num_workers", 0)))),
        "precision_bf16": ("bf16 autocast vs fp32, first epoch (new batch shapes)", "tokens/s", "higher", pair(
            t(("train", "precision", "bf16")), t(("train", "precision", "fp32")))),
        "precision_bf16_epoch2": ("bf16 autocast vs fp32, second epoch (shapes seen before)", "tokens/s",
                                  "higher", steady(t(("train", "precision", "bf16")),
                                                   t(("train", "precision", "fp32")))),
        "set_to_none": ("zero_grad(set_to_none=True) vs writing zeros", "tokens/s", "higher", pair(
            t(("train", "set_to_none", True)), t(("train", "set_to_none", False)))),
        "bucketing": ("token-budget length buckets vs random fixed-size batches", "tokens/s", "higher", pair(
            t(), t(fixed_batches=True))),
        "accumulation": ("1 x batch vs 4 x batch/4 (same tokens per update)" + eager, "tokens/s", "higher", pair(
            t(launched), t(launched, ("train", "accum_steps", 4), ("data", "batch_tokens", quarter)))),
        "item_at_log_intervals": (".item() at log intervals vs every step", "tokens/s", "higher", pair(
            t(), t(item_every_step=True))),
        "observability": (f"model FLOPs counted every step + per-module statistics every {cfg.bench.steps} steps "
                          f"(train.log_every is {cfg.train.log_every}) vs neither", "tokens/s", "higher",
                          pair(t(("train", "log_every", cfg.bench.steps), observe=True), t())),
        "fused_loss": ("fused vocabulary loss vs autograd logsumexp/gather/mean", "tokens/s", "higher", pair(
            t(("train", "fused_loss", True)), t(("train", "fused_loss", False)))),
        "attention_kernel": ("explicit attention vs SDPA math kernel" if not cuda else
                             "SDPA flash or memory-efficient kernels (auto: never cuDNN's) vs math",
                             "tokens/s", "higher", pair(t(("system", "sdpa_backend", "auto")),
                                                        t(("system", "sdpa_backend", "math")))),
        "fast_dropout": ("dropout masks from SFC64 bits vs torch's bernoulli_", "tokens/s", "higher", pair(
            t(("model", "fast_dropout", True)), t(("model", "fast_dropout", False)))),
        "fused_optimizer": ("AdamW(fused=True) vs torch's default implementation" + eager, "tokens/s", "higher",
                            pair(t(launched, ("train", "fused_optimizer", True)),
                                 t(launched, ("train", "fused_optimizer", False)))),
        "lean_layers": ("ReLU and no biases vs GELU with biases (a model choice)", "tokens/s", "higher", pair(
            t(("model", "activation", "relu"), ("model", "bias", False)),
            t(("model", "activation", "gelu"), ("model", "bias", True)))),
        "kernel_cache": (f"CPU kernel cache {cfg.system.cpu_kernel_cache} vs oneDNN's default 1024, in epoch 2",
                         "tokens/s", "higher", lambda: second_epoch_rates(
                             cfg, variant(cfg, ("system", "cpu_kernel_cache", 1024)))),
        "pad_multiple": (f"lengths padded to multiples of {padded} vs unpadded, in the second epoch", "tokens/s",
                         "higher", lambda: second_epoch_rates(variant(cfg, ("data", "pad_multiple", padded)),
                                                              variant(cfg, ("data", "pad_multiple", 1)))),
        "pad_rows": (f"batches filled with empty rows to the budget (a shape per pair of lengths) vs as cut, {best}, "
                     "first epoch (new shapes)", "tokens/s", "higher", pair(
                         t(("data", "pad_rows", True), ("train", "precision", best)),
                         t(("data", "pad_rows", False), ("train", "precision", best)))),
        "decode_greedy": ("greedy decoding: today's decoder (default eval.quantize) vs that of commit 9415323 (fp32), "
                          "word rules off on both", "sentences/s",
                          "higher", lambda: decode_row(cfg, 1, "v1")),
        "decode_beam4": ("beam-4 decoding: today's decoder (default eval.quantize) vs that of commit 9415323 (fp32), "
                          "word rules off on both", "sentences/s",
                         "higher", lambda: decode_row(cfg, 4, "v1")),
        "decode_rules": ("beam 4 with the word rules (known words, no repeats) vs without", "sentences/s", "higher",
                         lambda: decode_row(cfg, 4, "rules")),
        "decode_int8": ("beam 4 with int8 linear layers (eval.quantize=int8) vs float32", "sentences/s", "higher",
                        lambda: decode_row(cfg, 4, "int8")),
        "decode_static": ("beam 4 in static shapes (a CUDA graph per step on a GPU) vs dynamic, fp32, word rules on",
                          "sentences/s", "higher", lambda: decode_row(cfg, 4, "shapes")),
        "kv_cache": ("beam-4 decoding with KV cache vs recomputing the prefix", "sentences/s", "higher", on_off(
            lambda: decode_rate(cfg, True), lambda: decode_rate(cfg, False))),
        "compile": ("torch.compile vs eager", "tokens/s", "higher", pair(
            t(("train", "compile", True)), t(("train", "compile", False)))),
        "memory_eval_no_grad": ("evaluation: inference_mode + .item() vs autograd on + summed loss tensors",
                                "peak MiB", "lower", lambda: memory_row(cfg, "eval_item", cfg, "eval_tensor", 8)),
        "memory_del_outputs": ("last step's outputs deleted vs kept referenced", "peak MiB", "lower",
                               lambda: memory_row(cfg, "train", cfg, "keep_outputs", 3)),
        "memory_precision": (f"step memory {best} vs fp32", "peak MiB", "lower", lambda: memory_row(
            variant(cfg, ("train", "precision", best)), "train", variant(cfg, ("train", "precision", "fp32")),
            "train", 2)),
        "naive_vs_default": ("every practice on (default config) vs every practice off"
                             + (", second epoch" if cuda else ""), "tokens/s", "higher",
                             (steady if cuda else pair)(t(), t(
                                 ("data", "num_workers", 0), ("train", "precision", "fp32"),
                                 ("train", "set_to_none", False), ("train", "fused_loss", False),
                                 ("system", "sdpa_backend", "default"), ("model", "fast_dropout", False),
                                 ("train", "fused_optimizer", False), ("train", "cuda_graphs", False),
                                 fixed_batches=True, item_every_step=True))),
    }
    if weights(cfg).is_file():
        table["summarize"] = ("summarize, raw text in, summaries out: default settings vs "
                              + ("eval.batch_tokens=16384 (a CPU's batches)" if cuda else "eval.quantize=none (fp32)"),
                              "lines/s", "higher", lambda: summarize_row(cfg, cuda))
    if best != "fp32":
        table["decode_bf16"] = (f"beam 4 decoding in {best} vs float32", "sentences/s", "higher",
                                lambda: decode_row(cfg, 4, best))
    if cuda:
        table["precision_fp16"] = ("fp16 autocast + GradScaler vs fp32, first epoch", "tokens/s", "higher", pair(
            t(("train", "precision", "fp16")), t(("train", "precision", "fp32"))))
        table["precision_fp16_epoch2"] = ("fp16 autocast + GradScaler vs fp32, second epoch", "tokens/s", "higher",
                                          steady(t(("train", "precision", "fp16")), t(("train", "precision", "fp32"))))
        table["pin_memory"] = ("pinned memory + non-blocking copies vs pageable", "tokens/s", "higher", pair(
            t(("data", "pin_memory", True)), t(("data", "pin_memory", False))))
        table["cudnn_benchmark"] = ("cudnn.benchmark on vs off", "tokens/s", "higher", pair(
            t(("system", "cudnn_benchmark", True)), t(("system", "cudnn_benchmark", False))))
        table["cuda_graphs"] = ("each batch shape's whole step replayed as a CUDA graph vs launched from Python, "
                                "second epoch", "tokens/s", "higher", steady(t(("train", "cuda_graphs", True)),
                                                                             t(("train", "cuda_graphs", False))))
    if cuda and torch.cuda.device_count() >= 2:
        split = (("placement", "encoder_device", "cuda:0"), ("placement", "decoder_device", "cuda:1"))
        table["pipeline_chunks"] = ("encoder/decoder on two GPUs: 4 pipeline chunks vs 1", "tokens/s", "higher",
                                    pair(t(*split, ("placement", "pipeline_chunks", 4)),
                                         t(*split, ("placement", "pipeline_chunks", 1))))
    if cuda:
        table.pop("kernel_cache")
        table.pop("decode_int8")
        table.pop("fast_dropout")
    if best == "fp32":
        for name in ("precision_bf16", "precision_bf16_epoch2", "memory_precision"):
            table.pop(name)
    return table


NOT_HERE = {"precision_bf16": "no fast bf16 on this device", "decode_bf16": "no fast bf16 on this device",
            "precision_bf16_epoch2": "no fast bf16 on this device", "precision_fp16": "needs CUDA",
            "precision_fp16_epoch2": "needs CUDA",
            "pin_memory": "needs CUDA (pinning only speeds up host-to-GPU copies)",
            "cudnn_benchmark": "needs CUDA", "cuda_graphs": "needs CUDA", "kernel_cache": "a CPU (oneDNN) setting",
            "fast_dropout": "CPU dropout masks (on CUDA both variants run torch's dropout kernel)",
            "decode_int8": "a CPU decoding mode (int8 linear layers)",
            "pipeline_chunks": "needs two GPUs", "summarize": "needs trained weights (bench.checkpoint, or best.pt)",
            "memory_precision": "no 16-bit mode worth measuring on this device"}


AFTER_ROWS = ("decode_file", "decode_profile", "max_batch_tokens")  # rows that are not an on/off pair


def _fmt(s: dict) -> str:
    return f"{s['median']:.0f} [{s['min']:.0f}-{s['max']:.0f}]" if s["median"] >= 10 else \
        f"{s['median']:.2f} [{s['min']:.2f}-{s['max']:.2f}]"


def run_bench(cfg: Config) -> list[dict]:
    """Measure every (selected) row; print the table; write bench.json, bench.md and TensorBoard scalars."""
    claim_dir(cfg.run_dir, "run", "run.dir")
    table = rows(cfg)
    wanted = cfg.bench.rows or list(table) + [n for n in NOT_HERE if n not in table] + list(AFTER_ROWS)
    unknown = [n for n in wanted if n not in table and n not in NOT_HERE and n not in AFTER_ROWS]
    if unknown:
        raise ConfigError(f"unknown bench rows {unknown}; choose from "
                          f"{sorted(set(table) | set(NOT_HERE) | set(AFTER_ROWS))}")
    if any(name.startswith("decode") or name == "summarize" for name in wanted):  # the rows that decode
        check_weights(cfg)
    search = "max_batch_tokens" in wanted and bool(cfg.bench.find_batch_tokens or cfg.bench.rows)
    if search and cfg.data.batch_tokens > cfg.bench.max_batch_tokens:
        raise ConfigError(f"bench.max_batch_tokens={cfg.bench.max_batch_tokens} is below data.batch_tokens="
                          f"{cfg.data.batch_tokens}, where the search for the largest batch that fits starts: "
                          f"raise it, or leave the search out (bench.find_batch_tokens=false, and max_batch_tokens "
                          f"out of bench.rows)")
    results = []
    for name in wanted:
        if results:  # the rows measured so far, kept should the bench be stopped or killed before its end
            atomic_write(cfg.run_dir / "bench.json", json.dumps(results, indent=2))
        if name in AFTER_ROWS:
            continue  # not on/off pairs: measured after the rows
        if name not in table:
            results.append({"practice": name, "skipped": NOT_HERE[name]})
            continue
        what, unit, better, measure = table[name]
        print(f"bench: {name} ({what}) ...", file=sys.stderr, flush=True)
        started = time.perf_counter()
        try:
            values = measure()
        except Exception as exc:  # a practice that fails here (e.g. compile without a compiler) is a finding
            results.append({"practice": name, "compared": what, "error": f"{type(exc).__name__}: {exc}"[:300]})
            continue
        ratio = values["on"]["median"] / max(values["off"]["median"], 1e-9)
        results.append({"practice": name, "compared": what, "unit": unit, "better": better, "on": values["on"],
                        "off": values["off"], "ratio": ratio, "seconds": time.perf_counter() - started,
                        **({"padding_on": values["on"]["padding"], "padding_off": values["off"]["padding"]}
                           if "padding" in values["on"] and name == "bucketing" else {}),
                        **{k: v for k, v in values.items() if k not in ("on", "off")}})
    if "decode_file" in wanted and not weights(cfg).is_file():
        results.append({"practice": "decode_file", "skipped": f"no trained checkpoint at {weights(cfg)} "
                                                              f"(bench.checkpoint, else the run's best.pt)"})
    elif "decode_file" in wanted:
        print("bench: decode_file (a file of raw text decoded with the default eval, start-up apart) ...",
              file=sys.stderr, flush=True)
        results.append({"practice": "decode_file", **file_row(cfg)})
    if "decode_profile" in wanted:
        print("bench: decode_profile (where a beam-4 default-eval decode spends its time) ...", file=sys.stderr,
              flush=True)
        results.append({"practice": "decode_profile", **profile_row(cfg)})
    if search:
        print("bench: max_batch_tokens (the largest data.batch_tokens whose worst-case step fits) ...",
              file=sys.stderr, flush=True)
        try:
            results.append(batch_search_row(cfg))
        except RuntimeError as exc:
            results.append({"practice": "max_batch_tokens", "compared": "largest data.batch_tokens whose "
                            "worst-case step fits", "error": str(exc)[:300]})
    write_outputs(cfg, results)
    return results


def batch_search_row(cfg: Config) -> dict:
    """The largest data.batch_tokens whose worst-case training step fits in memory, searched from data.batch_tokens
    up to bench.max_batch_tokens, with the learning rates the linear and square-root rules give it."""
    device = runtime.resolve_device(cfg.system.device)
    budget = bench_memory.memory_budget_mb(device)
    found, trials = bench_memory.largest_batch_tokens(cfg, budget, cfg.data.batch_tokens, cfg.bench.max_batch_tokens)
    scale = found / cfg.data.batch_tokens
    return {"practice": "max_batch_tokens", "compared": "largest data.batch_tokens whose worst-case step fits",
            "budget_mb": budget, "batch_tokens": found, "trials": trials,
            "lr_linear_rule": cfg.train.lr * scale, "lr_sqrt_rule": cfg.train.lr * scale ** 0.5}


def markdown(results: list[dict]) -> str:
    lines = ["| practice | compared | on | off | unit | on/off |", "|---|---|---|---|---|---|"]
    for r in results:
        if "skipped" in r:
            lines.append(f"| {r['practice']} | not measured: {r['skipped']} | | | | |")
        elif "error" in r:
            lines.append(f"| {r['practice']} | {r['compared']} | failed: {r['error']} | | | |")
        elif r["practice"] == "decode_file":
            rates = "; ".join(f"{k} {_fmt(v)} sentences/s" for k, v in r["rates"].items())
            lines.append(f"| decode_file | {r['file']} ({r['sentences']} sentences), default eval: start-up "
                         f"(checkpoint, lexicon, reading, tokenizing) {r['startup_s']:.1f} s, then {rates} | | | | |")
        elif r["practice"] == "decode_profile":
            ops = ", ".join(f"{o['op']} {o['share']:.0%} ({o['calls']} calls)" for o in r["top_ops"][:6])
            device = ""
            if "device_s" in r:
                device = "; {:.0f} kernel launches a step; the GPU busy {:.0%}, most: {}".format(
                    r.get("launches_per_step", 0), r["device_share"], ", ".join(
                    f"{o['op']} {o['self_s']:.2f} s ({o['calls']} calls)" for o in r["top_device_ops"][:6]))
            lines.append(f"| decode_profile | beam-{r['beam']} default eval of {r['sentences']} sentences, one thread, "
                         f"torch.profiler: {r['ops_share']:.0%} of {r['wall_s']:.2f} s inside torch operators, the "
                         f"rest Python; {r['host_reads_per_step']:.1f} values read back to the host a step; most: "
                         f"{ops}{device} (decode_profile.txt) | | | | |")
        elif r["practice"] == "max_batch_tokens":
            lines.append(f"| max_batch_tokens | {r['compared']} (budget {r['budget_mb']:.0f} MiB) | "
                         f"{r['batch_tokens']} | | tokens | lr {r['lr_linear_rule']:.2g} (linear rule), "
                         f"{r['lr_sqrt_rule']:.2g} (sqrt rule) |")
        else:
            extra = f" (padding {r['padding_on']:.1%} vs {r['padding_off']:.1%})" if "padding_on" in r else ""
            if "rouge1" in r["on"]:
                extra = (f" (ROUGE-1 {r['on']['rouge1']:.2f} vs {r['off']['rouge1']:.2f}; outputs "
                         f"{'identical' if r['same_outputs'] else 'differ'})")
            lines.append(f"| {r['practice']} | {r['compared']}{extra} | {_fmt(r['on'])} | {_fmt(r['off'])} | "
                         f"{r['unit']} | {r['ratio']:.2f}x |")
    return "\n".join(lines) + "\n"


def write_outputs(cfg: Config, results: list[dict]) -> None:
    atomic_write(cfg.run_dir / "bench.json", json.dumps(results, indent=2))
    table = markdown(results)
    header = (f"Medians of {cfg.bench.repeats} repeats of {cfg.bench.steps} steps after {cfg.bench.warmup} "
              f"warm-up, [min-max]; device {runtime.resolve_device(cfg.system.device)}, torch {torch.__version__}, "
              f"{torch.get_num_threads()} threads.\n\n")
    atomic_write(cfg.run_dir / "bench.md", header + table)
    from torch.utils.tensorboard import SummaryWriter
    events = claim_events_dir(str(cfg.tensorboard_dir) + "-bench", cfg.run_dir)  # marked, as a run's are
    with SummaryWriter(str(events)) as writer:
        for r in results:
            if "ratio" in r:
                writer.add_scalar(f"bench/{r['practice']}/on", r["on"]["median"], 0)
                writer.add_scalar(f"bench/{r['practice']}/off", r["off"]["median"], 0)
                writer.add_scalar(f"bench/{r['practice']}/ratio", r["ratio"], 0)
        writer.add_text("bench", header + table, 0)
    print(header + table)
