"""Every bench row runs on a tiny workload and reports well-formed figures (no timing assertions)."""
import json

import pytest
import torch

from summarizer.bench.run import NOT_HERE, markdown, rows, run_bench
from summarizer.config.load import load_config
from summarizer.errors import ConfigError

TINY = ["model.d_model=32", "model.ffn_dim=64", "model.encoder_layers=1", "model.decoder_layers=1",
        "data.batch_tokens=400", "data.max_source_len=40", "data.max_target_len=16", "bench.repeats=2",
        "bench.warmup=0", "bench.steps=2", "bench.decode_sentences=4", "eval.max_len=5", "eval.min_len=1"]


@pytest.fixture
def cfg(tiny_prepared, tmp_path):
    return load_config("configs/tiny.yaml", [f"data.dir={tiny_prepared}", f"run.dir={tmp_path / 'bench'}",
                                             f"run.tensorboard_dir={tmp_path / 'tb'}", *TINY])


@pytest.mark.slow
def test_every_timing_row_measures_on_and_off(cfg):
    # second-epoch rows (fresh processes, an epoch each) have their own test below
    steady = ("kernel_cache", "pad_multiple", "precision_bf16_epoch2")
    cfg.bench.rows = [n for n in rows(cfg) if not n.startswith("memory") and n not in ("compile", *steady)]
    cfg.bench.find_batch_tokens = False
    cfg.eval.quantize = "none"  # float32 on both sides of the decode rows: release 1 gives the same summaries
    results = run_bench(cfg)
    assert [r["practice"] for r in results] == cfg.bench.rows
    for r in results:
        assert "error" not in r, r
        for side in ("on", "off"):
            assert r[side]["n"] == 2 and 0 < r[side]["min"] <= r[side]["median"] <= r[side]["max"]
        assert r["ratio"] == pytest.approx(r["on"]["median"] / r["off"]["median"])
    for name in ("decode_greedy", "decode_beam4", "decode_static"):  # the same summaries: release 1's, dynamic
        assert next(r for r in results if r["practice"] == name)["same_outputs"] is True
    bucketing = next(r for r in results if r["practice"] == "bucketing")
    assert bucketing["padding_on"] < bucketing["padding_off"]
    saved = json.loads((cfg.run_dir / "bench.json").read_text())
    assert [r["practice"] for r in saved] == cfg.bench.rows
    assert "| workers |" in (cfg.run_dir / "bench.md").read_text()
    assert list(cfg.tensorboard_dir.parent.glob("*-bench/events.out.tfevents.*"))
    assert list(cfg.tensorboard_dir.parent.glob("*-bench/.summarizer.run_dir"))  # marked: `make clean` removes it


def test_training_rows_alternate_their_repeats(cfg, monkeypatch):
    import summarizer.bench.training as bench
    order, real_repeat = [], bench.TrainingProbe.repeat
    monkeypatch.setattr(bench.TrainingProbe, "repeat",
                        lambda self: (order.append(self.cfg.model.activation), real_repeat(self))[1])
    cfg.bench.warmup, cfg.bench.repeats = 1, 3
    result = rows(cfg)["lean_layers"][3]()
    assert order == ["relu", "gelu", "gelu", "relu", "relu", "gelu", "gelu", "relu"]  # drift hits both alike
    assert result["on"]["n"] == result["off"]["n"] == 3


@pytest.mark.slow
def test_memory_rows_show_what_the_guides_warn_about(cfg):
    cfg.bench.rows = ["memory_eval_no_grad", "memory_del_outputs", "memory_precision"]
    cfg.bench.find_batch_tokens = False
    cfg.bench.repeats = 1
    results = {r["practice"]: r for r in run_bench(cfg)}
    retained = results["memory_eval_no_grad"]
    assert retained["on"]["median"] < retained["off"]["median"]  # graphs kept alive by summed loss tensors
    for name, r in results.items():
        if "skipped" in r:  # memory_precision on a CPU without fast bf16: said why, not measured
            assert r["skipped"] == NOT_HERE[name]
        else:
            assert "error" not in r and r["on"]["median"] >= 0 and r["off"]["median"] > 0


