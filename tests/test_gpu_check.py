"""scripts/gpu_check.sh: its report's rows from hand-written run files, and the whole check in its CPU mode."""
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from summarizer import runtime

ROOT = Path(__file__).resolve().parent.parent
EQUAL = "share of predictions equal to the dynamic fp32 search's"
_spec = importlib.util.spec_from_file_location("gpu_check_report", ROOT / "scripts" / "gpu_check_report.py")
report = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(report)


def write_metrics(run_dir: Path, rates: dict, **extra) -> None:
    """Train records at the given steps (step -> tokens/s, loss = 10 / step) and one valid record."""
    run_dir.mkdir(parents=True)
    lines = [{"step": s, "split": "train", "loss": 10 / s, "tokens_per_s": r, **extra} for s, r in rates.items()]
    lines.append({"step": max(rates), "split": "valid", "loss": 9.0})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines) + '{"step": 3')  # torn


def write_rouge(eval_dir: Path, precision: str, shapes: str, rate: float, r1: float, predictions: str) -> None:
    eval_dir.mkdir(parents=True)
    (eval_dir / "rouge.json").write_text(json.dumps({
        "rouge1": {"f": r1}, "sentences_per_s": rate,
        "settings": {"precision": precision, "quantize": "none", "shapes": shapes, "batch_tokens": 131072}}))
    (eval_dir / "predictions.txt").write_text("".join(p + "\n" for p in predictions.split()))


def test_top_operators_are_read_from_a_profiler_table(tmp_path):
    table = tmp_path / "profile.txt"
    table.write_text("\n".join(["-" * 40, f"{'Name':>16}  Self CPU %  Self CPU", "-" * 40,
                                  f"{'ProfilerStep*':>16}  50%  1ms", f"{'aten::mm':>16}  30%  1ms",
                                  f"{'aten::bmm':>16}  10%  1ms", "-" * 40]))
    assert report.top_operators(table) == ["aten::mm", "aten::bmm"]
    assert report.top_operators(tmp_path / "missing.txt") == []


