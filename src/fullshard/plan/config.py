"""What the planner is told (layer 10): how the job would run (:class:`PlanConfig`), one unit as
the planner sees it (:class:`UnitCost`), and the byte sizes both count in.

The accounting (``accounting.py``), the step-time model (``steptime.py``), the activations
(``activations.py``) and the pipeline stages (``pipeline.py``) all read these; nothing here
computes a plan.
"""

from __future__ import annotations

from dataclasses import dataclass

from fullshard.engine.sharding import hybrid_shard_size
from fullshard.plan.hardware import Hardware
from fullshard.plan.transformer import POLICIES
from fullshard.policies import FullshardError, ShardingStrategy

__all__ = [
    "COMPILE_SCOPES",
    "DTYPE_BYTES",
    "GB",
    "MASTER_BYTES",
    "OPTIMIZERS",
    "PP_SCHEDULES",
    "PlanConfig",
    "UnitCost",
]

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
# Optimizer states per parameter (each in the fp32 master dtype) and foreach temporaries:
# torch's multi-tensor Adam allocates sqrt(exp_avg_sq) for every parameter during step().
OPTIMIZERS: dict[str, tuple[int, int]] = {
    "adam": (2, 1),
    "adamw": (2, 1),
    "sgd-momentum": (1, 0),
    "sgd": (0, 0),
}
MASTER_BYTES = 4  # shards, master weights and optimizer states are fp32
PP_SCHEDULES = ("1f1b", "interleaved")
# torch.compile: nothing, the blocks only (torchtitan in 2024), or the blocks and the loss
COMPILE_SCOPES = ("none", "blocks", "all")
GB = 1e9


