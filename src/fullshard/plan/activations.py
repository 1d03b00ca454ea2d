"""What each unit keeps for backward, by policy, and the loss's transient (layer 10).

Two sources, one result per unit (:class:`UnitActivations`):
- *measured*: one forward and the loss on fake tensors (``fullshard.plan.model``'s
  ``measure_activations``), exact for the implementation being planned, used when the fake
  forward runs the configuration as planned (no tensor, context or pipeline parallel);
- *analytic*: per token from the model's :class:`~fullshard.plan.transformer.TransformerShape`
  (NOTE [Saved bytes per policy]), times the tokens a device holds: the only source for
  sequence-parallel splits, context-parallel sequence shards and pipeline microbatches, and for
  the selective policy (a per-op decision the fake forward does not make).
The loss's peaks (NOTE [The loss's transient]) are added to the root by either source.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from fullshard.plan.config import DTYPE_BYTES, PlanConfig
from fullshard.plan.transformer import TransformerShape

__all__ = ["UnitActivations", "analytic_activations", "device_tokens", "with_loss_peaks"]

TOKEN_ID_BYTES = 8  # int64 token ids, kept by the embedding's backward


@dataclass(frozen=True)
class UnitActivations:
    """One unit's activation bytes (see :class:`fullshard.plan.accounting.UnitCost`, whose
    fields of the same names these fill): ``saved`` without checkpointing, ``input`` under full
    checkpointing, ``selective`` under selective checkpointing (0: unknown)."""

    saved: float
    input: float = 0.0
    tail: float = 0.0
    loss: float = 0.0
    selective: float = 0.0
    loss_forward_extra: float = 0.0
    loss_backward_extra: float = 0.0


def device_tokens(config: PlanConfig) -> float:
    """Tokens of one microbatch on one device: the batch's, split by context parallel and into
    the pipeline's microbatches."""
    micro = (config.microbatches or config.pp) if config.pp > 1 else 1
    return config.batch * config.seq / config.cp / micro


def with_loss_peaks(
    root: UnitActivations, config: PlanConfig, vocab: int | None
) -> UnitActivations:
    """``root`` with the loss's forward and backward peaks beyond what it keeps, for
    ``vocab`` logits per token (split by vocabulary under tensor parallel: loss parallel)."""
    if not vocab:
        return root
    act = DTYPE_BYTES[config.precision]
    loss = TransformerShape.loss_bytes(act, parallel=config.tp > 1, compiled=config.compile_loss)
    logits = device_tokens(config) * vocab / config.tp
    return replace(
        root,
        loss_forward_extra=logits * (loss.forward_peak - loss.saved),
        loss_backward_extra=logits * (loss.backward_peak - loss.saved),
    )


def analytic_activations(
    shape: TransformerShape, n_units: int, config: PlanConfig
) -> dict[int, UnitActivations]:
    """Every unit's activations from ``shape`` (unit 0 the root, then ``n_units - 1`` blocks)
    for one microbatch on one device."""
    act, tp = DTYPE_BYTES[config.precision], config.tp
    tokens = device_tokens(config)

    def per_token(policy: str) -> float:
        return tokens * shape.saved_bytes(policy, act, tp, compiled=config.compile_blocks)

    block = UnitActivations(
        saved=per_token("none"), input=per_token("full"), selective=per_token("selective")
    )
    h = shape.hidden
    # the root: the final norm's saved tensors, the head's (whole-sequence) input, and the
    # loss's log-probabilities; the embedding keeps only the token ids
    norm = (4 * h + act * h) / tp if shape.gated else (act * h + 8) / tp
    loss_saved = (
        tokens
        * shape.vocab
        / tp
        * TransformerShape.loss_bytes(act, compiled=config.compile_loss).saved
    )
    tail = tokens * (norm + act * h) + loss_saved
    root = UnitActivations(saved=tail + tokens * TOKEN_ID_BYTES, tail=tail, loss=loss_saved)
    out = {0: with_loss_peaks(root, config, shape.vocab)}
    out.update((i, block) for i in range(1, n_units))
    return out
