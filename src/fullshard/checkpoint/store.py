"""Sharded checkpoints on disk (layer 9): DCP writes, atomic commit, checksums, keep-last-k, async.

Layout of a checkpoint folder::

    ROOT/step_00000120/          a committed checkpoint (DCP files + manifest.json)
    ROOT/step_00000140.partial/  a save in progress, or one that crashed: never loaded

NOTE [Atomic commit]
Every rank writes its own shard into ``step_N.partial`` (``torch.distributed.checkpoint``; nobody
gathers the model). Only after *every* rank has reported its files written does rank 0 write
``manifest.json`` (size and SHA-256 of every file) and rename the folder to ``step_N``; a rename
within one directory is atomic. A crash at any point before that leaves only ``.partial``, so
:func:`latest_checkpoint` still finds the previous checkpoint; a save that fails (a full disk,
an error on any rank) removes its ``.partial`` and raises the same error on every rank. Loading
verifies the manifest first (each rank hashes its share of the files, every rank gets every
verdict), so a truncated or bit-flipped file is a clear error on every rank, never silently wrong
weights.

NOTE [Saving without DCP's collectives]
``dcp.save`` coordinates the ranks with collectives of its own (the plans gathered to rank 0 and
scattered back, the write results gathered, rank 0's verdict broadcast), and their waits are
torch's: synchronous gloo waits that only the process group's timeout ends. Under live recovery
a rank lost during a save left its peers in them: one whose gloo peer in the broadcast was a
survivor that had moved on to recovery sat out the whole timeout, and was fenced as hung
meanwhile (NOTE [Fencing]), which lost the copies it held. A gloo wait cannot be cut short from
outside (measured: neither this rank's abort nor its peers' wakes it), so a synchronous save
makes no DCP collective at all:

- each rank writes its own files and its own metadata with DCP's rank-local mode
  (``no_dist``; files ``__R_*.distcp``, ``__R.metadata``); items that DCP would deduplicate
  (plain tensors and objects, the same on every rank; a replicated DTensor's copies) are
  written once, by rank 0 or by the replicas' first coordinate (:class:`_OneCopyPlanner`);
- the ranks meet only in fullshard's control plane (``comm.control``: rank 0's start, every
  rank's outcome, rank 0's commit), whose waits are bounded and poll the membership's token
  (NOTE [Interrupts]), so a loss anywhere in a save ends every survivor's wait at once;
- rank 0 merges the ranks' metadata into the one ``.metadata`` DCP's own save writes (same
  chunks, storage entries and flattening), then commits (NOTE [Atomic commit]): the folder is an
  ordinary DCP checkpoint, loaded by ``dcp.load`` at any world size and by torch's FSDP2.

Before writing, rank 0 checks that the disk holding the checkpoints has room for another
checkpoint as large as the newest one, and says so (:class:`CheckpointDiskFull`) instead of
writing half of one. ``async_save`` keeps DCP's own collectives, on a group of their own in a
background thread (it is not used under live recovery).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import errno
import functools
import hashlib
import json
import os
import pickle
import re
import shutil
import time
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from fullshard.policies import FullshardError

# torch.distributed.checkpoint, DTensor and comm.control (which imports DTensor) are imported by
# the functions that save, stage and load: the manifest helpers (latest_checkpoint, verify,
# file_sha256) serve the launcher's validation and data/token_shards, which must not pay their
# seconds of import.

MANIFEST = "manifest.json"
_STEP = re.compile(r"^step_(\d{8})$")


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step_{step:08d}")


def committed_steps(root: str) -> list[int]:
    """Steps of the committed checkpoints under ``root``, oldest first."""
    if not os.path.isdir(root):
        return []
    steps = []
    for name in os.listdir(root):
        m = _STEP.match(name)
        if m and os.path.isfile(os.path.join(root, name, MANIFEST)):
            steps.append(int(m.group(1)))
    return sorted(steps)


def latest_checkpoint(root: str) -> str | None:
    """The newest committed checkpoint folder under ``root`` (``None`` if there is none)."""
    steps = committed_steps(root)
    return step_dir(root, steps[-1]) if steps else None


def file_sha256(path: str | os.PathLike[str]) -> str:
    """sha256 of a file, read in blocks (never mapped: resident memory stays flat); checkpoint
    manifests and prepared token shards (``fullshard.app.data.token_shards``) both use it."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(8 << 20):
            h.update(block)
    return h.hexdigest()


