"""The planner's model mode (layer 10): unit sizes and activations of a real model, and the
recommendation.

The model may be built on the meta device (any size, no memory). Its parameters are split into
units by the same :class:`~fullshard.engine.sharding.ShardingPlan` that ``parallelize`` applies
(NOTE [Unit membership]), and each unit laid out by :class:`fullshard.shard.layout.FlatLayout` so the per-rank
shard includes its padding.

Activations are measured, not guessed: one forward and the caller's loss step run under ``FakeTensorMode`` (tensors
with shapes and a CPU device but no storage, so the same kernels as a real CPU run are chosen)
and a ``saved_tensors_hooks`` pack hook records every distinct storage autograd saves, attributed
to the unit whose forward is running. Parameters are excluded (they are the gathered window).
When that fails (a model whose forward cannot run on fake tensors), the Korthikanti estimate from
the model's shape is used instead and the plan says so in ``notes``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn

from fullshard.engine.sharding import UnitPlan, plan_sharding
from fullshard.engine.unit import unit_layout
from fullshard.plan.accounting import Plan, build_plan, korthikanti_activation_bytes
from fullshard.plan.activations import UnitActivations, analytic_activations, with_loss_peaks
from fullshard.plan.config import DTYPE_BYTES, PlanConfig, UnitCost
from fullshard.plan.pipeline import inflight, stage_units
from fullshard.plan.recommendation import recommend
from fullshard.plan.steptime import step_time
from fullshard.plan.transformer import TransformerShape, shape_of
from fullshard.shard.layout import FlatLayout

__all__ = [
    "LossStep",
    "measure_activations",
    "model_units",
    "plan_model",
]

# One training step's loss for a batch of token ids: ``loss_step(model, tokens)``.
LossStep = Callable[[nn.Module, torch.Tensor], torch.Tensor]
_TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _units(model: nn.Module, unit_types: Sequence[type[nn.Module]]) -> tuple[UnitPlan, ...]:
    # membership only: the strategy and world size do not change which unit owns what
    return plan_sharding(model, "full_shard", unit_types, world_size=1).units


def model_units(
    model: nn.Module,
    unit_types: Sequence[type[nn.Module]],
    shard_group: int,
    activations: dict[int, UnitActivations] | None = None,
    local_shapes: dict[str, torch.Size] | None = None,
    shard_dims: dict[str, int] | None = None,
) -> list[UnitCost]:
    """The model's units with per-rank shard sizes (padding included) for ``shard_group`` ranks.

    ``activations`` maps a unit index (0 = the root) to its :class:`UnitActivations`
    (:func:`measure_activations` or :func:`~fullshard.plan.activations.analytic_activations`).
    ``local_shapes``: parameter name -> the shape one rank holds under tensor parallel (the
    others are whole). ``shard_dims``: parameter name -> the dim ``shard_placement_fn`` shards
    it on (others: 0); a Shard(k) parameter's shard is exactly ``numel / shard_group``, with no
    padding. A unit's ``fp8_numel`` counts the weights of its ``nn.Linear`` layers (what
    float8 training converts and gathers as float8; never the root's, as torchtitan leaves the
    output head in 16 bits).
    """
    out = []
    linear = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    for i, unit in enumerate(_units(model, unit_types)):
        params = [model.get_parameter(n) for n in unit.params]
        local = local_shapes or {}
        shapes = [
            local.get(n, p.shape) if p.dim() else torch.Size([1])
            for n, p in zip(unit.params, params, strict=True)
        ]
        trainable = [s for s, p in zip(shapes, params, strict=True) if p.requires_grad]
        # the engine's own layout of a unit (whatever its shard carries besides the rows)
        dims = [(shard_dims or {}).get(n, 0) for n in unit.params]
        grads = [d for d, p in zip(dims, params, strict=True) if p.requires_grad]
        layout = unit_layout(shapes, shard_group, dims)
        grad_layout = FlatLayout(trainable, shard_group, dims=grads)
        acts = (activations or {}).get(i, UnitActivations(0.0))
        fp8 = (
            0
            if unit.is_root
            else sum(s.numel() for n, s in zip(unit.params, shapes, strict=True) if n in linear)
        )
        out.append(
            UnitCost(
                name=unit.name or "root",
                numel=float(sum(s.numel() for s in shapes)),
                trainable_numel=float(sum(s.numel() for s in trainable)),
                shard_numel=float(layout.shard_numel),
                # + one presence column per trainable parameter (NOTE [Which gradients exist])
                grad_shard_numel=float(grad_layout.shard_numel + len(trainable)),
                act_bytes=acts.saved,
                input_bytes=acts.input,
                is_root=unit.is_root,
                tail_bytes=acts.tail,
                loss_bytes=acts.loss,
                selective_bytes=acts.selective,
                loss_forward_extra=acts.loss_forward_extra,
                loss_backward_extra=acts.loss_backward_extra,
                fp8_numel=float(fp8),
            )
        )
    # (a root without parameters of its own stays as an empty unit: its activations count)
    return out


@contextlib.contextmanager
def _fake_mode() -> Iterator[None]:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        yield


class _WithLoss(nn.Module):
    # the model and its loss step as one module, so functional_call swaps the parameters of both
    def __init__(self, model: nn.Module, loss_step: LossStep) -> None:
        super().__init__()
        self.m = model
        self.loss_step = loss_step

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.loss_step(self.m, tokens)


def measure_activations(
    model: nn.Module,
    unit_types: Sequence[type[nn.Module]],
    loss_step: LossStep,
    batch: int,
    seq: int,
    dtype: torch.dtype,
) -> dict[int, tuple[float, float, float, float]]:
    """Bytes autograd saves per unit for one forward + ``loss_step``, on fake tensors.

    ``loss_step(model, tokens)`` gets ``seq + 1`` token ids per sequence (a language model's
    step predicts ``seq`` of them). Returns ``{unit index: (saved bytes, input bytes, tail
    bytes, loss bytes)}``; index 0 is the root, whose tail is what it saves after another
    unit's forward started (a language model's head and its loss), and whose loss bytes are
    what the loss saves after the model's forward returned (0 for the other units). The model's own parameters are not touched: ``torch.func.functional_call``
    swaps in fake ones of ``dtype``.
    """
    from torch.func import functional_call

    units = _units(model, unit_types)
    owner_of = {id(model.get_submodule(u.name)): i for i, u in enumerate(units) if i > 0}
    saved: dict[int, tuple[object, float, int, int]] = {}  # storage, bytes, unit, part
    inputs = dict.fromkeys(range(len(units)), 0.0)
    stack = [0]
    # part of the step: 0 before any other unit started, 1 after (the root's tail), 2 after the
    # model's forward returned (the loss)
    part = [0]

    def pre(mod: nn.Module, args: tuple[object, ...]) -> None:
        part[0] = max(part[0], 1)
        stack.append(owner_of[id(mod)])
        inputs[stack[-1]] += sum(
            a.numel() * a.element_size() for a in args if isinstance(a, torch.Tensor)
        )

    def post(mod: nn.Module, args: object, out: object) -> None:
        stack.pop()

    def model_done(mod: nn.Module, args: object, out: object) -> None:
        part[0] = 2

    handles = [m.register_forward_pre_hook(pre) for m in model.modules() if id(m) in owner_of]
    handles.append(model.register_forward_hook(model_done))
    handles += [m.register_forward_hook(post) for m in model.modules() if id(m) in owner_of]
    try:
        with _fake_mode():
            fakes = {
                "m." + n: torch.empty(
                    p.shape,
                    dtype=dtype if p.is_floating_point() else p.dtype,
                    device="cpu",
                    requires_grad=p.requires_grad,
                )
                for n, p in model.named_parameters(remove_duplicate=False)
            }
            fakes.update(
                ("m." + n, torch.empty(b.shape, dtype=b.dtype, device="cpu"))
                for n, b in model.named_buffers()
            )
            skip = {t.untyped_storage()._cdata for t in fakes.values()}

            def pack(t: torch.Tensor) -> torch.Tensor:
                storage = t.untyped_storage()
                if storage._cdata not in skip and storage._cdata not in saved:
                    # keep the storage object alive so its id is not reused while we count
                    owner = stack[-1]
                    saved[storage._cdata] = (storage, float(storage.nbytes()), owner, part[0])
                return t

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                tokens = torch.zeros(batch, seq + 1, dtype=torch.long, device="cpu")
                loss = functional_call(_WithLoss(model, loss_step), fakes, (tokens,))
                del loss
    finally:
        for h in handles:
            h.remove()
    out = {i: [0.0, inputs[i], 0.0, 0.0] for i in range(len(units))}
    for _, nbytes, unit, when in saved.values():
        out[unit][0] += nbytes
        out[unit][2] += nbytes if unit == 0 and when >= 1 else 0.0
        out[unit][3] += nbytes if when == 2 else 0.0
    return {i: (a, b, c, d) for i, (a, b, c, d) in out.items()}


def _shape_estimate(model: nn.Module, batch: int, seq: int, cb: int) -> tuple[float, int]:
    """Fallback: Korthikanti per layer from the model's hidden size and heads (0 if unknown)."""
    cfg = getattr(model, "cfg", None) or getattr(model, "config", None)
    hidden = getattr(cfg, "d_model", None) or getattr(cfg, "hidden_size", None)
    heads = getattr(cfg, "n_head", None) or getattr(cfg, "num_attention_heads", None)
    if not hidden or not heads:
        return 0.0, 0
    return korthikanti_activation_bytes(batch, seq, hidden, heads, act_bytes=cb), int(hidden)


