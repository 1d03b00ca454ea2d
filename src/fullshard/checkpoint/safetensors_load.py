"""Sharded loading of a Hugging Face safetensors checkpoint into a sharded model (layer 9).

NOTE [Sharded safetensors load]
A model built on the meta device, sharded (``fully_shard``: fullshard's or torch's FSDP2) and
materialised with ``to_empty`` holds, on each rank, only its own rows of every parameter: the
local tensor of a DTensor. :func:`load_safetensors` fills exactly those rows from the checkpoint
files: safetensors maps each file and ``get_slice(key)[a:b]`` reads only the bytes of the rows
asked for, so a rank's peak host memory is its shard plus one slice, not the model. The box a
rank owns is computed from the DTensor's own mesh and placements
(``compute_local_shape_and_global_offset``), so ``Shard(0)``, ``Shard(k)`` (a rank's columns:
``get_slice`` slices any dim), HSDP's ``(Replicate(), Shard(k))`` and uneven or empty shards need
no special case. Rows are copied *into* the local tensor, which
the engine keeps as a view of its unit's flat buffer: the parameter objects, the optimizer's
references and the one-collective-per-unit layout all stay as they are.

No collectives: every rank opens the same files and runs the same checks, so a bad checkpoint
raises the same error on every rank before any rank has read a row.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

from fullshard.engine.param import local_of
from fullshard.policies import FullshardError

__all__ = [
    "INDEX_FILE",
    "SINGLE_FILE",
    "LoadReport",
    "SafetensorsFiles",
    "check_safetensors",
    "load_safetensors",
]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_LISTED = 10  # names listed in one error message before "... and N more"


def _rank() -> int | None:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else None


def _fail(message: str) -> FullshardError:
    rank = _rank()
    return FullshardError(message if rank is None else f"rank {rank}: {message}")


def _listing(names: Iterable[str]) -> str:
    names = list(names)
    shown = ", ".join(names[:_LISTED])
    return shown + (f" ... and {len(names) - _LISTED} more" if len(names) > _LISTED else "")


def _safe_open(path: Path) -> object:
    from safetensors import safe_open

    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except Exception as exc:  # safetensors raises its own error type for a bad header
        raise _fail(f"cannot read safetensors file {path}: {exc}") from None


@dataclass(frozen=True)
class SafetensorsFiles:
    """The files of one checkpoint and which file holds each tensor."""

    source: Path  # what the caller named: a file, an index or a directory
    files: tuple[Path, ...]
    key_file: dict[str, Path]

    @staticmethod
    def resolve(path: str | Path) -> SafetensorsFiles:
        """Find the checkpoint at ``path``: a ``.safetensors`` file, an index
        (``model.safetensors.index.json``) or a directory holding either (the index wins).
        Reads only headers and the index; raises :class:`FullshardError` saying what is missing.
        """
        source = Path(path)
        if source.is_dir():
            if (source / INDEX_FILE).is_file():
                return SafetensorsFiles._from_index(source / INDEX_FILE, source)
            if (source / SINGLE_FILE).is_file():
                return SafetensorsFiles._from_file(source / SINGLE_FILE, source)
            raise _fail(
                f"{source} holds neither {SINGLE_FILE} nor {INDEX_FILE}: no safetensors "
                "checkpoint to load (save one with save_pretrained(..., safe_serialization=True))."
            )
        if not source.is_file():
            raise _fail(f"safetensors checkpoint {source} does not exist.")
        if source.name.endswith(".json"):
            return SafetensorsFiles._from_index(source, source)
        return SafetensorsFiles._from_file(source, source)

    @staticmethod
    def _from_file(file: Path, source: Path) -> SafetensorsFiles:
        keys = _safe_open(file).keys()  # type: ignore[attr-defined]
        return SafetensorsFiles(source, (file,), dict.fromkeys(keys, file))

    @staticmethod
    def _from_index(index: Path, source: Path) -> SafetensorsFiles:
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError("weight_map is not an object")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise _fail(
                f"safetensors index {index} is not a valid index (a JSON object with a "
                f"'weight_map' of tensor name -> file): {exc}"
            ) from None
        key_file = {k: index.parent / str(v) for k, v in weight_map.items()}
        files = tuple(dict.fromkeys(key_file.values()))
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise _fail(
                f"safetensors index {index} names shard file(s) that do not exist in "
                f"{index.parent}: {_listing(absent)}. Copy the whole checkpoint directory."
            )
        return SafetensorsFiles(source, files, key_file)

    def searched(self) -> str:
        """The files, for error messages."""
        return _listing(str(f) for f in self.files)


@dataclass
class LoadReport:
    """What :func:`load_safetensors` did: checkpoint keys loaded, model buffers the file did not
    have (their values were kept), and checkpoint keys the model has no place for."""

    loaded: list[str] = field(default_factory=list)
    kept_buffers: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)


@dataclass
class _Target:
    """One distinct tensor of the model (all its tied names) and the key it loads from."""

    names: list[str]
    tensor: torch.Tensor
    is_param: bool
    key: str | None = None


def _targets(model: nn.Module) -> tuple[list[_Target], set[str]]:
    """The model's parameters and persistent buffers (tied names grouped), and the names of its
    non-persistent buffers (computed by the model itself, never loaded)."""
    by_id: dict[int, _Target] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), _Target([], p, True)).names.append(name)
    computed: set[str] = set()
    for prefix, module in model.named_modules(remove_duplicate=False):
        for bname, buf in module._buffers.items():
            if buf is None:
                continue
            full = f"{prefix}.{bname}" if prefix else bname
            if bname in module._non_persistent_buffers_set:
                computed.add(full)
            else:
                by_id.setdefault(id(buf), _Target([], buf, False)).names.append(full)
    return list(by_id.values()), computed


def _check_placements(t: _Target) -> None:
    tensor = t.tensor
    if not isinstance(tensor, DTensor):
        return
    for placement in tensor.placements:
        # _StridedShard (tensor parallel under FSDP) holds rows that are not one box of the
        # global tensor; Partial holds no rows at all.
        if isinstance(placement, _StridedShard) or not isinstance(placement, Shard | Replicate):
            raise _fail(
                f"'{t.names[0]}' is placed {tuple(tensor.placements)}: load_safetensors loads "
                "Shard and Replicate placements only (not tensor-parallel strided shards). Load "
                "before applying tensor parallel, or load the full model and shard it."
            )


def _box(tensor: torch.Tensor) -> tuple[slice, ...] | None:
    """The global index of this rank's piece of ``tensor`` (``None``: the whole tensor)."""
    if not isinstance(tensor, DTensor):
        return None
    shape, offset = compute_local_shape_and_global_offset(
        tensor.shape, tensor.device_mesh, list(tensor.placements)
    )
    return tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))