def write_manifest(folder: str, extra: dict[str, Any] | None = None) -> None:
    files = {}
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if name != MANIFEST and os.path.isfile(path):
            files[name] = {"bytes": os.path.getsize(path), "sha256": file_sha256(path)}
    with open(os.path.join(folder, MANIFEST + ".tmp"), "w") as f:
        json.dump({"files": files, **(extra or {})}, f, indent=1)
    os.replace(os.path.join(folder, MANIFEST + ".tmp"), os.path.join(folder, MANIFEST))


class CheckpointCorrupt(FullshardError):
    """A checkpoint that does not match its manifest (or whose manifest cannot be read): bad
    input to a resume, not a failure of the run."""


class CheckpointSaveFailed(FullshardError):
    """A save that failed (raised on every rank, the same message); nothing of it is left on
    disk. ``newest``: the newest complete checkpoint, or ``None``."""

    def __init__(self, message: str, newest: str | None) -> None:
        super().__init__(message)
        self.newest = newest

    def __reduce__(self) -> tuple[Any, ...]:  # rank 0's verdict travels pickled
        return (type(self), (str(self), self.newest))


class CheckpointDiskFull(CheckpointSaveFailed):
    """A save refused or failed for want of disk space."""


def checkpoint_bytes(folder: str) -> int:
    """The bytes of a committed checkpoint's files, from its manifest (0 when unreadable)."""
    try:
        return sum(int(w["bytes"]) for w in read_manifest(folder)["files"].values())
    except CheckpointCorrupt:
        return 0


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def _out_of_space(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)


def _told(exc: BaseException) -> tuple[bool, str]:
    """A failure as the other ranks hear of it: whether the disk was full, and its first line."""
    text = (str(exc).splitlines() or [""])[0][:300]
    return _out_of_space(exc), f"{type(exc).__name__}: {text}"


def read_manifest(folder: str) -> dict[str, Any]:
    """``folder``'s manifest, or :class:`CheckpointCorrupt` naming the file and what is wrong
    (missing, not JSON, or without its table of files)."""
    path = os.path.join(folder, MANIFEST)
    if not os.path.isfile(path):
        raise CheckpointCorrupt(
            f"{folder} has no {MANIFEST}: it was never committed (crashed or unfinished save)"
        )
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise CheckpointCorrupt(
            f"{path} cannot be read as JSON ({exc}): the manifest is damaged (truncated?), so "
            "the checkpoint cannot be verified"
        ) from None
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or not all(
        isinstance(w, dict) and isinstance(w.get("bytes"), int) and isinstance(w.get("sha256"), str)
        for w in files.values()
    ):
        raise CheckpointCorrupt(
            f"{path} has no valid table of files (name -> bytes, sha256): the manifest is "
            "damaged, so the checkpoint cannot be verified"
        )
    return dict(manifest)


def verify(folder: str, *, hashes: bool = True, names: list[str] | None = None) -> str:
    """Problems with ``folder`` against its manifest ("" when it is intact).

    ``hashes=False``: only that the manifest parses and every file it names exists with its
    recorded size (cheap: what ``fullshard train --resume`` checks before launching).
    ``names``: hash only these of the manifest's files (a rank's share, see
    :meth:`CheckpointManager.load`); sizes are checked for all of them.
    """
    try:
        files = read_manifest(folder)["files"]
    except CheckpointCorrupt as exc:
        return str(exc)
    for name, want in files.items():
        p = os.path.join(folder, name)
        if not os.path.isfile(p):
            return f"{p} is missing"
        size = os.path.getsize(p)
        if size != want["bytes"]:
            return f"{p} has {size} bytes, the manifest says {want['bytes']} (truncated?)"
    for name in (sorted(files) if names is None else names) if hashes else []:
        p = os.path.join(folder, name)
        if name in files and file_sha256(p) != files[name]["sha256"]:
            return f"{p} does not match its SHA-256 in the manifest (corrupted)"
    return ""


def _barrier(group: dist.ProcessGroup | None, what: str) -> None:
    """Every rank's host arrives before any goes on (NOTE [Atomic commit] needs the hosts, not
    just the device streams, to meet: the files are written by the hosts)."""
    from fullshard.comm import control

    control.host_barrier(group, what=what)


