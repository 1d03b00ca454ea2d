"""The launcher of ``fullshard train --nproc N --elastic``: ranks that outlive a lost peer.

torchrun's agent stops every worker when one fails (and restarts them all, with
``--max-restarts``). Under ``--elastic`` this launcher runs the ranks instead:

- it hosts the job's c10d ``TCPStore`` (a rank's death cannot take it down), and the ranks
  connect to it as clients (``TORCHELASTIC_USE_AGENT_STORE``, as under torchrun's agent);
- it forks the ranks from the forkserver of NOTE [Ranks from a forkserver] (``app/launch.py``);
- it writes each generation's membership to the store (NOTE [Generations] in
  ``fullshard.elastic``): when a rank's process exits before the job is done, it starts a
  replacement in that rank's slot, at most ``max_replacements`` in all, and writes the next
  generation; the survivors, which keep running, join it with the replacement.

It ends with 0 when every member of the last generation finished, 2 with one message for bad
input found on a rank, 1 when the ranks gave up (a message naming the newest checkpoint) or ran
out of replacements, and 124 after ``timeout_s``.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
import tempfile
import time
from typing import Any

__all__ = ["launch_elastic"]

SETTLE_S = 0.3  # exits this close together are one loss (a node's ranks, say): one generation


def launch_elastic(
    nproc: int,
    argv: list[str],
    *,
    max_replacements: int,
    module: str = "fullshard.app.cli",
    env: dict[str, str] | None = None,
    timeout_s: float | None = None,
) -> int:
    """Run ``python -m <module> <argv>`` on ``nproc`` local ranks that survive a lost peer
    (see the module docstring). Call it after validating ``argv``."""
    import torch.distributed as dist

    from fullshard.app.errors import ERROR_MARKER_ENV, VALIDATED_ENV, read_error
    from fullshard.app.launch import RANK_PRELOAD, run_rank
    from fullshard.elastic import ABORT_KEY, GEN_KEY, JOIN_ENV, LATEST_KEY, MEMBER_ENV

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    base = dict(os.environ if env is None else env)
    base.setdefault("GLOO_SOCKET_IFNAME", "lo")
    base.setdefault("OMP_NUM_THREADS", "1")
    base.update(
        {
            VALIDATED_ENV: "1",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(store.port),
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            "TORCHELASTIC_RESTART_COUNT": "0",
            "LOCAL_WORLD_SIZE": str(nproc),
            "WORLD_SIZE": str(nproc),
        }
    )
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(RANK_PRELOAD)
    members = list(range(nproc))  # member id per slot (rank)
    procs: dict[int, Any] = {}  # member -> process
    next_member = nproc
    generation = 0
    replaced = 0

    def publish(gen: int, info: dict[str, Any]) -> None:
        store.set(GEN_KEY.format(gen), json.dumps({"members": members, **info}))
        store.set(LATEST_KEY, str(gen))

    def start(member: int, slot: int, join: int | None) -> None:
        child = {**base, MEMBER_ENV: str(member), "RANK": str(slot), "LOCAL_RANK": str(slot)}
        if join is not None:
            child[JOIN_ENV] = str(join)
            child["FULLSHARD_FAULT"] = ""  # a drill fires in the first process only
        p = ctx.Process(target=run_rank, args=(child, module, list(argv)), daemon=False)
        p.start()
        procs[member] = p

    def stop_all() -> None:
        for p in procs.values():
            if p.is_alive():
                p.kill()
        for p in procs.values():
            p.join(10)

    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    with tempfile.TemporaryDirectory(prefix="fullshard-elastic-") as tmp:
        error = base[ERROR_MARKER_ENV] = os.path.join(tmp, "input-error.txt")
        publish(0, {"lost": [], "joined": []})
        for slot, member in enumerate(members):
            start(member, slot, None)
        pids = [procs[m].pid for m in members]
        print(f"fullshard: --elastic ranks 0-{nproc - 1} are pids {pids}", file=sys.stderr)
        while True:
            time.sleep(0.05)
            if deadline is not None and time.monotonic() > deadline:
                stop_all()
                print(f"fullshard: launch timed out after {timeout_s:.0f} s", file=sys.stderr)
                return 124
            current = [procs[m] for m in members]
            if all(p.exitcode == 0 for p in current):
                return 0
            failed = [m for m in members if procs[m].exitcode not in (None, 0)]
            if not failed:
                continue
            message = read_error(error)
            if message is not None:
                stop_all()
                print(f"fullshard {argv[0]}: error: {message}", file=sys.stderr)
                return 2
            dead_at = time.time()
            time.sleep(SETTLE_S)
            failed = [m for m in members if procs[m].exitcode not in (None, 0)]
            if store.check([ABORT_KEY]):
                stop_all()
                print(f"fullshard: {store.get(ABORT_KEY).decode()}", file=sys.stderr)
                return 1
            lost = [members.index(m) for m in failed]
            for slot, m in zip(lost, failed, strict=True):
                status = procs[m].exitcode
                print(
                    f"fullshard: rank {slot} (pid {procs[m].pid}) exited with status {status}; "
                    "the other ranks keep running",
                    file=sys.stderr,
                    flush=True,
                )
            if replaced + len(failed) > max_replacements:
                message = (
                    f"rank(s) {lost} lost after {replaced} replacement(s), and "
                    f"--max-replacements is {max_replacements}"
                )
                store.set(ABORT_KEY, message)
                time.sleep(1.0)  # the survivors read it and print the newest checkpoint
                stop_all()
                print(f"fullshard: {message}", file=sys.stderr)
                return 1
            generation += 1
            for slot in lost:
                members[slot] = next_member
                next_member += 1
                replaced += 1
            publish(generation, {"lost": lost, "joined": lost, "dead_at": dead_at})
            for slot in lost:
                start(members[slot], slot, generation)
