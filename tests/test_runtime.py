import contextlib
import os
import subprocess
import sys

import pytest
import torch

from summarizer import runtime
from summarizer.config.schema import ModelConfig, PlacementConfig, SystemConfig
from summarizer.errors import ConfigError
from summarizer.model.transformer import Seq2Seq
from summarizer.runtime.placement import PlacedSeq2Seq


@pytest.mark.parametrize("name, message", [("tpu", "unknown device|not supported"), ("cuda:0", "no CUDA GPU")])
def test_invalid_devices_are_refused_clearly(name, message):
    if torch.cuda.is_available() and name.startswith("cuda"):
        pytest.skip("this machine has a GPU")
    with pytest.raises(ConfigError, match=message):
        runtime.resolve_device(name)


@pytest.mark.parametrize("host_bf16", [False, True], ids=["fp32-host", "bf16-host"])
def test_precision_resolution_on_cpu(monkeypatch, capsys, host_bf16):
    cpu = torch.device("cpu")
    monkeypatch.setattr(runtime.device, "cpu_has_fast_bf16", lambda: host_bf16)
    assert runtime.resolve_precision("auto", cpu) == ("bf16" if host_bf16 else "fp32")
    assert runtime.resolve_precision("bf16", cpu) == "bf16"
    assert runtime.resolve_precision("fp16", cpu) == "fp16"  # for testing the loss-scaling path
    assert "fp16 on a CPU is slow" in capsys.readouterr().err


def test_seeding_makes_runs_repeatable():
    runtime.seed_everything(7)
    a = torch.rand(3)
    runtime.seed_everything(7)
    assert torch.equal(a, torch.rand(3))


def test_placement_cpu_cpu_matches_single_device():
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=32, n_heads=4, encoder_layers=1, decoder_layers=1, ffn_dim=64, dropout=0.0)
    model = Seq2Seq(cfg, 40).eval()
    src, tgt = torch.randint(4, 40, (4, 6)), torch.randint(4, 40, (4, 5))
    ref = model(src, tgt)
    placed = PlacedSeq2Seq(model, torch.device("cpu"), torch.device("cpu"), chunks=2)
    for got, want in zip(placed(src, tgt), ref, strict=True):
        assert torch.allclose(got, want, atol=1e-6)
    assert torch.allclose(placed.decode(tgt, placed.encode(src), src), model.decode(tgt, model.encode(src), src))
    # One unwrap rule: the placed model is what decoding and checkpoints see, and its state dict is the model's.
    assert runtime.unwrap(placed) is placed and placed.state_dict().keys() == model.state_dict().keys()


def test_a_placed_models_state_dict_is_the_models_also_inside_a_moving_average():
    """A module holding the placed model (the moving average: every run's default) saves through each child's
    state_dict and loads through _load_from_state_dict: the keys are the plain model's both ways, so a split run
    resumes, rolls back and writes best.pt as a single-device one does."""
    from summarizer.train.ema import MovingAverage
    cfg = ModelConfig(d_model=16, n_heads=2, encoder_layers=1, decoder_layers=1, ffn_dim=32)
    cpu = torch.device("cpu")
    torch.manual_seed(0)
    placed = PlacedSeq2Seq(Seq2Seq(cfg, 30), cpu, cpu)
    ema = MovingAverage(placed, 0.9)
    ema.update_parameters(placed)
    saved = ema.state_dict()
    plain = MovingAverage(Seq2Seq(cfg, 30), 0.9).state_dict()
    assert list(saved) == list(plain)  # "module.embedding.weight", ..., "n_averaged"
    torch.manual_seed(1)
    again = MovingAverage(PlacedSeq2Seq(Seq2Seq(cfg, 30), cpu, cpu), 0.9)
    again.load_state_dict(saved)
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), saved.values(), strict=True))
    loaded = PlacedSeq2Seq(Seq2Seq(cfg, 30), cpu, cpu)
    loaded.load_state_dict(placed.state_dict())  # the checkpoint's own model, as before
    assert all(torch.equal(a, b) for a, b in zip(loaded.parameters(), placed.parameters(), strict=True))


