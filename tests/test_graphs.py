"""train.cuda_graphs (summarizer/train/graphs.py): the captured step computes what the eager one does. A CPU runs
the captured path eagerly (fixed input tensors, the loss factor and learning rates read from tensors); a GPU
captures and replays it."""
import copy
import json
from pathlib import Path

import pytest
import torch

from summarizer import runtime
from summarizer.config.load import load_config
from summarizer.data.batches import PairDataset, collate
from summarizer.model.transformer import Seq2Seq
from summarizer.runtime import Runtime, move_batch
from summarizer.train import loop as train_mod
from summarizer.train.graphs import StepGraphs, step_function, unsupported
from summarizer.train.optim import build_optimizer, build_scheduler

ROOT = Path(__file__).resolve().parents[1]
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
# lr 2**-10 with 4 warm-up steps: every scheduled lr is exact in float32, as the tensor a graph reads holds it
SMALL = ["model.d_model=32", "model.n_heads=4", "model.encoder_layers=1", "model.decoder_layers=1",
         "model.ffn_dim=64", "data.num_workers=0", "train.lr=0.0009765625", "train.warmup_steps=4",
         "train.schedule=constant"]
ORDER = [0, 1, 2, 0, 1, 2, 1, 0, 2]  # three batch shapes, met again in another order


def make_cfg(tiny_data, *extra):
    return load_config(ROOT / "configs/tiny.yaml", [f"data.dir={tiny_data}", *SMALL, *extra])


def shaped_batches(tiny_data, cfg, device) -> list[dict]:
    ds = PairDataset.from_dir(tiny_data, "train", cfg.data)
    groups = [range(0, 4), range(4, 10), range(10, 13)]
    batches = [move_batch(collate([ds[i] for i in group], pad_multiple=4), device) for group in groups]
    assert len({tuple(b["src_ids"].shape) + tuple(b["tgt_in"].shape) for b in batches}) == 3
    return batches


def train_on(cfg, rt, batches, graphed: bool, capture: bool = False, reload_at: int = -1, step=None):
    """ORDER's steps from one seed: each step's outputs, the model, the optimizer and the step function."""
    torch.manual_seed(0)
    model = Seq2Seq(cfg.model, 192).to(rt.device)
    trained = runtime.compile_model(model) if cfg.train.compile else model
    optimizer, scaler = build_optimizer(model, cfg.train), runtime.make_scaler(rt)
    scheduler = build_scheduler(optimizer, cfg.train)
    step = step or train_mod.train_step
    run = StepGraphs(step, optimizer, rt.device, capture=capture) if graphed else step
    outs = []
    for i, which in enumerate(ORDER):
        if i == reload_at:  # as a rollback does: the optimizer's state becomes new tensors
            optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))
        out = run(trained, optimizer, scaler, [batches[which]], rt, cfg.train)
        assert all(isinstance(g["lr"], float) and not g["capturable"] for g in optimizer.param_groups)
        scheduler.step()
        outs.append({k: out[k].detach().clone() for k in ("loss_sum", "nll_sum", "grad_norm", "finite")})
    return outs, model, optimizer, run


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_captured_path_computes_what_the_eager_step_does(tiny_data, precision):
    """Every step's outputs, the weights and AdamW's state equal the eager step's exactly (dropout on: the same
    random stream); one set of fixed inputs per batch shape, made anew when the optimizer's state is replaced."""
    cfg = make_cfg(tiny_data, f"train.precision={precision}")
    rt = runtime.setup(cfg.system, cfg.placement, cfg.train.precision)
    batches = shaped_batches(tiny_data, cfg, rt.device)
    eager, model_e, opt_e, _ = train_on(cfg, rt, batches, graphed=False, reload_at=6)
    graphed, model_g, opt_g, run = train_on(cfg, rt, batches, graphed=True, reload_at=6)
    for a, b in zip(eager, graphed, strict=True):
        assert all(torch.equal(a[k], b[k]) for k in a), (a, b)
    assert all(torch.equal(a, b) for a, b in zip(model_e.parameters(), model_g.parameters(), strict=True))
    for p_e, p_g in zip(model_e.parameters(), model_g.parameters(), strict=True):
        assert all(torch.equal(opt_e.state[p_e][k], opt_g.state[p_g][k]) for k in ("exp_avg", "exp_avg_sq", "step"))
    # the first two steps are the warm-up; the state was replaced before step 6: shapes seen since, 1, 0, 2
    assert len(run.graphs) == 3 and run.anchor is next(iter(opt_g.state.values()))["exp_avg"]