def snapshot(obj: Any) -> Any:
    """A copy of a state dict that training cannot change while an async write reads it.

    DTensors are rebuilt over cloned local tensors (same placements, global shape and stride):
    torch's own staging copier cannot copy a DTensor whose local tensor is a view at a storage
    offset, which every shard in a flat unit buffer is.
    """
    from torch.distributed.tensor import DTensor

    if isinstance(obj, DTensor):
        return DTensor.from_local(
            obj.to_local().detach().clone(),
            obj.device_mesh,
            obj.placements,
            run_check=False,
            shape=obj.shape,
            stride=obj.stride(),
        )
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: snapshot(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(snapshot(v) for v in obj)
    return copy.deepcopy(obj)


class _SnapshotStager:
    """DCP async stager that stages with :func:`snapshot` (see its note)."""

    _synchronize_after_execute = False

    @property
    def should_synchronize_after_execute(self) -> bool:
        return False

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return snapshot(state_dict)  # type: ignore[no-any-return]

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


@contextlib.contextmanager
def _save_errors(partial: str) -> Iterator[None]:
    """DCP reports a failed write on every rank as ``CheckpointException`` (a BaseException):
    turn it into an error that says what it means for the run."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as exc:
        raise FullshardError(
            f"rank {dist.get_rank()}: saving {partial} failed ({exc!s:.300}). Nothing was "
            "committed: the previous checkpoint is still the latest one."
        ) from exc


@functools.cache
def _rank_local() -> tuple[type, type]:
    """DCP's writer and planner for NOTE [Saving without DCP's collectives] (made on first use:
    DCP is imported by the functions that save)."""
    from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter
    from torch.distributed.tensor import DTensor

    class RankWriter(FileSystemWriter):
        """DCP's file writer in its rank-local mode, told this rank's number (``no_dist`` would
        call every rank 0): files ``__R_*.distcp`` and metadata ``__R.metadata``."""

        def __init__(self, path: str, rank: int) -> None:
            super().__init__(path)
            self.own_rank = rank

        def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
            super().set_up_storage_writer(is_coordinator, rank=self.own_rank, use_collectives=False)

    class OneCopyPlanner(DefaultSavePlanner):
        """DCP's planner, writing once what DCP's own save would deduplicate across ranks: a
        plain tensor or object (the same on every rank) on rank 0 only, a replicated DTensor's
        block on the first coordinate of its replicated mesh dims only."""

        def __init__(self, rank: int) -> None:
            super().__init__()
            self.own_rank = rank

        def create_local_plan(self) -> Any:
            plan = super().create_local_plan()
            items = [item for item in plan.items if self._writes(item.index.fqn)]
            self.plan = dataclasses.replace(plan, items=items)
            return self.plan

        def _writes(self, fqn: str) -> bool:
            value = self.state_dict.get(fqn)
            if not isinstance(value, DTensor):
                return self.own_rank == 0
            where = value.device_mesh.get_coordinate()
            return where is not None and all(
                c == 0 for c, p in zip(where, value.placements, strict=True) if p.is_replicate()
            )

    return RankWriter, OneCopyPlanner


def _write_own(state: dict[str, Any], partial: str, rank: int) -> BaseException | None:
    """This rank's files of a checkpoint (no collective); the error that stopped them."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    writer, planner = _rank_local()
    try:
        with warnings.catch_warnings():  # no_dist's "assuming ... a single process": it is one
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            dcp.save(
                state, storage_writer=writer(partial, rank), planner=planner(rank), no_dist=True
            )
    except CheckpointException as exc:  # (no_dist wraps the writer's own error too)
        return next(iter(exc.failures.values()))[0] if exc.failures else exc
    except Exception as exc:
        return exc
    return None