@pytest.mark.slow
def test_batch_search_doubles_then_bisects(cfg):
    cfg.bench.rows = ["pin_memory"]  # a row that is only reported as not measured on this machine
    assert [r["practice"] for r in run_bench(cfg)] == ["pin_memory"]  # the search runs where it is asked for
    cfg.bench.rows, cfg.bench.max_batch_tokens = ["pin_memory", "max_batch_tokens"], 1600
    results = run_bench(cfg)
    assert results[0] == {"practice": "pin_memory", "skipped": NOT_HERE["pin_memory"]} or "ratio" in results[0]
    search = results[-1]
    assert search["practice"] == "max_batch_tokens" and search["batch_tokens"] >= 400
    assert [size for size, _ in search["trials"]][:3] == [400, 800, 1600]
    assert search["lr_linear_rule"] == pytest.approx(cfg.train.lr * search["batch_tokens"] / 400)
    assert "max_batch_tokens" in markdown(results)


def test_the_batch_search_tells_memory_from_other_failures_and_refuses_an_empty_range(cfg, monkeypatch):
    """Only running out of memory means a size does not fit; any other failure of the trial step is the row's
    error, not a size of 0. A bound below the start searches nothing: refused before any row runs."""
    from summarizer.bench import memory
    outcomes = {"OutOfMemoryError: CUDA out of memory": False, "MemoryError: ": False,
                "process exited with code -9": False,
                "RuntimeError: DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 GB": False,
                "ValueError: bad vocabulary": True}
    for error, fit in outcomes.items():
        monkeypatch.setattr(memory, "peak_memory", lambda *args, error=error: {"error": error})
        if fit:  # not a size that does not fit: a failure of the trial
            with pytest.raises(RuntimeError, match="failed"):
                memory.fits(cfg, 800, 1e6)
        else:
            assert memory.fits(cfg, 800, 1e6) is False
    monkeypatch.setattr(memory, "peak_memory", lambda *args: {"error": "AcceleratorError: CUDA error: an illegal "
                                                                       "memory access was encountered"})
    with pytest.raises(RuntimeError, match="illegal memory access"):
        memory.fits(cfg, 800, 1e6)
    monkeypatch.setattr(memory, "peak_memory", lambda *args: {"error": "ValueError: bad vocabulary"})
    with pytest.raises(RuntimeError, match="data.batch_tokens=800 failed: ValueError: bad vocabulary"):
        memory.fits(cfg, 800, 1e6)
    cfg.bench.rows = ["max_batch_tokens"]
    [row] = run_bench(cfg)
    assert row["practice"] == "max_batch_tokens" and "ValueError: bad vocabulary" in row["error"]
    cfg.bench.max_batch_tokens = 200
    with pytest.raises(ConfigError, match="bench.max_batch_tokens=200 is below data.batch_tokens=400"):
        run_bench(cfg)


def test_unknown_row_is_refused_with_every_name(cfg):
    cfg.bench.rows = ["wrokers"]
    with pytest.raises(ConfigError, match="unknown bench rows") as refused:
        run_bench(cfg)
    assert all(f"'{name}'" in str(refused.value) for name in ("workers", "decode_file", "decode_profile"))


def test_a_bench_checkpoint_that_is_not_a_file_is_refused_not_replaced_by_a_fresh_model(cfg, tmp_path):
    cfg.bench.rows, cfg.bench.checkpoint = ["decode_greedy"], str(tmp_path / "nope.pt")
    with pytest.raises(ConfigError, match=r"bench.checkpoint=.*nope.pt is not a file"):
        run_bench(cfg)


@pytest.mark.parametrize("row", ["decode_greedy", "decode_profile"])
def test_a_bench_checkpoint_beside_another_tokenizers_data_is_refused_as_eval_refuses_it(cfg, trained_run, row):
    """Decoding ids of one tokenizer with a model of another times and scores nonsense: the decoding rows load
    bench.checkpoint as eval does, and refuse it."""
    from summarizer.errors import DataError
    cfg.bench.rows, cfg.bench.checkpoint = [row], str(trained_run[0] / "run" / "best.pt")
    with pytest.raises(DataError, match="tokenizer mismatch"):
        run_bench(cfg)


@pytest.mark.slow
def test_compile_row_measures_or_reports_why_not(cfg):
    cfg.bench.rows = ["compile"]
    cfg.bench.find_batch_tokens = False
    cfg.bench.repeats, cfg.bench.steps = 1, 1
    (row,) = run_bench(cfg)
    assert "error" not in row, row["error"]  # torch.compile works on this platform: the row must measure it
    assert row["on"]["median"] > 0 and row["off"]["median"] > 0 and row["ratio"] > 0