def test_what_runs_eagerly_and_why(tiny_data):
    cfg = make_cfg(tiny_data)
    model = Seq2Seq(cfg.model, 192)
    fused, plain = True, False  # the optimizer takes the finiteness flag into its kernel, or reads it first
    adamw = build_optimizer(model, cfg.train)
    gpu, gpu1, cpu = torch.device("cuda", 0), torch.device("cuda", 1), torch.device("cpu")
    one_gpu = Runtime(gpu, gpu, "bf16")
    assert unsupported(one_gpu, cfg.train, fused) == ""
    assert "one GPU" in unsupported(Runtime(cpu, cpu, "fp32"), cfg.train, fused)
    assert "one GPU" in unsupported(Runtime(gpu, gpu1, "bf16"), cfg.train, fused)
    assert "DDP" in unsupported(Runtime(gpu, gpu, "bf16", world_size=2), cfg.train, fused)
    assert "accum_steps" in unsupported(one_gpu, make_cfg(tiny_data, "train.accum_steps=2").train, fused)
    compiled = make_cfg(tiny_data, "train.compile=true").train  # compiled layers inside the captured step
    assert unsupported(one_gpu, compiled, fused) == ""
    for mode in ("reduce-overhead", "max-autotune"):  # torch.compile captures graphs of its own
        compiled.compile_mode = mode
        assert "torch.compile's own CUDA graphs" in unsupported(one_gpu, compiled, fused)
    assert "fused_optimizer" in unsupported(one_gpu, cfg.train, plain)
    off = make_cfg(tiny_data, "train.cuda_graphs=false").train
    assert step_function(train_mod.train_step, model, adamw, one_gpu, off) == (train_mod.train_step, "")
    on = cfg.train
    assert on.cuda_graphs  # the default
    # a CPU run has no graphs to miss, as it has no memory to pin: nothing said
    assert step_function(train_mod.train_step, model, adamw, Runtime(cpu, cpu, "fp32"), on) == \
        (train_mod.train_step, "")
    step, note = step_function(train_mod.train_step, model, adamw, Runtime(gpu, cpu, "fp32"), on)
    assert step is train_mod.train_step and note == "train.cuda_graphs: off for this run (the model is not on one GPU)"
    step, note = step_function(train_mod.train_step, model, torch.optim.AdamW(model.parameters()), one_gpu, on)
    assert step is train_mod.train_step and "train.fused_optimizer=false" in note  # read from the optimizer itself


