"""train.precision=auto on a GPU: the probe that times fp32 against 16 bit on the run's own model and batches, what
it leaves behind (nothing), and how a run uses and keeps its result. The GPU's branch runs here on the CPU with
the probe's device test patched; the timing itself runs on the CPU's kernels."""
import json
from pathlib import Path

import pytest
import torch

from summarizer import runtime
from summarizer.__main__ import main
from summarizer.config.load import load_config
from summarizer.config.schema import TrainConfig
from summarizer.data.batches import PairDataset, TokenBatchSampler
from summarizer.data.prepared import read_meta
from summarizer.model.transformer import Seq2Seq
from summarizer.runtime import Runtime
from summarizer.train import precision

ROOT = Path(__file__).resolve().parents[1]
CPU, GPU = torch.device("cpu"), torch.device("cuda")
SMALL = ["model.d_model=32", "model.n_heads=4", "model.encoder_layers=1", "model.decoder_layers=1",
         "model.ffn_dim=64", "data.batch_tokens=400", "data.num_workers=0", "train.log_every=2",
         "train.eval_every=4", "train.ckpt_every=2", "train.sample_summaries=0"]


def test_a_gpu_run_on_auto_is_probed_and_every_other_is_settled_by_rule():
    assert precision.candidates("auto", Runtime(GPU, GPU, "bf16")) == ("fp32", "bf16")
    assert precision.candidates("auto", Runtime(GPU, GPU, "fp16")) == ("fp32", "fp16")  # a GPU without bf16
    assert precision.candidates("auto", Runtime(CPU, GPU, "bf16")) == ("fp32", "bf16")  # the decoder's device decides
    assert precision.candidates("auto", Runtime(CPU, CPU, "bf16")) == ()
    assert precision.candidates("bf16", Runtime(GPU, GPU, "bf16")) == ()
    assert precision.candidates("fp32", Runtime(GPU, GPU, "fp32")) == ()


def test_the_faster_precision_is_picked_and_16_bit_wins_a_tie():
    assert precision.pick({"fp32": 1.0, "bf16": 0.7}) == "bf16"
    assert precision.pick({"fp32": 1.0, "bf16": 1.5}) == "fp32"
    assert precision.pick({"fp32": 1.0, "bf16": 1.0 + precision.TIE / 2}) == "bf16"
    assert precision.pick({"fp32": 1.0, "fp16": 1.0 + 2 * precision.TIE}) == "fp32"
    assert precision.pick({"fp32": float("inf"), "bf16": 3.0}) == "bf16"  # fp32 ran out of memory
    assert precision.pick({"fp32": 3.0, "bf16": float("inf")}) == "fp32"


def _setup(tiny_data, *extra):
    cfg = load_config(ROOT / "configs/tiny.yaml", [f"data.dir={tiny_data}", *SMALL, *extra])
    ds = PairDataset.from_dir(tiny_data, "train", cfg.data)
    sampler = TokenBatchSampler(ds.src_lens, ds.tgt_lens, cfg.data.batch_tokens, cfg.data.bucket_size, seed=1,
                                pad_multiple=cfg.data.pad_multiple)
    torch.manual_seed(0)
    return cfg, ds, sampler, Seq2Seq(cfg.model, read_meta(tiny_data)["vocab_size"])