def test_pipeline_chunks_queue_encoder_i_plus_1_before_decoder_i_and_its_hop_after(monkeypatch):
    """A copy between two GPUs makes each one's stream wait for all the other has queued (a two-way barrier), so
    the queue order decides whether the devices overlap: chunk i+1's memory must hop to the decoder only after
    decoder chunk i is queued, with encoder chunk i+1 queued before both. The order is recorded here."""
    import summarizer.runtime.placement as placement
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=32, n_heads=4, encoder_layers=1, decoder_layers=1, ffn_dim=64, dropout=0.0)
    placed = PlacedSeq2Seq(Seq2Seq(cfg, 40).eval(), torch.device("cpu"), torch.device("cpu"), chunks=3)
    order, move, encoded, decoded = [], placement.move, placed._encoded, placed.decoder_output
    names, decoding = {}, []

    def record_move(x, device):
        out = move(x, device)
        if id(x) in names and not decoding:  # a memory, hopping to the decoder (a no-op inside decoder_output)
            order.append(f"hop {names[id(x)]}")
        return out

    def record_encoded(x, src):
        out = encoded(x, src)
        names[id(out)] = len(names)
        order.append(f"encoder {names[id(out)]}")
        return out

    def record_decoded(tgt, memory, src, state=None):
        order.append(f"decoder {sum(o.startswith('decoder') for o in order)}")
        decoding.append(True)
        try:
            return decoded(tgt, memory, src, state)
        finally:
            decoding.pop()

    monkeypatch.setattr(placement, "move", record_move)
    monkeypatch.setattr(placed, "_encoded", record_encoded)
    monkeypatch.setattr(placed, "decoder_output", record_decoded)
    placed(torch.randint(4, 40, (6, 5)), torch.randint(4, 40, (6, 4)))
    assert order == ["encoder 0", "hop 0", "encoder 1", "decoder 0", "hop 1", "encoder 2", "decoder 1", "hop 2",
                     "decoder 2"]


def test_setup_single_process_cpu():
    rt = runtime.setup(SystemConfig(device="cpu"), PlacementConfig(), "fp32")
    assert rt.device == rt.decoder_device == torch.device("cpu") and rt.world_size == 1 and rt.is_main
    assert not runtime.make_scaler(rt).is_enabled()


def test_ddp_with_model_parallel_gives_each_rank_its_own_gpu_pair(monkeypatch):
    cuda = lambda i: torch.device("cuda", i)  # noqa: E731
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert runtime.device._per_rank_pair(cuda(0), cuda(1), local_rank=1) == (cuda(2), cuda(3))
    assert runtime.device._per_rank_pair(cuda(0), torch.device("cpu"), local_rank=3) == (cuda(3), torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ConfigError, match="nproc_per_node=1"):
        runtime.device._per_rank_pair(cuda(0), cuda(1), local_rank=1)


def test_ddp_refuses_a_model_split_between_a_gpu_and_the_cpu_before_it_starts(monkeypatch):
    """DDP wraps only a module on one kind of device: said by setup, not by DDP once every rank has loaded."""
    monkeypatch.setattr(runtime.device, "resolve_device", torch.device)  # no GPU needed to reach the check
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="one kind of device"):
        runtime.setup(SystemConfig(), PlacementConfig(encoder_device="cuda:0", decoder_device="cpu"), "fp32")


def test_setup_flushes_denormals_when_asked():
    tiny = torch.tensor([1e-39])  # a float32 denormal
    runtime.setup(SystemConfig(device="cpu", flush_denormal=False), PlacementConfig(), "fp32")
    assert (tiny * 1.0).item() != 0.0
    runtime.setup(SystemConfig(device="cpu", flush_denormal=True), PlacementConfig(), "fp32")
    assert (tiny * 1.0).item() == 0.0


@pytest.mark.parametrize("backend,explicit", [("auto", True), ("explicit", True), ("math", False), ("default", False)])
def test_cpu_attention_kernel_choice(backend, explicit):
    from summarizer.model.attention import _EXPLICIT_ATTENTION
    rt = runtime.setup(SystemConfig(device="cpu", sdpa_backend=backend), PlacementConfig(), "fp32")
    with rt.compute():
        assert _EXPLICIT_ATTENTION.get() is explicit
    assert _EXPLICIT_ATTENTION.get() is False