def test_a_cpu_run_with_graphs_on_trains_eagerly_and_says_nothing_of_them(tiny_data, tmp_path, capsys):
    cfg = make_cfg(tiny_data, f"run.dir={tmp_path / 'run'}", f"run.tensorboard_dir={tmp_path / 'tb'}",
                   "system.device=cpu", "train.cuda_graphs=true", "train.max_steps=3", "train.eval_every=3",
                   "train.rouge_every=0", "train.select_by=loss", "train.sample_summaries=0")
    result = train_mod.train(cfg)
    assert result["steps"] == 3 and result["finished"]
    assert "cuda_graphs" not in capsys.readouterr().err


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_failed_capture_leaves_a_step_that_trains_as_the_eager_one(tiny_data, precision, capsys, monkeypatch):
    """What a CPU can run of a capture that fails (the GPU test below makes one fail for real): the fallback resets
    the loss scaler, which is disabled outside fp16, and the run's steps compute what the eager ones do."""
    cfg = make_cfg(tiny_data, f"train.precision={precision}", "system.device=cpu", "model.dropout=0.0")
    rt = runtime.setup(cfg.system, cfg.placement, cfg.train.precision)
    batches = shaped_batches(tiny_data, cfg, rt.device)

    def fails(self, *args):
        raise RuntimeError("operation not permitted when stream is capturing")
    monkeypatch.setattr(StepGraphs, "_record", fails)
    monkeypatch.setattr(StepGraphs, "warned", False)
    eager, model_e, _, _ = train_on(cfg, rt, batches, graphed=False)
    graphed, model_g, _, run = train_on(cfg, rt, batches, graphed=True)
    assert "could not be captured as a CUDA graph (operation not permitted" in capsys.readouterr().err
    assert not run.graphs and not run.capture
    for a, b in zip(eager, graphed, strict=True):
        assert all(torch.equal(a[k], b[k]) for k in ("loss_sum", "nll_sum", "grad_norm", "finite"))
    monkeypatch.setattr(StepGraphs, "warned", False)  # auto's 16 bit was chosen for captured steps: said so
    run._give_up(RuntimeError("x"), model_g, runtime.make_scaler(rt), Runtime(rt.device, rt.device, "bf16"),
                 make_cfg(tiny_data).train)
    assert "train.precision=auto chose bf16 by rule for captured steps" in capsys.readouterr().err
    for a, b in zip(model_e.parameters(), model_g.parameters(), strict=True):
        assert torch.equal(a, b)


def test_running_out_of_memory_in_a_capture_is_an_out_of_memory_error_not_a_quiet_fallback(tiny_data, monkeypatch):
    """torch.OutOfMemoryError is a RuntimeError: a capture that ran out of memory turned graphs off for the rest of
    the run (1.5-6x slower) under a line about capture. It reaches the loop, which names the batch and what to
    lower, with the capture's leftovers cleared and graphs still on."""
    cfg = make_cfg(tiny_data, "train.precision=fp32", "system.device=cpu", "model.dropout=0.0")
    rt = runtime.setup(cfg.system, cfg.placement, cfg.train.precision)
    batches = shaped_batches(tiny_data, cfg, rt.device)

    models = []

    def out_of_memory(self, model, *args):
        for p in model.parameters():
            p.grad = torch.zeros_like(p)  # as a capture leaves them: in the graph's memory
        models.append(model)
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    monkeypatch.setattr(StepGraphs, "_record", out_of_memory)
    monkeypatch.setattr(StepGraphs, "warned", False)
    with pytest.raises(torch.OutOfMemoryError):
        train_on(cfg, rt, batches, graphed=True)
    assert all(p.grad is None for p in models[0].parameters()) and not StepGraphs.warned
    from summarizer.train.guard import out_of_memory as message
    on_gpu = Runtime(torch.device("cuda", 0), torch.device("cuda", 0), "fp32")
    assert "train.cuda_graphs=false" in str(message(torch.OutOfMemoryError(), [batches[0]], cfg, on_gpu, 7))
    assert "cuda_graphs" not in str(message(MemoryError(), [batches[0]], cfg, rt, 7))