def test_the_probe_batches_span_the_first_epoch_from_its_shortest_to_its_longest(tiny_data):
    cfg, ds, sampler, _ = _setup(tiny_data)
    batches = precision.probe_batches(ds, sampler, cfg.data)
    lengths = [b["src_ids"].shape[1] + b["tgt_in"].shape[1] for b in batches]
    padded = lambda n: -(-n // cfg.data.pad_multiple) * cfg.data.pad_multiple  # noqa: E731
    every = [padded(int(ds.src_lens[b].max())) + padded(int(ds.tgt_lens[b].max())) for b in sampler.plan(0)]
    assert len(batches) == precision.BATCHES and lengths == sorted(lengths)
    assert lengths[0] == min(every) and lengths[-1] == max(every)
    assert all(b["src_ids"].shape[1] % cfg.data.pad_multiple == 0 for b in batches)


def test_the_probe_times_both_precisions_and_leaves_weights_gradients_and_random_streams_alone(tiny_data):
    cfg, ds, sampler, model = _setup(tiny_data)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    random_state = torch.get_rng_state()
    seconds = precision.measure(model, precision.probe_batches(ds, sampler, cfg.data),
                                ("fp32", "bf16"), Runtime(CPU, CPU, "fp32"), cfg.train)
    assert set(seconds) == {"fp32", "bf16"} and all(0 < s < float("inf") for s in seconds.values())
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(torch.get_rng_state(), random_state)
    assert model.training


def test_a_precision_that_runs_out_of_memory_loses(tiny_data, monkeypatch):
    cfg, ds, sampler, model = _setup(tiny_data)
    forward = Seq2Seq.forward

    def bf16_out_of_memory(self, *args, **kwargs):
        if torch.is_autocast_enabled("cpu"):
            raise torch.OutOfMemoryError("probe test")
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(Seq2Seq, "forward", bf16_out_of_memory)
    seconds = precision.measure(model, precision.probe_batches(ds, sampler, cfg.data),
                                ("fp32", "bf16"), Runtime(CPU, CPU, "fp32"), cfg.train)
    assert seconds["bf16"] == float("inf") and seconds["fp32"] < float("inf")
    assert precision.pick(seconds) == "fp32"


def _as_if_on_a_gpu(monkeypatch, name: str, faster: str, calls: list):
    """The probe's GPU branch on this CPU: candidates as a GPU's, a device name, and timings that make `faster`
    win (the one the CPU's own rule would not pick, so the test sees the probe's choice take effect)."""
    monkeypatch.setattr(precision, "candidates",
                        lambda requested, rt: ("fp32", "bf16") if requested == "auto" else ())
    monkeypatch.setattr(precision, "device_name", lambda rt: name)

    def measure(model, batches, precisions, rt, cfg):
        calls.append(len(batches))
        return {p: 1.0 if p == faster else 2.0 for p in precisions}

    monkeypatch.setattr(precision, "measure", measure)


def _run(tiny_data, run_dir, steps, capsys):
    args = ["train", "--config", str(ROOT / "configs/tiny.yaml"), f"data.dir={tiny_data}", f"run.dir={run_dir}",
            f"run.tensorboard_dir={run_dir}/tb", *SMALL, f"train.max_steps={steps}"]
    assert main(args) == 0
    manifest = json.loads((run_dir / "manifest.json").read_text())
    state = torch.load(run_dir / f"ckpt_{steps:08d}.pt", weights_only=False)
    assert manifest.get("precision_probe") == state["progress"].get("precision_probe")
    return manifest["precision"], state["progress"].get("precision_probe"), capsys.readouterr().err


def test_a_new_run_trains_in_the_probed_precision_and_keeps_it_on_resume(tiny_data, tmp_path, monkeypatch, capsys):
    by_rule = runtime.resolve_precision("auto", CPU)
    faster = "fp32" if by_rule == "bf16" else "bf16"
    calls = []
    _as_if_on_a_gpu(monkeypatch, "GPU A", faster, calls)
    used, probe, err = _run(tiny_data, tmp_path / "run", 2, capsys)
    assert used == faster and probe["precision"] == faster and probe["device"] == "GPU A"
    assert probe["ms"] == {"fp32": 1000.0 if faster == "fp32" else 2000.0,
                           "bf16": 1000.0 if faster == "bf16" else 2000.0}
    assert f"train.precision=auto: {faster} on GPU A" in err and calls == [precision.BATCHES]

    _as_if_on_a_gpu(monkeypatch, "GPU A", by_rule, calls)  # a probe now would choose otherwise: none runs
    used, probe, _ = _run(tiny_data, tmp_path / "run", 4, capsys)
    assert used == faster and probe["precision"] == faster and calls == [precision.BATCHES]

    _as_if_on_a_gpu(monkeypatch, "GPU B", by_rule, calls)  # another kind of GPU: measured again
    used, probe, err = _run(tiny_data, tmp_path / "run", 6, capsys)
    assert used == by_rule and probe == {"precision": by_rule, "device": "GPU B", "compile": None, "ms": probe["ms"]}
    assert len(calls) == 2 and f"train.precision=auto: {by_rule} on GPU B" in err


def test_a_precision_set_by_hand_is_never_probed(tiny_data, tmp_path, monkeypatch, capsys):
    calls = []
    _as_if_on_a_gpu(monkeypatch, "GPU A", "bf16", calls)
    args = ["train", "--config", str(ROOT / "configs/tiny.yaml"), f"data.dir={tiny_data}",
            f"run.dir={tmp_path / 'run'}", f"run.tensorboard_dir={tmp_path}/tb", *SMALL, "train.max_steps=2",
            "train.precision=fp32"]
    assert main(args) == 0
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert calls == [] and manifest["precision"] == "fp32" and "precision_probe" not in manifest
    assert "train.precision=auto" not in capsys.readouterr().err


def test_a_probe_result_is_reused_only_for_its_own_kind_of_gpu_and_model(monkeypatch):
    """An eager run's probe (train.cuda_graphs=false: the step launched from Python)."""
    monkeypatch.setattr(precision, "device_name", lambda rt: "GPU A")
    rt, auto = Runtime(GPU, GPU, "bf16"), TrainConfig(cuda_graphs=False, precision="auto")
    progress = {"precision_probe": {"precision": "fp32", "device": "GPU A", "compile": None, "ms": {}}}
    assert precision.recorded(progress, auto, rt) == "fp32"
    by_hand = TrainConfig(cuda_graphs=False, precision="bf16")
    assert precision.recorded(progress, by_hand, rt) is None  # set by hand: the setting wins
    assert precision.recorded({}, auto, rt) is None  # a run from before the probe: probed now
    assert precision.recorded({**progress, "precision_probe": {**progress["precision_probe"], "device": "GPU B"}},
                              auto, rt) is None
    assert precision.recorded(progress, auto, Runtime(CPU, CPU, "bf16")) is None  # resumed on a CPU: the rule
    # an eager probe holds for an eager run only, a compiled one for its own mode; one without the key was eager
    compiled = {"precision_probe": {**progress["precision_probe"], "compile": "default"}}
    assert precision.recorded(progress, TrainConfig(cuda_graphs=False, compile=True), rt) is None
    assert precision.recorded(compiled, TrainConfig(cuda_graphs=False, compile=True), rt) == "fp32"
    own_graphs = TrainConfig(cuda_graphs=False, compile=True, compile_mode="reduce-overhead")
    assert precision.recorded(compiled, own_graphs, rt) is None
    assert precision.recorded(compiled, auto, rt) is None
    older = {"precision_probe": {k: v for k, v in progress["precision_probe"].items() if k != "compile"}}
    assert precision.recorded(older, auto, rt) == "fp32"


def test_a_compiled_run_is_probed_compiled_and_trains_with_the_probes_graph(tiny_data, monkeypatch):
    """With train.compile the probe times the model as the run will train it: compiled, its layers once per precision
    (the precision is a guard of the compiled code), and the run's own compile of that model reuses the graphs of
    the precision it trains in rather than compiling again."""
    from torch._dynamo.utils import counters
    cfg, ds, sampler, model = _setup(tiny_data, "train.compile=true", "model.dropout=0")
    monkeypatch.setattr(precision, "candidates", lambda requested, rt: ("fp32", "bf16"))
    timed, measure = [], precision.measure
    monkeypatch.setattr(precision, "measure", lambda m, *args: timed.append(m) or measure(m, *args))
    torch._dynamo.reset()
    counters.clear()
    probe = precision.choose(model, ds, sampler, cfg.data, Runtime(CPU, CPU, "bf16"), cfg.train)
    assert timed[0] is not model and runtime.unwrap(timed[0]) is model
    assert probe["compile"] == "default" and set(probe["ms"]) == {"fp32", "bf16"}
    assert "compiled (default)" in precision.describe(probe)
    assert counters["stats"]["unique_graphs"] == 4  # a graph per kind of layer and precision, every batch shape
    batch = precision.probe_batches(ds, sampler, cfg.data)[0]
    with Runtime(CPU, CPU, probe["precision"]).compute():
        runtime.compile_model(model, cfg.train.compile_mode)(batch["src_ids"], batch["tgt_in"])
    assert counters["stats"]["unique_graphs"] == 4
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_the_probe_times_fp32_against_16_bit_and_leaves_the_gpus_random_stream(tiny_data):
    cfg, ds, sampler, model = _setup(tiny_data)
    device = torch.device("cuda", 0)
    rt = Runtime(device, device, runtime.resolve_precision("auto", device))
    model, cuda_random = model.to(device), torch.cuda.get_rng_state(device)
    probe = precision.choose(model, ds, sampler, cfg.data, rt, cfg.train)
    assert probe["precision"] in precision.candidates("auto", rt) and probe["device"] == torch.cuda.get_device_name(0)
    assert set(probe["ms"]) == {"fp32", rt.precision} and all(ms > 0 for ms in probe["ms"].values())
    assert torch.equal(torch.cuda.get_rng_state(device), cuda_random)
    assert all(p.grad is None for p in model.parameters())


def _rank_chooses(rank: int, world: int, init_file: str, data_dir: str, out_dir: str) -> None:
    """One DDP rank (gloo) of the probe's GPU branch, stood in for on the CPU: rank 0 times fp32 faster, the others
    bf16; every rank must train in rank 0's choice."""
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        precision.candidates = lambda requested, rt: ("fp32", "bf16")
        precision.device_name = lambda rt: "GPU A"
        precision.measure = lambda model, batches, precisions, rt, cfg: \
            {"fp32": 1.0, "bf16": 2.0} if rank == 0 else {"fp32": 2.0, "bf16": 1.0}
        cfg = load_config(ROOT / "configs/tiny.yaml", [f"data.dir={data_dir}", *SMALL])
        ds = PairDataset.from_dir(data_dir, "train", cfg.data)
        sampler = TokenBatchSampler(ds.src_lens, ds.tgt_lens, cfg.data.batch_tokens, rank=rank, world_size=world)
        model = Seq2Seq(cfg.model, read_meta(data_dir)["vocab_size"])
        probe = precision.choose(model, ds, sampler, cfg.data, Runtime(CPU, CPU, "bf16", rank, world), cfg.train)
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(probe))
    finally:
        dist.destroy_process_group()


