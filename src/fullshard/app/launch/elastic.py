"""How an elastic job's processes start (``fullshard train --elastic``): on one machine from
fullshard's own launcher (:func:`launch_elastic`), or under torchrun agents, one per node, with
``--rdzv-backend fullshard`` (:class:`FullshardRendezvous`). Either way the job's c10d store
outlives any one rank, and the ranks decide each membership themselves (NOTE [Generations] in
``fullshard.elastic.membership``).

**fullshard train --nproc N --elastic.** torchrun's agent stops every worker when one fails (and
restarts them all, with ``--max-restarts``). Under ``--elastic`` this launcher runs the ranks
instead:

- it hosts the job's c10d ``TCPStore`` (a rank's death cannot take it down), and the ranks
  connect to it as clients (``TORCHELASTIC_USE_AGENT_STORE``, as under torchrun's agent);
- it forks the ranks from the forkserver of NOTE [Ranks from a forkserver] (``app/launch/local.py``);
- when a rank's process exits before the job is done, it reports the exit in the store and
  starts a replacement that asks to join in its place, at most ``max_replacements`` in all
  (after that the others go on at a smaller world, where the job can run at one). The report
  lets the ranks decide at once, without waiting for the dead rank's heartbeat to go quiet, and
  tells them a replacement is on its way.

It ends with 0 when the job finished (every member of the newest generation finished, or the
last rank 0 noted the end: a process that exits badly afterwards does not fail a job that
trained to the end), 2 with one message for bad input found on a rank, the status a rank's
:class:`~fullshard.app.errors.RunStopped` carries (a full disk: 1) with its one message, 1 when
the ranks gave up (a message naming the newest checkpoint and the command that resumes it), and
124 after ``timeout_s``. Its own loss (it hosts the store) is survived by the ranks as far as
can be: they stop, checkpoint and say so themselves (NOTE [Losing the store]).

**torchrun --rdzv-backend fullshard.** torchrun's own ``c10d`` rendezvous makes every agent
restart its healthy workers when a new node arrives (``num_nodes_waiting() > 0``), so a
restarted node would cost every survivor its process and its state. This backend is ``c10d``'s,
with two changes:

- the first rendezvous is ``c10d``'s, unchanged (``--nnodes MIN:MAX`` nodes gather); its group
  rank 0 records the workers' store (``MASTER_ADDR``:``MASTER_PORT``, hosted by that agent) in
  the rendezvous store, under the run id;
- a node that arrives after that (a restarted one, started with the same command) does not wait
  for a new round: its agent gets the running job's worker store and a node slot, and its
  workers start as new processes of the running job (``FULLSHARD_ELASTIC_JOIN``), which rank 0
  admits at a step boundary. No agent ever sees a node waiting, so none restarts its workers.

Every agent's view of the agents' store is one prefix of the rendezvous store, so an arriving
agent reads the rank assignment made at the start and joins the others' exit barrier. The
backend (``app/launch/rendezvous.py``) is registered with torchrun through the entry point group
``torchrun.handlers`` (``pyproject.toml``); :data:`RDZV_ENV` tells a worker (validation) it
runs under it. What it
cannot survive: the loss of the node whose agent hosts the workers' store (group rank 0) or the
rendezvous endpoint; the job then ends with a message naming the newest checkpoint.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import tempfile
import time
from typing import Any

__all__ = ["LAUNCHER_ENV", "RDZV_ENV", "job_status", "launch_elastic"]

RDZV_ENV = (
    "FULLSHARD_ELASTIC_RDZV"  # set in an agent by app/launch/rendezvous.py: its workers inherit it
)


LAUNCHER_ENV = "FULLSHARD_ELASTIC_LAUNCHER"  # set for its ranks: the launcher says the last word


def job_status(statuses: list[int | None], finished: bool, preempted: bool) -> int:
    """The launcher's exit status once every process ended: ``statuses``, the newest
    generation's members' exit statuses; ``finished``, whether the job noted that it trained to
    the end; ``preempted``, whether a stop signal's checkpoint was reported. A job that trained to
    the end succeeded, whatever a process did after it (a member that exited badly on its way
    out is named)."""
    from fullshard.app.launch.preempt import PREEMPTED_EXIT

    bad = [s for s in statuses if s not in (0, PREEMPTED_EXIT)]
    if finished:
        if bad:
            print(
                "fullshard: the job trained to the end (its final checkpoint is complete); "
                f"exit statuses {bad} came after it",
                file=sys.stderr,
            )
        return 0
    if not bad:
        return PREEMPTED_EXIT if preempted else 0
    print("fullshard: every rank exited, some with an error", file=sys.stderr)
    return 1


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

    from fullshard.app.launch.local import RANK_PRELOAD, start_helpers
    from fullshard.app.launch.preempt import ForwardSignals

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    job = _Job(store, nproc, argv, module, dict(os.environ if env is None else env))
    start_helpers(RANK_PRELOAD)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    with (
        tempfile.TemporaryDirectory(prefix="fullshard-elastic-") as tmp,
        ForwardSignals(job.forward),
    ):
        job.begin(tmp)
        while True:
            time.sleep(0.05)
            if deadline is not None and time.monotonic() > deadline:
                job.stop_all()
                print(f"fullshard: launch timed out after {timeout_s:.0f} s", file=sys.stderr)
                return 124
            status = job.poll(max_replacements)
            if status is not None:
                return status


class _Job:
    """The processes of one elastic job, and what the launcher does with them each poll: a
    rank's reported input error or ending, the ranks' abort, members lost (fenced, or exited
    badly) and their replacements, and the end."""

    def __init__(
        self, store: Any, nproc: int, argv: list[str], module: str, base: dict[str, str]
    ) -> None:
        from fullshard.app.errors import RESUME_ENV, VALIDATED_ENV
        from fullshard.app.faults import LAUNCHER_PID_ENV, fault_from_env
        from fullshard.elastic.membership import JobStore

        self.jobs, self.nproc, self.argv, self.module = JobStore(store), nproc, argv, module
        base.setdefault("GLOO_SOCKET_IFNAME", "lo")
        base.setdefault("OMP_NUM_THREADS", "1")
        base.update(
            {
                VALIDATED_ENV: "1",
                LAUNCHER_ENV: "1",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(store.port),
                "TORCHELASTIC_USE_AGENT_STORE": "True",
                "TORCHELASTIC_RESTART_COUNT": "0",
                "LOCAL_WORLD_SIZE": str(nproc),
                "WORLD_SIZE": str(nproc),
                LAUNCHER_PID_ENV: str(os.getpid()),  # (a drill's ``launcher`` fault)
            }
        )
        self.base = base
        self.resume = base.get(RESUME_ENV) or "the same command with --resume latest"
        self.ctx = multiprocessing.get_context("forkserver")
        fault = fault_from_env(base)
        self.spared = set() if fault is None else fault.frozen_ranks()  # member ids 0.. are ranks
        self.procs: dict[int, Any] = {}  # member id -> its process
        self.slots: dict[int, int] = {}  # member id -> the local slot (device) it runs on
        self.reported: set[int] = set()
        self.replaced = 0

    def begin(self, tmp: str) -> None:
        """Start the first ``nproc`` ranks, their input errors and stop marker in ``tmp``."""
        from fullshard.app.errors import ERROR_MARKER_ENV
        from fullshard.app.launch.preempt import MARKER_ENV

        self.error = self.base[ERROR_MARKER_ENV] = os.path.join(tmp, "input-error.txt")
        self.marker = self.base[MARKER_ENV] = os.path.join(tmp, "preempted.json")
        self.jobs.reserve_ids(self.nproc)
        for rank in range(self.nproc):
            self.start(rank, rank, None)
        pids = [self.procs[m].pid for m in range(self.nproc)]
        print(f"fullshard: --elastic ranks 0-{self.nproc - 1} are pids {pids}", file=sys.stderr)

    def start(self, member: int, slot: int, replaces: int | None) -> None:
        from fullshard.app.launch.local import run_rank
        from fullshard.elastic.membership import JOIN_ENV, MEMBER_ENV, REPLACES_ENV

        child = {**self.base, MEMBER_ENV: str(member), "RANK": str(slot), "LOCAL_RANK": str(slot)}
        if replaces is not None:  # (a drill's faults fire in it only when marked again=1)
            child.update({JOIN_ENV: "1", REPLACES_ENV: str(replaces)})
        args = (child, self.module, list(self.argv))
        p = self.ctx.Process(target=run_rank, args=args, daemon=False)
        p.start()
        self.procs[member], self.slots[member] = p, slot

    def forward(self, signum: int) -> None:  # NOTE [Preemption]: the ranks checkpoint and exit 75
        for p in self.procs.values():
            if p.is_alive():
                os.kill(p.pid, signum)

    def stop_all(self) -> None:
        for p in self.procs.values():
            if p.is_alive():
                p.kill()
        for p in self.procs.values():
            p.join(10)

    def newest_members(self) -> list[Any]:
        """The processes of the newest generation (all of them before the first is written)."""
        record = self.jobs.generation(self.jobs.latest())
        members = list(self.procs) if record is None else record["members"]
        return [self.procs[m] for m in members if m in self.procs]

    def poll(self, max_replacements: int) -> int | None:
        """One look at the job: the launcher's exit status once it ends, else ``None``."""
        from fullshard.app.errors import read_report
        from fullshard.app.launch.preempt import read_marker

        report = read_report(self.error)
        if report is not None:
            message, stopped = report
            time.sleep(0.5 if stopped is not None else 0)  # the ranks leave by themselves
            self.stop_all()
            said = "" if stopped is not None else "error: "
            print(f"fullshard {self.argv[0]}: {said}{message}", file=sys.stderr)
            return 2 if stopped is None else stopped
        aborted = self.jobs.aborted()
        if aborted is not None:
            time.sleep(1.0)  # the ranks read it and leave
            self.stop_all()
            print(f"fullshard: {aborted}", file=sys.stderr)
            return 1
        lost = self.lost()
        finished = self.jobs.note("complete") is not None  # the job trained to the end
        self.replace(lost, finished, max_replacements)
        if (
            lost
            and not finished
            and all(p.exitcode not in (None, 0) for p in self.newest_members())
        ):
            self.jobs.abort(  # no survivor holds a copy, nor can decide the next membership
                "--elastic cannot recover in memory: every rank of the job was lost at once; "
                f"resume from the newest complete checkpoint: {self.resume}"
            )
        if all(p.exitcode is not None for p in self.procs.values()):
            statuses = [p.exitcode for p in self.newest_members()]
            return job_status(statuses, finished, read_marker(self.marker) is not None)
        return None

    def lost(self) -> dict[int, str]:
        """The members lost since the last look, and how: fenced (killed, unless a drill's
        frozen rank: its own fencing ends it), or exited badly."""
        from fullshard.app.launch.preempt import PREEMPTED_EXIT

        lost: dict[int, str] = {}
        for member, why in self.jobs.fenced().items():  # NOTE [Fencing]: lost, and never again
            p = self.procs.get(member)
            if p is None or member in self.reported:
                continue
            if member in self.spared:
                lost[member] = f"was fenced ({why}); left alone (a drill's frozen rank)"
                continue
            p.kill()
            p.join(10)
            lost[member] = f"was fenced ({why}): killed"
        for member, p in self.procs.items():
            # a rank that stopped on a stop signal, checkpointed, is not lost
            if p.exitcode not in (None, 0, PREEMPTED_EXIT) and member not in self.reported:
                lost.setdefault(member, f"exited with status {p.exitcode}")
        return lost

    def replace(self, lost: dict[int, str], finished: bool, max_replacements: int) -> None:
        """Report each lost member's exit in the store, and start a replacement in its slot
        while any are left (after the end: nothing to recover, no one to replace)."""
        for member, what in sorted(lost.items()):
            p = self.procs[member]
            self.reported.add(member)
            if finished:
                continue
            print(
                f"fullshard: member {member} (pid {p.pid}) {what}; the other ranks keep running",
                file=sys.stderr,
                flush=True,
            )
            if self.replaced >= max_replacements:  # the others go on without it, if they can
                self.jobs.report_exit(member, p.exitcode, None)
                continue
            self.replaced += 1
            new = self.jobs.new_member_ids(1)
            self.jobs.report_exit(member, p.exitcode, new)
            self.start(new, self.slots[member], member)
