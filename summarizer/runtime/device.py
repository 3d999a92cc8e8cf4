"""Where and how the model runs: devices, seeding, determinism, precision and the process group it joins."""
from __future__ import annotations

import contextlib
import os
import random
import sys
from dataclasses import dataclass
from functools import cache, lru_cache

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from summarizer.config.schema import PlacementConfig, SystemConfig
from summarizer.errors import ConfigError
from summarizer.model.attention import explicit_attention


@dataclass
class Runtime:
    device: torch.device  # inputs go here (the encoder's device); collectives run here
    decoder_device: torch.device  # == device unless the model is split (only placement and precision read it)
    precision: str  # resolved: fp32 | bf16 | fp16
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def devices(self) -> list[torch.device]:
        """Every device the model occupies (two when it is split)."""
        return list(dict.fromkeys([self.device, self.decoder_device]))

    @property
    def cuda_devices(self) -> list[torch.device]:
        """The GPUs among `devices` (whose random streams a run keeps, and whose work a timer waits for)."""
        return [d for d in self.devices if d.type == "cuda"]

    sdpa_backend: str = "auto"

    @property
    def dtype(self) -> torch.dtype:
        """The dtype matrix products compute in (autocast's, in 16 bit)."""
        return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[self.precision]

    def compute(self) -> contextlib.ExitStack:
        """The context every forward pass runs in: autocast to the run's precision (matmuls in 16 bit,
        reductions and norms kept in fp32 by torch.amp) and the attention kernel choice.

        Autocast keeps no cache of cast weights, ever: a training forward casts each weight once anyway (the recipe's
        step on a CPU: the same time with the cache and without), decoding runs under inference_mode, where autocast
        caches nothing (its 16-bit weights are cast once: decode.quantize.decoding_form), and torch's CUDA graph
        notes ask for no cache while a graph is captured. Off only during a capture, the cache was a guard of code
        compiled outside it (train.compile with train.cuda_graphs): every compiled layer recompiled inside the
        capture, which fails there."""
        stack = contextlib.ExitStack()
        if self.precision != "fp32":
            for device_type in {self.device.type, self.decoder_device.type}:
                stack.enter_context(torch.autocast(device_type=device_type, dtype=self.dtype, cache_enabled=False))
        backends = attention_kernels(self.sdpa_backend, {self.device.type, self.decoder_device.type})
        if backends == "explicit":
            stack.enter_context(explicit_attention())
        elif backends:
            stack.enter_context(sdpa_kernel(backends))
        return stack


def attention_kernels(backend: str, device_types: set[str]) -> str | list[SDPBackend]:
    """What `system.sdpa_backend` means on these devices: "explicit" (attention as two batched matmuls), the SDPA
    kernels allowed, or [] for torch's own choice ("default").

    `auto`: explicit on a CPU, where at sentence lengths two matmuls beat every SDPA kernel (bench row
    "attention_kernel"). On CUDA, flash, then memory-efficient, then math: every kernel but cuDNN's, which torch
    prefers for 16-bit inputs on Hopper and which builds an execution plan for each new (batch, heads, query
    length, key length) shape. Length-bucketed batches bring new shapes for a whole epoch, and decoding with a
    KV cache a new key length at every step; fp32, which cuDNN's kernel does not take, never paid it."""
    if backend == "auto":
        backend = "explicit" if "cpu" in device_types else "fused"
    return {"explicit": "explicit", "default": [], "math": [SDPBackend.MATH],
            "flash": [SDPBackend.FLASH_ATTENTION], "efficient": [SDPBackend.EFFICIENT_ATTENTION],
            "fused": [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]}[backend]


def move(x: Tensor, device: torch.device) -> Tensor:
    # non_blocking is only safe towards CUDA: a non-blocking copy into host memory may be read
    # before it lands (https://pytorch.org/tutorials/intermediate/pinmem_nonblock.html).
    return x.to(device, non_blocking=device.type == "cuda")


def move_batch(batch: dict, device: torch.device) -> dict:
    """A collated batch's id tensors to `device` (non-blocking from pinned memory); token counts stay ints."""
    return {key: move(value, device) if torch.is_tensor(value) else value for key, value in batch.items()}


@cache
def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream warm-up steps and CUDA graph captures run on, one per device for the process (torch's CUDA graph
    notes ask for warm-up on a side stream): memory the caching allocator files under a stream is reused only by
    that stream, so a new stream per capture would strand each one's blocks."""
    return torch.cuda.Stream(device)