def test_every_ddp_rank_trains_in_rank_0s_choice(tiny_data, tmp_path):
    import torch.multiprocessing as mp
    mp.spawn(_rank_chooses, args=(2, str(tmp_path / "init"), str(tiny_data), str(tmp_path)), nprocs=2)
    chosen = [json.loads((tmp_path / f"rank{r}.json").read_text())["precision"] for r in range(2)]
    assert chosen == ["fp32", "fp32"]


def test_a_step_that_replays_as_a_cuda_graph_takes_16_bit_by_rule_and_keeps_it_on_resume(tiny_data, tmp_path,
                                                                                        monkeypatch, capsys):
    """What an eager probe times (the host launching autocast's casts) is gone from a replayed step: no probe runs.
    The rule's record is kept like a probe's, and holds only while the step is still captured."""
    gpu_graphs = TrainConfig(precision="auto", cuda_graphs=True)
    assert precision.captured(gpu_graphs, Runtime(GPU, GPU, "bf16"))
    assert not precision.captured(TrainConfig(precision="auto", cuda_graphs=False), Runtime(GPU, GPU, "bf16"))
    assert not precision.captured(TrainConfig(cuda_graphs=True, fused_optimizer=False), Runtime(GPU, GPU, "bf16"))
    assert not precision.captured(TrainConfig(cuda_graphs=True, accum_steps=2), Runtime(GPU, GPU, "bf16"))
    assert not precision.captured(gpu_graphs, Runtime(CPU, CPU, "bf16"))

    calls = []
    _as_if_on_a_gpu(monkeypatch, "GPU A", "fp32", calls)  # a probe would pick fp32
    monkeypatch.setattr(precision, "captured", lambda cfg, rt: True)
    used, probe, err = _run(tiny_data, tmp_path / "run", 2, capsys)
    assert calls == [] and used == "bf16"
    assert probe == {"precision": "bf16", "device": "GPU A", "compile": None, "captured": True, "ms": {}}
    assert "train.precision=auto: bf16 on GPU A (by rule: the step replays as a CUDA graph" in err
    assert precision.timings(probe) == "not timed: the step is captured"
    used, _, _ = _run(tiny_data, tmp_path / "run", 4, capsys)
    assert calls == [] and used == "bf16"

    monkeypatch.setattr(precision, "captured", lambda cfg, rt: False)  # resumed without the graphs: probed
    used, probe, err = _run(tiny_data, tmp_path / "run", 6, capsys)
    assert calls == [precision.BATCHES] and used == "fp32" and "captured" not in probe
