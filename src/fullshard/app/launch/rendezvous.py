"""``torchrun --rdzv-backend fullshard``: the rendezvous of ``--elastic`` jobs on several
machines (what it changes in torchrun's ``c10d`` rendezvous, and why: ``app/launch/elastic.py``).

torchrun's registry imports this module when torch's rendezvous package is first imported (the
``torchrun.handlers`` entry point): nothing else may import it first, or the registry would
find it half initialised. Workers read :data:`fullshard.app.launch.elastic.RDZV_ENV` instead.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

from torch.distributed.elastic.rendezvous import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousStoreInfo,
)

from fullshard.app.launch.elastic import RDZV_ENV

__all__ = ["FullshardRendezvous", "create_handler", "torchrun_handler"]


def torchrun_handler() -> Callable[[Any], Any]:
    """The ``torchrun.handlers`` entry point: torchrun registers what this returns under the
    name ``fullshard``."""
    return create_handler


def create_handler(params: Any) -> Any:
    """A :class:`FullshardRendezvous` for torchrun's ``RendezvousParameters`` (the ``c10d``
    backend's endpoint and options)."""
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
        create_handler as create_dynamic,
    )

    backend, store = create_backend(params)
    return FullshardRendezvous(create_dynamic(store, backend, params), store, params.run_id)


class FullshardRendezvous(RendezvousHandler):
    """``c10d``'s rendezvous handler, wrapped (see the module docstring)."""

    def __init__(self, inner: Any, store: Any, run_id: str) -> None:
        import torch.distributed as dist

        self._inner, self._store, self._run_id = inner, store, run_id
        self._key = f"fullshard/rdzv/{run_id}/"
        self._agents = dist.PrefixStore(self._key + "agents/", store)
        self._late = False
        os.environ[RDZV_ENV] = "1"

    def get_backend(self) -> str:
        return "fullshard"

    @property
    def use_agent_store(self) -> bool:
        return bool(self._inner.use_agent_store)

    def next_rendezvous(self) -> RendezvousInfo:
        job = self._key + "job"
        if self._store.check([job]):  # the job runs: this node joins it (the module docstring)
            record = json.loads(self._store.get(job).decode())
            world = int(record["nodes"])
            late = int(self._store.add(self._key + "late", 1))
            # a slot other than 0 (the agent of group rank 0 computes the rank assignment)
            slot = world - 1 - (late - 1) % max(1, world - 1) if world > 1 else 0
            self._late = True
            from fullshard.elastic.membership import JOIN_ENV

            os.environ[JOIN_ENV] = "1"
            store_info = RendezvousStoreInfo(record["master_addr"], int(record["master_port"]))
            return RendezvousInfo(self._agents, slot, world, store_info)
        info = self._inner.next_rendezvous()
        boot = info.bootstrap_store_info
        if info.rank == 0 and boot is not None:
            record = {
                "nodes": info.world_size,
                "master_addr": boot.master_addr,
                "master_port": boot.master_port,
            }
            self._store.set(job, json.dumps(record))
        return RendezvousInfo(self._agents, info.rank, info.world_size, boot)

    def is_closed(self) -> bool:
        return bool(self._inner.is_closed())

    def set_closed(self) -> None:
        self._inner.set_closed()

    def num_nodes_waiting(self) -> int:
        """Arriving nodes join the running job instead of waiting for a round: none waits, and
        no agent restarts its workers for one."""
        return 0

    def get_run_id(self) -> str:
        return str(self._inner.get_run_id())

    def shutdown(self) -> bool:
        return True if self._late else bool(self._inner.shutdown())
