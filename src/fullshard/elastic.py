"""Live recovery from a lost rank (layer 9: in-memory copies of checkpoint state), for
``fullshard train --elastic`` and for a training loop of one's own (``fullshard.elastic``).

When a rank's process dies (killed, out of memory), the others keep running. They notice within
the collective timeout (at once, usually: the dead peer's sockets close, and each survivor that
fails aborts its process group, which fails its peers' waits in turn), learn the new membership
from the c10d store that the launcher hosts (NOTE [Generations]), join a new process group,
rebuild the missing shards from their neighbours' copies, reshard everything in memory to the
new world size, and redo the interrupted step. No checkpoint is read from disk.

Redundancy (NOTE [Ring copies]): at a step boundary every rank keeps a host copy of its own
shards (parameters, optimizer state) with the loop's small state (scheduler, sampler), and sends
it to its ring neighbour, which keeps it too. Any one lost rank, or several that are not ring
neighbours, can be rebuilt. With ``every=k`` the copies are refreshed every k steps and recovery
replays the steps since; with fixed-order training (``fullshard.deterministic``) the replay,
like the whole recovered run, gives the bits of the uninterrupted one.

The loop (the shape of torchft's ``Manager``)::

    mgr = elastic.Manager.from_env()   # under fullshard's elastic launcher
    membership = mgr.join()            # the process group of the current generation
    model, opt, state = build(membership)
    step = mgr.restore(model, opt, state) if membership.joined_now else 0
    while step < total:
        try:
            mgr.snapshot(step, model, opt, state)     # the step boundary: ring copies
            train_step(model, opt, step)
            step += 1
        except Exception as exc:
            membership = mgr.recover(exc)   # raises Lost unless the membership changed
            model, opt, state = build(membership)
            step = mgr.restore(model, opt, state)

``state`` is a dict of picklable loop state (the same on every rank: scheduler, global sampler),
filled in place by :meth:`Manager.restore`.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fullshard.policies import FullshardError

__all__ = [
    "Aborted",
    "Lost",
    "Manager",
    "Membership",
    "Unrecoverable",
    "choose_boundary",
    "merge_pieces",
    "pieces_of",
]

# Store keys (NOTE [Generations]); the launcher writes the generations, ranks read them.
PREFIX = "fullshard/elastic/"
GEN_KEY = PREFIX + "gen/{}"
LATEST_KEY = PREFIX + "latest"
ABORT_KEY = PREFIX + "abort"
MEMBER_ENV = "FULLSHARD_ELASTIC_MEMBER"
MEMBERSHIP = "_fullshard_membership"  # the loop state's key for the history of changes
JOIN_ENV = "FULLSHARD_ELASTIC_GENERATION"

# NOTE [Generations]: the launcher hosts the job's TCPStore (it outlives every rank) and is the
# one writer of memberships: generation 0 is ranks 0..N-1; when a rank's process exits before the
# job is done, it starts a replacement in the lost rank's slot (or, without one, closes the
# slot) and writes generation g+1 = {"members": member ids in rank order, "lost": old ranks,
# "joined": new ranks, "dead_at": when it saw the exit}. A rank joins the process group of a
# generation under a key prefix of its own, so no key of a dead generation is ever read again.


class Lost(FullshardError):
    """Ranks were lost and the job cannot go on in memory (or no new membership came)."""


class Aborted(Lost):
    """The job was ended by the launcher or another rank (the message is theirs, said once)."""


class Unrecoverable(Lost):
    """The lost state is not held by any survivor (two ring neighbours at once)."""


@dataclass(frozen=True)
class Membership:
    """One generation: who is in the job, and this process's place in it."""

    generation: int
    members: list[int]  # member ids, in rank order
    rank: int
    lost: list[int] = field(default_factory=list)  # ranks of the previous generation lost
    joined: list[int] = field(default_factory=list)  # ranks of this one that are new
    dead_at: float | None = None  # wall-clock time the launcher saw the loss

    @property
    def world(self) -> int:
        return len(self.members)

    @property
    def joined_now(self) -> bool:
        """True for a replacement in the generation it joined (it holds no state yet)."""
        return self.rank in self.joined