def test_decode_profile_row_splits_the_wall_time_into_operators_and_the_rest(cfg):
    cfg.bench.rows, cfg.bench.find_batch_tokens = ["decode_profile"], False
    [row] = run_bench(cfg)
    assert row["practice"] == "decode_profile" and row["sentences"] == 4 and row["beam"] == 4
    assert 0 < row["ops_s"] and 0 < row["ops_share"] <= 1.05  # the profiler's own overhead aside, within the wall
    # torch operators (aten::, and quantized:: where the default eval runs int8 layers)
    assert row["top_ops"] and all(o["op"].split("::")[0] in ("aten", "quantized") and o["calls"] > 0
                                  for o in row["top_ops"])
    shares = [o["share"] for o in row["top_ops"]]
    assert shares == sorted(shares, reverse=True)
    assert row["host_reads_per_step"] > 0  # the word rules' nonzero calls, among others
    assert "| decode_profile | beam-4 default eval of 4 sentences" in (cfg.run_dir / "bench.md").read_text()
    assert "aten::topk" in (cfg.run_dir / "decode_profile.txt").read_text()


def test_decode_file_row_times_start_up_apart_from_both_searches(trained_run, tmp_path):
    import gzip

    tmp, _ = trained_run
    pairs = tmp_path / "pairs.jsonl.gz"
    with gzip.open(pairs, "wt") as f:
        for text in ("The mayor opened a new park on Sunday .", "Oil prices rose sharply on Monday ."):
            f.write(json.dumps({"source": text, "target": "a headline"}) + "\n")
    cfg = load_config("configs/tiny.yaml", [f"data.dir={tmp / 'data'}", f"run.dir={tmp_path / 'bench'}",
                                            f"run.tensorboard_dir={tmp_path / 'tb'}", f"eval.pairs={pairs}",
                                            f"bench.checkpoint={tmp / 'run' / 'best.pt'}", "bench.repeats=2",
                                            "bench.warmup=0", "bench.rows=[decode_file]",
                                            "bench.find_batch_tokens=false"])
    [row] = run_bench(cfg)
    assert row["practice"] == "decode_file" and row["file"] == "pairs.jsonl.gz" and row["sentences"] == 2
    assert row["startup_s"] > 0 and set(row["rates"]) == {"beam 1", "beam 4"}
    assert all(r["n"] == 2 and r["median"] > 0 for r in row["rates"].values())
    table = (cfg.run_dir / "bench.md").read_text()
    assert "| decode_file | pairs.jsonl.gz (2 sentences), default eval: start-up" in table


def test_decode_file_row_without_a_checkpoint_says_so(cfg):
    cfg.bench.rows, cfg.bench.find_batch_tokens = ["decode_file"], False
    [row] = run_bench(cfg)
    assert row["practice"] == "decode_file" and "no trained checkpoint" in row["skipped"]
    assert "| decode_file | not measured: no trained checkpoint" in (cfg.run_dir / "bench.md").read_text()


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_16_bit_decoding_row_runs_on_any_cpu(cfg, precision):
    """The bench lists decode_bf16 only where bf16 is fast; the row itself runs either way (CPU autocast
    computes both 16-bit types), so both branches are exercised whatever this CPU is."""
    from summarizer.bench.decoding import decode_row
    result = decode_row(cfg, 4, precision)
    for side in ("on", "off"):
        assert result[side]["n"] == 2 and 0 < result[side]["median"] and 0 <= result[side]["rouge1"] <= 100
    assert isinstance(result["same_outputs"], bool)


@pytest.mark.slow
def test_second_epoch_rows_take_probe_options_and_alternate_fresh_processes(cfg):
    """The steady-state form of a row (the GPU's AMP rows and naive_vs_default there): each side trains an epoch
    unmeasured in its own process first, with its probe options (fixed-size batches, a sync every step)."""
    from summarizer.bench.training import second_epoch_rates
    cfg.bench.repeats = 1
    result = second_epoch_rates((cfg, {}), (cfg, {"fixed_batches": True, "item_every_step": True}))
    for side in ("on", "off"):
        assert result[side]["n"] == 1 and result[side]["min"] > 0
    table = rows(cfg)
    padded = table["pad_multiple"][3]()  # a row of the table in that form, end to end
    assert padded["on"]["n"] == padded["off"]["n"] == 1
    if "precision_bf16" in table:  # the first-epoch and second-epoch forms come as a pair
        assert "precision_bf16_epoch2" in table


