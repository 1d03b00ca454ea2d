"""The general form of a whole-matrix optimizer over sharded parameters, and the rule that says
which parameters are whole matrices.

NOTE [Whole-matrix optimizers]
Muon, Shampoo, SOAP and their kin update each hidden 2-D weight as a whole matrix; embeddings,
the output head, norms and biases are better served by AdamW (Muon's authors' advice). A
:class:`MatrixOptimizer` is one ``torch.optim.Optimizer`` with both kinds of param groups: a
group whose flag (:attr:`MatrixOptimizer.flag`, ``use_muon`` for Muon as in its authors'
``MuonWithAuxAdam``) is False steps as ``torch.optim.AdamW`` (torch's own, over the local
shards: NOTE [Local optimizer steps]), its ``lr`` and ``weight_decay`` the optimizer's unless
it sets them, AdamW's defaults for the rest (``betas``, ``eps``, ...); the other
groups are whole matrices, whose update a subclass defines in three parts:

- :meth:`~MatrixOptimizer.rows`: elementwise, on this rank's piece of the gradient and of the
  state (Muon: the momentum and the Nesterov blend), giving its piece of the matrix input;
- :meth:`~MatrixOptimizer.whole`: on the matrix's owner, the function of the whole input
  (Muon: torch's Newton–Schulz), NOTE [Matrices on owners];
- :meth:`~MatrixOptimizer.apply`: elementwise again, the result's piece into the parameter's.

Why three parts, and not "any torch optimizer run whole on the owner": the state of an
optimizer whose state is elementwise (Muon's momentum) then stays where every other state of
fullshard lives, in rows beside the parameter's (DTensors of its layout, ``1/N`` per rank
exactly, saved and resharded by DCP as AdamW's are), only the function's input and output
travel (bf16 for torch's Newton–Schulz: 2 + 2 bytes per element, against the 4 + 4 + 4 of a
gradient and a parameter to the owner and the new parameter back), and a parameter is never
copied. A subclass whose whole-matrix step keeps state of its own (Shampoo's preconditioners)
would keep it on the owner, keyed by the matrix; that needs a reshardable form in state dicts,
which this class does not provide yet.

Parameters that are not DTensors (not sharded) run the whole function on every rank, as
torch's optimizer does; so does everything outside a process group.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from fullshard.engine.param import as_dtensor, local_of
from fullshard.optim.exchange import Exchange, exchange_group

__all__ = ["MatrixOptimizer", "hidden_matrix", "matrix_groups"]

# a name's parts that mark the output head (a 2-D weight Muon's authors leave to AdamW)
HEAD_NAMES = ("head", "lm_head", "output", "classifier", "score")
# plans kept per optimizer: one per set of matrices with gradients (usually one)
MAX_PLANS = 8


def hidden_matrix(name: str, param: torch.Tensor, module: nn.Module) -> bool:
    """Muon's authors' rule: a 2-D weight of a hidden layer. Not an embedding's table
    (``nn.Embedding``), not the output head (a module named like :data:`HEAD_NAMES`), and
    nothing of another rank (norms, biases)."""
    if param.ndim != 2 or isinstance(module, nn.Embedding):
        return False
    owner = name.rsplit(".", 1)[0] if "." in name else ""
    return owner.rsplit(".", 1)[-1] not in HEAD_NAMES


def matrix_groups(
    model: nn.Module,
    *,
    rule: Callable[[str, torch.Tensor, nn.Module], bool] = hidden_matrix,
    flag: str = "use_muon",
) -> list[dict[str, Any]]:
    """The model's trainable parameters as two param groups: ``rule``'s matrices
    (``{flag: True}``) and the rest (``{flag: False}``: AdamW), each left out when empty. Set
    each group's hyperparameters on the dicts before building the optimizer."""
    modules = dict(model.named_modules())
    matrices: list[torch.Tensor] = []
    others: list[torch.Tensor] = []
    seen: set[int] = set()
    for name, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        module = modules[name.rsplit(".", 1)[0]] if "." in name else model
        (matrices if rule(name, p, module) else others).append(p)
    groups = [{"params": matrices, flag: True}, {"params": others, flag: False}]
    return [g for g in groups if g["params"]]