def test_report_rows_from_hand_written_runs(tmp_path):
    out = tmp_path / "out"
    steps = [50, 100, 150, 200, 250, 300]
    write_metrics(out / "train" / "fp32", dict(zip(steps, [100, 200, 300, 300, 400, 400], strict=True)), mfu=0.1)
    write_metrics(out / "train" / "bf16", dict(zip(steps, [200, 400, 600, 600, 800, 800], strict=True)), mfu=0.05)
    write_metrics(out / "train" / "auto", dict(zip(steps, [200, 400, 600, 600, 800, 800], strict=True)))
    write_metrics(out / "train" / "bf16_captured", dict(zip(steps, [300, 800, 1200, 1200, 1600, 1600], strict=True)))
    (out / "train" / "auto" / "manifest.json").write_text(json.dumps({"precision": "bf16", "precision_probe": {
        "precision": "bf16", "device": "NVIDIA H100", "ms": {"fp32": 41.5, "bf16": 30.0}}}))
    (out / "bench").mkdir(parents=True)
    (out / "bench" / "bench.json").write_text(json.dumps([
        {"practice": "precision_bf16", "unit": "tokens/s", "on": {"median": 900.0}, "off": {"median": 450.0},
         "ratio": 2.0},
        {"practice": "pin_memory", "skipped": "needs CUDA"}]))
    write_rouge(out / "eval" / "beam4_fp32_dynamic", "fp32", "dynamic", 50.0, 30.0, "a b c d")
    write_rouge(out / "eval" / "beam4_auto_auto", "fp32", "static", 100.0, 30.0, "a b c d")
    write_rouge(out / "eval" / "greedy_auto_auto", "fp32", "static", 400.0, 27.0, "a x c y")
    write_rouge(out / "eval" / "greedy_fp32_dynamic", "fp32", "dynamic", 200.0, 27.0, "a b c d")
    write_metrics(out / "placement" / "enc-cuda0_dec-cpu", {30: 100, 60: 150, 90: 200})
    write_metrics(out / "gigaword" / "fp32", {50: 1000, 100: 2000, 150: 2000}, mfu=0.3, peak_memory_mb=8000)
    write_metrics(out / "gigaword" / "bf16", {50: 3000, 100: 5000, 150: 6000}, mfu=0.2, peak_memory_mb=5000,
                  peak_reserved_mb=9000)
    (out / "notes.txt").write_text("4|cuda:0 + cuda:1, DDP|skipped: needs two GPUs (this machine: 1)\n")
    (out / "logs").mkdir()
    recompiled = "V1127 [__recompiles] Recompiling function forward in transformer.py:278\n"
    (out / "logs" / "5-gigaword_bf16_compile.log").write_text(
        "torch.compile (default): the first step compiles the model\nstep 1: compiled and ran in 41.5 s\n"
        + 2 * recompiled)
    (out / "logs" / "5-gigaword_bf16_graphs.log").write_text("torch.compile (reduce-overhead): the first step\n")
    (out / "logs" / "5-gigaword_bf16.log").write_text("step 50/100000 train loss 7.5883\n")

    rows, notes = report.all_rows(out)

    got = [(part, setting, round(value, 4), None if r is None else round(r, 4)) for part, setting, value, r in rows]
    assert got == [
        ("1 train", "train.precision=fp32: tokens/s, steps 1-100", 150, 1.0),
        ("1 train", "train.precision=fp32: tokens/s, steps 201-300", 400, 1.0),
        ("1 train", "train.precision=fp32: loss at step 300", round(10 / 300, 4), 1.0),
        ("1 train", "train.precision=fp32: MFU, steps 201-300", 0.1, None),
        ("1 train", "train.precision=bf16: tokens/s, steps 1-100", 300, 2.0),
        ("1 train", "train.precision=bf16: tokens/s, steps 201-300", 800, 2.0),
        ("1 train", "train.precision=bf16: loss at step 300", round(10 / 300, 4), 1.0),
        ("1 train", "train.precision=bf16: MFU, steps 201-300", 0.05, None),
        ("1 train", "train.precision=auto (bf16): tokens/s, steps 1-100", 300, 2.0),
        ("1 train", "train.precision=auto (bf16): tokens/s, steps 201-300", 800, 2.0),
        ("1 train", "train.precision=auto (bf16): loss at step 300", round(10 / 300, 4), 1.0),
        ("1 train", "train.precision=bf16, train.cuda_graphs=true: tokens/s, steps 1-100", 550, 3.6667),
        ("1 train", "train.precision=bf16, train.cuda_graphs=true: tokens/s, steps 201-300", 1600, 4.0),
        ("1 train", "train.precision=bf16, train.cuda_graphs=true: loss at step 300", round(10 / 300, 4), 1.0),
        ("2 bench", "precision_bf16 (tokens/s, on)", 900, 2.0),
        ("3 eval", "beam4, fp32, static shapes, batch 131072 (beam4_auto_auto): sentences/s", 100, 2.0),
        ("3 eval", "beam4, fp32, static shapes, batch 131072 (beam4_auto_auto): ROUGE-1 F", 30, 1.0),
        ("3 eval", f"beam4, fp32, static shapes, batch 131072 (beam4_auto_auto): {EQUAL}", 1.0, None),
        ("3 eval", "beam4, fp32, dynamic shapes, batch 131072 (beam4_fp32_dynamic): sentences/s", 50, 1.0),
        ("3 eval", "beam4, fp32, dynamic shapes, batch 131072 (beam4_fp32_dynamic): ROUGE-1 F", 30, 1.0),
        ("3 eval", f"beam4, fp32, dynamic shapes, batch 131072 (beam4_fp32_dynamic): {EQUAL}", 1.0, None),
        ("3 eval", "greedy, fp32, static shapes, batch 131072 (greedy_auto_auto): sentences/s", 400, 2.0),
        ("3 eval", "greedy, fp32, static shapes, batch 131072 (greedy_auto_auto): ROUGE-1 F", 27, 1.0),
        ("3 eval", f"greedy, fp32, static shapes, batch 131072 (greedy_auto_auto): {EQUAL}", 0.5, None),
        ("3 eval", "greedy, fp32, dynamic shapes, batch 131072 (greedy_fp32_dynamic): sentences/s", 200, 1.0),
        ("3 eval", "greedy, fp32, dynamic shapes, batch 131072 (greedy_fp32_dynamic): ROUGE-1 F", 27, 1.0),
        ("3 eval", f"greedy, fp32, dynamic shapes, batch 131072 (greedy_fp32_dynamic): {EQUAL}", 1.0, None),
        ("4 placement", "enc-cuda0_dec-cpu: tokens/s, steps 61-90 (ratio: to one device, fp32)", 200, 0.5),
        ("5 gigaword.yaml", "bf16: tokens/s, steps 101-150", 6000, 3.0),
        ("5 gigaword.yaml", "bf16: MFU, steps 101-150", 0.2, None),
        ("5 gigaword.yaml", "bf16: peak memory MiB", 5000, 0.625),
        ("5 gigaword.yaml", "bf16: peak memory reserved MiB (CUDA graphs' pools too)", 9000, None),
        ("5 gigaword.yaml", "fp32: tokens/s, steps 101-150", 2000, 1.0),
        ("5 gigaword.yaml", "fp32: MFU, steps 101-150", 0.3, None),
        ("5 gigaword.yaml", "fp32: peak memory MiB", 8000, 1.0),
        ("5 gigaword.yaml", "bf16_compile: first step, compiling (s)", 41.5, None),
        ("5 gigaword.yaml", "bf16_compile: recompilations", 2, None),
        ("5 gigaword.yaml", "bf16_graphs: recompilations", 0, None),
    ]
    assert notes == ["1 train, train.precision=auto: bf16, by the probe's timings of forward and backward: fp32 "
                     "41.5 ms, bf16 30.0 ms",
                     "2 bench, pin_memory: needs CUDA",
                     "4 placement, cuda:0 + cuda:1, DDP: skipped: needs two GPUs (this machine: 1)"]
    table = report.markdown(rows, notes, "GPU check")
    assert "| 1 train | train.precision=bf16: tokens/s, steps 201-300 | 800 | 2x |" in table
    assert "| 1 train | train.precision=fp32: MFU, steps 201-300 | 0.1 |  |" in table


