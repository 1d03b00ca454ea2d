"""The planner: per-device memory and communication of a sharded training step (layer 10).

Two ways in, one accounting. :func:`plan_analytic` describes a model by its parameter count and
``layers`` equal units; :func:`fullshard.plan.model.plan_model` reads a real model's units
(built on the meta device, so any size is free). Both reduce the model to a list of
:class:`UnitCost` and hand it to :func:`build_plan`, which walks one training step the way the
engine runs it and reports, per phase, the peak bytes of each category of
``fullshard.policies.MEMORY_CATEGORIES`` (the memory tracker's vocabulary). Pure functions: no
process group, no model memory; the report and the ``fullshard plan`` command live in ``fullshard.app``.

NOTE [Two byte conventions]
The ZeRO ladder is quoted in the ZeRO paper's convention (Rajbhandari et al., 2020, section 3.1):
mixed-precision Adam keeps 2 B of 16-bit parameters, 2 B of 16-bit gradients and K = 12 B of
fp32 master weights, momentum and variance per parameter. The phase accounting follows what
fullshard (like torch's FSDP2) actually stores: the fp32 shards *are* the master weights, gathers
cast them to the compute dtype, and sharded gradients are kept in the master dtype. Both add up
to 16 B/param at rest; they split it differently between "parameters", "gradients" and
"optimizer state".

NOTE [Step model]
Steady state (step >= 2, optimizer state exists), ``zero_grad(set_to_none=True)`` so forward
holds no gradients. Forward: all activations, the root unit gathered, one non-root unit
gathered (the one computing; all of them under SHARD_GRAD_OP) while the next one's all-gather
is in flight as one output buffer (the engine allocates a prefetched unit's gathered storage
only when it is waited for). Backward is walked unit by unit in reverse: activations of
the units not yet visited, sharded gradients of those already reduced, the unit's gathered
parameters and unsharded gradients, the root's (gathered through backward, gradients reduced at
the end), one gather in flight (prefetch) and the previous unit's reduce-scatter in flight
(packed full gradient + its 1/N output). Optimizer step: shards, gradients, state and the
temporaries of torch's foreach implementation.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace

from fullshard.engine.sharding import hybrid_shard_size
from fullshard.policies import MEMORY_CATEGORIES, STRATEGY_NAMES, FullshardError, ShardingStrategy

__all__ = [
    "DTYPE_BYTES",
    "OPTIMIZERS",
    "Collective",
    "Ladder",
    "PhaseMemory",
    "Plan",
    "PlanConfig",
    "Recommendation",
    "UnitCost",
    "build_plan",
    "GB",
    "fmt_bytes",
    "korthikanti_activation_bytes",
    "plan_analytic",
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
GB = 1e9


@dataclass(frozen=True)
class PlanConfig:
    """How the job would run, apart from the model's size and the number of devices.

    ``precision``: ``fp32``, or ``bf16`` / ``fp16`` mixed precision (16-bit gathers, compute and
    activations; fp32 shards as master weights). ``reduce_dtype``: gradient reduction dtype
    (default fp32, the engine's default). ``hybrid_group``: ranks per shard group for the
    hybrid strategies (default ``devices_per_node``). ``device_memory`` in bytes, of which
    ``reserve`` (a fraction) is kept back for the CUDA context and allocator fragmentation.
    ``optimizer_state_bytes`` overrides the optimizer's state bytes per parameter.
    """

    strategy: str = "full_shard"
    hybrid_group: int | None = None
    precision: str = "bf16"
    reduce_dtype: str | None = None
    optimizer: str = "adam"
    optimizer_state_bytes: float | None = None
    batch: int = 1
    seq: int = 2048
    activation_checkpointing: bool = False
    offload: bool = False
    device_memory: float | None = None
    reserve: float = 0.1
    devices_per_node: int = 8
    # gloo's reduce-scatter is an all-to-all into a receive buffer plus a local sum (NOTE
    # [Reduce-scatter on gloo]): one more unit-sized buffer while it is in flight
    backend: str = "nccl"
    # tensor parallel: devices per TP group; the strategy shards over world / tp devices. The
    # units' sizes must then be TP-local (``fullshard.plan.model_units(..., local_shapes)``).
    tp: int = 1

    def shard_group(self, world_size: int) -> int:
        """Ranks one parameter is split over under this strategy."""
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
    saves during the unit's forward; ``input_bytes``: what activation checkpointing keeps instead;
    ``tail_bytes`` (the root): the part of ``act_bytes`` saved after the other units' forwards
    started (a language model's head and loss), which exists only at the end of forward;
    ``loss_bytes``: the part of that saved by the loss, which its own backward frees before any
    unit's backward starts.
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


@dataclass(frozen=True)
class Ladder:
    """ZeRO's model-state bytes per device (NOTE [Two byte conventions]), activations excluded."""

    bytes_per_param: float
    replicated: float
    os: float
    os_g: float
    os_g_p: float


@dataclass(frozen=True)
class PhaseMemory:
    """Predicted peak bytes per device of each category during one phase.

    Each category field is that category's own peak within the phase; ``total`` is the peak of
    their sum over time (never more than the sum of the fields, less when peaks do not coincide).
    ``other`` holds what belongs to no category: the optimizer step's foreach temporaries.
    """

    phase: str
    sharded_params: float = 0.0
    gradients: float = 0.0
    optimizer_state: float = 0.0
    gathered_window: float = 0.0
    activations: float = 0.0
    comm_buffers: float = 0.0
    other: float = 0.0
    total: float = 0.0

    def categories(self) -> dict[str, float]:
        """The six named categories as a dict (``MEMORY_CATEGORIES``)."""
        return {c: getattr(self, c) for c in MEMORY_CATEGORIES}


@dataclass(frozen=True)
class Collective:
    """One kind of collective per step: ``units`` of the model, tensor bytes, bytes each device
    sends with a ring algorithm, and the group it runs in (``shard`` or ``replicate``)."""

    kind: str
    group: str
    group_size: int
    units: float
    tensor_bytes: float
    sent_bytes: float


@dataclass(frozen=True)
class Recommendation:
    """The configuration :func:`recommend` picked, whether it fits, and why."""

    strategy: str
    hybrid_group: int | None
    activation_checkpointing: bool
    offload: bool
    fits: bool
    peak_bytes: float
    reason: str


@dataclass
class Plan:
    """Everything ``fullshard plan`` predicts for one configuration, per device."""

    mode: str
    model: str
    params: float
    layers: int
    world_size: int
    shard_group: int
    config: PlanConfig
    ladder: Ladder
    shard_bytes: float
    window_forward: float
    window_backward: float
    phases: dict[str, PhaseMemory]
    comm: list[Collective]
    host_bytes: float
    shape: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    recommendation: Recommendation | None = None

    @property
    def peak_bytes(self) -> float:
        """The step's peak per device: the largest phase total."""
        return max(p.total for p in self.phases.values())

    @property
    def usable_bytes(self) -> float | None:
        mem = self.config.device_memory
        return None if mem is None else mem * (1.0 - self.config.reserve)

    @property
    def fits(self) -> bool | None:
        usable = self.usable_bytes
        return None if usable is None else self.peak_bytes <= usable

    @property
    def comm_units(self) -> float:
        return sum(c.units for c in self.comm)

    def to_dict(self) -> dict[str, object]:
        """A JSON-ready dict (bytes as numbers)."""
        out = asdict(self)
        out.update(peak_bytes=self.peak_bytes, fits=self.fits, comm_units=self.comm_units)
        return out


def fmt_bytes(n: float) -> str:
    """Bytes in decimal units with 3 significant figures, trailing zeros dropped: '1.88 GB'."""
    # (no TB: the published figures say "1,120 GB")
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale or unit == "kB" and abs(n) >= 1:
            value = n / scale
            digits = max(0, 2 - int(math.floor(math.log10(abs(value)))))
            text = f"{value:,.{digits}f}"
            if "." in text:
                text = text.rstrip("0").rstrip(".")
            return f"{text} {unit}"
    return f"{n:.0f} B"


def korthikanti_activation_bytes(
    batch: int, seq: int, hidden: int, heads: int, *, act_bytes: int = 2, fused: bool = False
) -> float:
    """Activations one transformer layer saves: ``s*b*h*(34 + 5*a*s/h)`` bytes at 16 bits.

    Korthikanti et al. (2022), "Reducing Activation Recomputation in Large Transformer Models",
    section 4.1 (no tensor or sequence parallelism). The formula counts 2-byte activations and
    1-byte dropout masks; fp32 scales it by 2. ``fused`` attention (flash / memory-efficient SDPA)
    does not store the ``a*s*s`` score matrices, which drops the ``5*a*s/h`` term.
    """
    per_token = 34.0 + (0.0 if fused else 5.0 * heads * seq / hidden)
    return seq * batch * hidden * per_token * act_bytes / 2


def _ladder(psi: float, n: int, compute_bytes: int, k: float) -> Ladder:
    # ZeRO: 2 B params + 2 B grads (16-bit) + K; in fp32 the "16-bit" copies are 4 B each.
    p = g = compute_bytes
    total = p + g + k
    return Ladder(
        bytes_per_param=total,
        replicated=total * psi,
        os=(p + g) * psi + k * psi / n,
        os_g=p * psi + (g + k) * psi / n,
        os_g_p=total * psi / n,
    )


class _Walk:
    """The peaks of one phase walked moment by moment: each category's own peak, and the
    peak of their sum on top of the ``static`` bytes (shards and optimizer state)."""

    def __init__(self, static: float) -> None:
        self.static = static
        self.peak = dict.fromkeys(MEMORY_CATEGORIES, 0.0)
        self.total = 0.0

    def visit(self, **now: float) -> None:
        for c in MEMORY_CATEGORIES:
            self.peak[c] = max(self.peak[c], now.get(c, 0.0))
        self.total = max(self.total, self.static + sum(now.values()))

    def phase(self, name: str, shards: float, states: float) -> PhaseMemory:
        peaks = {**self.peak, "sharded_params": shards, "optimizer_state": states}
        return PhaseMemory(name, **peaks, total=self.total)


def build_plan(
    units: list[UnitCost],
    world_size: int,
    config: PlanConfig,
    *,
    mode: str,
    model: str,
    shape: dict[str, int] | None = None,
    notes: list[str] | None = None,
) -> Plan:
    """Walk one training step over ``units`` (root first) and predict memory and communication.

    See NOTE [Step model] for what is counted when. Bytes are per device (rank 0, which holds
    the most real rows: padding lives on the last ranks).
    """
    if config.strategy not in STRATEGY_NAMES:
        names = ", ".join(STRATEGY_NAMES)
        raise ValueError(f"unknown strategy {config.strategy!r}; one of {names}")
    if config.precision not in DTYPE_BYTES or config.optimizer not in OPTIMIZERS:
        raise ValueError(
            f"unknown precision {config.precision!r} or optimizer {config.optimizer!r}"
        )
    if config.tp < 1 or world_size % config.tp:
        raise ValueError(f"--tp {config.tp} must divide the {world_size} devices")
    dp_world = world_size // config.tp
    n = config.shard_group(dp_world)
    replicas = dp_world // n
    cb = DTYPE_BYTES[config.precision]  # compute: gathered params, unsharded grads, activations
    rb = DTYPE_BYTES[config.reduce_dtype or "fp32"]
    n_states, n_temps = OPTIMIZERS[config.optimizer]
    state_b = (
        n_states * MASTER_BYTES
        if config.optimizer_state_bytes is None
        else config.optimizer_state_bytes
    )
    mixed = cb != MASTER_BYTES
    psi = sum(u.numel for u in units)
    root = [u for u in units if u.is_root]
    blocks = [u for u in units if not u.is_root]
    # Root stays gathered from forward through backward when other units exist (fully_shard's
    # reshard_after_forward=None); blocks reshard after forward under FULL_SHARD / HYBRID_SHARD.
    raf = ShardingStrategy(config.strategy).reshard_after_forward
    aliased = n == 1 and not mixed and not config.offload  # gathered params view the shards
    ckpt = config.activation_checkpointing
    host = config.offload

    def gathered(u: UnitCost) -> float:
        return 0.0 if aliased else n * u.shard_numel * cb

    def ag_buffer(u: UnitCost) -> float:
        return 0.0 if n == 1 else n * u.shard_numel * cb

    def rs_buffers(u: UnitCost) -> float:
        recv = n if config.backend == "gloo" else 0
        return 0.0 if n == 1 else (n + 1 + recv) * u.grad_shard_numel * rb

    def grad_shard(u: UnitCost) -> float:
        return 0.0 if host else u.grad_shard_numel * MASTER_BYTES

    def ugrad(u: UnitCost) -> float:
        return u.trainable_numel * cb

    def act(u: UnitCost) -> float:
        return u.input_bytes if ckpt and not u.is_root else u.act_bytes

    shards = 0.0 if host else sum(u.shard_numel for u in units) * MASTER_BYTES
    trainable_shard = sum(u.shard_numel * (u.trainable_numel > 0) for u in units)
    states = 0.0 if host else trainable_shard * state_b
    temps = 0.0 if host else trainable_shard * n_temps * MASTER_BYTES
    static = shards + states
    root_gathered = sum(gathered(u) for u in root)
    by_size = sorted(blocks, key=gathered, reverse=True)
    acts = sum(act(u) for u in units)

    # -- forward: walked unit by unit, like backward. The engine allocates a prefetched unit's
    # gathered storage only when it is waited for: until then that unit is its all-gather buffer
    # (comm_buffers), so the gathered window is the unit computing (and the root) while the next
    # one is in flight. Activations grow as units finish; the root's head and the loss add theirs
    # at the end, when no block is gathered any more (under FULL_SHARD).
    fwalk = _Walk(static)
    fvisit = fwalk.visit
    done_acts = sum(act(u) - u.tail_bytes for u in root)
    fvisit(
        gathered_window=root_gathered,
        activations=done_acts,
        comm_buffers=ag_buffer(blocks[0]) if blocks else 0.0,
    )
    for i, u in enumerate(blocks):
        held = [u] if raf else blocks[: i + 1]
        # (a checkpointed unit keeps only its input; its activations are rebuilt in backward)
        fvisit(
            gathered_window=root_gathered + sum(gathered(b) for b in held),
            activations=done_acts + act(u),
            comm_buffers=ag_buffer(blocks[i + 1]) if i + 1 < len(blocks) else 0.0,
        )
        done_acts += act(u)
    fvisit(
        gathered_window=root_gathered + (0.0 if raf else sum(gathered(b) for b in blocks)),
        activations=done_acts + sum(u.tail_bytes for u in root),
    )
    window_f = fwalk.peak["gathered_window"]
    fwd = fwalk.phase("forward", shards, states)

    # -- backward: root first (its head), then blocks in reverse; walk and take the max.
    # Unsharded gradients count as "gradients" (as the memory tracker does) until reduced.
    root_params = root_gathered
    root_grads = sum(ugrad(u) for u in root)
    bwalk = _Walk(static)
    visit = bwalk.visit
    last = blocks[-1] if blocks else None
    # Start: the loss and the root's head run backward; every activation is still held and
    # the last block is being gathered (prefetch, or still gathered under SHARD_GRAD_OP).
    visit(
        gradients=root_grads,
        gathered_window=root_params + (gathered(last) if last else 0.0) if raf else window_f,
        activations=acts - sum(u.loss_bytes for u in units),
        comm_buffers=ag_buffer(last) if last and raf else 0.0,
    )
    remaining_acts = sum(act(u) for u in blocks)
    done_grads = 0.0
    prev: UnitCost | None = None
    for i in range(len(blocks) - 1, -1, -1):
        u = blocks[i]
        nxt = blocks[i - 1] if i > 0 else None
        if raf:
            window = root_params + gathered(u)  # the next unit is still its buffer (comm)
            comm = ag_buffer(nxt) if nxt else 0.0
        else:
            window = root_params + sum(gathered(b) for b in blocks[: i + 1])
            comm = 0.0
        comm += rs_buffers(prev) if prev else 0.0
        # the previous unit's reduce-scatter is in flight: its shard is a comm buffer until
        # this unit's post-backward waits for it (one in flight, MAX_REDUCES_IN_FLIGHT)
        in_flight = grad_shard(prev) if prev else 0.0
        visit(
            gradients=done_grads - in_flight + root_grads + ugrad(u),
            gathered_window=window,
            activations=remaining_acts + (u.act_bytes if ckpt else 0.0),
            comm_buffers=comm,
        )
        remaining_acts -= act(u)
        done_grads += grad_shard(u)
        prev = u
    # The end: the root's reduce-scatter, every other gradient already reduced.
    all_grads = done_grads + sum(grad_shard(u) for u in root)
    visit(
        gradients=done_grads + root_grads,
        gathered_window=root_params,
        comm_buffers=sum(rs_buffers(u) for u in root) + (rs_buffers(prev) if prev else 0.0),
    )
    visit(gradients=all_grads)
    bwd = bwalk.phase("backward", shards, states)

    step = PhaseMemory(
        "optimizer",
        sharded_params=shards,
        gradients=all_grads,
        optimizer_state=states,
        other=temps,
        total=shards + all_grads + states + temps,
    )

    # The published window: two blocks of parameters (+ one block of gradients in backward),
    # counted whatever the strategy so that it can be compared with the shard.
    two = sum(n * u.shard_numel * cb for u in by_size[:2])
    window_bwd = two + max((ugrad(u) for u in blocks), default=0.0)
    k = state_b + (MASTER_BYTES if mixed else 0)  # ZeRO's K: master copy + states
    return Plan(
        mode=mode,
        model=model,
        params=psi,
        layers=len(blocks),
        world_size=world_size,
        shard_group=n,
        config=config,
        ladder=_ladder(psi, world_size, cb, k),
        shard_bytes=sum(u.shard_numel for u in units) * (2 * MASTER_BYTES + state_b),
        window_forward=two,
        window_backward=window_bwd,
        phases={"forward": fwd, "backward": bwd, "optimizer": step},
        comm=_communication(units, n, replicas, cb, rb, raf)
        + _tp_communication(units, config.tp, cb),
        host_bytes=sum(u.shard_numel for u in units) * (2 * MASTER_BYTES + state_b) if host else 0,
        shape=dict(shape or {}),
        notes=list(notes or []),
    )


def _communication(
    units: list[UnitCost], n: int, replicas: int, cb: int, rb: int, raf: bool
) -> list[Collective]:
    """Collectives per step; one model unit = every parameter once. Ring algorithms: an
    all-gather or reduce-scatter over n ranks sends (n-1)/n of the tensor, an all-reduce twice."""
    psi = sum(u.numel for u in units) or 1.0
    trainable = sum(u.trainable_numel for u in units)
    # Under FULL_SHARD the root is not gathered again for backward: it stayed gathered.
    regather = sum(u.numel for u in units if not u.is_root) if raf else 0.0
    out: list[Collective] = []
    ring = (n - 1) / n
    if n > 1:
        out.append(Collective("all-gather (forward)", "shard", n, 1.0, psi * cb, ring * psi * cb))
        if regather:
            out.append(Collective("all-gather (backward)", "shard", n, regather / psi,
                                  regather * cb, ring * regather * cb))  # fmt: skip
        out.append(Collective("reduce-scatter", "shard", n, trainable / psi, trainable * rb,
                              ring * trainable * rb))  # fmt: skip
    if replicas > 1:
        # HYBRID / NO_SHARD: each rank's gradient shard is all-reduced across the replicas.
        shard = trainable / n
        out.append(Collective("all-reduce (replicas)", "replicate", replicas, 2 * shard / psi,
                              shard * rb, 2 * (replicas - 1) / replicas * shard * rb))  # fmt: skip
    return out


def _tp_communication(units: list[UnitCost], tp: int, cb: int) -> list[Collective]:
    """Tensor parallel's activation all-reduces: Megatron's plan all-reduces a block's output
    twice in forward (attention, MLP) and twice in backward (their inputs' gradients), each the
    size of the block's input (its ``input_bytes``). ``units``: over this rank's parameters."""
    if tp == 1:
        return []
    psi = sum(u.numel for u in units) or 1.0
    total = sum(4 * u.input_bytes for u in units if not u.is_root)
    ring = 2 * (tp - 1) / tp
    return [Collective("all-reduce (TP)", "tp", tp, total / (psi * cb), total,
                       ring * total)]  # fmt: skip


def plan_analytic(
    params: float,
    world_size: int,
    config: PlanConfig | None = None,
    *,
    layers: int = 32,
    hidden: int | None = None,
    heads: int | None = None,
    fused_attention: bool = False,
) -> Plan:
    """Plan a model of ``params`` parameters in ``layers`` equal units on ``world_size`` devices.

    ``hidden`` defaults to ``sqrt(params / (12 * layers))`` (a transformer block has about
    ``12 h^2`` parameters) and ``heads`` to ``hidden / 128``; they only shape the activation
    estimate (:func:`korthikanti_activation_bytes`, per device batch ``config.batch``).
    """
    config = config or PlanConfig()
    if params <= 0 or layers < 1 or world_size < 1:
        raise ValueError("--params, --layers and --devices must be positive")
    n = config.shard_group(world_size)
    h = hidden or max(1, round(math.sqrt(params / (12 * layers))))
    a = heads or max(1, round(h / 128))
    cb = DTYPE_BYTES[config.precision]
    act = korthikanti_activation_bytes(
        config.batch, config.seq, h, a, act_bytes=cb, fused=fused_attention
    )
    per_layer = params / layers
    unit = UnitCost(
        name="layer",
        numel=per_layer,
        trainable_numel=per_layer,
        shard_numel=per_layer / n,
        grad_shard_numel=per_layer / n,
        act_bytes=act,
        # Checkpointing keeps each layer's input: s*b*h values in the compute dtype.
        input_bytes=config.seq * config.batch * h * cb,
    )
    shape = {"hidden": h, "heads": a, "batch": config.batch, "seq": config.seq}
    notes = ["activations: Korthikanti et al. (2022), no tensor/sequence parallelism"]
    return build_plan(
        [replace(unit, name=f"layer{i}") for i in range(layers)],
        world_size,
        config,
        mode="analytic",
        model=f"{params:.3g} parameters",
        shape=shape,
        notes=notes,
    )