def _adamw_defaults() -> dict[str, Any]:
    """The keys of a ``torch.optim.AdamW`` param group besides its parameters, ``lr`` and
    ``weight_decay`` (the optimizer's own, for every group), at AdamW's defaults."""
    probe = torch.optim.AdamW([torch.zeros(1, requires_grad=True)])
    skip = ("params", "lr", "weight_decay")
    return {k: v for k, v in probe.param_groups[0].items() if k not in skip}


class MatrixOptimizer(torch.optim.Optimizer):
    """NOTE [Whole-matrix optimizers]: whole-matrix groups split over ranks (NOTE [Matrices
    on owners]), AdamW groups elementwise. A subclass defines :meth:`rows`, :meth:`whole`,
    :meth:`apply` and :meth:`cost`."""

    flag = "matrix"  # a param group's key: True (the default) whole matrices, False AdamW

    def __init__(self, params: Any, defaults: dict[str, Any]) -> None:
        self._adamw_keys = _adamw_defaults()
        self._adamw: torch.optim.AdamW | None = None
        self._plans: dict[tuple[Any, ...], Exchange] = {}
        self._groups: dict[int, tuple[Any, Any]] = {}  # id(mesh) -> (mesh, exchange_group)
        super().__init__(params, defaults)

    # -- the parts a subclass defines ---------------------------------------------------------

    def rows(self, group: dict[str, Any], p: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        """This rank's piece of the matrix input of parameter ``p`` (as the optimizer holds it:
        the key of its state), from its piece of the gradient (``grad``, a plain tensor) and
        of the state (:meth:`state_of`), elementwise."""
        raise NotImplementedError

    def whole(self, group: dict[str, Any], matrix: torch.Tensor) -> torch.Tensor:
        """The whole-matrix function, on the owner (``matrix`` in :meth:`wire_dtype`)."""
        raise NotImplementedError

    def apply(
        self, group: dict[str, Any], p: torch.Tensor, shape: torch.Size, result: torch.Tensor
    ) -> None:
        """Update this rank's piece ``p`` (a plain tensor) of a parameter of global ``shape``
        with its piece ``result`` of the whole function's result, elementwise."""
        raise NotImplementedError

    def cost(self, group: dict[str, Any], shape: Sequence[int]) -> float:
        """The whole function's work on a ``shape`` matrix (balances the owners)."""
        return float(shape[0] * shape[1])

    def wire_dtype(self, group: dict[str, Any], dtype: torch.dtype) -> torch.dtype:
        """The dtype a ``dtype`` input travels in: its own, unless :meth:`whole` casts it
        first to a narrower one (then casting the pieces first gives the same bits)."""
        return dtype

    def state_of(self, p: torch.Tensor, key: str, like: torch.Tensor) -> torch.Tensor:
        """This rank's piece of state ``key`` of ``p`` (zeros like ``like`` the first time),
        kept as a DTensor of ``p``'s layout when ``p`` is one (NOTE [Local optimizer steps])."""
        state = self.state[p]
        if key not in state:
            zeros = torch.zeros_like(like, memory_format=torch.preserve_format)
            state[key] = as_dtensor(zeros, p) if isinstance(p, DTensor) else zeros
        return local_of(state[key])  # type: ignore[no-any-return]

    # -- groups ---------------------------------------------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if param_group.get(self.flag, True) is False:
            for k, v in self._adamw_keys.items():
                param_group.setdefault(k, v)
        else:
            param_group[self.flag] = True
            params = param_group["params"]
            params = [params] if isinstance(params, torch.Tensor) else list(params)
            for p in params:
                if p.ndim != 2:
                    raise ValueError(
                        f"{type(self).__name__} steps 2-D parameters as whole matrices; got one "
                        f"of shape {tuple(p.shape)}. Put it in a group with "
                        f"{{'{self.flag}': False}} (AdamW), e.g. with "
                        "fullshard.optim.matrix_groups(model)."
                    )
            param_group["params"] = params
        super().add_param_group(param_group)

    # -- the step -------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        matrices = [
            (g, p)
            for g in self.param_groups
            if g[self.flag]
            for p in g["params"]
            if p.grad is not None
        ]
        inputs = [self.rows(g, p, local_of(p.grad)) for g, p in matrices]
        results = self._whole_results(matrices, inputs)
        for (g, p), result in zip(matrices, results, strict=True):
            local = local_of(p)
            # (from the group's device to the parameter's: the host, under CPU offload)
            self.apply(g, local, p.shape, result.view(local.shape).to(local.device))
        adamw = [g for g in self.param_groups if not g[self.flag]]
        if adamw:
            self._adamw_step(adamw)
        return loss

    def _whole_results(
        self, matrices: list[tuple[dict[str, Any], torch.Tensor]], inputs: list[torch.Tensor]
    ) -> list[torch.Tensor]:
        """Every matrix's piece of its whole function's result: computed here for parameters
        that are not sharded, by the owners for the rest (one exchange per group of ranks)."""
        results: list[torch.Tensor | None] = [None] * len(matrices)
        by_group: dict[tuple[int, ...], tuple[Any, list[int]]] = {}
        for k, (g, p) in enumerate(matrices):
            if isinstance(p, DTensor) and dist.is_initialized():
                # once per mesh (it reads the mesh's ranks: a host tensor)
                mesh = p.device_mesh
                if id(mesh) not in self._groups:
                    self._groups[id(mesh)] = (mesh, exchange_group(p))
                key, pg = self._groups[id(mesh)][1]
                by_group.setdefault(key, (pg, []))[1].append(k)
            else:
                results[k] = self.whole(g, inputs[k].to(self.wire_dtype(g, inputs[k].dtype)))
        for pg, ks in by_group.values():
            for k, r in self._exchanged(matrices, inputs, ks, pg).items():
                results[k] = r
        return results  # type: ignore[return-value]

    def _exchanged(
        self,
        matrices: list[tuple[dict[str, Any], torch.Tensor]],
        inputs: list[torch.Tensor],
        ks: list[int],
        pg: dist.ProcessGroup | None,
    ) -> dict[int, torch.Tensor]:
        """NOTE [Matrices on owners] for the matrices ``ks`` of one group of ranks."""
        params = [matrices[k][1] for k in ks]
        groups = [matrices[k][0] for k in ks]
        costs = [self.cost(g, p.shape) for g, p in zip(groups, params, strict=True)]
        plan = self._plan(params, costs, pg)  # type: ignore[arg-type]
        wires = [self.wire_dtype(g, inputs[k].dtype) for g, k in zip(groups, ks, strict=True)]
        wire = _widest(wires)
        wholes = plan.to_owners([inputs[k] for k in ks], wire, wires)
        outs = {i: self.whole(groups[i], w) for i, w in wholes.items()}
        # every rank must know the results' dtypes before they arrive: the function's on a
        # 2x2 matrix of each input dtype (the same on every rank)
        probed: dict[tuple[int, torch.dtype], torch.dtype] = {}
        for g, w in zip(groups, wires, strict=True):
            if (id(g), w) not in probed:
                probed[(id(g), w)] = self.whole(g, torch.eye(2, dtype=w, device=plan.device)).dtype
        results = [probed[(id(g), w)] for g, w in zip(groups, wires, strict=True)]
        got = plan.from_owners({i: o.contiguous() for i, o in outs.items()}, _widest(results))
        # a rank without rows of a matrix (an empty shard) gets nothing back for it
        return {
            k: got[i].to(results[i]) if i in got else inputs[k].new_empty(0, dtype=results[i])
            for i, k in enumerate(ks)
        }

    def _plan(
        self, params: list[DTensor], costs: list[float], pg: dist.ProcessGroup | None
    ) -> Exchange:
        key = (id(pg), *(id(p) for p in params), *costs)
        plan = self._plans.get(key)
        if plan is None:
            if len(self._plans) >= MAX_PLANS:
                self._plans.pop(next(iter(self._plans)))
            plan = self._plans[key] = Exchange(params, costs, pg)
        return plan

    def _adamw_step(self, groups: list[dict[str, Any]]) -> None:
        """The AdamW groups, stepped by torch's AdamW over this optimizer's groups and state
        (so its state dict holds them, and fullshard's local-step hooks see an AdamW)."""
        if self._adamw is None:
            self._adamw = torch.optim.AdamW([torch.zeros(1, requires_grad=True)])
        self._adamw.param_groups = groups
        self._adamw.state = self.state
        self._adamw.step()


def _widest(dtypes: Iterable[torch.dtype]) -> torch.dtype:
    out: torch.dtype | None = None
    for d in dtypes:
        out = d if out is None else torch.promote_types(out, d)
    return out if out is not None else torch.float32