def _local_box(dt: Any) -> tuple[list[int], list[int]]:
    """(shape, global offset) of a DTensor's local tensor, as DTensor's own sharding rule says."""
    try:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    except ImportError:  # torch 2.4
        from torch.distributed._tensor._utils import (  # type: ignore[no-redef]
            compute_local_shape_and_global_offset,
        )
    shape, offset = compute_local_shape_and_global_offset(dt.shape, dt.device_mesh, dt.placements)
    return list(shape), list(offset)


def pieces_of(
    model_sd: dict[str, Any], optim_sd: dict[str, Any], state: dict[str, Any]
) -> dict[str, Any]:
    """This rank's part of a step boundary, on the host: every DTensor leaf as its local block
    with the block's place in the global tensor; plain tensors and objects as they are."""
    from torch.distributed.tensor import DTensor

    chunks: dict[str, tuple[list[int], list[int], torch.Tensor]] = {}
    fulls: dict[str, torch.Tensor] = {}

    def put(path: str, value: Any) -> None:
        if isinstance(value, DTensor):
            shape, offset = _local_box(value)
            local = value.to_local()
            if list(local.shape) != shape:
                raise FullshardError(f"{path}: local block {list(local.shape)} is not {shape}")
            chunks[path] = (list(value.shape), offset, local.detach().to("cpu", copy=True))
        elif isinstance(value, torch.Tensor):
            fulls[path] = value.detach().to("cpu", copy=True)

    for fqn, v in model_sd.items():
        put("model\0" + fqn, v)
    for fqn, entry in optim_sd.get("state", {}).items():
        for k, v in entry.items():
            put(f"optim\0{fqn}\0{k}", v)
    objects = {"param_groups": optim_sd.get("param_groups", []), "state": dict(state)}
    for fqn, entry in optim_sd.get("state", {}).items():  # non-tensor optimizer state
        for k, v in entry.items():
            if not isinstance(v, torch.Tensor):
                objects[f"optim\0{fqn}\0{k}"] = v
    return {"chunks": chunks, "fulls": fulls, "objects": objects}


def merge_pieces(parts: Iterable[dict[str, Any]]) -> tuple[dict, dict, dict]:
    """The full model state dict, optimizer state dict and loop state that ``parts`` (every
    member's pieces of one boundary, from any world size) cover; raises :class:`Unrecoverable`
    naming a tensor some element of which no part holds."""
    parts = list(parts)
    full: dict[str, torch.Tensor] = {}
    covered: dict[str, torch.Tensor] = {}
    for part in parts:
        for path, (shape, offset, local) in part["chunks"].items():
            if path not in full:
                full[path] = torch.empty(shape, dtype=local.dtype)
                covered[path] = torch.zeros(shape, dtype=torch.bool)
            box = tuple(slice(o, o + n) for o, n in zip(offset, local.shape, strict=True))
            full[path][box] = local
            covered[path][box] = True
        for path, t in part["fulls"].items():
            full.setdefault(path, t)
            covered.setdefault(path, torch.ones((), dtype=torch.bool))
    for path, mask in covered.items():
        if not bool(mask.all()):
            name = path.replace("\0", ".")
            raise Unrecoverable(f"{name}: no survivor holds all of it")
    objects = parts[0]["objects"]
    model_sd: dict[str, Any] = {}
    optim_state: dict[str, dict[str, Any]] = {}
    for path, t in full.items():
        kind, *rest = path.split("\0")
        if kind == "model":
            model_sd[rest[0]] = t
        else:
            optim_state.setdefault(rest[0], {})[rest[1]] = t
    for path, v in objects.items():
        if path.startswith("optim\0"):
            _, fqn, k = path.split("\0")
            optim_state.setdefault(fqn, {})[k] = v
    optim_sd = {"state": optim_state, "param_groups": objects["param_groups"]}
    return model_sd, optim_sd, objects["state"]


