"""GPUs the simulation predicts step times for: dense 16-bit tensor-core FLOP/s and memory bandwidth.

Spec sheet figures (dense, no sparsity), and the fractions a real kernel reaches, which
turn the simulation's per-operator FLOPs and bytes into a time (:mod:`tnlg.training.simulate`):

* ``matmul_efficiency`` 0.78: the best bf16 GEMM measured on an H200 in this repository
  (docs/gpu_check_h200.json: 772 TFLOP/s of 989), used for every GPU;
* ``memory_efficiency`` 0.85: STREAM-like copies reach 80-90% of the HBM spec;
* ``kernel_floor_s`` 4 us: the shortest a kernel launch and its tail take on a GPU.

Links: ``nvlink_gbps`` per GPU inside a node (unidirectional bus bandwidth an NCCL ring
reaches), ``network_gbps`` per GPU across nodes (InfiniBand), ``host_gbps`` the GPU's PCIe link
to the host, one direction (spec: Gen5 x16 64 GB/s on H100/H200, Gen4 32 on A100, Gen3 16 on
V100), which a checkpoint's device-to-host copies cross; copies into pageable memory (what
``tensor.to("cpu")`` makes) reach less, so a save's predicted time is a lower bound.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import UserError

if TYPE_CHECKING:  # the annotations only: torch is imported where it is used
    import torch

__all__ = ["GPU", "GPUS", "gpu", "attention_kernel"]


@dataclass(frozen=True)
class GPU:
    name: str
    flops_16bit: float      # dense bf16/fp16 tensor-core FLOP/s (spec)
    memory_bps: float       # HBM bytes/s (spec)
    memory_bytes: float
    nvlink_gbps: float      # GB/s per GPU inside a node, NCCL bus bandwidth
    network_gbps: float     # GB/s per GPU across nodes
    host_gbps: float        # GB/s of the PCIe link to the host, one direction (spec)
    matmul_efficiency: float = 0.78
    memory_efficiency: float = 0.85
    kernel_floor_s: float = 4e-6


GPUS: dict[str, GPU] = {
    "h200": GPU("H200 SXM 141GB", 989e12, 4.8e12, 141e9, 360.0, 50.0, 64.0),
    "h100": GPU("H100 SXM 80GB", 989e12, 3.35e12, 80e9, 360.0, 50.0, 64.0),
    "a100": GPU("A100 SXM 80GB", 312e12, 2.039e12, 80e9, 240.0, 25.0, 32.0),
    "v100": GPU("V100 SXM2 32GB", 125e12, 0.9e12, 32e9, 130.0, 12.5, 16.0),
}


def gpu(name: str) -> GPU:
    """The GPU named ``name`` (case-insensitive); a clear :class:`UserError` for an unknown one."""
    key = str(name).lower()
    if key not in GPUS:
        raise UserError(f"--gpu {name!r} is not a GPU the simulation knows; valid: {', '.join(GPUS)} "
                        f"(dense 16-bit FLOP/s and memory bandwidth from the spec sheets, see tnlg.plan.gpus).")
    return GPUS[key]


def attention_kernel(device: torch.device, dtype: torch.dtype, heads: int, head_dim: int, seq: int,
                     dropout: float) -> str:
    """The kernel ``F.scaled_dot_product_attention`` picks for the model's causal attention (no mask)
    on ``device``: ``flash``, ``efficient``, ``cudnn`` or ``math`` on CUDA (asked of torch's own
    checks, in its order of preference), ``flash`` or ``math`` on the CPU (whose flash kernel has no
    dropout). The memory a step needs depends on it (:func:`tnlg.plan.memory.gpu_attention`)."""
    import torch  # here, not at the top: ``tnlg plan`` without --simulate (and its --help) needs no torch
    device = torch.device(device)
    if device.type != "cuda":
        return "flash" if dropout == 0.0 and device.type == "cpu" else "math"
    q = torch.empty(1, heads, seq, head_dim, device=device, dtype=dtype)
    params = torch.backends.cuda.SDPAParams(q, q, q, None, float(dropout), True, False)
    b = torch.backends.cuda
    for name, enabled, usable in (("flash", b.flash_sdp_enabled, b.can_use_flash_attention),
                                  ("efficient", b.mem_efficient_sdp_enabled, b.can_use_efficient_attention),
                                  ("cudnn", b.cudnn_sdp_enabled, b.can_use_cudnn_attention)):
        if enabled() and usable(params):
            return name
    return "math"