_CONV_TWICE = """
import sys, torch
from summarizer import runtime
from summarizer.runtime.placement import PlacedSeq2Seq
from summarizer.config.load import load_config
cfg = load_config(None, ["system.device=cpu", "system.cpu_kernel_cache=" + sys.argv[1]])
runtime.setup(cfg.system, cfg.placement, "fp32")
weight = torch.randn(32, 16, 3)
for _ in range(2):  # 20 distinct shapes, then the same 20 again
    for length in range(100, 120):
        torch.nn.functional.conv1d(torch.randn(4, 16, length), weight)
"""


def _conv_kernel_lookups(capacity: int) -> list[str]:
    """oneDNN's own log of each convolution kernel lookup (cache_hit or cache_miss) in a fresh process."""
    env = {**os.environ, "ONEDNN_VERBOSE": "profile_create"}
    env.pop("ONEDNN_PRIMITIVE_CACHE_CAPACITY", None)
    out = subprocess.run([sys.executable, "-c", _CONV_TWICE, str(capacity)], env=env, capture_output=True,
                         text=True, check=True).stdout
    return [line for line in out.splitlines() if ",convolution," in line and "create:" in line]


@pytest.mark.slow
def test_cpu_kernel_cache_keeps_the_kernels_of_recurring_shapes():
    lookups = _conv_kernel_lookups(1000)
    assert len(lookups) == 40
    assert [("cache_hit" in line) for line in lookups] == [False] * 20 + [True] * 20
    # Each shape needs a convolution and its layout reorders: two kept kernels evict every one.
    assert not any("cache_hit" in line for line in _conv_kernel_lookups(2))


def test_fp16_loss_scaling_runs_on_the_cpu():
    """GradScaler("cpu"): gradients are unscaled before clipping (the logged norm is the true one), a step with
    an inf gradient is skipped and the scale backs off, and the next finite step updates the weights."""
    from summarizer.config.schema import Config, ModelConfig, TrainConfig
    from summarizer.model.transformer import Seq2Seq
    from summarizer.train.loop import train_step
    torch.manual_seed(0)
    cfg = Config()
    cfg.train.precision = "fp16"
    rt = runtime.setup(cfg.system, cfg.placement, "fp16")
    model = Seq2Seq(ModelConfig(d_model=16, n_heads=2, encoder_layers=1, decoder_layers=1, ffn_dim=32), 30)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = runtime.make_scaler(rt)
    assert scaler.is_enabled() and scaler.get_scale() == 2.0**16
    src = torch.randint(4, 30, (2, 6))
    tgt = torch.randint(4, 30, (2, 5))
    batch = {"src_ids": src, "tgt_in": tgt[:, :-1], "tgt_out": tgt[:, 1:], "n_tgt": 8, "n_src": 12}
    tcfg = TrainConfig(clip_norm=1.0)
    before = [p.detach().clone() for p in model.parameters()]
    poisoned = model.embedding.weight.register_hook(lambda g: torch.full_like(g, float("inf")))
    out = train_step(model, optimizer, scaler, [batch], rt, tcfg)
    poisoned.remove()
    assert not out["finite"] and scaler.get_scale() == 2.0**15  # backed off by half
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))  # skipped
    out = train_step(model, optimizer, scaler, [batch], rt, tcfg)
    assert out["finite"] and float(out["grad_norm"]) < 100  # unscaled: the scale is 32768
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_autocast_keeps_no_cache_of_cast_weights_so_every_step_sees_one_autocast_state(precision, monkeypatch):
    """The cache is a guard of compiled code: were it on in eager steps and off in a CUDA graph's capture (torch's
    notes ask for it off there), layers compiled in the one would recompile in the other, which fails in a
    capture. A training forward casts each weight once anyway, so it is off everywhere, captures or not."""
    rt = runtime.Runtime(torch.device("cpu"), torch.device("cpu"), precision)
    states = []
    for capturing in (False, True):
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda capturing=capturing: capturing)
        with rt.compute():
            states.append((torch.is_autocast_enabled("cpu"), torch.is_autocast_cache_enabled()))
    assert states == [(True, False), (True, False)]