def choose_boundary(
    old_members: list[int], held: dict[int, dict[str, dict[int, list[int]]]]
) -> tuple[int, dict[int, int]] | None:
    """The newest step boundary at which every member of ``old_members`` has a copy held by a
    participant, and who provides each (member -> participant), or ``None``.

    ``held[participant] = {"own": {member: [steps]}, "copy": {member: [steps]}}``: the boundaries
    a participant holds of its own shards and of its ring neighbour's.
    """
    steps = sorted(
        {s for h in held.values() for kind in h.values() for ss in kind.values() for s in ss},
        reverse=True,
    )
    for step in steps:
        providers: dict[int, int] = {}
        for m in old_members:
            for p in sorted(held):  # its own copy first, then a neighbour's: the same choice
                h = held[p]
                if step in h["own"].get(m, []) or step in h["copy"].get(m, []):
                    providers[m] = p
                    if step in h["own"].get(m, []):
                        break
            if m not in providers:
                break
        else:
            return step, providers
    return None


def gens_of(everyone: list[dict[str, Any]]) -> list[int]:
    """The generations of the boundaries the participants hold."""
    return [g for e in everyone for g in e["gens"].values()]


def _to_bytes(obj: Any) -> torch.Tensor:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)


def _from_bytes(t: torch.Tensor) -> Any:
    return torch.load(io.BytesIO(t.numpy().tobytes()), weights_only=False)


# Process groups given up by abort_groups: kept referenced, never shut down (see there).
_ABANDONED: list[Any] = []


def abort_groups() -> None:
    """Abort every process group of this rank (a peer blocked in a synchronous gloo collective
    with it fails at once), and forget them, so that a new default group can be made.

    Not ``destroy_process_group``: its ``shutdown`` joins gloo's worker threads, one of which
    may sit in a collective with the dead rank until the timeout (measured: 29 s of a 30 s
    timeout). The groups are kept referenced instead, so that their destructors never wait
    either; a lost generation costs its groups' memory. Safe to call when none is initialised.
    """
    if not dist.is_initialized():
        return
    c10d = dist.distributed_c10d
    groups = list(c10d._world.pg_map.keys())
    for pg in groups:
        abort = getattr(pg, "abort", None)
        if abort is not None:
            with contextlib.suppress(RuntimeError):  # already failed or torn down
                abort()
    forget = (
        getattr(c10d, "_update_default_pg", None),
        getattr(c10d, "_unregister_all_process_groups", None),
    )
    if None in forget:  # an older torch: the slow way, bounded by the timeout
        dist.destroy_process_group()
        return
    _ABANDONED.extend(groups)
    c10d._update_default_pg(None)
    for name in (
        "pg_map", "pg_names", "pg_group_ranks", "pg_backend_config", "pg_to_tag", "tags_to_pg",
        "pg_coalesce_state",
    ):  # fmt: skip
        table = getattr(c10d._world, name, None)
        if table is not None:
            table.clear()
    c10d._unregister_all_process_groups()
    c10d._world.group_count = 0


