"""The step-time model (layer 10): how long one training step takes, and why.

NOTE [Step-time model]
A step is the sum, over the units a device runs in order, of each unit's time, plus what cannot
hide: the first all-gather, the last reduce-scatter, the loss, the optimizer step, a pipeline's
bubble. Per unit and pass (forward, backward, recomputation):
- compute = matmul FLOPs / the dtype's achieved rate (float8 linears at the float8 rate) +
  attention FLOPs / the attention rate + HBM bytes of the elementwise ops / achieved bandwidth
  (``TransformerShape.memory_traffic``; eager ops each read and write, compiled regions once);
- FSDP's collectives run on their own stream and hide under compute: the next unit's all-gather
  under this unit's forward; in backward the previous unit's all-gather and the next's
  reduce-scatter (serialised on one communicator) under this unit's backward. A unit costs
  ``max(compute, collectives)``. A ring collective over ``n`` ranks moves ``(n-1)/n`` of the
  tensor at the slowest link's bus bandwidth, plus ``n-1`` hops of latency;
- tensor parallel's all-gathers and reduce-scatters (sequence parallel: 2 + 2 per block and
  pass) sit between matmuls on the compute stream: exposed; async TP hides each all-gather
  under the matmul it feeds (but the first of its ``tp`` chunks), not the reduce-scatters;
- context parallel all-gathers each layer's k and v (torch's ``allgather`` rotation) while the
  local chunk's attention runs, and reduce-scatters their gradients in backward;
- the host launches ``eager_ops`` kernels per block (``Efficiency.launch_s`` each): a unit whose
  device time is shorter than its host time waits for the host (compiled blocks launch few);
- on a CPU nothing overlaps: compute, collectives and host time add up.
Pipeline parallel runs each stage's units per microbatch; 1F1B's step is ``(m + p - 1)`` times a
stage's microbatch time, interleaved 1F1B's with ``v`` stages per rank ``(m + (p - 1) / v)``.
MFU counts the model's FLOPs (``6 N`` per token for the matmuls, 3x the forward attention;
recomputation not counted) over the 16-bit peak, whatever the matmuls ran in.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fullshard.plan.config import DTYPE_BYTES, MASTER_BYTES, PlanConfig, UnitCost
from fullshard.plan.hardware import Hardware
from fullshard.plan.transformer import TransformerShape

__all__ = ["StepTime", "collective_time", "send_time", "step_time"]

# HBM bytes per parameter of one optimizer step: torch's foreach AdamW reads and writes the
# fp32 parameter, gradient and both moments over about ten kernels (lerp, mul, addcmul,
# sqrt, div, addcdiv, the decay), and clipping reads every gradient twice (norm, scale).
OPTIMIZER_TRAFFIC = {"adam": 84.0, "adamw": 84.0, "sgd-momentum": 40.0, "sgd": 24.0}
# float8 (tensorwise dynamic scaling): each linear's input and output gradient get an amax
# and a cast (read 16-bit, write 8-bit), and the 8-bit copies a transpose for the other GEMMs.
FLOAT8_CAST_BYTES = 5.0


@dataclass(frozen=True)
class StepTime:
    """The predicted step of one device. Seconds; ``parts`` splits ``compute_s`` by kind
    (matmul, attention, memory, loss) and ``exposed`` the exposed time by cause (fsdp, tp, cp,
    pp_p2p, host, bubble, optimizer)."""

    step_s: float
    tokens_per_s_per_device: float
    mfu: float
    compute_s: float
    exposed_comm_s: float
    host_s: float
    bubble_s: float
    optimizer_s: float
    parts: dict[str, float] = field(default_factory=dict)
    exposed: dict[str, float] = field(default_factory=dict)

    def shares(self) -> dict[str, float]:
        """The fraction of the step each of compute, exposed communication, host, the bubble
        and the optimizer is (they add up to 1)."""
        total = self.step_s or 1.0
        return {
            "compute": self.compute_s / total,
            "exposed_comm": self.exposed_comm_s / total,
            "host": self.host_s / total,
            "bubble": self.bubble_s / total,
            "optimizer": self.optimizer_s / total,
        }


def collective_time(nbytes: float, group: int, hw: Hardware, *, stride: int = 1) -> float:
    """Seconds of one ring all-gather or reduce-scatter of an ``nbytes`` tensor over ``group``
    ranks spaced ``stride`` devices apart (tensor parallel ranks sit between data-parallel
    ones). Inside a node the link is NVLink; across nodes each device's share of the network,
    times the group's members per node (each drives its own NIC)."""
    if group <= 1 or nbytes <= 0:
        return 0.0
    per_node = max(1, min(group, hw.devices_per_node // max(stride, 1)))
    nodes = -(-group // per_node)
    if nodes == 1:
        bus, hop = hw.intra_node_bandwidth, hw.latency_s
    else:
        bus = min(hw.intra_node_bandwidth, per_node * hw.inter_node_bandwidth)
        hop = hw.inter_node_latency_s
    bus *= hw.efficiency.collective
    return (group - 1) / group * nbytes / bus + (group - 1) * hop


@dataclass
class _Pass:
    """One pass's device work per token of one block, split by kind (FLOPs or bytes)."""

    mm: float = 0.0
    mm8: float = 0.0  # float8 matmuls
    attn: float = 0.0
    traffic: float = 0.0

    def seconds(self, tokens: float, hw: Hardware, dtype: str) -> dict[str, float]:
        """Device seconds of ``tokens`` tokens, by kind."""
        if hw.kind == "cpu":  # a CPU's attention runs at its matmul rate
            attn_rate = hw.rate(dtype)
        else:  # flash attention: 16-bit tensor cores whatever the model's dtype
            attn_rate = hw.peak("bf16") * hw.efficiency.attention
        mm = self.mm / hw.rate(dtype) + (self.mm8 / hw.rate("fp8") if self.mm8 else 0.0)
        return {
            "matmul": tokens * mm,
            "attention": tokens * self.attn / attn_rate,
            "memory": tokens * self.traffic / (hw.memory_bandwidth * hw.efficiency.memory),
        }


def _block_passes(shape: TransformerShape, cfg: PlanConfig) -> dict[str, _Pass]:
    """Forward, backward and recomputation work of one block per token on one device."""
    act, tp = DTYPE_BYTES[cfg.precision], cfg.tp
    mm = shape.block_matmul_flops(tp)
    attn = shape.attention_flops(cfg.seq, tp)
    traffic = shape.memory_traffic(act, tp, compiled=cfg.compile_blocks)
    cast = 0.0
    if cfg.float8:  # the linears' inputs forward, their output gradients backward
        ins = sum(i for i, _, _ in shape.matmuls()) / tp
        outs = sum(o for _, o, _ in shape.matmuls()) / tp
        cast = FLOAT8_CAST_BYTES * (ins + outs) / 2

    def gemms(flops: float) -> dict[str, float]:
        return {"mm8": flops} if cfg.float8 else {"mm": flops}

    policy = cfg.checkpointing
    return {
        "forward": _Pass(**gemms(mm), attn=attn, traffic=traffic + cast),
        # two GEMMs per forward GEMM; flash attention's backward runs 5 matmuls to forward's 2
        "backward": _Pass(**gemms(2 * mm), attn=2.5 * attn, traffic=2 * traffic + cast),
        "recompute": _Pass(
            **gemms(shape.recompute_matmul_flops(policy, tp)),
            attn=attn if policy == "full" else 0.0,
            traffic=traffic + cast if policy != "none" else 0.0,
        ),
    }


def _tp_seconds(
    shape: TransformerShape, cfg: PlanConfig, hw: Hardware, tokens: float, pass_: str
) -> tuple[float, float]:
    """One block's sequence-parallel collectives in one pass, ``(all-gathers, reduce-
    scatters)`` in seconds: 2 all-gathers (before attention and the MLP) and 2 reduce-scatters
    (after them); forward's all-gathers send float8 under --float8. Recomputation repeats
    forward's under full checkpointing."""
    if cfg.tp == 1 or (pass_ == "recompute" and cfg.checkpointing != "full"):
        return 0.0, 0.0
    act = DTYPE_BYTES[cfg.precision]
    whole = tokens * shape.hidden  # elements of one gathered (whole-sequence) activation
    gather = 1 if cfg.float8 and pass_ != "backward" else act
    return 2 * collective_time(whole * gather, cfg.tp, hw), 2 * collective_time(
        whole * act, cfg.tp, hw
    )


def _cp_seconds(
    shape: TransformerShape, cfg: PlanConfig, hw: Hardware, tokens: float, pass_: str
) -> float:
    """One block's context-parallel exchange in one pass: k and v of the whole sequence
    (repeated to every head, as SDPA gets them) all-gathered, and in backward their fp32
    gradients reduce-scattered."""
    if cfg.cp == 1 or (pass_ == "recompute" and cfg.checkpointing != "full"):
        return 0.0
    kv = 2 * tokens * cfg.cp * shape.q_dim / cfg.tp
    gather = collective_time(kv * DTYPE_BYTES[cfg.precision], cfg.cp, hw, stride=cfg.tp)
    grads = collective_time(kv * MASTER_BYTES, cfg.cp, hw, stride=cfg.tp)
    return gather + (grads if pass_ == "backward" else 0.0)


def _block_seconds(
    shape: TransformerShape, cfg: PlanConfig, hw: Hardware, tokens: float
) -> tuple[dict[str, dict[str, float]], dict[str, float], dict[str, float]]:
    """Per pass: device seconds by kind, exposed TP/CP seconds, host seconds, of one block
    running ``tokens`` tokens."""
    dtype = cfg.precision
    device: dict[str, dict[str, float]] = {}
    exposed: dict[str, float] = {}
    host: dict[str, float] = {}
    for name, work in _block_passes(shape, cfg).items():
        kinds = work.seconds(tokens, hw, dtype)
        device[name] = kinds
        gathers, scatters = _tp_seconds(shape, cfg, hw, tokens, name)
        if cfg.async_tp and gathers:
            # torch's micro-pipelined TP fuses each all-gather with the matmul that consumes it,
            # in tp chunks: the gather hides under the matmul but for its first chunk (what is
            # longer than the matmul shows). The reduce-scatters after a matmul stay exposed.
            gathers = max(0.0, gathers - kinds["matmul"]) + gathers / cfg.tp
        tp = gathers + scatters
        cp = _cp_seconds(shape, cfg, hw, tokens, name)
        if cp:  # the gathered k/v arrives while the local chunk's attention runs
            cp = max(0.0, cp - kinds["attention"] / cfg.cp)
        exposed[name] = tp + cp
        ops = shape.eager_ops() * (2 if name == "backward" else 1)
        ran = name != "recompute" or cfg.checkpointing != "none"
        # a compiled block launches its fused kernels: about a tenth of eager's ops
        host[name] = ops * hw.efficiency.launch_s * (0.1 if cfg.compile_blocks else 1.0) * ran
    return device, exposed, host


def send_time(nbytes: float, hw: Hardware, *, across_nodes: bool) -> float:
    """Seconds of one point-to-point send (a pipeline stage's activations)."""
    if across_nodes:
        return (
            nbytes / (hw.inter_node_bandwidth * hw.efficiency.collective) + hw.inter_node_latency_s
        )
    return nbytes / (hw.intra_node_bandwidth * hw.efficiency.collective) + hw.latency_s


class _Fsdp:
    """FSDP's collectives of one unit, in seconds: its all-gather (float8 weights at one byte
    under --float8) and its reduce-scatter, over the shard group."""

    def __init__(self, cfg: PlanConfig, world_size: int, hw: Hardware) -> None:
        self.cfg, self.hw = cfg, hw
        self.n = cfg.shard_group(cfg.dp_world(world_size))  # FSDP shards over dp x cp
        self.replicas = max(1, cfg.dp_world(world_size) // self.n)
        self.act = DTYPE_BYTES[cfg.precision]
        self.rb = DTYPE_BYTES[cfg.reduce_dtype or "fp32"]

    def gather(self, u: UnitCost) -> float:
        fp8 = u.fp8_numel if self.cfg.float8 else 0.0
        nbytes = (self.n * u.shard_numel - fp8) * self.act + fp8
        return collective_time(nbytes, self.n, self.hw, stride=self.cfg.tp)

    def scatter(self, u: UnitCost) -> float:
        """The unit's reduce-scatter and, under HSDP, its shard's all-reduce across the
        replicas right after it (a ring all-reduce: a reduce-scatter and an all-gather)."""
        nbytes = self.n * u.grad_shard_numel * self.rb
        out = collective_time(nbytes, self.n, self.hw, stride=self.cfg.tp)
        if self.replicas > 1:
            shard = u.grad_shard_numel * self.rb
            stride = self.n * self.cfg.tp
            out += 2 * collective_time(shard, self.replicas, self.hw, stride=stride)
        return out


def _blocks_seconds(
    blocks: list[UnitCost],
    cfg: PlanConfig,
    hw: Hardware,
    fsdp: _Fsdp,
    work: tuple[dict[str, dict[str, float]], dict[str, float], dict[str, float]],
) -> tuple[float, dict[str, float]]:
    """One microbatch through ``blocks``: each unit's forward and backward cost the longest of
    their device time, their host time and the FSDP collectives under them (their sum on a
    CPU). Returns the seconds and the exposed host and FSDP seconds."""
    device, tp_cp, host = work
    micro = (cfg.microbatches or cfg.pp) if cfg.pp > 1 else 1
    f_dev = sum(device["forward"].values()) + tp_cp["forward"]
    b_dev = sum(device["backward"].values()) + sum(device["recompute"].values())
    b_dev += tp_cp["backward"] + tp_cp["recompute"]
    f_host, b_host = host["forward"], host["backward"] + host["recompute"]
    ag = [fsdp.gather(u) for u in blocks] + [0.0]
    rs = [fsdp.scatter(u) for u in blocks] + [0.0]
    raf = cfg.reshard_after_forward
    exposed = {"fsdp": 0.0, "host": 0.0}
    total = 0.0
    for i in range(len(blocks)):
        # the next unit's gather under this forward; the previous one's gather (again, when
        # resharded) and the next one's reduce-scatter under this backward
        f_comm, b_comm = ag[i + 1], (ag[i - 1] if raf and i > 0 else 0.0) + rs[i + 1]
        if cfg.pp > 1:  # a stage gathers once and reduces once per step, not per microbatch
            f_comm, b_comm = f_comm / micro, b_comm / micro
        for dev, hst, comm in ((f_dev, f_host, f_comm), (b_dev, b_host, b_comm)):
            busy = max(dev, hst) if hw.kind == "cuda" else dev + hst
            unit = max(busy, comm) if hw.kind == "cuda" else busy + comm
            exposed["host"] += busy - dev
            exposed["fsdp"] += unit - busy
            total += unit
    return total, exposed


def step_time(
    shape: TransformerShape,
    units: list[UnitCost],
    world_size: int,
    config: PlanConfig,
    hw: Hardware,
    *,
    head: bool = True,
) -> StepTime:
    """Predict one device's step (NOTE [Step-time model]) for ``units`` (one pipeline stage's,
    root first) of a model of ``shape`` under ``config`` on ``hw``. ``head``: the stage runs
    the output head and the loss (a pipeline's last; every other plan's)."""
    cfg = config
    act = DTYPE_BYTES[cfg.precision]
    if cfg.float8 and "fp8" not in hw.matmul_flops:
        raise ValueError(f"--float8: {hw.name} has no float8 matmuls")
    micro = (cfg.microbatches or cfg.pp) if cfg.pp > 1 else 1
    mb = cfg.batch * cfg.seq / cfg.cp / micro  # tokens of one microbatch on one device
    blocks = [u for u in units if not u.is_root]
    root = [u for u in units if u.is_root]
    fsdp = _Fsdp(cfg, world_size, hw)
    work = _block_seconds(shape, cfg, hw, mb)
    stage_mb, exposed = _blocks_seconds(blocks, cfg, hw, fsdp, work)
    # the root: embedding lookups, and on the last stage the head (16-bit) and the loss
    bw = hw.memory_bandwidth * hw.efficiency.memory
    head_s = loss_s = 0.0
    if root and head:
        head_s = 3 * mb * shape.head_flops(cfg.tp) / hw.rate(cfg.precision)
        per_logit = TransformerShape.loss_traffic(act, compiled=cfg.compile_loss)
        loss_s = mb * shape.vocab / cfg.tp * per_logit / bw
    embed_s = 3 * mb * shape.hidden * act / bw if root else 0.0
    stage_mb += head_s + loss_s + embed_s
    # exposed once a step: the first gathers (the root's, the first block's), the last
    # reduce-scatters (and their replicas' all-reduces), the optimizer step
    edge = sum(fsdp.gather(u) + fsdp.scatter(u) for u in [*root, *blocks[:1]])
    shard_numel = sum(u.shard_numel for u in units)
    exposed["fsdp"] += edge
    opt_s = shard_numel * OPTIMIZER_TRAFFIC.get(cfg.optimizer, 84.0) / bw
    step = stage_mb * micro + edge + opt_s
    bubble_s = 0.0
    if cfg.pp > 1:  # (m + (p - 1) / v) stage-microbatch times, and the activations' sends
        bubble_s = (cfg.pp - 1) / cfg.stages_per_rank * stage_mb
        sends = 2 * (micro + cfg.pp - 1)  # activations forward, their gradients backward
        across = world_size // cfg.pp >= hw.devices_per_node  # stages on different nodes
        nbytes = mb * shape.hidden * act / cfg.tp
        exposed["pp_p2p"] = sends * send_time(nbytes, hw, across_nodes=across)
        step += bubble_s + exposed["pp_p2p"]
    device, tp_cp, _ = work
    exposed["tp_cp"] = sum(tp_cp.values()) * len(blocks) * micro
    compute = {
        k: sum(device[p][k] for p in device) * len(blocks) * micro
        for k in ("matmul", "attention", "memory")
    }
    compute["matmul"] += head_s * micro
    compute["memory"] += (loss_s + embed_s) * micro
    tps = cfg.batch * cfg.seq / (cfg.tp * cfg.pp * cfg.cp) / step
    flops_per_token = 6 * shape.matmul_params() + 3 * shape.layers * shape.attention_flops(cfg.seq)
    peak = hw.peak("fp32" if cfg.precision == "fp32" else "bf16")
    return StepTime(
        step_s=step,
        tokens_per_s_per_device=tps,
        mfu=tps * flops_per_token / peak,
        compute_s=sum(compute.values()),
        exposed_comm_s=exposed["fsdp"] + exposed["tp_cp"] + exposed.get("pp_p2p", 0.0),
        host_s=exposed["host"],
        bubble_s=bubble_s,
        optimizer_s=opt_s,
        parts=compute,
        exposed=exposed,
    )