@pytest.mark.parametrize("device, multiple", [("cpu", 4), ("cuda", 8)])
def test_pad_multiple_row_pads_to_what_the_device_wants(cfg, monkeypatch, device, multiple):
    """On a GPU the row measures multiples of 8 (16-bit tensor cores), on a CPU 4 (oneDNN's kernel cache); both
    against unpadded, on any machine (the GPU branch with a CUDA device patched in)."""
    from summarizer import runtime
    monkeypatch.setattr(runtime, "resolve_device", lambda name: torch.device(device))
    assert f"multiples of {multiple} vs unpadded" in rows(cfg)["pad_multiple"][0]


def test_the_default_variant_trains_in_the_precision_make_train_would_choose(cfg, monkeypatch):
    """On a GPU `train.precision=auto` is a probe's choice (summarizer/train/precision.py); the bench's default
    variant makes the same choice, stood in for here by the probe's GPU branch on the CPU, timed to choose the
    precision the CPU's own rule would not."""
    import summarizer.bench.training as bench
    from summarizer import runtime
    from summarizer.train import precision
    faster = "fp32" if runtime.resolve_precision("auto", torch.device("cpu")) == "bf16" else "bf16"
    monkeypatch.setattr(precision, "candidates", lambda requested, rt: ("fp32", "bf16") if requested == "auto" else ())
    monkeypatch.setattr(precision, "device_name", lambda rt: "GPU A")
    monkeypatch.setattr(precision, "measure", lambda model, batches, precisions, rt, train:
                        {p: 1.0 if p == faster else 2.0 for p in precisions})
    probe = bench.TrainingProbe(cfg)
    assert probe.rt.precision == faster and probe.scaler.is_enabled() is False
    assert probe.repeat(1) > 0
    cfg.train.precision = "fp32"
    assert bench.TrainingProbe(cfg).rt.precision == "fp32"  # a precision set by hand is not probed


def test_a_bench_stopped_midway_keeps_the_rows_it_measured(cfg, monkeypatch):
    import summarizer.bench.run as bench_run
    table = bench_run.rows(cfg)

    def stopped():
        raise KeyboardInterrupt

    table["lean_layers"] = (*table["lean_layers"][:3], stopped)
    monkeypatch.setattr(bench_run, "rows", lambda cfg: table)
    cfg.bench.rows, cfg.bench.find_batch_tokens = ["set_to_none", "pin_memory", "lean_layers"], False
    with pytest.raises(KeyboardInterrupt):
        run_bench(cfg)
    kept = json.loads((cfg.run_dir / "bench.json").read_text())
    assert [r["practice"] for r in kept] == ["set_to_none", "pin_memory"] and kept[0]["ratio"] > 0


def test_on_a_gpu_the_rows_compare_what_a_gpu_runs(cfg, monkeypatch):
    """int8 decoding and the fast dropout masks are CPU modes (skipped there, not failed); the attention row names
    auto's kernels; the KV-cache row decodes as eval does, in the dynamic search on both sides (on a GPU auto would
    make its "on" side static)."""
    import summarizer.bench.decoding as decoding
    from summarizer import runtime
    monkeypatch.setattr(runtime, "resolve_device", lambda name: torch.device("cuda"))
    table = rows(cfg)
    assert "decode_int8" not in table and NOT_HERE["decode_int8"].startswith("a CPU decoding mode")
    assert "fast_dropout" not in table and NOT_HERE["fast_dropout"].startswith("CPU dropout masks")  # a no-op there
    assert "never cuDNN" in table["attention_kernel"][0]
    monkeypatch.undo()
    seen = []
    monkeypatch.setattr(decoding, "decode_all", lambda model, sources, settings, rt, **kw: seen.append(
        (settings.shapes, rt.precision, kw["use_cache"])))
    decoding.decode_rate(cfg, True)
    decoding.decode_rate(cfg, False)
    assert {s for s, _, _ in seen} == {"dynamic"} and {c for _, _, c in seen} == {True, False}
    assert {p for _, p, _ in seen} == {runtime.resolve_precision(decoding.decoding_precision(cfg), torch.device("cpu"))}


def test_device_syncs_counts_the_warnings_of_cudas_sync_debug_mode(monkeypatch):
    import contextlib
    import warnings

    import summarizer.bench.decoding as decoding
    modes = []
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)

    def work():
        for message in ("called a synchronizing CUDA operation", "something else",
                        "called a synchronizing CUDA operation"):
            warnings.warn(message, stacklevel=1)

    assert decoding.device_syncs(work, torch.device("cuda")) == 2 and modes == ["warn", "default"]