def _activations(
    model: nn.Module,
    unit_types: Sequence[type[nn.Module]],
    loss_step: LossStep,
    config: PlanConfig,
    shape: TransformerShape | None,
    vocab: int | None,
    notes: list[str],
) -> dict[int, UnitActivations]:
    """Each unit's activations, measured where the fake forward runs the planned configuration
    and analytic elsewhere (``fullshard.plan.activations``); selective always analytic."""
    n_units = len(_units(model, unit_types))
    analytic = analytic_activations(shape, n_units, config) if shape else None
    why = "tensor, pipeline or context parallel splits them"
    if config.tp == config.cp == config.pp == 1:
        dtype = _TORCH_DTYPES[config.precision]
        try:
            raw = measure_activations(model, unit_types, loss_step, config.batch, config.seq, dtype)
        except Exception as exc:  # any model whose forward fake tensors cannot run
            why = f"the fake-tensor forward failed: {exc}"
        else:
            notes.append(
                "activations: saved tensors of one forward + loss, measured on fake "
                "tensors (selective checkpointing: per token from the model's shape)"
            )
            acts = {
                i: UnitActivations(
                    a, inp, tail, loss, selective=analytic[i].selective if analytic else 0.0
                )
                for i, (a, inp, tail, loss) in raw.items()
            }
            acts[0] = with_loss_peaks(acts[0], config, vocab)
            return acts
    if analytic is not None:
        notes.append(f"activations: per token from the model's shape ({why})")
        return analytic
    cb = DTYPE_BYTES[config.precision]
    per_layer, hidden = _shape_estimate(model, config.batch, config.seq, cb)
    # checkpointing keeps each block's input: batch * seq * hidden in the compute dtype
    inp = float(config.batch * config.seq * hidden * cb)
    notes.append(f"activations: Korthikanti estimate ({why})")
    return {i: UnitActivations(per_layer, inp) for i in range(1, n_units)}


