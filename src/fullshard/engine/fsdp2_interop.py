"""What torch's own code reads from an FSDP2 module and its state, given by fullshard's objects
(layer 8): ``torch.distributed.pipelining`` drives each stage's data parallelism itself.

NOTE [What pipelining reads from an FSDP2 module]
torch's pipelining runs a stage's backward once per microbatch and wants one gradient
reduction per step: it asks the stage's FSDP2 modules not to reduce until the last microbatch
and then reduces by hand. What it uses, read from torch 2.13's ``stage.py`` and ``schedules.py``:

- ``isinstance(submod, FSDPModule)``, with the ``FSDPModule`` its modules imported when they
  were imported (``from torch.distributed.fsdp import FSDPModule, fully_shard``): a module that
  fails it is trained as a plain module, so each microbatch's backward reduces (correct
  weights, one reduction per unit per microbatch);
- before each microbatch's backward, on the stage module: ``set_is_last_backward(False)``,
  ``set_reshard_after_backward(False)``, ``set_requires_gradient_sync(False)``;
- the multi-stage schedules' UNSHARD / RESHARD actions: ``unshard(async_op=True)`` and the
  handle's ``wait()``, ``reshard()``, on every FSDP module of the stage; after its first step's
  metadata inference: ``reshard()`` and ``p.grad = None`` on every FSDP module;
- REDUCE_GRAD, after a stage's last microbatch: the three setters with ``True``, then, with
  ``state = fully_shard.state(submod)``, ``p.post_backward()`` for each ``p`` of each
  ``s._fsdp_param_groups`` for each ``s`` of ``state._state_ctx.all_states``, and
  ``state._root_post_backward_final_callback()``.

The public methods are ``FSDPModule``'s. The three private names are FSDP2's state, a de-facto
interface; ``FSDPState`` (what ``fully_shard.state(m)`` returns) has exactly those, over
fullshard's own objects: ``_state_ctx.all_states`` is the states of the root's tree (its
``named_modules`` order, FSDP2's too); ``_fsdp_param_groups`` holds one ``ParamGroupView`` of
the unit (none for a unit without parameters, as FSDP2), whose ``post_backward()`` is the
unit's post-backward (``StepSchedule.requested_post_backward``: reduce what the microbatches
accumulated, free the unit); the final callback is the root's end of backward (NOTE [End of
backward]), which lands the reductions. So a step reduces each unit once, at REDUCE_GRAD.

Recognised under every import order. With ``install()`` before pipelining's first import,
its modules import fullshard's ``FSDPModule`` and ``fully_shard`` (NOTE [Routing torch's FSDP2
names]). Imported before ``install()``, or with ``from fullshard import fully_shard`` and no
``install()``, they hold torch's, so fullshard meets torch's on torch's terms:

- each class ``fully_shard`` makes (``fsdp_class``) lists torch's ``FSDPModule`` as its last
  base, after the module's own class (``FSDP<Cls>``, ``fullshard.FSDPModule``, ``Cls``, ...,
  ``nn.Module``, torch's ``FSDPModule``): ``isinstance(m, torch's FSDPModule)`` holds, and a
  name is found on fullshard's class or the module's own before torch's. ``__mro__[2]`` is
  still the original class, where torch's code looks for it;
- ``fully_shard`` stores the module's state where torch's ``fully_shard.state(m)`` reads it
  (the composable-API state dict, keyed by torch's function; beside the registry entry of
  ``collect.register_with_torch``), so it returns the same ``FSDPState``.

Why this is sound: the subclass claims exactly what the module is, an FSDP2 module with
FSDP2's public controls, and torch's code reaches it through those controls and the three
names above. What torch's class contributes is only what fullshard's lacks: its private
helpers (``_get_fsdp_state``, ``_set_unshard_async_op``) and FSDP2 ``set_*`` controls fullshard
has not written yet, which look up torch's own state, find none and raise
``AssertionError("No FSDP state found ...")``. torch's other ``isinstance`` checks of
``FSDPModule`` are in its own FSDP2 methods, its ``register_fsdp_forward_method`` and
``share_comm_ctx`` (under the direct import they now raise that error where they silently did
nothing), ``FSDPMemTracker`` (FSDP2's memory tracker, which reads FSDP2's parameter groups) and
Dynamo's pickling of guards (which finds no FSDP2 class for ours either way): none runs in
fullshard's own path.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from torch import nn
from torch.distributed._composable.contract import STATE_KEY
from torch.distributed.fsdp._fully_shard import _fully_shard as _torch_fsdp2

from fullshard.engine.schedule import StepSchedule
from fullshard.engine.unit import CommUnit

if TYPE_CHECKING:
    from collections.abc import Callable

# torch's own classes and function, from the module that defines them (``install()`` routes the
# package's names, never this module's)
TORCH_FSDP_MODULE: type = _torch_fsdp2.FSDPModule
# the key under which torch's ``fully_shard.state(m)`` looks a module's state up
_TORCH_STATE_KEY: Callable[..., Any] = _torch_fsdp2.fully_shard.__wrapped__  # type: ignore[attr-defined]


def register_state_with_torch(module: nn.Module, state: object) -> None:
    """Where torch's ``fully_shard.state(module)`` reads: ``state`` (NOTE [What pipelining
    reads from an FSDP2 module])."""
    module.__dict__.setdefault(STATE_KEY, OrderedDict())[_TORCH_STATE_KEY] = state


class StateContextView:
    """FSDP2's ``FSDPStateContext``, the part pipelining reads: ``all_states``."""

    def __init__(self, all_states: list[Any]) -> None:
        self.all_states = all_states


class ParamGroupView:
    """FSDP2's ``FSDPParamGroup``, the part pipelining calls: ``post_backward()``."""

    def __init__(self, unit: CommUnit, schedule: StepSchedule | None) -> None:
        self.unit = unit
        self.schedule = schedule

    def post_backward(self) -> None:
        """The unit's post-backward, asked for outside autograd (pipelining's REDUCE_GRAD)."""
        if self.schedule is not None:  # None: no forward yet, so nothing to reduce
            self.schedule.requested_post_backward(self.unit)


__all__ = [
    "TORCH_FSDP_MODULE",
    "ParamGroupView",
    "StateContextView",
    "register_state_with_torch",
]
