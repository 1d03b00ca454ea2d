"""Frameworks that call ``fully_shard`` for their users, run under torch's FSDP2 and again inside
``with fullshard.install():`` in the same ranks (issue 33; NOTE [Routing torch's FSDP2 names]).

A tiny Llama built locally (no download), 2 gloo ranks, a few AdamW steps:
- accelerate's FSDP2 (``FullyShardedDataParallelPlugin(fsdp_version=2)``), in fp32 and with
  ``cpu_ram_efficient_loading`` (rank 0 holds the weights; the other ranks start from other
  values and receive rank 0's through ``load_state_dict(..., assign=True)`` into meta shards);
- transformers' ``Trainer`` with ``fsdp="full_shard"`` and ``fsdp_config={"fsdp_version": 2}``;
- then the README's recipes, ``examples/*.py`` as written (they call ``fullshard.install()``).
Each returns the losses and the full final weights, which the test compares bit for bit.

accelerate enables FSDP only on accelerators: on a CPU-only machine its state says MULTI_CPU.
``cpu_fsdp`` patches that, in these ranks only, after the state is built: the distributed type
becomes FSDP with the plugin given, which is what accelerate sets on a GPU.
"""

from __future__ import annotations

import contextlib
import os
import runpy
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

STEPS = 3


def _tiny_llama(seed: int) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def _tokens(rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, 64, (2, 12), generator=g)


@contextlib.contextmanager
def cpu_fsdp() -> Iterator[None]:
    """accelerate's FSDP on a CPU-only machine (see the module docstring): in the test only."""
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType

    original = AcceleratorState.__init__

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        plugin = kwargs.get("fsdp_plugin")
        if plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = plugin
            if self._mixed_precision != "no":
                plugin.set_mixed_precision(self._mixed_precision)

    AcceleratorState.__init__ = init  # type: ignore[method-assign]
    os.environ["ACCELERATE_USE_CPU"] = "true"  # what `accelerate launch --cpu` sets
    try:
        yield
    finally:
        AcceleratorState.__init__ = original  # type: ignore[method-assign]
        os.environ.pop("ACCELERATE_USE_CPU", None)


def _reset_accelerate() -> None:
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    os.environ.pop("ACCELERATE_USE_FSDP", None)
    os.environ.pop("FSDP_CPU_RAM_EFFICIENT_LOADING", None)


def _full_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
        for k, v in model.state_dict().items()
    }


def accelerate_run(rank: int, cpu_ram_efficient_loading: bool) -> dict:
    """accelerate's FSDP2: prepare, STEPS AdamW steps; losses and full weights."""
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin

    _reset_accelerate()
    # cpu_ram_efficient_loading: only rank 0's weights count (the others are overwritten)
    model = _tiny_llama(0 if rank == 0 or not cpu_ram_efficient_loading else 7)
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2,
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
        cpu_ram_efficient_loading=cpu_ram_efficient_loading,
        reshard_after_forward=True,
    )
    with cpu_fsdp():
        acc = Accelerator(fsdp_plugin=plugin, cpu=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = acc.prepare(model, opt)
    from torch.distributed.fsdp import FSDPModule

    losses = []
    for step in range(STEPS):
        x = _tokens(rank, step)
        loss = model(input_ids=x, labels=x).loss
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach().clone())
    out = {
        "losses": losses,
        "weights": _full_weights(model),
        "fsdp_class": type(model).__mro__[1].__module__,
        "is_fsdp": isinstance(model, FSDPModule),
    }
    _reset_accelerate()
    return out


def trainer_run(rank: int) -> dict:
    """transformers' Trainer with FSDP2 (full_shard): STEPS steps; losses and full weights."""
    from transformers import Trainer, TrainingArguments

    _reset_accelerate()
    model = _tiny_llama(0)
    rows = [_tokens(r, s)[0] for s in range(STEPS) for r in (0, 1)]
    data = [{"input_ids": t, "labels": t} for t in rows]
    losses: list[float] = []
    with tempfile.TemporaryDirectory() as out_dir:
        args = TrainingArguments(
            output_dir=out_dir,
            per_device_train_batch_size=1,
            max_steps=STEPS,
            learning_rate=1e-2,
            logging_steps=1,
            save_strategy="no",
            report_to=[],
            use_cpu=True,
            fsdp="full_shard",
            fsdp_config={
                "fsdp_version": 2,
                "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
                "reshard_after_forward": True,
            },
            seed=0,
            dataloader_drop_last=True,
        )
        with cpu_fsdp():
            trainer = Trainer(model=model, args=args, train_dataset=data)
            trainer.train()
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        weights = _full_weights(trainer.model)
    from torch.distributed.fsdp import FSDPModule

    out = {
        "losses": losses,
        "weights": weights,
        "fsdp_class": type(trainer.model).__mro__[1].__module__,
        "is_fsdp": isinstance(trainer.model, FSDPModule),
    }
    _reset_accelerate()
    return out


def frameworks_program(rank: int, world: int) -> dict[str, dict[str, Any]]:
    """Every framework run under torch's FSDP2, then inside ``fullshard.install()``."""
    import fullshard

    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
    )
    out: dict[str, dict[str, Any]] = {}
    for impl in ("torch", "fullshard"):
        ctx = fullshard.install() if impl == "fullshard" else contextlib.nullcontext()
        with ctx:
            out[impl] = {
                "accelerate": accelerate_run(rank, False),
                "accelerate cpu_ram_efficient_loading": accelerate_run(rank, True),
                "trainer": trainer_run(rank),
            }
    out["examples"] = {name: run_example(name) for name in EXAMPLES}  # last: they install
    return out


EXAMPLES = ("accelerate_fsdp2.py", "trainer_fsdp2.py")


def run_example(name: str) -> dict[str, Any]:
    """The README's recipe, ``examples/<name>`` as written (its ``main()``), FSDP on CPU."""
    _reset_accelerate()
    path = Path(__file__).resolve().parent.parent / "examples" / name
    with cpu_fsdp():
        scope = runpy.run_path(str(path), run_name="example")
        losses = scope["main"]()
    _reset_accelerate()
    return {"losses": [float(x) for x in losses]}
