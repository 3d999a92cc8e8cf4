"""Model FLOPs of a batch from its real lengths, for FLOP/s and model-FLOPs utilisation (MFU).

The usual 6·N·tokens is wrong for this model: attention grows with length², cross-attention with target x
source, the tied output projection and the copy head are not in N the way a decoder-only model's layers
are, and padding is computed but is not model work. Counted per sentence (s source, t target tokens, d
d_model, f ffn_dim, V vocabulary), in multiply-adds, x2 for FLOPs:

    encoder layer    4·s·d² (q, k, v, out) + 2·s²·d (scores, weighted sum) + 2·s·d·f (feed-forward)
    decoder layer    4·t·d² + 2·t²·d (self-attention, the whole t x t matrix as computed)
                     + 2·t·d² + 2·s·d² + 2·t·s·d (cross-attention: q and out, k and v of the memory, both products)
                     + 2·t·d·f
    output           t·d·V (the tied projection onto the vocabulary)
    copy head        t·d² + s·d² (query, key) + 2·t·s·d (scores, context) + 2·t·d (gate)

Embedding look-ups, norms, softmax and the loss are left out (no matrix products; a few percent at most).
Training is counted as 3 x forward: the backward pass computes two products (input and weight gradients) for
each one of the forward pass. tests/test_flops.py checks the count against torch's FlopCounterMode.
"""
from __future__ import annotations

import functools
import time

import numpy as np
import torch

from summarizer.config.schema import ModelConfig

TRAINING_FACTOR = 3  # forward + backward (two products per forward product)


def forward_flops(cfg: ModelConfig, vocab_size: int, src_lens, tgt_lens) -> int:
    """Forward FLOPs of the sentences with these source and target lengths (tokens each, as fed to the model)."""
    s = np.asarray(src_lens, dtype=np.float64)
    t = np.asarray(tgt_lens, dtype=np.float64)
    d, f = cfg.d_model, cfg.ffn_dim
    encoder = cfg.encoder_layers * (4 * s * d * d + 2 * s * s * d + 2 * s * d * f)
    decoder = cfg.decoder_layers * (4 * t * d * d + 2 * t * t * d + 2 * t * d * d + 2 * s * d * d + 2 * t * s * d
                                    + 2 * t * d * f)
    output = t * d * vocab_size
    copy = (t * d * d + s * d * d + 2 * t * s * d + 2 * t * d) if cfg.copy else 0.0
    return int(round(2 * float(np.sum(encoder + decoder + output + copy))))


def batch_flops(cfg: ModelConfig, vocab_size: int, batch: dict) -> tuple[int, int]:
    """(model FLOPs of the batch's real tokens, FLOPs computed on its padded shape) for one training step's
    forward and backward: their ratio is the share of compute spent on padding."""
    src, tgt = batch["src_ids"], batch["tgt_in"]
    pairs = (batch["tgt_out"] != 0).any(1)  # data.pad_rows' empty rows have no target: no model work
    real = forward_flops(cfg, vocab_size, (src[pairs] != 0).sum(1).tolist(),
                         (tgt[pairs] != 0).sum(1).clamp(min=1).tolist())
    b, s_pad, t_pad = src.shape[0], src.shape[1], tgt.shape[1]
    padded = forward_flops(cfg, vocab_size, [s_pad] * b, [t_pad] * b)
    return TRAINING_FACTOR * real, TRAINING_FACTOR * padded


# Dense (no sparsity) peak FLOP/s from the vendors' datasheets, by a part of the device's name (the longest that
# matches) and precision. fp32 is TF32 where the GPU has it (Ampere and newer): runtime.setup lets matmuls use it.
# H100 SXM ("NVIDIA H100 80GB HBM3") and H200: 989 TF bf16/fp16, 495 TF32; H100 PCIe 756 / 378; H100 NVL and
# H200 NVL 835 / 418; A100 312 / 156; L40S 362 / 183; L40 181 / 90.5; L4 121 / 60; V100 125 fp16 (tensor cores) /
# 15.7 fp32 (no TF32); T4 65 / 8.1.
GPU_PEAK = {"H100": {"bf16": 989e12, "fp16": 989e12, "fp32": 495e12},
            "H200": {"bf16": 989e12, "fp16": 989e12, "fp32": 495e12},
            "H100 PCIe": {"bf16": 756e12, "fp16": 756e12, "fp32": 378e12},
            "H100 NVL": {"bf16": 835e12, "fp16": 835e12, "fp32": 418e12},
            "H200 NVL": {"bf16": 835e12, "fp16": 835e12, "fp32": 418e12},
            "A100": {"bf16": 312e12, "fp16": 312e12, "fp32": 156e12},
            "L40S": {"bf16": 362e12, "fp16": 362e12, "fp32": 183e12},
            "L40": {"bf16": 181e12, "fp16": 181e12, "fp32": 90.5e12},
            "L4": {"bf16": 121e12, "fp16": 121e12, "fp32": 60e12},
            "V100": {"fp16": 125e12, "fp32": 15.7e12},
            "T4": {"fp16": 65e12, "fp32": 8.1e12}}


@functools.cache
def measured_peak(device: torch.device, precision: str, seconds: float = 0.3) -> float:
    """FLOP/s of large square matrix products on `device` at `precision`: the attainable peak where no datasheet
    figure applies (CPUs), measured once per process."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)
    n = 1024
    own = torch.Generator(device=device).manual_seed(0)  # never the run's random stream: resume stays exact
    a = torch.randn(n, n, device=device, dtype=dtype, generator=own)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=own)
    a @ b  # warm-up: kernel selection
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    started, runs = time.perf_counter(), 0
    while time.perf_counter() - started < seconds:
        a @ b
        runs += 1
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return 2 * n ** 3 * runs / (time.perf_counter() - started)


def peak_flops(device: torch.device, precision: str, override: float = 0.0) -> tuple[float, str]:
    """(peak FLOP/s for MFU, where it came from): train.peak_flops if set, the datasheet for a known GPU, else
    measured (`measured_peak`)."""
    if override > 0:
        return override, "train.peak_flops"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key in sorted(GPU_PEAK, key=len, reverse=True):  # "H100 PCIe" before "H100", "L40S" before "L4"
            if key in name and precision in GPU_PEAK[key]:
                return GPU_PEAK[key][precision], f"datasheet ({key}, {precision})"
    return measured_peak(device, precision), f"measured ({precision} matrix products)"
