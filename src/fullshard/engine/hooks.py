"""Module hooks (layer 8): detect when a unit's forward and backward start and end.

What happens at each of those points is decided in ``schedule.py``; this file only finds the
moments and the root.

NOTE [Post-backward events]
A unit's backward is over when (a) every trainable gathered parameter that this backward will
reach has its gradient accumulated, and (b) the gradient with respect to every unit input that
this backward will reach has been computed (only then is no node left that reads the gathered
parameters, frozen ones included). We count both kinds of event: a post-accumulate-grad hook on
each gathered parameter, and a pass-through autograd function on the unit's inputs. On the
first event of a backward we ask the engine which of those nodes it will execute
(``_will_engine_execute_node``): that is how many events to wait for. The last one triggers the
unit's post-backward at the earliest correct moment, also for unused parameters, frozen
parameters, activation checkpointing and ``backward(inputs=...)``.

A frozen parameter has no event of its own: the nodes that read it are counted only through
where their gradients go, (b) or a trainable parameter of the unit upstream. When no input of
the unit needs a gradient, they may go elsewhere: QLoRA's root holds a frozen base head whose
backward (the gradient of the last block's output) runs after the head's adapters have
accumulated, and freeing the root there freed the weight that node still reads (issue 41: a
plain weight's backward raised "storage of size 0", NF4's crashed). So a unit with frozen
parameters and no input event in this backward is ended by NOTE [End of backward] instead, as
FSDP2 ends every unit whose inputs need no gradient. In a chain of units that is the root and
the first units whose inputs are frozen embeddings: the last of the backward, nothing to
overlap.

NOTE [Gradient accumulators kept]
Counting NOTE [Post-backward events] asks the engine about each trainable gathered parameter's
gradient accumulator (``AccumulateGrad``), which a tensor only references weakly: once a
step's graph is gone, so is the node, and finding it again (``get_gradient_edge``: a
``view_as`` under ``enable_grad``) cost 6 us a parameter, every step. So a unit keeps the nodes
it found (as FSDP1 kept its ``AccumulateGrad`` objects): the tensor then gives every later graph
the same node. It finds them again when what they stand for changed: another ``trainable``
list (NOTE [Freezing after fully_shard]), another gathered parameter object, or a dtype or
device of one (``.data =`` of another type is what makes autograd drop a tensor's
accumulator). The probe's node is kept the same way, for the probe object it belongs to.

NOTE [Recomputed graphs that never run backward]
Activation checkpointing runs a unit's forward again inside its backward. Reentrant
checkpointing (``use_reentrant=True``) then runs backward on that recomputed graph, so its
inputs carry the unit's post-backward event again. The non-reentrant kind (torch's default,
and selective checkpointing) only takes the saved tensors out of it: its pack hook detaches
them and the graph is dropped, never run, so an event registered on it would never come (nor
be counted: ``_will_engine_execute_node`` says no). The pre-forward hook skips that registration
(an autograd ``Function`` per unit per step, issue 45) where the innermost saved-tensor hooks
are ``torch.utils.checkpoint``'s ``_recomputation_hook``; any other hooks innermost (a user's
own inside the recomputed function) keep the registration, which is harmless there.

NOTE [Backwards restricted to inputs]
``torch.autograd.grad(out, inputs)`` and ``out.backward(inputs=...)`` run only the part of the
graph that leads to ``inputs``: pipelining's first step computes each stage's input gradients
so (its metadata inference), as does a gradient penalty. Such a backward gives a unit's
parameters no gradient unless it reaches them, and what it reaches is decided by each rank's
own graph, as is whether the unit's backward runs there at all. So a unit whose parameters a
restricted backward does not reach on this rank is not reduced in it (FSDP2 skips a unit
without gradients too; the gradients it accumulated wait for the next reduction), while every
unrestricted ``.backward()`` reduces each unit whose backward ran, zeros included, so that
ranks that used different parameters stay paired (NOTE [Which gradients exist]). Autograd says
whether a node will run (``_will_engine_execute_node``), not whether the backward is
restricted; a leaf of the state's own, ``_probe``, tells: it is an input of each
``_PostBackwardInputs`` node, so it is in the graph whenever one of those runs, and it is
never among ``inputs``, so it would run exactly when nothing is restricted (it never gets a
gradient: no ``.grad``, no work). Where no such node runs, the unit reduces as before.

NOTE [Partial forwards of a list unit]
A unit of several modules (``fully_shard([norm, head])``) is gathered when the first of them
starts forward and finished (freed, as asked) when every one has run, as in FSDP2. Two patterns
break "every one": a root forward that skips a module (the chunked loss runs ``head`` later, per
chunk), and such a module called on its own outside the root's forward. So the root's own
post-forward finishes every unit still waiting for a module (FSDP2's
``_force_complete_incomplete_states``), and a call that starts outside the root's forward waits
for its own module only.

NOTE [Hooks run outside torch.compile]
``torch.compile`` traces a module's forward *with* its hooks. Ours gather and free storage
(``untyped_storage().resize_``, which Inductor cannot lower with dynamic shapes), issue async
collectives (unsupported in a graph), read clocks and branch on host state: traced, they either
fail or cut the graph into many pieces. Every hook entry point is therefore wrapped in
``outside_compile`` (``torch._disable_dynamo``: recursive, lazily imported, the disabled function
cached on first call, as torch's own optimizers do): Dynamo breaks the graph at the hook, runs it
eagerly and compiles the module's computation between hooks, as FSDP2 does with its
``_dynamo_disable``. The backward hooks run from the autograd engine, outside any trace, and are
wrapped all the same so that a traced backward (compiled autograd) cannot reach into them either,
except the parameters' gradient-accumulated events: the unit's pre-backward hook refuses
compiled autograd before any of them can run, and the wrapper cost 0.6 us a call (four a unit).
The parameter swap stays compile-friendly: the gathered ``nn.Parameter`` objects persist across
steps (``ShardedParam.make_unsharded``), so Dynamo's guards on them hold and nothing recompiles.
Compiled autograd is refused (``_refuse_compiled_autograd``): it runs the whole backward as one
node, so ``_will_engine_execute_node`` cannot count NOTE [Post-backward events] and gradients
would be reduced before they exist (measured: the toy's loss off by 1e-2 at the second step).
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from fullshard.engine.fsdp2_interop import ParamGroupView, StateContextView
from fullshard.engine.schedule import ExplicitPrefetch, StepSchedule
from fullshard.engine.unit import CommUnit, UnitState
from fullshard.policies import FullshardError, Phase, SharedParameterError, fsdp2_words

if TYPE_CHECKING:
    from torch.autograd.graph import Node

# NOTE [Hooks run outside torch.compile]; ``torch._compile`` is on Dynamo's skip list, so the
# wrapper itself is never traced either.
outside_compile = torch._disable_dynamo


class _PostBackwardInputs(torch.autograd.Function):
    """Identity on the unit's inputs whose backward is one post-backward event; ``probe`` (NOTE
    [Backwards restricted to inputs]) is an input too, and never gets a gradient."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, state: FSDPState, probe: torch.Tensor, *inputs: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        ctx.state = state
        return tuple([t.view_as(t) for t in inputs])

    @staticmethod
    @outside_compile
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        ctx.state.on_post_backward_event()
        return (None, None, *grads)


