"""Hardware as data (layer 10): what a device can do, for the planner's step-time model.

A :class:`Hardware` holds a device's memory, its dense peak rate per dtype, its memory bandwidth
and its links (inside a node and across nodes), plus the :class:`Efficiency` at which training
code reaches those peaks. Presets name the GPUs of published runs (:data:`PRESETS`);
``fullshard plan --gpu FILE.json`` describes any other, and ``fullshard plan --calibrate``
writes such a file for the machine it runs on (:func:`Hardware.to_dict` / :func:`load_hardware`).

NOTE [Peaks and efficiencies]
A preset's rates are the vendor's datasheet figures (dense, no sparsity; the source is beside
each). What a training step reaches is less, and differs by the kind of op, not by the GPU: large
GEMMs reach a fraction of the tensor-core peak (smaller in float8, whose GEMMs are harder to
feed), flash attention less (its softmax runs on the CUDA cores), elementwise kernels a fraction
of HBM bandwidth, NCCL a fraction of the link. Those fractions are :class:`Efficiency`; the GPU
presets share one, set on at most three published runs (``docs/plan.md`` says which, and tests
the rest). A calibrated machine measures its own (its rates *are* achieved rates: efficiency 1).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

__all__ = [
    "GIB",
    "GPU_EFFICIENCY",
    "PRESETS",
    "Efficiency",
    "Hardware",
    "hardware_names",
    "load_hardware",
]

GIB = 2**30


@dataclass(frozen=True)
class Efficiency:
    """Achieved over peak, per kind of work (NOTE [Peaks and efficiencies]).

    ``matmul``: 16/32-bit GEMMs over the tensor-core peak; ``matmul_fp8``: float8 GEMMs over the
    float8 peak; ``attention``: flash attention's forward and backward over the 16-bit peak;
    ``memory``: elementwise and reduction kernels over HBM bandwidth; ``collective``: NCCL's bus
    bandwidth over the link's. ``allocator``: the caching allocator's reserved peak over the
    live peak (fragmentation, blocks cached per stream). ``launch_s``: host time per launched op
    (eager PyTorch: the Python and dispatcher cost of one op, hidden while the device is busier).
    """

    matmul: float = 1.0
    matmul_fp8: float = 1.0
    attention: float = 1.0
    memory: float = 1.0
    collective: float = 1.0
    allocator: float = 1.0
    launch_s: float = 0.0

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if not (math.isfinite(value) and value >= 0) or (name != "launch_s" and value == 0):
                raise ValueError(f"efficiency {name}={value!r} must be a positive number")


# Calibrated on published runs (docs/plan.md, "Calibration"): the three runs named there set
# these; every other run tests them.
GPU_EFFICIENCY = Efficiency(
    matmul=0.5535,
    matmul_fp8=0.5179,
    attention=0.2579,
    memory=0.80,
    collective=0.80,
    allocator=1.201,
    launch_s=6e-6,
)


@dataclass(frozen=True)
class Hardware:
    """One device model. Rates in FLOP/s (dense), bandwidths in bytes/s per device and
    direction, memory in bytes. ``matmul_flops`` maps a compute dtype (``bf16``, ``fp16``,
    ``fp32``, ``fp8``) to its peak; a dtype it lacks cannot be planned (float8 on an A100).
    ``intra_node_bandwidth``: a device's link to the others of its node (NVLink);
    ``inter_node_bandwidth``: its share of the network (its NIC). ``latency_s``: the time of one
    step of a ring collective inside a node (network steps cost ``inter_node_latency_s``).
    ``kind``: ``cuda`` or ``cpu`` (a CPU has no caching allocator and no second stream: its
    collectives do not hide under compute). ``overhead_bytes``: memory a process holds outside
    the allocator (CUDA context, NCCL buffers), counted against ``memory_bytes`` in the verdict.
    """

    name: str
    memory_bytes: float
    matmul_flops: dict[str, float]
    memory_bandwidth: float
    intra_node_bandwidth: float
    inter_node_bandwidth: float
    devices_per_node: int = 8
    latency_s: float = 10e-6
    inter_node_latency_s: float = 20e-6
    kind: str = "cuda"
    overhead_bytes: float = 0.0
    efficiency: Efficiency = field(default_factory=Efficiency)
    source: str = ""

    def __post_init__(self) -> None:
        if self.kind not in ("cuda", "cpu"):
            raise ValueError(f"hardware kind {self.kind!r}: cuda or cpu")
        numbers = {
            "memory_bytes": self.memory_bytes,
            "memory_bandwidth": self.memory_bandwidth,
            "intra_node_bandwidth": self.intra_node_bandwidth,
            "inter_node_bandwidth": self.inter_node_bandwidth,
            **{f"matmul_flops[{k}]": v for k, v in self.matmul_flops.items()},
        }
        bad = [k for k, v in numbers.items() if not (math.isfinite(v) and v > 0)]
        if bad or self.devices_per_node < 1 or "fp32" not in self.matmul_flops:
            raise ValueError(
                f"hardware {self.name!r}: {', '.join(bad) or 'matmul_flops'} must be positive "
                "numbers, with at least an fp32 matmul rate and one device per node"
            )

    def rate(self, dtype: str) -> float:
        """Achieved GEMM rate in FLOP/s for ``dtype`` (its peak times the matmul efficiency)."""
        if dtype not in self.matmul_flops:
            have = ", ".join(sorted(self.matmul_flops))
            raise ValueError(f"{self.name} has no {dtype} matmuls (it has {have})")
        eff = self.efficiency.matmul_fp8 if dtype == "fp8" else self.efficiency.matmul
        return self.matmul_flops[dtype] * eff

    def peak(self, dtype: str) -> float:
        """The datasheet peak of ``dtype`` (what MFU divides by)."""
        return self.matmul_flops.get(dtype, self.matmul_flops["fp32"])

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready description (what ``--calibrate`` writes and ``--gpu FILE`` reads)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Hardware:
        """The inverse of :meth:`to_dict`; unknown keys are an error (a misspelt rate would
        otherwise be silently replaced by a default)."""
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown hardware keys {unknown}; known: {sorted(known)}")
        eff = data.get("efficiency", {})
        fields = {**data, "efficiency": Efficiency(**eff) if isinstance(eff, dict) else eff}
        fields["matmul_flops"] = {k: float(v) for k, v in data["matmul_flops"].items()}
        return cls(**fields)


_GBPS = 1e9
_T = 1e12
# Vendor figures. H100 SXM5 80GB: NVIDIA H100 Tensor Core GPU datasheet
# (https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet): BF16
# 1,979 and FP8 3,958 TFLOPS *with sparsity* ("one-half lower without"), TF32 989 with sparsity,
# FP32 67 TFLOPS, 3.35 TB/s, NVLink 900 GB/s (both directions: 450 each way). A DGX/HGX H100
# node has one 400 Gb/s ConnectX-7 NIC per GPU (50 GB/s each way). Memory is what CUDA reports
# as the device's total (an "80GB" part: about 81,500 MiB), not the datasheet's round figure.
# H100 SXM's dense matmul peaks (the datasheet's sparse figures halved), which the H200 shares;
# fp32 matmuls run as TF32 (torch's default on CUDA: high)
_H100_SXM_MATMUL = {"bf16": 989.4 * _T, "fp16": 989.4 * _T, "fp8": 1978.9 * _T, "fp32": 494.7 * _T}
PRESETS: dict[str, Hardware] = {
    "h100-80gb": Hardware(
        name="h100-80gb",
        memory_bytes=79.6 * GIB,
        matmul_flops=_H100_SXM_MATMUL,
        memory_bandwidth=3.35e12,
        intra_node_bandwidth=450 * _GBPS,
        inter_node_bandwidth=50 * _GBPS,
        overhead_bytes=2.0 * GIB,
        efficiency=GPU_EFFICIENCY,
        source="NVIDIA H100 datasheet (SXM5, 700 W)",
    ),
    # The part torchtitan's December 2024 tables ran on (benchmarks/llama3_h100_202412_torchtitan.md
    # in pytorch/torchtitan): 96 GB HBM2e at 2.4 TB/s, 500 W, 400 Gb/s per GPU, NVLink; torch
    # reports 95.0 GiB ("63.45GiB(66.79%)" in its logs). Its peak is "between SXM and NVL, and we
    # don't know its exact value" (that file's footnote 2): the midpoint of SXM's 989 and NVL's
    # 835 dense BF16 TFLOPS (NVIDIA's H100 datasheet, NVL column: 1,671 with sparsity).
    "h100-96gb-500w": Hardware(
        name="h100-96gb-500w",
        memory_bytes=95.0 * GIB,
        matmul_flops={"bf16": 912 * _T, "fp16": 912 * _T, "fp8": 1824 * _T, "fp32": 456 * _T},
        memory_bandwidth=2.4e12,
        intra_node_bandwidth=450 * _GBPS,
        inter_node_bandwidth=50 * _GBPS,
        overhead_bytes=2.0 * GIB,
        efficiency=GPU_EFFICIENCY,
        source="torchtitan benchmarks/llama3_h100_202412_torchtitan.md; NVIDIA H100 datasheet",
    ),
    # H200 SXM: NVIDIA H200 datasheet (https://www.nvidia.com/en-us/data-center/h200/): 141 GB
    # HBM3e at 4.8 TB/s, the H100 SXM's compute (BF16 1,979 / FP8 3,958 TFLOPS with sparsity),
    # NVLink 900 GB/s; 400 Gb/s per GPU as in the H100 nodes (ConnectX-7).
    "h200": Hardware(
        name="h200",
        memory_bytes=140.4 * GIB,
        matmul_flops=_H100_SXM_MATMUL,  # the H100 SXM's compute
        memory_bandwidth=4.8e12,
        intra_node_bandwidth=450 * _GBPS,
        inter_node_bandwidth=50 * _GBPS,
        overhead_bytes=2.0 * GIB,
        efficiency=GPU_EFFICIENCY,
        source="NVIDIA H200 datasheet (SXM, 700 W)",
    ),
    # A100 SXM4 80GB: NVIDIA A100 datasheet (nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf):
    # BF16 312 TFLOPS dense, TF32 156, 2,039 GB/s HBM2e, NVLink 600 GB/s (300 each way); no
    # float8. A DGX A100 node has one 200 Gb/s HDR NIC per GPU (25 GB/s each way). Ampere's
    # kernels reach more of its peak than Hopper's (whose tensor cores want warp-specialised
    # kernels): FlashAttention-2 (Dao, 2023, arXiv 2307.08691) reaches "50-73% of the
    # theoretical maximum FLOPs/s on A100" (about 60% causal, head dim 128, forward and
    # backward), "close to the efficiency of GEMM operations"; on H100 it reaches 35%
    # (FlashAttention-3, Shah et al., 2024, arXiv 2407.08608), as this repository's Hopper
    # calibration finds.
    "a100-80gb": Hardware(
        name="a100-80gb",
        memory_bytes=79.3 * GIB,
        matmul_flops={"bf16": 312 * _T, "fp16": 312 * _T, "fp32": 156 * _T},
        memory_bandwidth=2.039e12,
        intra_node_bandwidth=300 * _GBPS,
        inter_node_bandwidth=25 * _GBPS,
        overhead_bytes=2.0 * GIB,
        efficiency=replace(GPU_EFFICIENCY, matmul=0.75, attention=0.60),
        source="NVIDIA A100 datasheet (SXM4 80GB, 400 W); FlashAttention-2 paper",
    ),
}


def hardware_names() -> tuple[str, ...]:
    """The preset names ``--gpu`` accepts (besides a JSON file)."""
    return tuple(PRESETS)


def load_hardware(name_or_path: str, *, devices_per_node: int | None = None) -> Hardware:
    """A preset by name, or a JSON file written by :meth:`Hardware.to_dict` (``--calibrate``).

    ``devices_per_node`` overrides the node size (``--devices-per-node``)."""
    if name_or_path in PRESETS:
        hw = PRESETS[name_or_path]
    else:
        path = Path(name_or_path)
        if not path.is_file():
            names = ", ".join(PRESETS)
            raise ValueError(
                f"--gpu {name_or_path!r} is neither a preset ({names}) nor a JSON file (write "
                "one with `fullshard plan --calibrate --calibration FILE`)"
            )
        try:
            hw = Hardware.from_dict(json.loads(path.read_text(encoding="utf-8")))
        except (ValueError, TypeError, KeyError) as exc:
            raise ValueError(f"--gpu {path}: not a hardware description ({exc})") from None
    return hw if devices_per_node is None else replace(hw, devices_per_node=devices_per_node)