def plan_model(
    model: nn.Module,
    unit_types: Sequence[type[nn.Module]],
    world_size: int,
    config: PlanConfig | None = None,
    *,
    loss_step: LossStep,
    name: str | None = None,
    shape: dict[str, int] | None = None,
    with_recommendation: bool = True,
    local_shapes: dict[str, torch.Size] | None = None,
    vocab: int | None = None,
) -> Plan:
    """Predict per-device memory (by category and phase), communication and, given
    ``config.hardware``, the step time of a real model.

    ``model``: any module (any device, the meta device included; a real one is not modified),
    whose modules of ``unit_types`` become units. ``loss_step(model, tokens)`` is one step's
    loss, run once on fake tensors to measure activations. ``config`` gives strategy,
    precision, optimizer, per-device ``batch`` and ``seq``, checkpointing, offload and the
    parallel degrees (:class:`PlanConfig`; ``config.tp`` > 1 with ``local_shapes``, the TP-local
    parameter shapes). ``vocab``: the logits per token (the loss's size; default the model's
    own). ``name`` and ``shape`` only label the report. The result's
    ``phases[phase].categories()`` use the memory tracker's vocabulary
    (``fullshard.policies.MEMORY_CATEGORIES``).
    """
    config = config or PlanConfig(precision="fp32", seq=128)
    if world_size < 1:
        raise ValueError(f"world size must be at least 1, got {world_size}")
    notes: list[str] = []
    tshape = shape_of(model, vocab)
    acts = _activations(
        model,
        unit_types,
        loss_step,
        config,
        tshape,
        vocab or (tshape.vocab if tshape else None),
        notes,
    )
    if config.tp > 1:
        notes.append(
            f"tensor parallel over {config.tp} devices: split matrices count 1/{config.tp} per "
            "device, with sequence parallel (norms and block inputs split by sequence) and loss "
            "parallel (logits split by vocabulary)"
        )
    if tshape is None and config.hardware is not None:
        notes.append("no step time: the model is not a transformer the planner can count")
    label = name or type(model).__name__
    shape = shape or {"batch": config.batch, "seq": config.seq}

    def evaluate(cfg: PlanConfig) -> Plan:
        group = cfg.shard_group(cfg.dp_world(world_size))
        units = model_units(model, unit_types, group, acts, local_shapes)
        if cfg.pp > 1:
            return _pipeline_plan(units, world_size, cfg, tshape, label, shape, notes)
        plan = build_plan(
            units,
            world_size,
            cfg,
            mode="model",
            model=label,
            shape=shape,
            notes=notes,
            cp_bytes=_cp_bytes(cfg, tshape),
        )
        if cfg.hardware is not None and tshape is not None:
            plan.step = step_time(tshape, units, world_size, cfg, cfg.hardware)
        return plan

    plan = evaluate(config)
    if with_recommendation:
        plan.recommendation = recommend(evaluate, config, world_size)
    return plan


