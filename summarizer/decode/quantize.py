"""The form a trained model decodes in: dynamic int8 linear layers for CPU decoding in fp32
(eval.quantize=int8), or linear layers stored in 16 bit where decoding computes in 16 bit.

Every linear layer, and the output projection onto the vocabulary (tied to the embedding, so given
its own int8 copy here), computes with int8 weights and activations quantized on the fly (`Int8Linear`:
torch's quantized linear kernels, fbgemm on x86, called directly: what torch.ao.quantization.quantize_dynamic
makes, without that API, which torch deprecates for the separate torchao package; the quantized tensors beneath
are deprecated too, with nothing as fast to replace them on a CPU yet); embeddings, norms, attention
scores and the copy mixture stay in float32. Weights shrink 4x and the matmuls run faster; the
cost in ROUGE is measured by `make bench` and on both dev sets with three seeds (docs/results.md):
within the seeds' noise, so `auto` (the default) decodes in int8 wherever the CPU would decode in fp32.
Each layer's input gets one activation scale, the batch's: a sentence's summary can differ with the
sentences decoded beside it (eval.batch_tokens, eval.threads, the lines `summarize` reads together), where
`eval.quantize=none` decodes each alike in any batch. Scales per row remove that but decoded at 0.71-0.89x
(docs/experiments/decoding.md, "int8 activations scaled per row").
"""
from __future__ import annotations

import copy
import warnings

import torch
from torch import nn

from summarizer import runtime
from summarizer.config.schema import Config
from summarizer.errors import ConfigError
from summarizer.model.transformer import Seq2Seq
from summarizer.runtime import Runtime


def resolve_quantize(requested: str, rt: Runtime) -> str:
    """eval.quantize as decoding runs it: `auto` is int8 where the model decodes on the CPU in fp32, and none
    where it decodes in 16 bit (a GPU, or a CPU with fast bf16: eval.precision)."""
    if requested != "auto":
        return requested
    on_cpu = rt.device.type == "cpu" and rt.decoder_device.type == "cpu"
    return "int8" if on_cpu and rt.precision == "fp32" else "none"


def decoding_precision(cfg: Config) -> str:
    """The precision decoding runs in: eval.precision, except that int8 layers compute on float32
    activations, so eval.quantize=int8 decodes in fp32 where eval.precision is auto and is refused beside a
    16-bit eval.precision. With both at auto, a CPU decodes in fp32 with int8 layers, even one with fast bf16:
    there int8 decodes the recipe 1.05-1.15x faster than bf16, with the same ROUGE (docs/results.md, "Decoding
    speed"). On a GPU `auto` decodes in fp32 (TF32 matmuls): a decoding step multiplies a few thousand rows at
    most and waits on kernel launches, not arithmetic. On an H100 beam-4 decoding ran 6x faster in fp32 than in
    bf16 while cuDNN's attention built a plan per shape; without that kernel bf16 ran 0.78x fp32 on an H100 (1.06x
    on an H200, static shapes) and changed 21-22% of the predictions (docs/results.md, "On a GPU");
    `scripts/gpu_check.sh` measures both."""
    e = cfg.eval
    if e.precision == "auto":
        device = runtime.resolve_device(cfg.placement.decoder_device or cfg.system.device)
        if device.type == "cuda" or e.quantize != "none":
            return "fp32"
        return "auto"
    if e.quantize != "int8":
        return e.precision
    if e.precision in ("bf16", "fp16"):
        raise ConfigError(f"eval.quantize=int8 computes in float32 and cannot decode in eval.precision={e.precision}; "
                          f"choose one: eval.quantize=none for {e.precision}, or eval.precision=auto|fp32 for int8")
    return "fp32"


def decoding_form(model: Seq2Seq, rt: Runtime, quantize: str) -> nn.Module:
    """`model` as decoding runs it: int8 linear layers (`quantize`, resolved), or, where decoding computes
    in 16 bit (rt.precision), every linear layer's weights stored in that dtype, in place. Autocast keeps
    no casts under torch.inference_mode, where decoding runs, so float32 weights would be cast again at
    every step (twenty-odd casts a step for the recipe's decoder); cast once, the numbers are the same.
    Embedding and norms stay float32, as autocast computes them."""
    if quantize == "int8":
        return quantize_int8(model, rt.device)
    if rt.precision != "fp32":
        for module in model.modules():
            if isinstance(module, nn.Linear):
                module.to(rt.dtype)
    return model


def quantize_int8(model: Seq2Seq, device: torch.device) -> nn.Module:
    """A copy of `model` for decoding on the CPU with int8 linear layers; `model` itself is left as it was."""
    if device.type != "cpu":
        raise ConfigError(f"eval.quantize=int8 is a CPU decoding mode (device {device}); on a GPU decode in "
                          f"bf16 or fp16 (eval.precision) instead")
    model = copy.deepcopy(model).eval()
    vocab, d_model = model.embedding.weight.shape
    model.vocab_projection = nn.Linear(d_model, vocab, bias=False)
    with torch.no_grad():
        model.vocab_projection.weight.copy_(model.embedding.weight)
    for parent in list(model.modules()):
        for name, child in parent.named_children():
            if type(child) is nn.Linear:
                setattr(parent, name, Int8Linear(child))
    return model


class Int8Linear(nn.Module):
    """A linear layer with int8 weights, quantized once, per tensor and symmetric around zero (a scale of the
    largest magnitude / 127.5), and int8 activations quantized at each call by their range, in 7 bits
    (reduce_range: fbgemm's int8 products accumulate in 16 bits, which 8-bit activations could overflow). The
    numbers are those of torch.ao.quantization.quantize_dynamic(qint8): its MinMaxObserver's arithmetic, in
    float32, and the same kernel (tests/test_evaluate.py compares them)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach().float()
        low, high = torch.aminmax(weight)
        zero = torch.zeros((), dtype=torch.float32)
        bound = torch.max(-torch.min(low, zero), torch.max(high, zero))
        scale = torch.max(bound / (float(127 - (-128)) / 2), torch.tensor(torch.finfo(torch.float32).eps))
        bias = linear.bias.detach().float() if linear.bias is not None else None
        with warnings.catch_warnings():  # torch deprecates quantized tensors too, with no CPU kernel to replace
            # them yet: weight-only int8 (torch._weight_int8pack_mm) ran 30-70x slower than fp32 here
            # (docs/experiments/decoding.md)
            warnings.filterwarnings("ignore", message=r"torch\.quantize_per_tensor", category=UserWarning)
            qweight = torch.quantize_per_tensor(weight, float(scale), 0, torch.qint8)
        self.packed = torch.ops.quantized.linear_prepack(qweight, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.quantized.linear_dynamic(x, self.packed, reduce_range=True).to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"