class FSDPState:
    """The state of one ``fully_shard`` call: its unit, its hooks, its root.

    A call on a list of modules (one unit) registers its hooks on every module of the list; the
    unit is gathered when the first of them starts forward, and its forward is over (freed,
    backward hooks registered) when every module that started has finished, as in FSDP2.
    """

    def __init__(self, modules: list[nn.Module], unit: CommUnit) -> None:
        self.modules = modules
        self.module = modules[0]
        self.unit = unit
        self.parent: FSDPState | None = None
        self.schedule: StepSchedule | None = None
        self.is_root = False
        # root only: FSDPModule.set_is_last_backward / set_post_optim_event /
        # set_manual_backward_finalization
        self.is_last_backward = True
        self.manual_finalization = False
        self.post_optim_event: torch.Event | None = None
        self._to_run: set[int] = set()  # modules of the list still to finish this forward
        self.tree: list[FSDPState] = []  # root only: every state under it, itself included
        # weak references to this step's input nodes (NOTE [Post-backward events])
        self._input_nodes: list[weakref.ref[Node]] = []
        self._probe: torch.Tensor | None = None  # NOTE [Backwards restricted to inputs]
        # NOTE [Gradient accumulators kept]: (the probe, its accumulator), and (trainable, their
        # gathered parameters, their accumulators, their (dtype, device))
        self._probe_node: tuple[torch.Tensor, Node] | None = None
        self._accumulators: (
            tuple[list[Any], list[Any], list[Node], list[tuple[torch.dtype, torch.device]]] | None
        ) = None
        self._events: tuple[int, list[int]] | None = None  # (graph task, [seen, expected])
        # original_uid(parameter) -> fqn of the original parameters, to catch ties across units
        self.original_uids: dict[int, str] = {}
        # FSDPModule.set_modules_to_{forward,backward}_prefetch (the root's prefetcher holds
        # this object from its first forward on)
        self.explicit_prefetch = ExplicitPrefetch()
        self._handles = []
        for m in modules:
            self._handles += [
                m.register_forward_pre_hook(self.pre_forward, prepend=True, with_kwargs=True),
                m.register_forward_hook(self.post_forward, prepend=False),
            ]
        # Each parameter's event is the count itself: no call in between, and no
        # ``outside_compile`` (issue 45: 0.6 us a call in situ). It would guard nothing: only
        # the autograd engine calls these, and compiled autograd, the one tracer that could
        # reach them, is refused first by the unit's pre-backward hook (NOTE [Hooks run outside
        # torch.compile]). Frozen parameters too: hooked once unfrozen (NOTE [Freezing after
        # fully_shard], unit.py).
        for p in unit.params:
            p.on_grad_accumulated(self.on_post_backward_event)

    # -- root -----------------------------------------------------------------------------
    def lazy_init(self) -> None:
        """On the first forward: this module is the root; set up every unit below it."""
        if self.schedule is not None:
            return
        if self.parent is not None:
            raise FullshardError(
                f"rank {self.unit.mesh.rank}: forward ran through unit '{self.unit.name}' before "
                f"its root (unit '{self.parent.unit.name}' or above) ever ran forward. Call the "
                "root model (the outermost module you passed to fully_shard) instead of a block "
                "on its own; the root sets up prefetch and the end-of-backward step."
            )
        states: list[FSDPState] = []
        for name, sub in self.module.named_modules():
            st: FSDPState | None = getattr(sub, "_fullshard_state", None)
            if st is None or st in states:
                continue  # a list unit's modules share one state
            if st.schedule is not None:
                raise FullshardError(
                    f"unit '{name}' already belongs to another root; each module may be under "
                    "one fully_shard root only."
                )
            st.unit.name = name or "root"
            states.append(st)
        _check_ties_across_units(states)
        if self.unit.optional:
            raise FullshardError(
                f"unit '{self.unit.name}' was declared optional (set_optional()) but is the root: "
                "its forward starts every step. Declare the unit that some ranks skip instead."
            )
        for st in states:
            if st.unit.state is UnitState.GATHERING:
                # unshard(async_op=True) before the first forward: land it before the tags are
                # rewritten and the shards refreshed (the collective may still be reading them)
                st.unit.wait_for_unshard(Phase.IDLE)
            st.unit.refresh_shards()
        _check_materialized(states)
        self.tree = states
        schedule = StepSchedule(self.unit, [st.unit for st in states])
        schedule.is_last_backward = self.is_last_backward
        schedule.manual_finalization = self.manual_finalization
        for st in states:
            st.schedule = schedule
            schedule.prefetcher.explicit[st.unit] = st.explicit_prefetch
        if self.unit.reshard_after_forward is None:
            # FSDP2's default for the root: backward needs its parameters first (the other
            # units' None became True when their parent was sharded: ``fully_shard``)
            self.unit.reshard_after_forward = False
        self.is_root = True

    # -- FSDP2's private state as pipelining reads it (NOTE [What pipelining reads from an
    # FSDP2 module], fsdp2_interop.py) ---------------------------------------------------------
    @property
    def _state_ctx(self) -> StateContextView:
        root = self
        while root.parent is not None:
            root = root.parent
        return StateContextView(list(root.tree))

    @property
    def _fsdp_param_groups(self) -> list[ParamGroupView]:
        return [ParamGroupView(self.unit, self.schedule)] if self.unit.params else []

    def _root_post_backward_final_callback(self) -> None:
        if self.schedule is not None:
            self.schedule.end_backward()

    # -- forward --------------------------------------------------------------------------
    @outside_compile
    def pre_forward(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Gather the unit (the first module of a list unit to run), cast inputs, register the
        post-backward events on them. Also the pre-half of ``register_fsdp_forward_method``."""
        if _graph_task() != -1:  # _recomputing()
            assert self.schedule is not None
            self.schedule.pre_recompute(self.unit)
            # the recomputed forward must see what the first one saw: inputs cast the same way
            args, kwargs = self._cast_inputs(args, kwargs)
            if _discarded_recompute():
                return args, kwargs  # NOTE [Recomputed graphs that never run backward]
            # reentrant checkpointing runs the unit's backward on this recomputed graph
            return self._register_post_backward(args, kwargs)
        with _engine_only():
            self.lazy_init()
            assert self.schedule is not None
            if not self._to_run:  # the first module of the unit this forward
                if self.is_root:
                    self.schedule.begin_forward(self.post_optim_event)
                    self.post_optim_event = None
                # NOTE [Partial forwards of a list unit]
                inside = self.schedule.in_forward
                many = inside and len(self.modules) > 1
                self._to_run = {id(m) for m in self.modules} if many else {id(module)}
                self.schedule.pre_forward(self.unit)
        args, kwargs = self._cast_inputs(args, kwargs)
        if torch.is_grad_enabled():
            args, kwargs = self._register_post_backward(args, kwargs)
        return args, kwargs

    def _cast_inputs(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        mp = self.unit.mp_policy
        if mp.param_dtype is not None and mp.cast_forward_inputs:
            dtype = mp.param_dtype
            if not kwargs and all([isinstance(a, torch.Tensor) for a in args]):
                # positional tensors only: no tree to flatten and rebuild
                args = tuple([a.to(dtype) if a.is_floating_point() else a for a in args])
            else:
                args, kwargs = _cast_floats((args, kwargs), dtype)
        return args, kwargs

    @outside_compile
    def post_forward(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        """Cast the output; when the unit's last running module is done, free it (as asked)."""
        if self.unit.mp_policy.output_dtype is not None:  # recomputed too: the same dtypes
            output = _cast_floats(output, self.unit.mp_policy.output_dtype)
        if _recomputing():
            return output  # the unit's backward is about to use these parameters: keep them
        assert self.schedule is not None
        grad = torch.is_grad_enabled()
        if grad:
            self._register_pre_backward(output)
        self._to_run.discard(id(module))
        if self._to_run:
            return output  # other modules of this unit are still to run
        with _engine_only():
            if self.is_root:
                for st in self.tree:  # NOTE [Partial forwards of a list unit]
                    if st._to_run:
                        st._to_run.clear()
                        st.finish_forward(grad)
            self.finish_forward(grad)
            if self.is_root:
                self.schedule.end_forward(grad)
        return output

    def finish_forward(self, grad: bool) -> None:
        """The unit's forward is over: free it (as asked) and record its place in the order."""
        assert self.schedule is not None
        reshard = bool(self.unit.reshard_after_forward) or not grad
        self.schedule.post_forward(self.unit, reshard, grad)

    def reset_iter_state(self) -> None:
        """``FSDPModule.reset_iter_state`` on the root: forget a forward or backward that an
        exception cut short (every unit resharded, collectives in flight landed and dropped)."""
        for st in self.tree:
            st._to_run.clear()
            st._events = None
            st._input_nodes = []
        if self.schedule is not None:
            self.schedule.reset()

    def _register_post_backward(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        # positional tensors only (the usual block call): no tree to flatten and rebuild
        flat = not kwargs and all([isinstance(a, torch.Tensor) for a in args])
        leaves = args if flat else tensor_leaves((args, kwargs))
        inputs = [t for t in leaves if t.requires_grad]
        if not inputs:
            return args, kwargs
        device = inputs[0].device
        if self._probe is None or self._probe.device != device:
            self._probe = torch.zeros((), device=device, requires_grad=True)
        outs = _PostBackwardInputs.apply(self, self._probe, *inputs)
        node = outs[0].grad_fn
        assert node is not None
        it = iter(outs)  # the same tensors, in the same order, as ``inputs``
        if flat:
            new_args, new_kwargs = tuple([next(it) if a.requires_grad else a for a in args]), kwargs
        else:
            new_args, new_kwargs = map_tensors(
                lambda t: next(it) if t.requires_grad else t, (args, kwargs)
            )
        nodes = self._input_nodes
        if nodes and nodes[0]() is None:  # the last step's graph is gone
            nodes = self._input_nodes = [r for r in nodes if r() is not None]
        nodes.append(weakref.ref(node))
        return new_args, new_kwargs

    def _register_pre_backward(self, output: Any) -> None:
        if isinstance(output, torch.Tensor):  # one tensor: autograd's own hook, once per pass
            if output.requires_grad:
                output.register_hook(self._pre_backward)
            return
        tensors = [t for t in tensor_leaves(output) if t.requires_grad]
        if len(tensors) == 1:
            tensors[0].register_hook(self._pre_backward)
        elif tensors:
            torch.autograd.graph.register_multi_grad_hook(tensors, self._pre_backward, mode="any")

    # -- backward -------------------------------------------------------------------------
    @outside_compile
    def _pre_backward(self, grad: torch.Tensor) -> None:
        assert self.schedule is not None
        _refuse_compiled_autograd(self.unit.name)
        self.schedule.pre_backward(self.unit, accumulates=self._backward_accumulates())

    def on_post_backward_event(self, *_: Any) -> None:
        """Count one NOTE [Post-backward events]; the last one runs the unit's post-backward.
        (Also the gradient-accumulated hook itself: its parameter argument is not needed.)"""
        assert self.schedule is not None
        task = _graph_task()
        events = self._events
        if events is None or events[0] != task:
            events = self._events = (task, [0, self._expected_events()])
        counts = events[1]
        counts[0] += 1
        if counts[0] == counts[1]:
            self.schedule.post_backward(self.unit)

    def _param_nodes(self) -> list[Node]:
        """The gradient accumulators of the unit's trainable gathered parameters:
        ``get_gradient_edge(p).node`` of each, kept (NOTE [Gradient accumulators kept])."""
        trainable = self.unit.trainable
        kept = self._accumulators
        if kept is not None and kept[0] is trainable:
            for p, t, (dtype, device) in zip(trainable, kept[1], kept[3], strict=True):
                if t.dtype != dtype or t.device != device or p.unsharded is not t:
                    break
            else:
                return kept[2]
        tensors: list[Any] = [p.unsharded for p in trainable]
        with torch.enable_grad():
            nodes = [_accumulator(t) for t in tensors]
        meta = [(t.dtype, t.device) for t in tensors]
        self._accumulators = (trainable, tensors, nodes, meta)
        return nodes

    def _live_input_nodes(self) -> list[Node]:
        return [n for ref in self._input_nodes if (n := ref()) is not None]

    def _expected_events(self) -> int:
        """How many events end this backward; -1 (never reached) when only the end of backward
        may end it (NOTE [Post-backward events], frozen parameters)."""
        will = torch._C._will_engine_execute_node
        from_inputs = sum(map(will, self._live_input_nodes()))
        if not from_inputs and len(self.unit.trainable) < len(self.unit.params):
            return -1
        return from_inputs + sum(map(will, self._param_nodes()))

    def _backward_accumulates(self) -> bool:
        """NOTE [Backwards restricted to inputs]: whether this backward can give the unit's
        parameters a gradient on some rank (``False`` only where it is restricted to
        ``inputs`` and reaches none of them here)."""
        will_run = torch._C._will_engine_execute_node
        if self._probe is None or not any(map(will_run, self._live_input_nodes())):
            return True  # the probe is not in this graph: keep the reduction every rank makes
        # whether a pass is restricted is one answer for all of its units: asked once per pass
        task = _graph_task()
        assert self.schedule is not None
        seen = self.schedule.restricted
        if seen is None or seen[0] != task:
            probe = self._probe_node
            if probe is None or probe[0] is not self._probe:
                with torch.enable_grad():  # NOTE [Gradient accumulators kept]
                    probe = self._probe_node = (self._probe, _accumulator(self._probe))
            seen = self.schedule.restricted = (task, not will_run(probe[1]))
        if not seen[1]:
            return True  # not restricted
        return any(map(will_run, self._param_nodes()))


_graph_task = torch._C._current_graph_task_id  # -1 outside a backward pass
_OUTSIDE_FUNCTORCH = contextlib.nullcontext()  # nullcontext keeps no state: one serves all


def _accumulator(leaf: torch.Tensor | None) -> Node:
    """The gradient accumulator of ``leaf`` (call under ``enable_grad``): what
    ``get_gradient_edge(leaf).node`` returns, without building the edge."""
    assert leaf is not None and leaf.requires_grad and leaf.grad_fn is None
    node: Any = leaf.view_as(leaf).grad_fn
    acc = node.next_functions[0][0]
    assert acc is not None
    return acc


# torch < 2.8 has no such query (or one without the argument): every recomputed forward then
# registers its event, as before
_top_saved_tensor_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)


def _discarded_recompute() -> bool:
    """NOTE [Recomputed graphs that never run backward]: whether this recomputed forward is
    a non-reentrant checkpoint's (its saved-tensor hooks are innermost)."""
    if _top_saved_tensor_hooks is None:
        return False
    try:
        top = _top_saved_tensor_hooks(False)
    except TypeError:  # an older signature: keep the registration
        return False
    if top is None:
        return False
    name = getattr(top[0], "__qualname__", "")
    return isinstance(name, str) and name.startswith("_recomputation_hook.")


def _engine_only() -> contextlib.AbstractContextManager[Any]:
    """NOTE [Hooks under functorch transforms]: a forward run inside ``torch.func.jvp`` (or
    vmap, grad) reaches the hooks with functorch's transforms active, and they would treat the
    engine's own writes (the gather's copy-out, the desync tags, storage freed and refilled) as
    mutations of captured tensors, which they refuse. Those writes are not part of the user's
    function, so they run with the transforms off (as FSDP2 does); the user's tensors (input
    and output casts, the autograd hooks on them) stay under the transforms."""
    if torch._C._are_functorch_transforms_active():
        return torch._C._DisableFuncTorch()
    return _OUTSIDE_FUNCTORCH


def map_tensors(fn: Callable[[torch.Tensor], Any], tree: Any) -> Any:
    """``tree`` with ``fn`` applied to each tensor: a pytree (lists, tuples, dicts, NamedTuples,
    what libraries register, such as Hugging Face's ``ModelOutput``) whose leaves may also be
    dataclasses, which pytree does not open (FSDP2 reaches into them too)."""
    leaves, spec = tree_flatten(tree)
    out = []
    for x in leaves:
        if isinstance(x, torch.Tensor):
            x = fn(x)
        elif dataclasses.is_dataclass(x) and not isinstance(x, type):
            fields = [f.name for f in dataclasses.fields(x) if f.init]
            x = dataclasses.replace(x, **{n: map_tensors(fn, getattr(x, n)) for n in fields})
        out.append(x)
    return tree_unflatten(out, spec)


def tensor_leaves(tree: Any) -> list[torch.Tensor]:
    """Every tensor of ``tree``, in ``map_tensors``' order."""
    found: list[torch.Tensor] = []

    def keep(t: torch.Tensor) -> torch.Tensor:
        found.append(t)
        return t

    map_tensors(keep, tree)
    return found


def _cast_floats(tree: Any, dtype: torch.dtype) -> Any:
    """Cast every floating-point tensor in ``tree`` to ``dtype`` (mixed precision)."""
    return map_tensors(lambda t: t.to(dtype) if t.is_floating_point() else t, tree)


def _refuse_compiled_autograd(unit: str) -> None:
    """NOTE [Hooks run outside torch.compile]: a backward traced by compiled autograd would
    reduce wrong gradients silently; say so instead."""
    ca = sys.modules.get("torch._dynamo.compiled_autograd")
    if ca is not None and ca.in_compiled_autograd_region:
        raise FullshardError(
            f"unit '{unit}': backward runs under compiled autograd, which fullshard does not "
            "support (its hooks count autograd's nodes to know when a unit's gradients are "
            "complete). Compile the forward only: torch.compile(model) or block.compile(), with "
            "torch._dynamo.config.compiled_autograd left False."
        )


def _recomputing() -> bool:
    """True when a forward runs inside backward: activation checkpointing recomputing a unit.

    Such a forward must not record prefetch order, prefetch, register backward hooks or free
    anything: it is part of the unit's backward, which is already gathered.
    """
    return _graph_task() != -1


def _check_ties_across_units(states: list[FSDPState]) -> None:
    """A parameter tied between two sibling units would be sharded twice and silently untied
    by the first optimizer step; refuse it on every rank (FSDP2 raises a ValueError too)."""
    owner: dict[int, tuple[FSDPState, str]] = {}
    for st in states:
        for pid, fqn in st.original_uids.items():
            name = f"{st.unit.name}.{fqn}" if st.unit.name != "root" else fqn
            if pid in owner:
                first, first_name = owner[pid]
                raise SharedParameterError(
                    f"rank {st.unit.mesh.rank}: parameter '{name}' of unit '{st.unit.name}' is "
                    f"shared with parameter '{first_name}' already managed by another unit "
                    f"('{first.unit.name}'). Tied parameters must live in one unit: pass the "
                    "modules that share it to one call, e.g. fully_shard([model.tok_embeddings, "
                    "model.output]), or shard their common parent instead."
                )
            owner[pid] = (st, name)


def _check_materialized(states: list[FSDPState]) -> None:
    """Parameters still on the meta device at first forward: name them all, say what to do."""
    per_unit = [
        [
            f"{st.unit.name}.{p.fqn}" if st.unit.name != "root" else p.fqn
            for p in st.unit.params
            if p.sharded.is_meta
        ]
        for st in states
    ]
    meta = [n for names in per_unit for n in names]
    if meta:
        shown = ", ".join(meta[:8]) + (f" (+{len(meta) - 8} more)" if len(meta) > 8 else "")
        first = next(names for names in per_unit if names)  # FSDP2 names one unit's
        raise FullshardError(
            fsdp2_words(
                f"{len(meta)} parameter(s) are still on the meta device at the first forward: "
                f"{shown}. Materialise them after fully_shard and before the first forward, "
                "e.g. model.to_empty(device='cpu') followed by your init (reset_parameters()).",
                "FSDP parameters should be materialized from meta device before training, but "
                f"the following were still on meta device: {first}",
            )
        )