def test_a_precision_a_rule_chose_is_reported_by_rule(tmp_path):
    """auto's choice for a captured step is a rule, not timings: the note says "by rule", not "by the probe's
    timings of forward and backward: not timed"."""
    probes = {"timed": {"precision": "bf16", "device": "H100", "ms": {"fp32": 41.5, "bf16": 30.0}},
              "captured": {"precision": "bf16", "device": "H100", "captured": True, "ms": {}}}
    for name, probe in probes.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "manifest.json").write_text(json.dumps({"precision": "bf16", "precision_probe": probe}))
    assert report.chosen(tmp_path / "timed") == ("bf16", "fp32 41.5 ms, bf16 30.0 ms")
    assert report.chosen(tmp_path / "captured") == ("bf16", None)


def test_synthetic_pairs_take_their_lengths_from_the_data_dir(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    lengths = {(31, 8), (12, 5), (40, 11)}
    (data / "train.jsonl").write_text("".join(
        json.dumps({"source": " ".join(["w"] * s), "target": " ".join(["w"] * t)}) + "\n" for s, t in lengths))
    report.synth(data, tmp_path / "pairs", pairs=60)
    for split, n in (("train", 60), ("validation", 500), ("test", 200)):
        pairs = report.read_jsonl(tmp_path / "pairs" / f"{split}.jsonl")
        assert len(pairs) == n
        assert {(len(p["document"].split()), len(p["summary"].split())) for p in pairs} <= lengths


def table_rows(text: str) -> list[list[str]]:
    lines = [ln for ln in text.splitlines() if ln.startswith("| ") and not ln.startswith("| part ")]
    return [[cell.strip() for cell in ln.strip("|").split("|")] for ln in lines]


@pytest.mark.slow
@pytest.mark.skipif(not (shutil.which("bash") and shutil.which("timeout")), reason="needs bash and timeout")
def test_cpu_mode_runs_every_part_and_prints_a_number_per_row(tmp_path):
    from data_prep.__main__ import main as prep
    assert prep(["--config", str(ROOT / "configs/tiny.yaml"), f"data.dir={tmp_path / 'data'}"]) == 0
    (inherited := tmp_path / "inherited").mkdir()  # an OUT of the caller's own (a job's output dir) is not ours
    env = {**os.environ, "GPU_CHECK_DEVICE": "cpu", "GPU_CHECK_STEPS": "12", "GPU_CHECK_OUT": str(tmp_path / "out"),
           "OUT": str(inherited), "PYTHON": sys.executable, "GPU_CHECK_SECONDS": "1500"}
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), str(tmp_path / "data")], env=env,
                          capture_output=True, text=True, timeout=1700)  # past the budget: the script reports a cut
    assert done.returncode == 0, done.stdout + done.stderr
    assert not any(inherited.iterdir())
    table = (tmp_path / "out" / "gpu_check.md").read_text()
    assert table in done.stdout
    rows = table_rows(table)
    assert {r[0] for r in rows} == {"1 train", "2 bench", "3 eval", "4 placement", "6 profile"}
    assert all(re.fullmatch(r"-?\d+(\.\d+)?(e[-+]\d+)?", r[2]) for r in rows), rows
    assert {p for r in rows if r[0] == "1 train" for p in ("fp32", "bf16", "fp16") if f"={p}:" in r[1]} == \
        {"fp32", "bf16", "fp16"}
    by_rule = "bf16" if runtime.cpu_has_fast_bf16() else "fp32"  # a CPU's auto: no probe
    assert any(r[1].startswith(f"train.precision=auto ({by_rule}): tokens/s") for r in rows), rows
    assert f"1 train, train.precision=auto: {by_rule}, by rule" in table
    assert "5 gigaword.yaml, gigaword.yaml: skipped" in table
    assert "cuda:0 + cuda:1, DDP: skipped: needs two GPUs" in table
    assert re.search(r"6 profile, train (fp32|bf16), first steps: most time: aten::", table), table
    assert {"train fp32, first steps: ms a step", "train fp32, first steps: values read back to the host a step"} \
        <= {r[1] for r in rows if r[0] == "6 profile"}, rows
    assert re.search(r"6 profile, decode beam 4, \d+ sentences: most time: (aten|quantized)::", table), table
    assert re.search(r"6 profile, decode greedy, \d+ sentences: most time: (aten|quantized)::", table), table
    equal = {re.search(r"\((\w+)\): share", r[1]).group(1): float(r[2]) for r in rows
             if r[0] == "3 eval" and "equal to the dynamic" in r[1]}
    # the default on a CPU decodes with int8 layers (whatever its bf16), the reference without: a share, not all
    assert 0 <= equal["beam4_auto_auto"] <= 1 and 0 <= equal["greedy_auto_auto"] <= 1
    # static shapes: the same in float32 up to rounding, which a 20-step model's near ties can show
    assert equal["beam4_fp32_static"] > 0.9 and equal["greedy_fp32_static"] > 0.9


