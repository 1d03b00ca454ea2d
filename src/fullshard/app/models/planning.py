"""The plan of a model this application builds (layer 11): its vocabulary, the shapes one rank
holds under ``--tp``, and ``fullshard.plan``'s plan of it, built on the meta device.

``fullshard plan`` (``fullshard.app.commands.plan``), ``plan --check``
(``fullshard.app.commands.plan_check``) and the scripts that plan published runs all plan a
model this way, so that a plan and the run it predicts split the model alike.
"""

from __future__ import annotations

import torch
from torch import nn

from fullshard.app.models.gpt import (
    build_model,
    lm_loss,
    output_vocab_size,
    resolve_model_spec,
    unit_types_of,
)
from fullshard.plan import Plan, PlanConfig, plan_model

__all__ = ["BYTE_VOCAB", "model_vocab", "plan_builtin", "tp_local_shapes"]

BYTE_VOCAB = 256  # the built-in models' vocabulary: UTF-8 bytes, as fullshard train reads text


def model_vocab(name: str, vocab_size: int | None = None) -> int:
    """The vocabulary a plan of ``name`` uses: ``vocab_size`` when given (``--vocab``), else the
    model's own: a Hugging Face directory's (its ``config.json``), and for the built-in names the
    256 byte tokens ``fullshard train`` gives them."""
    if vocab_size is not None:
        return vocab_size
    kind, spec = resolve_model_spec(name)
    if kind == "hf":
        from fullshard.app.models.hf import config_vocab_size

        return config_vocab_size(spec) or BYTE_VOCAB
    return BYTE_VOCAB


def plan_builtin(
    name: str,
    world_size: int,
    config: PlanConfig | None = None,
    *,
    vocab_size: int | None = None,
    with_recommendation: bool = True,
) -> Plan:
    """:func:`fullshard.plan.plan_model` for a ``fullshard.app.models.gpt`` name (``small``,
    ``gpt2-124m``, ``hf:NAME``, ``hf:DIR`` ...), built on the meta device, with the trainer's
    loss; with ``config.tp`` > 1, split as ``fullshard train --tp`` splits it. ``vocab_size``:
    see :func:`model_vocab` (``None``: the model's own)."""
    model = build_model(name, model_vocab(name, vocab_size), device="meta")
    config = config or PlanConfig(precision="fp32", seq=128)
    local = tp_local_shapes(model, config.tp) if config.tp > 1 else None
    return plan_model(
        model,
        unit_types_of(model),
        world_size,
        config,
        loss_step=lm_loss,
        name=name,
        # the logits the model makes (a checkpoint's vocabulary wins over --vocab)
        shape={"batch": config.batch, "seq": config.seq, "vocab": output_vocab_size(model)},
        with_recommendation=with_recommendation,
        local_shapes=local,
        vocab=output_vocab_size(model),
    )


def tp_local_shapes(model: nn.Module, tp: int) -> dict[str, torch.Size]:
    """Parameter name -> the shape one rank holds under tensor parallel: the blocks as
    ``fullshard train --tp`` splits them (column-wise: rows split; row-wise: columns split, bias
    whole), and the input embedding and output head split by vocabulary as torchtitan's plan
    splits them (row-wise embedding, column-wise head with loss parallel), when ``tp`` divides
    the vocabulary."""
    from fullshard.app.models.tensor_parallel import block_plan, check_divisible

    out: dict[str, torch.Size] = {}
    types = unit_types_of(model)
    for bname, block in model.named_modules():
        if not isinstance(block, types):
            continue
        check_divisible(block, tp)
        for sub, kind in block_plan(block).items():
            linear = block.get_submodule(sub)
            assert isinstance(linear, nn.Linear)
            out_f, in_f = linear.out_features, linear.in_features
            w = (out_f // tp, in_f) if kind == "col" else (out_f, in_f // tp)
            out[f"{bname}.{sub}.weight"] = torch.Size(w)
            if linear.bias is not None and kind == "col":
                out[f"{bname}.{sub}.bias"] = torch.Size([out_f // tp])
    by_id = {id(p): n for n, p in model.named_parameters()}
    for get in ("get_input_embeddings", "get_output_embeddings"):
        module = getattr(model, get, lambda: None)()
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.Tensor) and id(weight) in by_id and weight.shape[0] % tp == 0:
            out[by_id[id(weight)]] = torch.Size([weight.shape[0] // tp, *weight.shape[1:]])
    return out