class Manager:
    """One rank's side of live recovery (see the module docstring).

    ``store``: the job's store (hosted by the launcher, not by a rank); ``member``: this process's
    member id (``FULLSHARD_ELASTIC_MEMBER``); ``backend``: the process groups' backend;
    ``timeout_s``: how long to wait for a collective and for a new membership; ``every``: copy
    the shards at every ``every``-th step boundary.
    """

    def __init__(
        self,
        store: dist.Store,
        member: int,
        *,
        backend: str = "gloo",
        timeout_s: float = 300.0,
        every: int = 1,
        generation: int = 0,
    ) -> None:
        self.store, self.member, self.backend = store, member, backend
        self.timeout_s, self.every = timeout_s, max(1, every)
        self.generation = generation
        self.membership: Membership | None = None
        # boundary step -> pieces (own: this rank's, copy: the ring predecessor's, as bytes)
        self.own: dict[int, tuple[int, dict[str, Any]]] = {}  # step -> (generation, pieces)
        self.copies: dict[int, tuple[int, int, torch.Tensor]] = {}  # step -> (gen, member, bytes)
        self.changes: list[dict[str, Any]] = []  # one entry per membership change
        self.snapshot_s = 0.0  # time spent copying and exchanging, all boundaries together
        self.copy_bytes = 0
        self._failed_at: float | None = None
        self._newest = generation  # the newest generation the watcher has seen
        self._watcher: threading.Thread | None = None

    @classmethod
    def from_env(cls, **kwargs: Any) -> Manager:
        """The manager of a rank started by fullshard's elastic launcher (``MASTER_ADDR``,
        ``MASTER_PORT``: its store; ``FULLSHARD_ELASTIC_MEMBER``; for a replacement, the
        generation it joins in ``FULLSHARD_ELASTIC_GENERATION``)."""
        timeout = timedelta(seconds=kwargs.get("timeout_s", 300.0))
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            is_master=False,
            timeout=timeout,
            wait_for_workers=False,
        )
        kwargs.setdefault("generation", int(os.environ.get(JOIN_ENV, "0")))
        return cls(store, int(os.environ[MEMBER_ENV]), **kwargs)

    # -- membership -------------------------------------------------------------------------

    def _generation(self, gen: int) -> dict[str, Any]:
        """What the launcher wrote for generation ``gen`` (NOTE [Generations])."""
        return dict(json.loads(self.store.get(GEN_KEY.format(gen)).decode()))

    def _read_generation(self, gen: int) -> Membership:
        info = self._generation(gen)
        if self.member not in info["members"]:
            raise Lost(f"member {self.member} is not in generation {gen}: {info['members']}")
        return Membership(
            gen,
            list(info["members"]),
            info["members"].index(self.member),
            list(info.get("lost", [])),
            list(info.get("joined", [])),
            info.get("dead_at"),
        )

    def _wait_generation(self, gen: int, why: str) -> None:
        """Wait (at most the timeout) for the launcher to write generation ``gen``."""
        deadline = time.monotonic() + self.timeout_s
        while not self.store.check([GEN_KEY.format(gen)]):
            if self.store.check([ABORT_KEY]):
                raise Aborted(self.store.get(ABORT_KEY).decode())
            if time.monotonic() > deadline:
                raise Lost(
                    f"{why}, and no new membership came within {self.timeout_s:.0f} s "
                    "(a stuck rank, not a lost one, or a failure of this rank's own)"
                )
            time.sleep(0.02)

    def join(self) -> Membership:
        """Join the process group of the current generation (generation 0 at the start; a
        replacement's own, given by the launcher)."""
        self._wait_generation(self.generation, "joining")
        m = self._read_generation(self.generation)
        dist.init_process_group(
            backend=self.backend,
            store=dist.PrefixStore(f"fullshard/elastic_{m.generation}", self.store),
            rank=m.rank,
            world_size=m.world,
            timeout=timedelta(seconds=self.timeout_s),
        )
        self.membership = m
        self._watch()
        return m

    def _watch(self) -> None:
        """A thread that notices a new generation (its own store client: the main thread's may
        be blocked in a call) and makes this rank's host waits give up
        (``fullshard.comm.desync.interrupt``)."""
        from fullshard.comm import desync

        desync.interrupt = lambda: self._newest > self.generation
        if self._watcher is not None:
            return
        host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if host is None or port is None:
            return  # a store of the caller's: no watcher, waits end at the timeout

        def watch() -> None:
            client = dist.TCPStore(host, int(port), is_master=False, wait_for_workers=False)
            while True:
                if client.check([LATEST_KEY]):
                    self._newest = max(self._newest, int(client.get(LATEST_KEY)))
                time.sleep(0.05)

        self._watcher = threading.Thread(target=watch, name="fullshard-elastic", daemon=True)
        self._watcher.start()

    def abort(self, message: str) -> None:
        """Stop the whole job: every rank waiting for a membership reads ``message``."""
        self.store.set(ABORT_KEY, message)

    def recover(self, error: BaseException) -> Membership:
        """After ``error`` in a step: abort this rank's groups (so its peers fail at once too),
        wait for the next generation, and join it. Raises :class:`Lost`, with ``error`` in its
        message, when no membership change comes within the timeout (no rank was lost: a stuck
        one, or a failure of this rank's own), or when the launcher ended the job."""
        self._failed_at = time.time()
        abort_groups()
        self.generation += 1
        why = f"a step failed ({type(error).__name__}: {str(error).splitlines()[0][:200]})"
        self._wait_generation(self.generation, why)
        return self.join()

    # -- redundancy -------------------------------------------------------------------------

    def due(self, step: int) -> bool:
        """True when the boundary after ``step`` steps gets ring copies."""
        return step % self.every == 0

    def snapshot(
        self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict
    ) -> None:
        """The step boundary after ``step`` steps (call on every rank before the step's first
        collective): keep this rank's shards and send them to the next rank in the ring."""
        if not self.due(step) or step in self.own:
            return
        from fullshard.checkpoint.state_dict import get_state_dict

        t0 = time.perf_counter()
        m = self.membership
        assert m is not None, "join() first"
        if optimizer.state:
            model_sd, optim_sd = get_state_dict(model, optimizer)
        else:  # before the first step: get_state_dict would create the state by stepping
            model_sd, optim_sd = model.state_dict(), {"state": {}, "param_groups": None}
        # the membership history travels with the state: a replacement rank 0 reports it all
        pieces = pieces_of(model_sd, optim_sd, {**state, MEMBERSHIP: self.changes})
        self.own[step] = (m.generation, pieces)
        if m.world > 1:
            from fullshard.comm import control

            payload = _to_bytes(pieces)
            got = control.ring_exchange(payload)
            prv = (m.rank - 1) % m.world
            self.copies[step] = (m.generation, m.members[prv], got)
            self.copy_bytes = payload.numel() + got.numel()  # this boundary's, on the host
        for kept in (self.own, self.copies):  # the newest two boundaries (NOTE [Ring copies])
            for old in sorted(kept)[:-2]:
                del kept[old]
        self.snapshot_s += time.perf_counter() - t0

    def restore(self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> int:
        """Load the newest boundary the participants hold into ``model``, ``optimizer`` and
        ``state`` (call on every rank of the new generation); returns its step."""
        from fullshard.checkpoint.state_dict import set_state_dict
        from fullshard.comm import control

        m = self.membership
        assert m is not None, "join() first"
        held = {
            "own": {self.member: sorted(self.own)},
            "copy": {c[1]: [s] for s, c in self.copies.items()},
        }
        gens = {s: g for s, (g, _) in self.own.items()}
        gens.update({s: c[0] for s, c in self.copies.items()})
        everyone = control.all_gather_objects({"member": self.member, "held": held, "gens": gens})
        by_participant = {e["member"]: e["held"] for e in everyone}
        old = self._old_members(everyone)
        chosen = choose_boundary(old, by_participant)
        if chosen is None:
            holders = {x for h in by_participant.values() for k in h.values() for x in k}
            missing = [old.index(x) for x in old if x not in holders]
            raise Unrecoverable(
                f"the shards of rank(s) {missing} of generation {max(gens_of(everyone))} are "
                "held by no survivor (ring neighbours lost together: each rank's copy is on "
                "the next rank only)"
            )
        step, providers = chosen
        mine: list[dict[str, Any]] = []
        for member, provider in providers.items():
            if provider != self.member:
                continue
            if member == self.member and step in self.own:
                mine.append(self.own[step][1])
            else:
                mine.append(_from_bytes(self.copies[step][2]))
        parts = [p for ps in control.all_gather_objects(mine) for p in ps]
        model_sd, optim_sd, loop_state = merge_pieces(parts)
        if optim_sd["param_groups"] is None:  # a boundary before the first step: fresh
            set_state_dict(model, (), model_state_dict=model_sd)
        else:
            set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
        self.changes = list(loop_state.pop(MEMBERSHIP, []))
        state.clear()
        state.update(loop_state)
        self.own.clear()  # copies of another generation's layout: the next boundary refreshes
        self.copies.clear()
        if self._failed_at is not None or m.joined:
            self.changes.append(
                {
                    "step": step + 1,
                    "generation": m.generation,
                    "world_size": m.world,
                    "ranks_lost": m.lost,
                    "ranks_joined": m.joined,
                    "recovery_s": round(time.time() - (m.dead_at or self._failed_at or 0), 3),
                }
            )
        self._failed_at = None
        return step

    def _old_members(self, everyone: list[dict[str, Any]]) -> list[int]:
        """The members of the generation whose boundaries the participants hold."""
        m = self.membership
        assert m is not None
        gens = gens_of(everyone)
        if not gens:
            raise Unrecoverable(f"generation {m.generation}: no participant holds any copy")
        return list(self._generation(max(gens))["members"])