def merge_rank_metadata(folder: str, world: int) -> None:
    """Merge ``__0.metadata`` ... ``__{world-1}.metadata`` (DCP's rank-local metadata) into the
    one ``.metadata`` a collective save writes (NOTE [Saving without DCP's collectives]), and
    remove them. Each rank's chunks come in rank order, as DCP's global plan lists them."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    parts = []
    for r in range(world):
        with open(os.path.join(folder, f"__{r}.metadata"), "rb") as f:
            parts.append(pickle.load(f))
    entries: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    flattening: dict[str, Any] = {}
    for md in parts:
        for fqn, entry in md.state_dict_metadata.items():
            have = entries.get(fqn)
            if have is None:
                fresh = isinstance(entry, TensorStorageMetadata)
                entries[fqn] = (
                    dataclasses.replace(entry, chunks=list(entry.chunks)) if fresh else entry
                )
            elif isinstance(entry, TensorStorageMetadata):
                have.chunks.extend(entry.chunks)
        storage.update(md.storage_data or {})
        flattening.update(md.planner_data or {})
    merged = dataclasses.replace(
        parts[0], state_dict_metadata=entries, storage_data=storage, planner_data=flattening
    )
    tmp = os.path.join(folder, ".metadata.tmp")
    with open(tmp, "wb") as f:
        pickle.dump(merged, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(folder, ".metadata"))
    for r in range(world):
        os.remove(os.path.join(folder, f"__{r}.metadata"))


@dataclass
class _PendingSave:
    step: int
    future: Future[Any]
    started: float


class CheckpointManager:
    """Saves and loads sharded checkpoints under ``root``; keeps the last ``keep`` of them.

    A save makes no collective of DCP's (NOTE [Saving without DCP's collectives]): the ranks
    meet only in fullshard's control plane, whose waits live recovery can interrupt. It checks
    the disk first (:class:`CheckpointDiskFull`). ``async_save=True`` stages the state to host
    memory and writes it in a background thread on a dedicated gloo group, so training goes on
    meanwhile; the commit (NOTE [Atomic commit]) happens at the next ``save()`` or at
    ``wait()``, on every rank at the same point. ``hook(point, step)``, for fault drills, is
    called on this rank before it writes its files of a save (``"write"``: an ``OSError`` it
    raises is that rank's failure), once they are written (``"written"``) and, on rank 0, once
    the merged ``.metadata`` is written, before the commit (``"metadata"``).
    """

    def __init__(
        self,
        root: str,
        *,
        keep: int = 3,
        async_save: bool = False,
        hook: Callable[[str, int], None] | None = None,
    ) -> None:
        self.root = root
        self.keep = keep
        self.async_save = async_save
        self.hook = hook
        self.rank = dist.get_rank()
        self._pending: _PendingSave | None = None
        # DCP's own collectives for async saves run in a background thread: they must not
        # share a group with training collectives, or the two would interleave.
        self._group = dist.new_group(backend="gloo") if async_save else None
        if self.rank == 0:
            os.makedirs(root, exist_ok=True)

    def _at(self, point: str, step: int) -> None:
        if self.hook is not None:
            self.hook(point, step)

    def save(self, step: int, state: dict[str, Any], meta: dict[str, Any] | None = None) -> str:
        """Write ``state`` (DTensors / tensors / picklable objects) as checkpoint ``step``."""
        from fullshard.comm import control

        self.wait()
        final = step_dir(self.root, step)
        partial = final + ".partial"
        # rank 0 makes the folder once the disk has room; its verdict is every rank's start
        refused = self._prepare(step, partial) if self.rank == 0 else None
        refused = control.broadcast_object(refused)
        if refused is not None:
            raise refused
        if self.async_save:
            self._save_async(step, state, meta, partial)
            return final
        try:
            self._at("write", step)  # (a drill's full disk)
            failure = _write_own(state, partial, self.rank)
        except OSError as exc:
            failure = exc
        self._at("written", step)
        failures = control.all_gather_objects(None if failure is None else _told(failure))
        problem = self._failed(step, partial, failures)
        if problem is None and self.rank == 0:
            problem = self._commit_here(step, meta, merge=True)
        problem = control.broadcast_object(problem)  # rank 0's verdict on the commit
        if problem is not None:
            raise problem
        return final

    def _prepare(self, step: int, partial: str) -> CheckpointSaveFailed | None:
        """Rank 0: the error every rank raises when checkpoint ``step`` must not be written (no
        room for it, no folder for it), or ``None`` once its folder is made."""
        newest = latest_checkpoint(self.root)
        need = checkpoint_bytes(newest) if newest is not None else 0
        shutil.rmtree(partial, ignore_errors=True)  # an earlier attempt's, never loaded
        free = shutil.disk_usage(self.root).free
        if need > free:
            return CheckpointDiskFull(
                f"the disk is full: {self.root} has {_mib(free)} free, and the newest checkpoint "
                f"({newest}) takes {_mib(need)}, so checkpoint step {step} would not fit. Nothing "
                f"was written; {newest} is the newest complete checkpoint",
                newest,
            )
        try:
            os.makedirs(partial)
        except OSError as exc:
            full, what = _told(exc)
            kind = CheckpointDiskFull if full else CheckpointSaveFailed
            still = f"; {newest} is the newest complete checkpoint" if newest else ""
            return kind(f"cannot make {partial} ({what}). Nothing was written{still}", newest)
        return None

    def _failed(
        self, step: int, partial: str, failures: list[tuple[bool, str] | None]
    ) -> CheckpointSaveFailed | None:
        """The error every rank raises when some rank's files failed (rank 0 removes the
        folder: nothing is left half written), or ``None``."""
        failed = [(r, f) for r, f in enumerate(failures) if f is not None]
        if not failed:
            return None
        if self.rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
        newest = latest_checkpoint(self.root)
        ranks = [r for r, _ in failed]
        first = failed[0][1]
        still = (
            f"the previous checkpoint is still the latest ({newest})"
            if newest
            else ("there is no complete checkpoint yet")
        )
        if any(full for _, (full, _) in failed):
            return CheckpointDiskFull(
                f"the disk is full: saving checkpoint step {step} under {self.root} failed on "
                f"rank(s) {ranks} ({first[1]}). Nothing was committed, and the partial folder "
                f"was removed: {still}",
                newest,
            )
        return CheckpointSaveFailed(
            f"saving {partial} failed on rank(s) {ranks} ({first[1]}). Nothing was committed, "
            f"and the partial folder was removed: {still}",
            newest,
        )

    def _commit_here(
        self, step: int, meta: dict[str, Any] | None, *, merge: bool
    ) -> CheckpointSaveFailed | None:
        """Rank 0: the commit of NOTE [Atomic commit] (every rank's files are written); the
        error every rank raises when it fails (the folder is then removed), or ``None``."""
        final = step_dir(self.root, step)
        partial = final + ".partial"
        try:
            if merge:
                merge_rank_metadata(partial, dist.get_world_size())
        except Exception as exc:  # (every rank waits for this verdict: never raised here)
            return self._uncommitted(step, partial, exc)
        if merge:
            self._at("metadata", step)
        try:
            write_manifest(partial, {"step": step, **(meta or {})})
            shutil.rmtree(final, ignore_errors=True)
            os.rename(partial, final)  # the commit point
        except Exception as exc:
            return self._uncommitted(step, partial, exc)
        for old in committed_steps(self.root)[: -self.keep] if self.keep > 0 else []:
            shutil.rmtree(step_dir(self.root, old), ignore_errors=True)
        return None

    def _uncommitted(self, step: int, partial: str, exc: Exception) -> CheckpointSaveFailed:
        """Rank 0: the error of a commit that failed, its folder removed."""
        shutil.rmtree(partial, ignore_errors=True)
        newest = latest_checkpoint(self.root)
        full, what = _told(exc)
        kind = CheckpointDiskFull if full else CheckpointSaveFailed
        said = "the disk is full: committing checkpoint" if full else "committing checkpoint"
        return kind(
            f"{said} step {step} under {self.root} failed ({what}). Nothing was committed: "
            f"{newest or 'no checkpoint'} is the newest complete checkpoint",
            newest,
        )

    def _save_async(
        self, step: int, state: dict[str, Any], meta: dict[str, Any] | None, partial: str
    ) -> None:
        import torch.distributed.checkpoint as dcp

        with _save_errors(partial):
            fut = dcp.async_save(
                state,
                checkpoint_id=partial,
                process_group=self._group,
                async_stager=_SnapshotStager(),  # type: ignore[arg-type]
            )
        self._pending = _PendingSave(step, fut, time.perf_counter())  # type: ignore[arg-type]
        self._meta = meta

    def wait(self) -> None:
        """Finish and commit an async save in flight (every rank must call it)."""
        from fullshard.comm import control
        from fullshard.comm.mesh import default_timeout

        if self._pending is None:
            return
        pending, self._pending = self._pending, None
        with _save_errors(step_dir(self.root, pending.step) + ".partial"):
            pending.future.result(timeout=default_timeout().total_seconds())
        _barrier(None, "checkpoint commit barrier")  # every rank's files are complete
        problem = None
        if self.rank == 0:
            problem = self._commit_here(pending.step, self._meta, merge=False)
        problem = control.broadcast_object(problem)  # rank 0's verdict, on every rank
        if problem is not None:
            raise problem

    def load(self, state: dict[str, Any], folder: str | None = None) -> str:
        """Verify, then load into ``state`` in place (DTensors are resharded as needed).

        Every rank hashes its share of the files (file ``i`` of the sorted manifest on rank
        ``i % world``), and every rank gets every rank's verdict: the same
        :class:`CheckpointCorrupt` everywhere, before DCP reads a byte.
        """
        import torch.distributed.checkpoint as dcp

        from fullshard.comm import control

        folder = folder or latest_checkpoint(self.root)
        if folder is None:
            raise FullshardError(
                f"rank {self.rank}: cannot load checkpoint: no committed "
                f"checkpoint under {self.root}."
            )
        world = dist.get_world_size()
        try:
            names = sorted(read_manifest(folder)["files"])[self.rank :: world]
        except CheckpointCorrupt:
            names = []  # verify() reports it
        problems = control.all_gather_objects(verify(folder, names=names))
        problem = next((p for p in problems if p), "")
        if problem:
            raise CheckpointCorrupt(f"cannot load checkpoint {folder}: {problem}")
        dcp.load(state, checkpoint_id=folder)
        return folder