@pytest.mark.parametrize("gpu, auto", [("A100", "bf16"), ("V100", "fp16")])
def test_on_a_gpu_auto_is_bf16_only_where_the_hardware_has_it(monkeypatch, gpu, auto):
    """A V100 or T4 runs bf16 only emulated, slowly: auto is fp16 there, and bf16 asked for is refused. The GPU's
    answers are stood in for (the branch runs on any machine); the question goes to the run's device."""
    asked = []

    @contextlib.contextmanager
    def on(device):
        asked.append(device)
        yield

    monkeypatch.setattr(torch.cuda, "device", on)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported",
                        lambda including_emulation=True: gpu == "A100" or including_emulation)
    gpu1 = torch.device("cuda", 1)
    assert runtime.resolve_precision("auto", gpu1) == auto and asked == [gpu1]
    assert runtime.resolve_precision("fp16", gpu1) == "fp16" and runtime.resolve_precision("fp32", gpu1) == "fp32"
    if auto == "fp16":
        with pytest.raises(ConfigError, match="needs an Ampere or newer GPU"):
            runtime.resolve_precision("bf16", gpu1)
    else:
        assert runtime.resolve_precision("bf16", gpu1) == "bf16"


def test_cuda_attention_leaves_out_cudnn_and_each_choice_means_one_thing():
    """auto on CUDA: the fused kernels without cuDNN's, which plans per shape (checked without a GPU: only the
    choice is under test). The flags set inside the context are what SDPA then dispatches on."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from summarizer.runtime.device import attention_kernels
    fused = attention_kernels("auto", {"cuda"})
    assert SDPBackend.CUDNN_ATTENTION not in fused and SDPBackend.FLASH_ATTENTION in fused
    assert attention_kernels("auto", {"cuda", "cpu"}) == "explicit"  # a split with the decoder on the CPU
    assert attention_kernels("default", {"cuda"}) == []
    assert attention_kernels("math", {"cuda"}) == [SDPBackend.MATH]
    with sdpa_kernel(fused):
        assert not torch.backends.cuda.cudnn_sdp_enabled() and torch.backends.cuda.flash_sdp_enabled()
    rt = runtime.Runtime(torch.device("cuda"), torch.device("cuda"), "fp32")
    with rt.compute():
        assert not torch.backends.cuda.cudnn_sdp_enabled()
    assert torch.backends.cuda.cudnn_sdp_enabled()  # restored after


def test_a_run_on_a_second_gpu_makes_it_the_current_device(monkeypatch):
    """Without it, cuda:0 stays current: new streams, CUDA graph captures and calls that take no device go there
    while the run's kernels go to cuda:1. The GPU calls are recorded (the branch runs on any machine)."""
    current = []

    def set_device(device):  # torch's: a device without an index is refused
        if device.index is None:
            raise ValueError(f"Expected a torch.device with a specified index or an integer, but got:{device}")
        current.append(device)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    monkeypatch.setattr(runtime.device, "gpu_has_bf16", lambda device: True)
    cudnn_benchmark = torch.backends.cudnn.benchmark
    try:
        rt = runtime.setup(SystemConfig(device="cuda:1"), PlacementConfig(), "fp32")
        assert rt.device == torch.device("cuda", 1) and current == [torch.device("cuda", 1)]
        current.clear()
        runtime.setup(SystemConfig(), PlacementConfig(encoder_device="cpu", decoder_device="cuda:1"), "fp32")
        assert current == [torch.device("cuda", 1)]
        for name in ("cuda", "auto"):  # a bare "cuda" (auto's choice too) is the current GPU, by number
            current.clear()
            rt = runtime.setup(SystemConfig(device=name), PlacementConfig(), "auto")
            assert rt.device == rt.decoder_device == torch.device("cuda", 0) and current == [torch.device("cuda", 0)]
    finally:
        torch.backends.cudnn.benchmark = cudnn_benchmark


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
def test_a_late_read_waits_for_its_own_work_and_not_for_what_came_after(device):
    """train_step's `finite` is read while the next step runs: on a GPU the read must not wait for that step."""
    x = torch.randn(2048, 2048, device=device)
    late = runtime.LateRead(torch.isfinite(x.sum()))
    for _ in range(50 if device == "cuda" else 1):  # tens of ms of work queued behind the value
        x = torch.tanh(x @ x)
    assert bool(late.get()) is True
    if device == "cuda":
        assert late.get().is_pinned()
        assert not torch.cuda.current_stream().query()  # the read returned while the later work still ran