def on_side_stream(device: torch.device, run):
    """run() on `device`'s side stream, ordered after the work queued so far and before the work queued next."""
    side, current = side_stream(device), torch.cuda.current_stream(device)
    side.wait_stream(current)
    with torch.cuda.stream(side):
        out = run()
    current.wait_stream(side)
    return out


@contextlib.contextmanager
def graph_capture(graph: torch.cuda.CUDAGraph, device: torch.device, stream: torch.cuda.Stream | None = None,
                  pool=None):
    """torch.cuda.graph(graph, ...) on `device`, capturing only this thread's calls (capture_error_mode=
    "thread_local": another thread's work goes on), that gives the thread its stream back when the capture fails:
    torch's exit ends the capture before it restores the stream, so a capture that raises would leave the capture
    stream current, and every later kernel of the thread unordered with the work queued on its own stream."""
    with torch.cuda.stream(torch.cuda.current_stream(device)), \
            torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
        yield


def device_tensor(values, device: torch.device) -> Tensor:
    """Python numbers as a tensor on `device`, queued behind the device's work rather than waiting for it:
    `torch.tensor(x, device="cuda")` copies from pageable memory and then waits for the whole queue to drain; a copy
    from pinned memory does not."""
    cuda = device.type == "cuda"
    return torch.tensor(values, pin_memory=cuda).to(device, non_blocking=cuda)