@dataclass(frozen=True)
class PlanConfig:
    """How the job would run, apart from the model's size and the number of devices.

    ``precision``: ``fp32``, or ``bf16`` / ``fp16`` mixed precision (16-bit gathers, compute and
    activations; fp32 shards as master weights). ``reduce_dtype``: gradient reduction dtype
    (default fp32, the engine's default). ``hybrid_group``: ranks per shard group for the
    hybrid strategies (default ``devices_per_node``). ``device_memory`` in bytes, of which
    ``reserve`` (a fraction) is kept back for the CUDA context and allocator fragmentation;
    with ``hardware`` the device's own memory, its allocator factor and its overhead decide
    instead (unless ``device_memory`` is given). ``optimizer_state_bytes`` overrides the
    optimizer's state bytes per parameter. ``activation_checkpointing``: ``none``, ``selective``
    (torchtitan's per-op policy, NOTE [Saved bytes per policy]) or ``full`` (``True`` is full).
    ``tp``, ``pp``, ``cp``: tensor (with sequence and loss parallel), pipeline and context
    parallel degrees; the strategy shards over ``world / (tp * pp)`` ranks (context-parallel
    ranks included, as torchtitan's ``dp_shard_cp``). ``pp_schedule``: ``1f1b`` or
    ``interleaved`` (two stages per rank); ``microbatches``: default ``pp``. ``compile``:
    ``blocks`` (torch.compile'd blocks) or ``all`` (blocks and loss; ``True``); ``float8``: float8 linears in the blocks with float8 all-gathers;
    ``async_tp``: tensor parallel's collectives split under its matmuls.
    """

    strategy: str = "full_shard"
    hybrid_group: int | None = None
    precision: str = "bf16"
    reduce_dtype: str | None = None
    optimizer: str = "adam"
    optimizer_state_bytes: float | None = None
    batch: int = 1
    seq: int = 2048
    activation_checkpointing: bool | str = "none"
    offload: bool = False
    device_memory: float | None = None
    reserve: float = 0.1
    devices_per_node: int = 8
    # gloo's reduce-scatter is an all-to-all into a receive buffer plus a local sum (NOTE
    # [Reduce-scatter on gloo]): one more unit-sized buffer while it is in flight
    backend: str = "nccl"
    # tensor parallel: devices per TP group. The units' sizes must then be TP-local
    # (``fullshard.plan.model_units(..., local_shapes)``).
    tp: int = 1
    pp: int = 1
    cp: int = 1
    pp_schedule: str = "1f1b"
    microbatches: int | None = None
    compile: bool | str = "none"
    float8: bool = False
    async_tp: bool = False
    hardware: Hardware | None = None

    def __post_init__(self) -> None:
        # booleans as the older API took them: True is full checkpointing / blocks and loss
        ac = self.activation_checkpointing
        policy = ac if isinstance(ac, str) else ("full" if ac else "none")
        if policy not in POLICIES:
            raise ValueError(f"activation checkpointing {ac!r}: one of {', '.join(POLICIES)}")
        object.__setattr__(self, "activation_checkpointing", policy)
        scope = self.compile
        compiled = scope if isinstance(scope, str) else ("all" if scope else "none")
        if compiled not in COMPILE_SCOPES:
            raise ValueError(f"compile {self.compile!r}: one of {', '.join(COMPILE_SCOPES)}")
        object.__setattr__(self, "compile", compiled)
        if self.pp_schedule not in PP_SCHEDULES:
            raise ValueError(f"pipeline schedule {self.pp_schedule!r}: one of {PP_SCHEDULES}")
        if min(self.tp, self.pp, self.cp) < 1 or (self.microbatches or 1) < 1:
            raise ValueError("--tp, --pp, --cp and the microbatches must be at least 1")

    @property
    def checkpointing(self) -> str:
        """The activation checkpointing policy: ``none``, ``selective`` or ``full``."""
        return str(self.activation_checkpointing)

    @property
    def compile_blocks(self) -> bool:
        """The blocks run torch.compile'd (``--compile`` or ``--compile blocks``)."""
        return self.compile != "none"

    @property
    def compile_loss(self) -> bool:
        """The loss runs torch.compile'd too (``--compile``; torchtitan since 2025)."""
        return self.compile == "all"

    @property
    def stages_per_rank(self) -> int:
        return 2 if self.pp_schedule == "interleaved" else 1

    @property
    def reshard_after_forward(self) -> bool:
        """Whether blocks free their gathered parameters after forward (never under pipeline
        parallel: each microbatch would gather them again, torchtitan keeps them)."""
        return ShardingStrategy(self.strategy).reshard_after_forward and self.pp == 1

    def dp_world(self, world_size: int) -> int:
        """Ranks the strategy shards and replicates over: ``world / (tp * pp)``."""
        return world_size // (self.tp * self.pp)

    def shard_group(self, world_size: int) -> int:
        """Ranks one parameter is split over under this strategy (``world_size``: the
        data-parallel ranks, :meth:`dp_world`)."""
        if self.strategy == "no_shard":
            return 1
        if self.strategy.startswith("hybrid"):
            try:  # the engine's default and its check: a node's devices, else half the world
                per_node = max(self.devices_per_node // self.tp, 1)  # data-parallel ranks per node
                return hybrid_shard_size(world_size, self.hybrid_group or 0, per_node)
            except FullshardError as exc:
                raise ValueError(f"{self.strategy}: {exc} (--hybrid-group here)") from None
        return world_size


@dataclass(frozen=True)
class UnitCost:
    """One communication unit as the planner sees it (sizes in elements, activations in bytes).

    ``shard_numel`` is one rank's flat shard including padding (``FlatLayout.shard_numel``);
    ``grad_shard_numel`` the reduce-scatter output per rank (trainable shards + one presence
    column per trainable parameter, NOTE [Which gradients exist]). ``act_bytes``: what autograd
    saves during the unit's forward; ``input_bytes``: what full activation checkpointing keeps
    instead; ``selective_bytes``: what selective checkpointing keeps (0: not planned).
    ``tail_bytes`` (the root): the part of ``act_bytes`` saved after the other units' forwards
    started (a language model's head and loss), which exists only at the end of forward;
    ``loss_bytes``: the part of that saved by the loss, which its own backward frees before any
    unit's backward starts; ``loss_forward_extra`` / ``loss_backward_extra``: what the loss
    holds beyond that at its forward and backward peaks (NOTE [The loss's transient]).
    ``fp8_numel``: elements of the unit's linear weights, gathered as float8 under --float8.
    """

    name: str
    numel: float
    trainable_numel: float
    shard_numel: float
    grad_shard_numel: float
    act_bytes: float = 0.0
    input_bytes: float = 0.0
    is_root: bool = False
    tail_bytes: float = 0.0
    loss_bytes: float = 0.0
    selective_bytes: float = 0.0
    loss_forward_extra: float = 0.0
    loss_backward_extra: float = 0.0
    fp8_numel: float = 0.0