@pytest.mark.slow
@pytest.mark.skipif(not (shutil.which("bash") and shutil.which("timeout")), reason="needs bash and timeout")
def test_only_the_parts_asked_for_run(tmp_path):
    """GPU_CHECK_PARTS: the others are listed as skipped, with the reason; parts 3 and 6 need part 1's run."""
    from data_prep.__main__ import main as prep
    assert prep(["--config", str(ROOT / "configs/tiny.yaml"), f"data.dir={tmp_path / 'data'}"]) == 0
    env = {**os.environ, "GPU_CHECK_DEVICE": "cpu", "GPU_CHECK_STEPS": "12", "GPU_CHECK_OUT": str(tmp_path / "out"),
           "PYTHON": sys.executable, "GPU_CHECK_PARTS": "4 6"}
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), str(tmp_path / "data")], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    table = (tmp_path / "out" / "gpu_check.md").read_text()
    assert {r[0] for r in table_rows(table)} == {"4 placement", "6 profile"}  # part 6: the training profiles' steps
    assert "1 train, train fp32: skipped: not among GPU_CHECK_PARTS (4 6)" in table
    assert "6 profile, profile gigaword bf16: skipped: GPU only" in table
    assert "6 profile, profile decode: skipped: no checkpoint: part 1's fp32 run did not finish" in table
    assert re.search(r"6 profile, train fp32, first steps: most time: aten::", table), table


