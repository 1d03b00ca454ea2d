"""How ``--elastic``'s protocol scales: store operations per member and bytes per rank of a
recovery, at 4, 64 and 1,024 members simulated on this machine (threads on one ``TCPStore``, no
model, no process group).

    python scripts/elastic_scale.py                      # this checkout
    python scripts/elastic_scale.py --src /tmp/old/src   # another checkout's protocol, the same way

Members are dealt to ``--procs`` worker processes (threads within each), so that a thousand
members do not queue on one interpreter's lock.

1. *Steady state*: every member runs its watcher (``fullshard.elastic``'s own thread) for
   ``--window`` seconds; each member's store client counts the operations it issues.
2. *Recovery*: member 0 is lost without an exit report (its node gone: its heartbeat stops)
   while every other member's watcher runs; every survivor runs the settle of ``Manager`` at
   once; each member's operations (its watcher's and its settle's) are counted until it holds
   the new record, and so are all of them together (the one store's load).
3. *Bytes*: what each rank receives in a recovery's restore, by the cut of NOTE [Restore by
   blocks] (``fullshard.elastic.restore.plan_bytes``) against the gather of every piece by
   every rank before it, for a 7B-shaped model (AdamW: parameters and two moments, fp32) that
   loses one rank (a replacement joins: N to N) or half its ranks (N to N/2).

Threads share one interpreter: with many members a thread gets a slice of the CPU, so a
member's achieved operations per second understate what a process of its own would issue (the
watcher's own periods give this checkout's 30 a second: the news counter every 0.05 s, its
heartbeat and its neighbour's every 0.2 s). Compare two checkouts at the same member count.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


class Counting:
    """A store client that counts the operations it issues (the protocol's only ones)."""

    def __init__(self, real: Any) -> None:
        self.real, self.ops = real, 0

    def __getattr__(self, name: str) -> Any:
        call = getattr(self.real, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.ops += 1
            return call(*args, **kwargs)

        return counted


def _client(port: int) -> Counting:
    import torch.distributed as dist

    return Counting(dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False))


def _watchers(n: int, port: int, members: list[int], clients: list[Counting]) -> list[Any]:
    """A watcher per member of ``members`` (generation 0 of ``n``), on ``clients``."""
    import torch.distributed as dist

    from fullshard.elastic import membership

    watcher_mod = sys.modules.get("fullshard.elastic.watcher")
    real_store = dist.TCPStore
    made = iter(clients)
    dist.TCPStore = lambda *a, **k: next(made)  # the watcher makes its own client
    everyone = list(range(n))
    try:
        if watcher_mod is not None:  # this checkout's: ring neighbours, progress
            return [
                watcher_mod.Watcher(
                    "127.0.0.1",
                    port,
                    m,
                    lambda: 0,
                    members=lambda: everyone,
                    neighbour=lambda m=m: (m + 1) % n,
                    progress=lambda: 1,
                    on_fenced=lambda *_: None,
                )
                for m in members
            ]
        return [membership.Watcher("127.0.0.1", port, m, lambda: 0) for m in members]
    finally:
        time.sleep(1.0)  # (the threads connect on their clients first)
        dist.TCPStore = real_store


def _job(n: int) -> Any:
    import torch.distributed as dist

    from fullshard.elastic import membership

    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    membership.JobStore(master).write_generation(0, {"members": list(range(n))})
    return master


def _split(members: list[int], procs: int) -> list[list[int]]:
    """``members`` dealt to ``procs`` worker processes (each runs its share as threads)."""
    return [members[i::procs] for i in range(procs) if members[i::procs]]


def _workers(target: Any, shares: list[list[int]], *args: Any) -> list[Any]:
    """Run ``target(share, *args, out)`` in a new process per share; their results. Spawned,
    not forked: a fork while the store's server thread holds a lock can deadlock the child."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [
        ctx.Process(target=_in_checkout, args=(sys.path[0], target, share, *args, out))
        for share in shares
    ]
    for p in procs:
        p.start()
    results = [out.get() for _ in procs]
    for p in procs:
        p.join()
    return results


def _in_checkout(src: str, target: Any, *args: Any) -> None:
    """A worker: the measured checkout's ``src`` first on the path, then ``target``."""
    sys.path.insert(0, src)
    with contextlib.suppress(ImportError):  # (an older checkout has none)
        import fullshard.elastic.watcher  # noqa: F401
    target(*args)


def _steady_worker(share: list[int], n: int, port: int, window: float, out: Any) -> None:
    clients = [_client(port) for _ in share]
    watchers = _watchers(n, port, share, clients)
    go = _client(port)
    go.add("steady_ready", 1)
    go.wait(["steady_go"])  # every process's watchers run: the window starts for all at once
    start = [c.ops for c in clients]
    time.sleep(window)
    ops = [c.ops - s for c, s in zip(clients, start, strict=True)]
    for w in watchers:
        w.stop()
    out.put(ops)


def steady(n: int, window: float, procs: int) -> dict[str, Any]:
    """Every member's watcher for ``window`` s: operations per member per second."""
    master = _job(n)
    shares = _split(list(range(n)), procs)

    def go() -> None:
        while int(master.add("steady_ready", 0)) < len(shares):
            time.sleep(0.05)
        master.set("steady_go", "1")

    threading.Thread(target=go, daemon=True).start()
    ops = [x for part in _workers(_steady_worker, shares, n, master.port, window) for x in part]
    return {"per_s_achieved": round(statistics.median(ops) / window, 1)}


def _recovery_worker(share: list[int], n: int, port: int, timeout_s: float, out: Any) -> None:
    """This process's survivors: their watchers, and each one's settle in a thread of its own,
    all started when the store's ``go`` key appears."""
    from fullshard.elastic import manager, membership

    watch = [_client(port) for _ in share]
    watchers = _watchers(n, port, share, watch)
    counted = {m: _client(port) for m in share}
    done: dict[int, float] = {}
    go = _client(port)
    started = threading.Event()
    t0: list[float] = []

    def member(m: int) -> None:
        mgr = manager.Manager(counted[m], m, world=n, timeout_s=timeout_s)  # type: ignore[arg-type]
        mgr.membership = membership.Membership.of(0, {"members": list(range(n))}, m)
        mgr.generation = 0
        started.wait()
        mgr._settle(1, RuntimeError("peer lost"))
        done[m] = time.time() - t0[0]

    threads = [threading.Thread(target=member, args=(m,), daemon=True) for m in share]
    for t in threads:
        t.start()
    base = {m: c.ops for m, c in zip(share, watch, strict=True)}
    go.add("recovery_ready", 1)
    go.wait(["recovery_go"])
    t0.append(float(go.get("recovery_go").decode()))
    started.set()
    for t in threads:
        t.join(timeout_s)
    for w in watchers:
        w.stop()
    ops = {m: counted[m].ops + watch[i].ops - base[m] for i, m in enumerate(share) if m in done}
    out.put((done, ops))


def recovery(n: int, procs: int, timeout_s: float = 600.0) -> dict[str, Any]:
    """Member 0 lost without an exit report (a node gone: its heartbeat stops), the others'
    watchers running: they settle generation 1; each member's operations (its watcher's and
    its settle's) per second until it holds the new record, and the wall time."""
    master = _job(n)
    shares = _split(list(range(1, n)), procs)

    def go() -> None:
        while int(master.add("recovery_ready", 0)) < len(shares):
            time.sleep(0.05)
        master.set("recovery_go", repr(time.time()))

    threading.Thread(target=go, daemon=True).start()
    results = _workers(_recovery_worker, shares, n, master.port, timeout_s)
    done = {m: t for d, _ in results for m, t in d.items()}
    ops = {m: x for _, o in results for m, x in o.items()}
    wall = max(done.values()) if done else float("nan")
    rates = [ops[m] / wall for m in ops]
    return {
        "settled": len(done),
        "wall_s": round(wall, 2),
        "ops_per_member_median": statistics.median(ops.values()),
        "ops_per_member_max": max(ops.values()),
        "per_s_median": round(statistics.median(rates), 1),
        "per_s_max": round(max(rates), 1),
        "store_ops_per_s": round(sum(ops.values()) / wall),
    }


def _boxes(shapes: dict[str, tuple[int, int]], world: int) -> dict[int, dict[str, Any]]:
    """Each rank's dim-0 block of each tensor, torch.chunk's split (fullshard's layout)."""
    out: dict[int, dict[str, Any]] = {r: {} for r in range(world)}
    for name, (rows, cols) in shapes.items():
        chunk = -(-rows // world)
        for r in range(world):
            a, b = min(rows, r * chunk), min(rows, (r + 1) * chunk)
            out[r][name] = ([b - a, cols], [a, 0])
    return out


def restore_bytes(n: int) -> dict[str, Any]:
    """Bytes a rank receives from others, a 7B-shaped model with AdamW (fp32, three tensors a
    parameter), when one rank is replaced (n to n) and when half the ranks are lost (n to n/2)."""
    from fullshard.elastic.restore import plan_bytes

    d, ffn, layers, vocab = 4096, 11008, 32, 32000
    shapes = {"embed": (vocab, d), "head": (vocab, d)}
    for i in range(layers):
        for w in ("q", "k", "v", "o"):
            shapes[f"{i}.{w}"] = (d, d)
        shapes[f"{i}.up"], shapes[f"{i}.gate"], shapes[f"{i}.down"] = (ffn, d), (ffn, d), (d, ffn)
    elements = sum(r * c for r, c in shapes.values())
    per_element = 3 * 4  # parameter, exp_avg, exp_avg_sq in fp32
    old = _boxes(shapes, n)
    out: dict[str, Any] = {"params": elements}
    for case, new_world in (("replace_one", n), ("lose_half", max(1, n // 2))):
        new = _boxes(shapes, new_world)
        # survivors keep their rank numbers (a replacement takes the lost one's): rank 0 lost,
        # its pieces come from the ring neighbour that kept them (NOTE [Ring copies]); with
        # half lost, every other rank's from its neighbour
        lost = [0] if case == "replace_one" else list(range(0, n, 2)) if n > 1 else []
        held = [((r + 1) % n if r in lost else r, boxes) for r, boxes in old.items()]
        plan = plan_bytes(held, new)
        received = [others * per_element for others, _ in plan.values()]
        gather = elements * per_element * (n - 1) / n  # every piece but its own, before
        out[case] = {
            "bytes_per_rank_max": max(received),
            "bytes_per_rank_mean": statistics.mean(received),
            "before_bytes_per_rank": gather,
        }
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--members", default="4,64,1024")
    ap.add_argument("--window", type=float, default=5.0, help="steady-state seconds")
    ap.add_argument("--src", default=str(ROOT / "src"), help="the checkout's src to measure")
    ap.add_argument(
        "--procs", type=int, default=16, help="worker processes the members are dealt to"
    )
    ap.add_argument("--skip", default="", help="parts to skip: steady,recovery,bytes")
    ap.add_argument("--out", default="runs/elastic_scale.json")
    args = ap.parse_args()
    sys.path.insert(0, args.src)
    import fullshard  # noqa: F401

    with contextlib.suppress(ImportError):  # (an older checkout has none)
        import fullshard.elastic.watcher  # noqa: F401
    results: dict[str, Any] = {"src": args.src}
    skip = set(args.skip.split(","))
    for n in [int(x) for x in args.members.split(",")]:
        row: dict[str, Any] = {}
        if "steady" not in skip:
            row["steady"] = steady(n, args.window, min(n, args.procs))
        if "recovery" not in skip:
            row["recovery"] = recovery(n, min(n - 1, args.procs))
        if "bytes" not in skip and "fullshard.elastic.restore" in _modules():
            row["bytes"] = restore_bytes(n)
        results[str(n)] = row
        print(f"{n} members: {json.dumps(row)}", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


def _modules() -> set[str]:
    import importlib.util

    return {m for m in ("fullshard.elastic.restore",) if importlib.util.find_spec(m)}


if __name__ == "__main__":
    raise SystemExit(main())
