"""Live recovery from a lost rank (layer 9: in-memory copies of checkpoint state), for
``fullshard train --elastic`` and for a training loop of one's own.

When a rank's process dies (killed, out of memory, its node lost), the others keep running.
They notice within the collective timeout (at once, usually: the dead peer's sockets close, and
each survivor that fails aborts its process groups, which fails its peers' waits in turn),
agree on the next membership through the job's c10d store (NOTE [Generations] in
``membership.py``), join a new process group, rebuild the missing shards from copies held in
host memory (NOTE [Ring copies] in ``pieces.py``: a ring neighbour's, or under HSDP another
replica's), reshard everything in memory to the new world size and replay the steps since the
boundary they restored. A process that joins later (a replacement, a restarted node) is
admitted at a step boundary and receives its shards from its peers. No checkpoint is read from
disk. With fixed-order training (``fullshard.deterministic``) the recovered run has the bits
of the uninterrupted one.

The loop (the shape of torchft's ``Manager``)::

    mgr = elastic.Manager.from_env(accepts=worlds_ok, layout=where_copies_live)
    membership = mgr.join()            # generation 0, or the one that admits this process
    model, opt, state = build(membership)
    step = mgr.restore(model, opt, state) if membership.joined_now else 0
    while step < total:
        try:
            mgr.snapshot(step, model, opt, state)     # the step boundary: copies
            train_step(model, opt, step)
            step += 1
        except Exception as exc:
            membership = mgr.recover(exc)   # raises Lost when the job cannot go on
            model, opt, state = build(membership)
            step = mgr.restore(model, opt, state)

``state`` is a dict of picklable loop state (the same on every rank: scheduler, global sampler),
filled in place by :meth:`Manager.restore`. ``build`` must give every membership the same
initial weights (one seed): a boundary before the first update is not copied. ``accepts(world)``
says which world sizes the loop can run at; ``layout(world)`` where copies live
(:class:`Layout`: the ring step, and under HSDP the shard group). Under fullshard's launcher or
``torchrun --rdzv-backend fullshard`` the store is ``MASTER_ADDR``:``MASTER_PORT``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fullshard._lazy import lazy_exports

if TYPE_CHECKING:  # the real imports, for type checkers and IDEs
    from fullshard.elastic.manager import Aborted, Layout, Manager, Regroup, abort_groups
    from fullshard.elastic.membership import Joiner, Lost, Membership, decide
    from fullshard.elastic.pieces import Unrecoverable, choose_boundary, pieces_of
    from fullshard.elastic.restore import assemble, cut_for, state_dicts

__all__ = [
    "Aborted",
    "Joiner",
    "Layout",
    "Lost",
    "Manager",
    "Membership",
    "Regroup",
    "Unrecoverable",
    "abort_groups",
    "assemble",
    "choose_boundary",
    "cut_for",
    "decide",
    "pieces_of",
    "state_dicts",
]

# public name -> the module that defines it (the TYPE_CHECKING imports above, as data)
_SOURCES = {
    "Aborted": "fullshard.elastic.manager",
    "Layout": "fullshard.elastic.manager",
    "Manager": "fullshard.elastic.manager",
    "Regroup": "fullshard.elastic.manager",
    "abort_groups": "fullshard.elastic.manager",
    "Joiner": "fullshard.elastic.membership",
    "Lost": "fullshard.elastic.membership",
    "Membership": "fullshard.elastic.membership",
    "decide": "fullshard.elastic.membership",
    "Unrecoverable": "fullshard.elastic.pieces",
    "choose_boundary": "fullshard.elastic.pieces",
    "pieces_of": "fullshard.elastic.pieces",
    "assemble": "fullshard.elastic.restore",
    "cut_for": "fullshard.elastic.restore",
    "state_dicts": "fullshard.elastic.restore",
}

__getattr__, __dir__ = lazy_exports(__name__, globals(), _SOURCES)