@pytest.mark.slow
@pytest.mark.skipif(not (shutil.which("bash") and shutil.which("timeout")), reason="needs bash and timeout")
def test_the_bench_rows_and_the_commit_named_can_be_set(tmp_path):
    """GPU_CHECK_BENCH_ROWS: part 2 runs those rows alone; GPU_CHECK_COMMIT: the commit a copy without .git ran."""
    from tests.fixture_data import prepared
    prepared("tiny", tmp_path / "data")
    env = {**os.environ, "GPU_CHECK_DEVICE": "cpu", "GPU_CHECK_STEPS": "12", "GPU_CHECK_OUT": str(tmp_path / "out"),
           "PYTHON": sys.executable, "GPU_CHECK_PARTS": "2", "GPU_CHECK_BENCH_ROWS": "set_to_none",
           "GPU_CHECK_COMMIT": "abc1234"}
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), str(tmp_path / "data")], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    table = (tmp_path / "out" / "gpu_check.md").read_text()
    assert [r[:2] for r in table_rows(table)] == [["2 bench", "set_to_none (tokens/s, on)"]], table
    assert "commit abc1234" in table


def test_the_decode_profile_rows_include_the_gpus_waits(tmp_path):
    decode = tmp_path / "profile" / "decode"
    decode.mkdir(parents=True)
    (decode / "bench.json").write_text(json.dumps([{
        "practice": "decode_profile", "beam": 4, "sentences": 2000, "wall_s": 0.5, "host_reads_per_step": 3.0,
        "device_syncs_per_step": 4.0, "launches_per_step": 400.0, "device_share": 0.6}]))
    rows, _ = report.profile_rows(tmp_path)
    assert [(r[1], r[2]) for r in rows] == [
        ("decode beam 4, 2000 sentences: seconds", 0.5),
        ("decode beam 4, 2000 sentences: values read back to the host a step", 3.0),
        ("decode beam 4, 2000 sentences: waits for the GPU a step (sync debug mode)", 4.0),
        ("decode beam 4, 2000 sentences: kernel launches a step", 400.0),
        ("decode beam 4, 2000 sentences: share of the time the GPU is busy", 0.6)]


@pytest.mark.slow
@pytest.mark.skipif(not (shutil.which("bash") and shutil.which("timeout")), reason="needs bash and timeout")
def test_a_step_the_budget_cuts_short_is_reported_not_failed(tmp_path):
    """The budget cuts a run that would take far longer: the check still exits 0, the note says so, and what the run
    logged before the cut is in the table."""
    from data_prep.__main__ import main as prep
    assert prep(["--config", str(ROOT / "configs/tiny.yaml"), f"data.dir={tmp_path / 'data'}"]) == 0
    env = {**os.environ, "GPU_CHECK_DEVICE": "cpu", "GPU_CHECK_STEPS": "100000", "GPU_CHECK_OUT": str(tmp_path / "out"),
           "PYTHON": sys.executable, "GPU_CHECK_PARTS": "1", "GPU_CHECK_SECONDS": "45",
           "GPU_CHECK_LOG_EVERY": "1"}  # a row from the first step on, however slowly a loaded machine starts it
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), str(tmp_path / "data")], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    table = (tmp_path / "out" / "gpu_check.md").read_text()
    assert re.search(r"1 train, train fp32: cut short after \d+s, when the time budget", table), table
    assert "| 1 train | train.precision=fp32: tokens/s" in table
    assert "1 train, train bf16: skipped: the time budget (GPU_CHECK_SECONDS=45) is spent" in table
