"""Sharded checkpoints on disk (layer 9): DCP writes, atomic commit, checksums, keep-last-k, async.

Layout of a checkpoint folder::

    ROOT/step_00000120/          a committed checkpoint (DCP files + manifest.json)
    ROOT/step_00000140.partial/  a save in progress, or one that crashed: never loaded

NOTE [Atomic commit]
Every rank writes its own shard into ``step_N.partial`` (``torch.distributed.checkpoint``; nobody
gathers the model). Only after *every* rank has finished (a barrier) does rank 0 write
``manifest.json`` (size and SHA-256 of every file) and rename the folder to ``step_N``; a rename
within one directory is atomic. A crash at any point before that leaves only ``.partial``, so
:func:`latest_checkpoint` still finds the previous checkpoint. Loading verifies the manifest
first (each rank hashes its share of the files, every rank gets every verdict), so a truncated
or bit-flipped file is a clear error on every rank, never silently wrong weights.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import os
import re
import shutil
import time
from collections.abc import Iterator
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


@dataclass
class _PendingSave:
    step: int
    future: Future[Any]
    started: float


class CheckpointManager:
    """Saves and loads sharded checkpoints under ``root``; keeps the last ``keep`` of them.

    ``async_save=True`` stages the state to host memory and writes it in a background thread
    on a dedicated gloo group, so training goes on meanwhile; the commit (NOTE [Atomic
    commit]) happens at the next ``save()`` or at ``wait()``, on every rank at the same point.
    """

    def __init__(self, root: str, *, keep: int = 3, async_save: bool = False) -> None:
        self.root = root
        self.keep = keep
        self.async_save = async_save
        self.rank = dist.get_rank()
        self._pending: _PendingSave | None = None
        # DCP's own collectives for async saves run in a background thread: they must not
        # share a group with training collectives, or the two would interleave.
        self._group = dist.new_group(backend="gloo") if async_save else None
        if self.rank == 0:
            os.makedirs(root, exist_ok=True)

    def save(self, step: int, state: dict[str, Any], meta: dict[str, Any] | None = None) -> str:
        """Write ``state`` (DTensors / tensors / picklable objects) as checkpoint ``step``."""
        import torch.distributed.checkpoint as dcp

        self.wait()
        final = step_dir(self.root, step)
        partial = final + ".partial"
        if self.rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
            os.makedirs(partial)
        _barrier(None, "checkpoint start barrier")
        started = time.perf_counter()
        with _save_errors(partial):
            if self.async_save:
                fut = dcp.async_save(
                    state,
                    checkpoint_id=partial,
                    process_group=self._group,
                    async_stager=_SnapshotStager(),  # type: ignore[arg-type]
                )
                self._pending = _PendingSave(step, fut, started)  # type: ignore[arg-type]
                self._meta = meta
            else:
                dcp.save(state, checkpoint_id=partial)
        if not self.async_save:
            self._commit(step, meta)
        return final

    def wait(self) -> None:
        """Finish and commit an async save in flight (every rank must call it)."""
        from fullshard.comm.mesh import default_timeout

        if self._pending is None:
            return
        pending, self._pending = self._pending, None
        with _save_errors(step_dir(self.root, pending.step) + ".partial"):
            pending.future.result(timeout=default_timeout().total_seconds())
        self._commit(pending.step, self._meta)

    def _commit(self, step: int, meta: dict[str, Any] | None) -> None:
        final = step_dir(self.root, step)
        _barrier(None, "checkpoint commit barrier")  # every rank's files are complete
        if self.rank == 0:
            write_manifest(final + ".partial", {"step": step, **(meta or {})})
            shutil.rmtree(final, ignore_errors=True)
            os.rename(final + ".partial", final)  # the commit point
            for old in committed_steps(self.root)[: -self.keep] if self.keep > 0 else []:
                shutil.rmtree(step_dir(self.root, old), ignore_errors=True)
        _barrier(None, "checkpoint committed barrier")

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
            raise FullshardError(f"rank {self.rank}: cannot load checkpoint: no committed "
                                 f"checkpoint under {self.root}.")  # fmt: skip
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
