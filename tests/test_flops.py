"""The FLOP count from real lengths agrees with torch's own count of the matrix products; a GPU's peak FLOP/s
is its datasheet's."""
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from summarizer.config.schema import ModelConfig
from summarizer.model.attention import explicit_attention
from summarizer.model.transformer import Seq2Seq
from summarizer.train.watch.flops import batch_flops, forward_flops, peak_flops


@pytest.mark.parametrize("copy", [True, False])
@pytest.mark.parametrize("b, s, t", [(2, 7, 5), (3, 12, 9), (1, 30, 4), (4, 5, 16)])
def test_forward_count_matches_flop_counter_mode(copy, b, s, t):
    cfg = ModelConfig(d_model=32, n_heads=4, encoder_layers=2, decoder_layers=3, ffn_dim=64, copy=copy, dropout=0.0)
    model = Seq2Seq(cfg, 50).eval()
    src, tgt = torch.randint(4, 50, (b, s)), torch.randint(4, 50, (b, t))
    with explicit_attention(), FlopCounterMode(display=False) as counter, torch.no_grad():
        model(src, tgt)
    measured = counter.get_total_flops()
    assert forward_flops(cfg, 50, [s] * b, [t] * b) == pytest.approx(measured, rel=0.01)


def test_padding_is_computed_but_is_not_model_work():
    cfg = ModelConfig(d_model=32, n_heads=4, encoder_layers=1, decoder_layers=1, ffn_dim=64)
    src = torch.tensor([[5, 6, 7, 8], [5, 6, 0, 0], [3, 0, 0, 0]])  # the last row empty (data.pad_rows)
    tgt = torch.tensor([[2, 5, 6], [2, 5, 0], [2, 0, 0]])
    tgt_out = torch.tensor([[5, 6, 3], [5, 3, 0], [0, 0, 0]])
    real, padded = batch_flops(cfg, 50, {"src_ids": src, "tgt_in": tgt, "tgt_out": tgt_out})
    assert real == 3 * forward_flops(cfg, 50, [4, 2], [3, 2]) and padded == 3 * forward_flops(cfg, 50, [4] * 3, [3] * 3)
    assert 0 < real < padded


@pytest.mark.parametrize("name, precision, peak", [
    ("NVIDIA H100 80GB HBM3", "bf16", 989e12), ("NVIDIA H100 80GB HBM3", "fp32", 495e12),  # SXM; fp32 runs as TF32
    ("NVIDIA H100 PCIe", "bf16", 756e12), ("NVIDIA H100 NVL", "fp16", 835e12), ("NVIDIA H200", "bf16", 989e12),
    ("NVIDIA H200 NVL", "bf16", 835e12),
    ("NVIDIA A100-SXM4-80GB", "fp32", 156e12), ("NVIDIA L40S", "bf16", 362e12), ("NVIDIA L4", "bf16", 121e12),
    ("Tesla V100-SXM2-16GB", "fp32", 15.7e12), ("Tesla T4", "fp16", 65e12)])
def test_a_gpus_peak_is_its_datasheets_for_the_precision_it_trains_in(monkeypatch, name, precision, peak):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    value, origin = peak_flops(torch.device("cuda"), precision)
    assert value == peak and origin.startswith("datasheet")
    assert peak_flops(torch.device("cuda"), precision, override=1e12) == (1e12, "train.peak_flops")


@pytest.mark.parametrize("gpus, mfu", [(0, 2.0), (1, 2.0), (2, 1.0)])
def test_mfu_is_per_device_counting_both_gpus_of_a_split_model(gpus, mfu):
    """400 FLOPs in 2 s against a 100 FLOP/s peak: 2.0 on one device, 1.0 where each process holds two GPUs."""
    from types import SimpleNamespace

    from summarizer.train.watch.monitor import Window
    cpu = torch.device("cpu")
    rt = SimpleNamespace(device=cpu, devices=[cpu], world_size=1, distributed=False,
                         cuda_devices=[torch.device("cuda", i) for i in range(gpus)])  # memory read on the CPU alone
    window = Window(rt, clock=iter([0.0, 2.0]).__next__, peak_flops=100.0)
    out = {"nll_sum": torch.tensor(1.0), "loss_sum": torch.tensor(1.0), "tokens": 4, "finite": torch.tensor(True)}
    window.add(out, [{"n_src": 2, "n_tgt": 2}], 0.0, (400, 400))
    assert window.summary(1e-3, torch.tensor(1.0))["mfu"] == mfu