def _by_file(targets: list[_Target], files: SafetensorsFiles) -> Iterator[tuple[object, list]]:
    """Each file that holds some target, opened once, with its targets in model order."""
    for file in files.files:
        mine = [t for t in targets if t.key is not None and files.key_file[t.key] == file]
        if mine:
            yield _safe_open(file), mine


def _read_into(local: torch.Tensor, box: tuple[slice, ...] | None, file: Path, key: str) -> None:
    """Copy ``file``'s ``key`` (only the rows in ``box``) into ``local``, converting the dtype.

    The file is opened for this one tensor: the pages the read touched through the memory map
    count in the resident set until the map is closed, and closing it after each tensor keeps
    them to one tensor's worth instead of the whole shard's (the header is parsed again each
    time, a small cost next to the read).
    """
    handle = _safe_open(file)
    value = handle.get_slice(key)[box] if box is not None else handle.get_tensor(key)  # type: ignore[attr-defined]
    del handle
    if value.shape != local.shape:
        raise _fail(
            f"'{key}': this rank's piece of the parameter has shape {tuple(local.shape)}, but "
            f"its placements describe {tuple(value.shape)}; load_safetensors cannot tell which "
            "rows it holds."
        )
    local.copy_(value.to(dtype=local.dtype))


def _match(targets: list[_Target], files: SafetensorsFiles, computed: set[str]) -> LoadReport:
    """Pick each target's key (any of its tied names); raise for missing parameters and shapes
    that disagree, listing them all."""
    report = LoadReport()
    missing: list[str] = []
    for t in targets:
        t.key = next((n for n in t.names if n in files.key_file), None)
        if t.key is None:
            (missing if t.is_param else report.kept_buffers).append(" = ".join(t.names))
    if missing:
        raise _fail(
            f"safetensors checkpoint {files.source} has no tensor for {len(missing)} parameter(s) "
            f"of the model: {_listing(missing)} (searched: {files.searched()}). Is it a checkpoint "
            "of this model (same architecture and config)?"
        )
    wrong: list[str] = []
    for handle, mine in _by_file(targets, files):
        for t in mine:
            shape = tuple(handle.get_slice(t.key).get_shape())  # type: ignore[attr-defined]
            if shape != tuple(t.tensor.shape):
                wrong.append(
                    f"'{t.key}' is {shape} in {files.key_file[t.key or '']}, the model's is "
                    f"{tuple(t.tensor.shape)}"
                )
    if wrong:
        raise _fail(
            f"safetensors checkpoint {files.source} does not fit the model: {'; '.join(wrong)}. "
            "Check that the model's config matches the checkpoint's."
        )
    known = {n for t in targets for n in t.names} | computed
    report.unexpected = [k for k in files.key_file if k not in known]
    return report