@CUDA
@pytest.mark.parametrize("precision,compiled", [("fp32", False), ("bf16", False), ("fp16", False), ("bf16", True)])
def test_replayed_graphs_train_as_the_eager_step_does_on_a_gpu(tiny_data, precision, compiled):
    """Captured graphs, one per batch shape, replayed in another order than captured (they share one memory pool):
    the same outputs and weights as the eager step, within the GPU's run-to-run rounding (atomic adds); with
    compiled layers too (train.compile, torch.compile's default mode)."""
    cfg = make_cfg(tiny_data, f"train.precision={precision}", "system.device=cuda:0", "model.dropout=0.0",
                   f"train.compile={str(compiled).lower()}")
    rt = runtime.setup(cfg.system, cfg.placement, cfg.train.precision)
    batches = shaped_batches(tiny_data, cfg, rt.device)
    eager, model_e, _, _ = train_on(cfg, rt, batches, graphed=False, reload_at=6)
    graphed, model_g, _, run = train_on(cfg, rt, batches, graphed=True, capture=True, reload_at=6)
    assert len(run.graphs) == 3 and all(isinstance(g, torch.cuda.CUDAGraph) for g, _, _ in run.graphs.values())
    for a, b in zip(eager, graphed, strict=True):
        assert torch.equal(a["finite"], b["finite"])
        assert all(torch.allclose(a[k], b[k], rtol=1e-4, atol=1e-5) for k in ("loss_sum", "nll_sum", "grad_norm"))
    for a, b in zip(model_e.parameters(), model_g.parameters(), strict=True):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-5)


@CUDA
def test_a_step_that_cannot_be_captured_runs_eagerly_from_then_on(tiny_data, capsys):
    """A step that reads a value back cannot be captured: said once, and the run goes on eagerly, as it would
    have without graphs."""
    def reads_back(*args, **kwargs):
        out = train_mod.train_step(*args, **kwargs)
        if torch.cuda.is_current_stream_capturing():
            out["loss_sum"].item()
        return out
    cfg = make_cfg(tiny_data, "train.precision=fp32", "system.device=cuda:0", "model.dropout=0.0")
    rt = runtime.setup(cfg.system, cfg.placement, cfg.train.precision)
    batches = shaped_batches(tiny_data, cfg, rt.device)
    StepGraphs.warned = False
    eager, model_e, _, _ = train_on(cfg, rt, batches, graphed=False)
    graphed, model_g, _, run = train_on(cfg, rt, batches, graphed=True, capture=True, step=reads_back)
    assert "could not be captured as a CUDA graph" in capsys.readouterr().err
    assert not run.graphs and not run.capture
    for a, b in zip(model_e.parameters(), model_g.parameters(), strict=True):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-5)
    assert torch.cuda.current_stream(rt.device) == torch.cuda.default_stream(rt.device)  # its own stream back


@CUDA
def test_a_capture_that_fails_gives_the_thread_its_stream_back():
    """torch ends a capture before it restores the thread's stream: one that fails would leave the capture
    stream current, and the eager steps after it unordered with the batches' copies on the thread's stream."""
    device = torch.device("cuda", 0)
    x, side = torch.ones(3, device=device), runtime.side_stream(device)
    with pytest.raises(RuntimeError):
        with runtime.graph_capture(torch.cuda.CUDAGraph(), device, side):
            x.sum().item()  # a read back: forbidden while capturing
    assert torch.cuda.current_stream(device) == torch.cuda.default_stream(device)


@CUDA
def test_a_run_with_graphs_logs_the_losses_of_one_without(tiny_data, tmp_path, capsys):
    losses = []
    for graphs in ("true", "false"):
        run_dir = tmp_path / graphs
        cfg = make_cfg(tiny_data, f"run.dir={run_dir}", f"run.tensorboard_dir={run_dir}/tb", "system.device=cuda:0",
                       f"train.cuda_graphs={graphs}", "model.dropout=0.0", "train.max_steps=30", "train.log_every=5",
                       "train.eval_every=30", "train.rouge_every=0", "train.select_by=loss",
                       "train.sample_summaries=0", "train.precision=fp32")
        train_mod.train(cfg)
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        losses.append([r["loss"] for r in map(json.loads, lines) if r["split"] == "train"])
    assert "each batch shape's whole step is captured" in capsys.readouterr().err
    assert losses[0] == pytest.approx(losses[1], rel=1e-3)
