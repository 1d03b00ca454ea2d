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
only when it is waited for); at its end the loss's forward peak (NOTE [The loss's transient]).
Backward starts with the loss's backward peak, every activation still held, then is walked unit
by unit in reverse: activations of the units not yet visited (a checkpointed unit's recomputed
tensors while it runs), sharded gradients of those already reduced, the unit's gathered
parameters and unsharded gradients, the root's (gathered through backward, gradients reduced at
the end), one gather in flight (prefetch) and the previous unit's reduce-scatter in flight
(packed full gradient + its 1/N output). Optimizer step: shards, gradients, state and the
temporaries of torch's foreach implementation. Under pipeline parallel the walk is one stage's,
with the activations of every microbatch in flight, all its parameters gathered and its
unsharded gradients accumulated in the reduce dtype (NOTE [Pipeline stages]); under context
parallel a layer's gathered k and v are communication buffers.

NOTE [Reserved memory]
What a CUDA run reports (``torch.cuda.max_memory_reserved``, torchtitan's "memory") is the
caching allocator's segments, not live tensors: freed blocks stay cached per stream and size,
and large transients (the loss's) need fresh segments. The planner predicts the live peak
(``Plan.peak_bytes``) and the reserved peak as the live peak times the hardware's allocator
factor (``Efficiency.allocator``, set on a published run: reserved over live); on a CPU they are
the same. The verdict compares the reserved peak with the device's memory less what a process
holds outside the allocator (CUDA context, NCCL buffers: ``Hardware.overhead_bytes``).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from fullshard.plan.config import (
    DTYPE_BYTES,
    MASTER_BYTES,
    OPTIMIZERS,
    PlanConfig,
    UnitCost,
)
from fullshard.plan.steptime import StepTime
from fullshard.policies import MEMORY_CATEGORIES, STRATEGY_NAMES

__all__ = [
    "Collective",
    "Ladder",
    "PhaseMemory",
    "Plan",
    "Recommendation",
    "build_plan",
    "fmt_bytes",
    "korthikanti_activation_bytes",
]


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
    ``other`` holds what belongs to no category: the optimizer step's foreach temporaries and
    the loss's transient beyond what it saves; ``tracked`` the peak of the sum without it (what
    the memory tracker, which follows categorized storages, can see).
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
    tracked: float = 0.0

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
    activation_checkpointing: str
    offload: bool
    fits: bool
    peak_bytes: float
    reason: str
    tokens_per_s_per_device: float | None = None


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
    # the step-time model's prediction, when the model's shape and the hardware are known
    step: StepTime | None = None

    @property
    def peak_bytes(self) -> float:
        """The step's peak of live tensor bytes per device: the largest phase total."""
        return max(p.total for p in self.phases.values())

    @property
    def peak_reserved_bytes(self) -> float:
        """What the caching allocator holds at that peak (NOTE [Reserved memory])."""
        hw = self.config.hardware
        return self.peak_bytes * (hw.efficiency.allocator if hw else 1.0)

    @property
    def usable_bytes(self) -> float | None:
        """Device memory the allocator may fill: the device's, less the reserve fraction (or,
        for known hardware, its context and communication buffers)."""
        cfg, hw = self.config, self.config.hardware
        if hw is not None and cfg.device_memory is None:
            return hw.memory_bytes - hw.overhead_bytes
        mem = cfg.device_memory
        return None if mem is None else mem * (1.0 - cfg.reserve)

    @property
    def fits(self) -> bool | None:
        usable = self.usable_bytes
        return None if usable is None else self.peak_reserved_bytes <= usable

    @property
    def comm_units(self) -> float:
        return sum(c.units for c in self.comm)

    def to_dict(self) -> dict[str, object]:
        """A JSON-ready dict (bytes as numbers)."""
        out = asdict(self)
        step = self.step
        out.update(
            peak_bytes=self.peak_bytes,
            peak_reserved_bytes=self.peak_reserved_bytes,
            fits=self.fits,
            comm_units=self.comm_units,
            step_time_s=step.step_s if step else None,
            tokens_per_s_per_device=step.tokens_per_s_per_device if step else None,
            mfu=step.mfu if step else None,
            step_shares=step.shares() if step else None,
        )
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
        self.peak = dict.fromkeys((*MEMORY_CATEGORIES, "other"), 0.0)
        self.total = self.tracked = 0.0

    def visit(self, **now: float) -> None:
        for c in self.peak:
            self.peak[c] = max(self.peak[c], now.get(c, 0.0))
        self.total = max(self.total, self.static + sum(now.values()))
        self.tracked = max(self.tracked, self.static + sum(now.values()) - now.get("other", 0.0))

    def phase(self, name: str, shards: float, states: float) -> PhaseMemory:
        peaks = {**self.peak, "sharded_params": shards, "optimizer_state": states}
        return PhaseMemory(name, **peaks, total=self.total, tracked=self.tracked)


class _Bytes:
    """What each unit costs in bytes under one configuration (NOTE [Step model]): its
    gathered parameters, communication buffers, gradients, and the activations it keeps."""

    def __init__(self, config: PlanConfig, n: int, inflight: float) -> None:
        self.cfg = config
        self.n = n
        self.cb = DTYPE_BYTES[config.precision]  # gathered params, unsharded grads, activations
        self.rb = DTYPE_BYTES[config.reduce_dtype or "fp32"]
        mixed = self.cb != MASTER_BYTES
        self.aliased = n == 1 and not mixed and not config.offload  # gathered = the shards
        self.raf = config.reshard_after_forward
        self.inflight = inflight  # microbatches whose activations a pipeline stage holds
        self.policy = config.checkpointing

    def gathered(self, u: UnitCost) -> float:
        if self.aliased:
            return 0.0
        fp8 = u.fp8_numel if self.cfg.float8 else 0.0  # float8 weights gather 1 byte each
        return (self.n * u.shard_numel - fp8) * self.cb + fp8

    def ag_buffer(self, u: UnitCost | None) -> float:
        return 0.0 if u is None or self.n == 1 else self.gathered(u)

    def rs_buffers(self, u: UnitCost | None) -> float:
        recv = self.n if self.cfg.backend == "gloo" else 0
        return (
            0.0 if u is None or self.n == 1 else (self.n + 1 + recv) * u.grad_shard_numel * self.rb
        )

    def grad_shard(self, u: UnitCost) -> float:
        return 0.0 if self.cfg.offload else u.grad_shard_numel * MASTER_BYTES

    def ugrad(self, u: UnitCost) -> float:
        # under pipeline parallel FSDP2 accumulates unsharded gradients in the reduce dtype
        # across microbatches and reduce-scatters them once, after the last
        return u.trainable_numel * (self.rb if self.cfg.pp > 1 else self.cb)

    def act(self, u: UnitCost) -> float:
        """What ``u`` keeps for backward under the checkpointing policy (the root is never
        checkpointed), for every microbatch a pipeline stage holds."""
        if u.is_root:
            return u.act_bytes
        kept = {
            "none": u.act_bytes,
            "full": u.input_bytes,
            "selective": u.selective_bytes or u.act_bytes,
        }[self.policy]
        return kept * self.inflight

    def recompute(self, u: UnitCost) -> float:
        """A checkpointed unit's tensors rebuilt for its backward, beyond what it kept."""
        if u.is_root or self.policy == "none":
            return 0.0
        kept = self.act(u) / self.inflight - u.input_bytes
        return max(0.0, u.act_bytes - kept)


def build_plan(
    units: list[UnitCost],
    world_size: int,
    config: PlanConfig,
    *,
    mode: str,
    model: str,
    shape: dict[str, int] | None = None,
    notes: list[str] | None = None,
    inflight: float = 1,
    cp_bytes: float = 0.0,
) -> Plan:
    """Walk one training step over ``units`` (root first) and predict memory and communication.

    See NOTE [Step model] for what is counted when. Bytes are per device (rank 0, which holds
    the most real rows: padding lives on the last ranks). Under pipeline parallel ``units`` are
    one stage's and ``inflight`` the microbatches whose activations it holds at once;
    ``cp_bytes``: one layer's k and v gathered by context parallel.
    """
    if config.strategy not in STRATEGY_NAMES:
        names = ", ".join(STRATEGY_NAMES)
        raise ValueError(f"unknown strategy {config.strategy!r}; one of {names}")
    if config.precision not in DTYPE_BYTES or config.optimizer not in OPTIMIZERS:
        raise ValueError(
            f"unknown precision {config.precision!r} or optimizer {config.optimizer!r}"
        )
    model_parallel = config.tp * config.pp
    if world_size % model_parallel or config.dp_world(world_size) % config.cp:
        raise ValueError(
            f"--tp {config.tp} x --pp {config.pp} x --cp {config.cp} must divide the "
            f"{world_size} devices"
        )
    dp_world = config.dp_world(world_size)
    n = config.shard_group(dp_world)
    replicas = dp_world // n
    b = _Bytes(config, n, inflight)
    n_states, n_temps = OPTIMIZERS[config.optimizer]
    state_b = (
        n_states * MASTER_BYTES
        if config.optimizer_state_bytes is None
        else config.optimizer_state_bytes
    )
    psi = sum(u.numel for u in units)
    host = config.offload
    shards = 0.0 if host else sum(u.shard_numel for u in units) * MASTER_BYTES
    trainable_shard = sum(u.shard_numel * (u.trainable_numel > 0) for u in units)
    states = 0.0 if host else trainable_shard * state_b
    temps = 0.0 if host else trainable_shard * n_temps * MASTER_BYTES
    fwd, window_f = _forward_phase(units, b, shards, states, cp_bytes)
    bwd, all_grads = _backward_phase(units, b, shards, states, window_f, cp_bytes)
    step = PhaseMemory(
        "optimizer",
        sharded_params=shards,
        gradients=all_grads,
        optimizer_state=states,
        other=temps,
        total=shards + all_grads + states + temps,
        tracked=shards + all_grads + states,
    )

    # The published window: two blocks of parameters (+ one block of gradients in backward),
    # counted whatever the strategy so that it can be compared with the shard.
    blocks = [u for u in units if not u.is_root]
    by_size = sorted(blocks, key=lambda u: u.shard_numel, reverse=True)
    two = sum(n * u.shard_numel * b.cb for u in by_size[:2])
    window_bwd = two + max((b.ugrad(u) for u in blocks), default=0.0)
    k = state_b + (MASTER_BYTES if b.cb != MASTER_BYTES else 0)  # ZeRO's K: master + states
    shard_state = sum(u.shard_numel for u in units) * (2 * MASTER_BYTES + state_b)
    return Plan(
        mode=mode,
        model=model,
        params=psi,
        layers=len(blocks),
        world_size=world_size,
        shard_group=n,
        config=config,
        ladder=_ladder(psi, dp_world, b.cb, k),
        shard_bytes=shard_state,
        window_forward=two,
        window_backward=window_bwd,
        phases={"forward": fwd, "backward": bwd, "optimizer": step},
        comm=_communication(units, n, replicas, b.cb, b.rb, b.raf)
        + _tp_communication(units, config.tp, b.cb),
        host_bytes=shard_state if host else 0,
        shape=dict(shape or {}),
        notes=list(notes or []),
    )


def _forward_phase(
    units: list[UnitCost], b: _Bytes, shards: float, states: float, cp_bytes: float
) -> tuple[PhaseMemory, float]:
    """Forward walked unit by unit (NOTE [Step model]). The engine allocates a prefetched
    unit's gathered storage only when it is waited for: until then that unit is its all-gather
    buffer (comm_buffers), so the gathered window is the unit computing (and the root) while
    the next one is in flight. Activations grow as units finish; the root's head and the loss
    add theirs at the end, when no block is gathered any more (under FULL_SHARD), and the loss
    peaks there (NOTE [The loss's transient]). Returns the phase and its gathered peak."""
    root = [u for u in units if u.is_root]
    blocks = [u for u in units if not u.is_root]
    walk = _Walk(shards + states)
    root_gathered = sum(b.gathered(u) for u in root)
    done = sum(b.act(u) - u.tail_bytes for u in root)
    walk.visit(
        gathered_window=root_gathered,
        activations=done,
        comm_buffers=b.ag_buffer(blocks[0] if blocks else None),
    )
    for i, u in enumerate(blocks):
        held = [u] if b.raf else blocks[: i + 1]
        # (a checkpointed unit keeps only its input; its activations are rebuilt in backward)
        walk.visit(
            gathered_window=root_gathered + sum(b.gathered(x) for x in held),
            activations=done + b.act(u),
            comm_buffers=b.ag_buffer(blocks[i + 1] if i + 1 < len(blocks) else None) + cp_bytes,
        )
        done += b.act(u)
    walk.visit(
        gathered_window=root_gathered + (0.0 if b.raf else sum(b.gathered(x) for x in blocks)),
        activations=done + sum(u.tail_bytes for u in root),
        other=sum(u.loss_forward_extra for u in root),
    )
    return walk.phase("forward", shards, states), walk.peak["gathered_window"]


def _backward_phase(
    units: list[UnitCost],
    b: _Bytes,
    shards: float,
    states: float,
    window_f: float,
    cp_bytes: float,
) -> tuple[PhaseMemory, float]:
    """Backward: the loss, the root's head, then blocks in reverse (NOTE [Step model]).
    Unsharded gradients count as "gradients" (as the memory tracker does) until reduced.
    Returns the phase and the gradient bytes left for the optimizer."""
    root = [u for u in units if u.is_root]
    blocks = [u for u in units if not u.is_root]
    walk = _Walk(shards + states)
    visit = walk.visit
    root_params = sum(b.gathered(u) for u in root)
    root_grads = sum(b.ugrad(u) for u in root)
    acts = sum(b.act(u) for u in units)
    last = blocks[-1] if blocks else None
    pp = b.cfg.pp > 1  # accumulators for the whole stage, reduced once after the last microbatch
    accum = sum(b.ugrad(u) for u in units) if pp else 0.0
    # The loss's backward: every activation held, its gradients at their peak
    visit(
        gradients=accum,
        gathered_window=window_f,
        activations=acts,
        other=sum(u.loss_backward_extra for u in root),
    )
    # The root's head runs backward; the last block is being gathered (prefetch, or still
    # gathered under SHARD_GRAD_OP).
    visit(
        gradients=accum or root_grads,
        gathered_window=root_params + (b.gathered(last) if last else 0.0) if b.raf else window_f,
        activations=acts - sum(u.loss_bytes for u in units),
        comm_buffers=b.ag_buffer(last) if b.raf else 0.0,
    )
    remaining = sum(b.act(u) for u in blocks)
    done_grads = 0.0
    prev: UnitCost | None = None
    for i in range(len(blocks) - 1, -1, -1):
        u = blocks[i]
        nxt = blocks[i - 1] if i > 0 else None
        if b.raf:
            window = root_params + b.gathered(u)  # the next unit is still its buffer (comm)
            comm = b.ag_buffer(nxt)
        else:
            window = root_params + sum(b.gathered(x) for x in blocks[: i + 1])
            comm = 0.0
        # the previous unit's reduce-scatter is in flight (under pipeline parallel: in the
        # last microbatch): its shard is a comm buffer until this unit's post-backward waits for
        # it (one in flight, MAX_REDUCES_IN_FLIGHT)
        comm += b.rs_buffers(prev)
        in_flight = b.grad_shard(prev) if prev else 0.0
        grads = accum if pp else done_grads - in_flight + root_grads + b.ugrad(u)
        visit(
            gradients=grads,
            gathered_window=window,
            activations=remaining,
            comm_buffers=comm + 2 * cp_bytes,
            # a checkpointed unit's recomputed tensors: real, but held by the checkpoint's own
            # saved-tensor hooks, which the memory tracker's cannot see
            other=b.recompute(u),
        )
        remaining -= b.act(u)
        done_grads += b.grad_shard(u)
        prev = u
    # The end: the root's reduce-scatter, every other gradient already reduced.
    all_grads = done_grads + sum(b.grad_shard(u) for u in root)
    visit(
        gradients=accum if pp else done_grads + root_grads,
        gathered_window=root_params,
        comm_buffers=sum(b.rs_buffers(u) for u in [*root, *([prev] if prev else [])]),
    )
    visit(gradients=all_grads)
    return walk.phase("backward", shards, states), all_grads


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
            out.append(
                Collective(
                    "all-gather (backward)",
                    "shard",
                    n,
                    regather / psi,
                    regather * cb,
                    ring * regather * cb,
                )
            )
        out.append(
            Collective(
                "reduce-scatter", "shard", n, trainable / psi, trainable * rb, ring * trainable * rb
            )
        )
    if replicas > 1:
        # HYBRID / NO_SHARD: each rank's gradient shard is all-reduced across the replicas.
        shard = trainable / n
        out.append(
            Collective(
                "all-reduce (replicas)",
                "replicate",
                replicas,
                2 * shard / psi,
                shard * rb,
                2 * (replicas - 1) / replicas * shard * rb,
            )
        )
    return out


def _tp_communication(units: list[UnitCost], tp: int, cb: int) -> list[Collective]:
    """Tensor parallel's activation collectives: Megatron's plan sums a block's output twice in
    forward (attention, MLP) and twice in backward (their inputs' gradients), each the size of
    the whole sequence's block input. Under sequence parallel each sum is a reduce-scatter and
    the next all-gather: the same bytes as an all-reduce. A unit's ``input_bytes`` is its
    sequence-parallel share (``1/tp``). ``units``: over this rank's parameters."""
    if tp == 1:
        return []
    psi = sum(u.numel for u in units) or 1.0
    total = sum(4 * u.input_bytes * tp for u in units if not u.is_root)
    ring = 2 * (tp - 1) / tp
    return [Collective("all-reduce (TP)", "tp", tp, total / (psi * cb), total, ring * total)]