def _prepare(
    model: nn.Module, path: str | Path, strict: bool
) -> tuple[SafetensorsFiles, list[_Target], LoadReport]:
    files = SafetensorsFiles.resolve(path)
    targets, computed = _targets(model)
    for t in targets:
        _check_placements(t)
    report = _match(targets, files, computed)
    if report.unexpected and strict:
        raise _fail(_unexpected(files, report) + " (strict=True).")
    return files, targets, report


def _unexpected(files: SafetensorsFiles, report: LoadReport) -> str:
    return (
        f"safetensors checkpoint {files.source} has {len(report.unexpected)} tensor(s) the "
        f"model has no parameter or buffer for: {_listing(report.unexpected)}"
    )


def check_safetensors(model: nn.Module, path: str | Path, *, strict: bool = False) -> LoadReport:
    """Every check of :func:`load_safetensors`, reading only the files' headers: ``model`` may
    still be on the meta device (a check before launching anything). Returns the report
    (``loaded`` empty)."""
    return _prepare(model, path, strict)[2]


@torch.no_grad()
def load_safetensors(model: nn.Module, path: str | Path, *, strict: bool = False) -> LoadReport:
    """Load a safetensors checkpoint into ``model``, each rank reading only its own rows.

    ``path``: a ``.safetensors`` file, a ``model.safetensors.index.json`` or a directory holding
    one of them (Hugging Face's layout). ``model`` may be sharded with ``fully_shard``
    (fullshard's or torch's FSDP2: DTensor parameters, ``Shard`` / ``Replicate`` placements) or
    not; call it after ``to_empty`` and while the model is sharded (not between ``unshard()`` and
    ``reshard()``). Values are converted to each parameter's dtype and copied into the existing
    tensors (see NOTE [Sharded safetensors load]); sharded parameters read only their rows,
    plain ones and persistent buffers are read whole. A tied parameter loads from whichever of
    its names the file has.

    Every parameter must be in the checkpoint with the model's shape; otherwise this raises
    :class:`FullshardError` (the same on every rank, before anything is read). Persistent buffers
    missing from the file keep their values. Keys the model has no place for are a warning (Hugging
    Face checkpoints often carry extras), an error with ``strict=True``. Returns a
    :class:`LoadReport`. No communication.
    """
    files, targets, report = _prepare(model, path, strict)
    on_meta = [t.names[0] for t in targets if local_of(t.tensor).is_meta]
    if on_meta:
        raise _fail(
            f"{len(on_meta)} tensor(s) of the model are still on the meta device "
            f"({_listing(on_meta)}): materialise the model first (model.to_empty(device=...)), "
            f"then load {files.source}."
        )
    if report.unexpected and _rank() in (None, 0):
        warnings.warn(_unexpected(files, report) + "; they were not loaded.", stacklevel=2)
    for t in targets:
        if t.key is None:
            continue
        local = local_of(t.tensor)
        if local.numel() > 0:  # an empty shard: nothing of it is on this rank
            _read_into(local, _box(t.tensor), files.key_file[t.key], t.key)
        report.loaded.append(t.key)
    return report