class LateRead:
    """A device value for the host to read later without draining the device's queue: copied now, behind the work
    that computes it, into pinned memory; `get` then waits for that work alone, not for what was queued after it
    (a `.item()` would wait for all of it). Elsewhere than on a GPU, the value itself."""

    def __init__(self, value: Tensor):
        self.event = None
        if value.is_cuda:
            self.value = torch.empty(value.shape, dtype=value.dtype, pin_memory=True).copy_(value, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record(torch.cuda.current_stream(value.device))  # the stream the copy was queued on
        else:
            self.value = value.detach().cpu()

    def get(self) -> Tensor:
        if self.event is not None:
            self.event.synchronize()
        return self.value


def resolve_device(name: str) -> torch.device:
    if name in ("", "auto"):
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"unknown device '{name}'; use cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"device '{name}' asked for, but this machine has no CUDA GPU; use cpu or auto")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError(f"device '{name}' asked for, but only {torch.cuda.device_count()} GPU(s) exist")
        if device.index is None:  # one GPU by number: torch.cuda.set_device and CUDA graphs refuse a bare "cuda"
            device = torch.device("cuda", torch.cuda.current_device())
    elif device.type != "cpu":
        raise ConfigError(f"device type '{device.type}' is not supported; use cpu or cuda")
    return device


@lru_cache(maxsize=1)
def cpu_has_fast_bf16() -> bool:
    """AVX-512 BF16 or AMX: oneDNN then runs bf16 matmuls natively, faster than fp32."""
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def gpu_has_bf16(device: torch.device) -> bool:
    """bf16 in the GPU's hardware: Ampere or newer (or ROCm). torch.cuda.is_bf16_supported() by default also says
    yes where bf16 is only emulated, slowly (V100, T4: its including_emulation=True), and asks the current device."""
    if not torch.cuda.is_available():
        return False
    with torch.cuda.device(device):
        return torch.cuda.is_bf16_supported(including_emulation=False)


def resolve_precision(requested: str, device: torch.device) -> str:
    if device.type == "cuda":
        if requested == "auto":
            return "bf16" if gpu_has_bf16(device) else "fp16"
        if requested == "bf16" and not gpu_has_bf16(device):
            raise ConfigError("train.precision=bf16 needs an Ampere or newer GPU; use fp16 (with loss scaling)")
        return requested
    if requested == "auto":
        return "bf16" if cpu_has_fast_bf16() else "fp32"
    if requested == "fp16":
        # Slow (CPUs have no fast fp16 matmuls), but it runs the loss-scaling path CUDA users rely on
        # (GradScaler("cpu"): scale, unscale before clipping, skip on inf, back off) where tests can see it.
        print("warning: precision fp16 on a CPU is slow and meant for testing the loss-scaling path; use bf16 "
              "(fast where the CPU has AVX-512 BF16 or AMX) or fp32 to train", file=sys.stderr, flush=True)
    return requested


def seed_everything(seed: int, deterministic: bool = False) -> None:
    """Seed python, numpy and torch (all devices); optionally forbid non-deterministic kernels."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds every CUDA device
    if deterministic:
        # cuBLAS needs a fixed workspace to be deterministic (CUDA docs, "Reproducibility").
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False
        torch.backends.cudnn.deterministic = True


def set_cpu_kernel_cache(capacity: int) -> None:
    """Keep up to `capacity` compiled CPU kernels (oneDNN's primitive cache; 0 = its default, 1024).

    oneDNN compiles a matmul kernel for every distinct shape, which at these sizes costs more than
    the matmul itself. A length-bucketed epoch has hundreds of batch shapes with dozens of kernels
    each; a cache smaller than that evicts every kernel before its shape returns, and every step
    recompiles (docs/results.md, bench rows "kernel_cache" and "pad_multiple"). oneDNN reads the capacity
    once, at its first kernel: this must run before the process's first matmul (setup does, first).
    """
    if capacity > 0:
        os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = str(capacity)


def setup(system: SystemConfig, placement: PlacementConfig, precision: str) -> Runtime:
    """Initialise the process group when launched by torchrun, pick devices (`system.device`, or the placement's)
    and `precision` (train.precision for training, eval.precision for decoding)."""
    # Denormal floats (below 1.2e-38) take a slow microcode path on x86: as the model grows
    # confident, exp() in the vocabulary softmax produces them by the million and CPU steps slow
    # down (docs/practices.md, "denormals flushed"). FTZ/DAZ treats them as zero. The flag is per thread and OpenMP's
    # pool copies it when created, so this must run before the first parallel op: first here.
    torch.set_flush_denormal(system.flush_denormal)
    set_cpu_kernel_cache(system.cpu_kernel_cache)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    split = bool(placement.encoder_device or placement.decoder_device) and \
        placement.encoder_device != placement.decoder_device
    if split:
        device = resolve_device(placement.encoder_device or system.device)
        decoder_device = resolve_device(placement.decoder_device or system.device)
        if world_size > 1 and device.type != decoder_device.type:  # DDP refuses such a module when it wraps it
            raise ConfigError(f"DDP (torchrun, {world_size} processes) needs the model's halves on one kind of device, "
                              f"not placement.encoder_device={device.type} and decoder_device={decoder_device.type}: "
                              f"two GPUs per process, or one device each (placement unset)")
        if world_size > 1 and "cuda" in (device.type, decoder_device.type):
            device, decoder_device = _per_rank_pair(device, decoder_device, local_rank)
    else:
        device = resolve_device(placement.encoder_device or system.device)
        if device.type == "cuda" and world_size > 1:
            device = torch.device("cuda", local_rank)
        decoder_device = device
    gpus = [d for d in (device, decoder_device) if d.type == "cuda"]
    if gpus:  # the current device: where NCCL, new streams, CUDA graphs and calls without a device go (not cuda:0)
        torch.cuda.set_device(gpus[0])
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" and decoder_device.type == "cuda" else "gloo")
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = system.cudnn_benchmark and not system.deterministic
        # TF32 matmuls on Ampere+: fp32 accuracy is not needed for the fp32 master path of training.
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    precision = resolve_precision(precision, decoder_device)
    return Runtime(device, decoder_device, precision, rank, world_size, local_rank, system.sdpa_backend)


def _per_rank_pair(encoder: torch.device, decoder: torch.device, local_rank: int) -> tuple:
    """DDP x model parallel: local rank r owns the placement's GPUs shifted by r * (GPUs per process),
    so `cuda:0`/`cuda:1` means GPUs 0,1 for rank 0, GPUs 2,3 for rank 1, and so on."""
    per_process = len({d.index for d in (encoder, decoder) if d.type == "cuda"})

    def shift(d: torch.device) -> torch.device:
        return torch.device("cuda", (d.index or 0) + local_rank * per_process) if d.type == "cuda" else d

    encoder, decoder = shift(encoder), shift(decoder)
    needed = max(d.index for d in (encoder, decoder) if d.type == "cuda") + 1
    if needed > torch.cuda.device_count():
        raise ConfigError(f"DDP with model parallelism: local rank {local_rank} needs GPU {needed - 1}, but this "
                          f"node has {torch.cuda.device_count()}; use --nproc_per_node="
                          f"{torch.cuda.device_count() // per_process} (GPUs / {per_process} per process)")
    return encoder, decoder


@contextlib.contextmanager
def eval_mode(model: nn.Module):
    """Dropout off (so nothing draws from the training RNG streams) for the block; the mode it had, after."""
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)


def make_scaler(rt: Runtime) -> torch.amp.GradScaler:
    """Loss scaling for fp16 only: bf16 has fp32's exponent range and needs none."""
    return torch.amp.GradScaler(rt.decoder_device.type, enabled=rt.precision == "fp16")