def _cp_bytes(cfg: PlanConfig, shape: TransformerShape | None) -> float:
    """One layer's k and v gathered by context parallel (whole sequence, every head)."""
    if cfg.cp == 1 or shape is None:
        return 0.0
    tokens = cfg.batch * cfg.seq / ((cfg.microbatches or cfg.pp) if cfg.pp > 1 else 1)
    return 2 * tokens * shape.q_dim * DTYPE_BYTES[cfg.precision] / cfg.tp


def _pipeline_plan(
    units: list[UnitCost],
    world_size: int,
    cfg: PlanConfig,
    shape: TransformerShape | None,
    label: str,
    shape_label: dict[str, int],
    notes: list[str],
) -> Plan:
    """The worst pipeline rank's memory and the slowest one's step (NOTE [Pipeline stages]):
    the first rank (most microbatches in flight) and the last (the head and the loss)."""
    plans = []
    for rank in sorted({0, cfg.pp - 1}):
        stage = stage_units(units, cfg, rank, shape)
        plan = build_plan(
            stage,
            world_size,
            cfg,
            mode="model",
            model=label,
            shape=shape_label,
            notes=[*notes, f"pipeline rank {rank} of {cfg.pp}"],
            inflight=inflight(cfg, rank),
            cp_bytes=_cp_bytes(cfg, shape),
        )
        if cfg.hardware is not None and shape is not None:
            plan.step = step_time(
                shape, stage, world_size, cfg, cfg.hardware, head=rank == cfg.pp - 1
            )
        plans.append(plan)
    worst = max(plans, key=lambda p: p.peak_bytes)
    timed = [p.step for p in plans if p.step is not None]
    if timed:
        worst.step = max(timed, key=lambda st: st.step_s)
    return worst
