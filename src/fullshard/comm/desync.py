"""Desync detection (layer 4): when ranks disagree on which collective comes next, say who is
where, on every rank, instead of hanging or mixing numbers.

NOTE [Collective positions]
Every collective fullshard issues gets a *position*: its sequence number on this rank, the
training step, its kind, its unit (by the unit's index in the root's registration order, which
every rank shares, so two units never share a code) and why it runs. Three mechanisms use it:

1. Tags inside the payload (always on, no extra collective). An all-gather shard ends in
   ``TAG_LEN`` small integers (magic, unit index in two bytes, phase, sequence mod 256): after
   the gather every rank holds every rank's tag and compares them, so two ranks that pair
   *different* collectives of the *same size* (identical transformer blocks!) cannot silently
   compute with each other's weights. A reduce-scatter block ends in one column per trainable
   parameter ("this rank has a gradient for it") and the same five bytes written as 40 bits.
   Sums of bits stay exact integers in every reduce dtype as long as the group has at most 256
   ranks (bf16's exact range; fp16: 2048), so after the sum every tag column must be 0 or the
   group size: anything between means the ranks disagreed. The presence columns may hold any
   count: how many ranks used the parameter (NOTE [Which gradients exist]).
2. A failed or timed-out wait (a dead rank, or a rank that went elsewhere): each rank publishes
   its position in the process group's store and reads the others' for a few seconds, so the
   error lists every rank's position, and names the ranks that never reported.
3. Debug mode (``FULLSHARD_DEBUG_COLLECTIVES=1``): before every collective, ranks exchange a
   fixed-size fingerprint (sequence, kind, unit, size, dtype, step) and compare, so a mismatch
   is caught at once even when the real collectives' sizes differ. One extra small all-gather
   and a host synchronisation per collective: for debugging only.

NOTE [Reading the verdict]
Comparing tags is device work; *reading* the answer on the host is what costs on a GPU (a
synchronisation per collective, two per unit per step). ``Verdict`` therefore checks CPU tensors
at once (gloo on CPU: reading is free, and the error comes before any result is used) and keeps
CUDA tensors until the step's collectives are done: ``close()`` reduces them on the device to a
few flags copied to pinned host memory behind an event, and ``poll()`` reads the flags once the
event has passed, at the next step's start (a loop that reads its loss has passed it already)
or, blocking, before a state dict is taken. On a GPU a desync is therefore reported at most a
step later, with the same message, on every rank; the step's results were used, so the error
says to restart from the last checkpoint.

NOTE [Backends that move no data]
torch's fake process group (backend ``"fake"``, ``torch.testing._internal.distributed.fake_pg``)
lets one process play rank r of N: every collective "succeeds" without another rank. Its
all-gather copies this rank's shard into every slot and its reduce-scatter returns this rank's
block unsummed, so the tags compare a rank with itself (gather) or can never add up to N
(reduce-scatter: each column is 0 or 1). There is no other rank to be out of step with, so
``Verdict`` checks nothing on such a group; every backend that moves data is checked as always.
The single-process tests (``tests/fast``) run the engine this way.
"""

from __future__ import annotations

import functools
import os
import time
import weakref
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from fullshard.comm.device import backend_name, cuda_semantics, new_event
from fullshard.policies import FullshardError, Phase

KINDS = ("all_gather", "reduce_scatter", "all_reduce")
# The tag's phase byte indexes this table: which collective of which ``Phase`` (its label in
# messages; ``position_label``).
PHASE_LABELS = ("other", "forward gather", "backward gather", "reduce-scatter", "unshard()")
TAG_MAGIC = 0xA5
TAG_LEN = 5  # all-gather tail: magic, unit index (2 bytes), phase, sequence mod 256
TAG_BITS = 8 * TAG_LEN  # reduce-scatter: the same bytes as bits
UNREGISTERED = 0xFFFF  # a unit gathered before its root's first forward gave it an index
MAX_EXACT_SUM = {torch.bfloat16: 256, torch.float16: 2048}  # ranks whose bit sums stay exact
NO_DATA_BACKENDS = frozenset({"fake"})  # NOTE [Backends that move no data]


class DesyncError(FullshardError):
    """Ranks disagree on the collective sequence; the message says which rank is where."""


def moves_data(group: dist.ProcessGroup | None) -> bool:
    """False for a group whose backend moves no data (NOTE [Backends that move no data])."""
    return backend_name(group) not in NO_DATA_BACKENDS


def debug_enabled() -> bool:
    return os.environ.get("FULLSHARD_DEBUG_COLLECTIVES", "").lower() in ("1", "true", "yes")


def report_wait() -> timedelta:
    """How long a failing rank waits to hear where the other ranks are."""
    return timedelta(seconds=float(os.environ.get("FULLSHARD_REPORT_WAIT_S", "10")))


@dataclass
class Position:
    """Where one rank is in the collective sequence (NOTE [Collective positions])."""

    seq: int
    step: int
    kind: str
    unit: str
    phase: Phase
    index: int = UNREGISTERED  # the unit's index in its root's registration order

    def __str__(self) -> str:
        return f"{self.label} of unit '{self.unit}' (step {self.step}, collective #{self.seq})"

    @property
    def label(self) -> str:
        """What the collective is, for messages: ``"forward gather"``, ``"reduce-scatter"``..."""
        label = _LABELS.get((self.kind, self.phase))
        return label if label is not None else position_label(self.kind, self.phase)

    def phase_seq(self) -> int:
        """Tag bytes 3 and 4 (phase, sequence mod 256) as one row of ``phase_seq_rows``."""
        phase = _PHASE_BYTES.get((self.kind, self.phase))  # one read per collective
        if phase is None:
            phase = _LABEL_INDEX[self.label]
        return phase * 256 + self.seq % 256

    def tag_bytes(self) -> list[int]:
        """The five tag bytes of this position (NOTE [Collective positions])."""
        row = self.phase_seq()
        return [TAG_MAGIC, self.index >> 8 & 0xFF, self.index & 0xFF, row >> 8, row & 0xFF]


_LABEL_INDEX = {label: i for i, label in enumerate(PHASE_LABELS)}


def position_label(kind: str, phase: Phase) -> str:
    """The label (an entry of ``PHASE_LABELS``) of a collective of ``kind`` in ``phase``."""
    if kind == "reduce_scatter":
        return "reduce-scatter"
    if kind != "all_gather":
        return "other"
    if phase is Phase.FORWARD:
        return "forward gather"
    if phase is Phase.BACKWARD:
        return "backward gather"
    return "unshard()"


# position_label of every kind and phase, looked up (a position's label is asked twice a
# collective: its tag and its name in messages)
_LABELS = {(kind, phase): position_label(kind, phase) for kind in KINDS for phase in Phase}
_PHASE_BYTES = {key: _LABEL_INDEX[label] for key, label in _LABELS.items()}  # tag_bytes' byte 3


def tags_exact(dtype: torch.dtype, world: int) -> bool:
    """Whether sums of ``world`` bits stay exact in ``dtype`` (reduce-scatter tags)."""
    return world <= MAX_EXACT_SUM.get(dtype, 1 << 24)


# -- 1. payload tags: device tables, so that writing a tag is one kernel and no host copy -------
@functools.lru_cache(maxsize=32)
def _tables(device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(phase*256 + seq -> [phase, seq]), (byte -> its 8 bits, high first), on ``device``."""
    n = torch.arange(len(PHASE_LABELS) * 256)
    pairs = torch.stack([n // 256, n % 256], dim=1)
    b = torch.arange(256).unsqueeze(1)
    bits = (b >> torch.arange(7, -1, -1)) & 1
    return pairs.to(device, dtype), bits.to(device, dtype)


@functools.lru_cache(maxsize=1024)
def _static_tag(device: torch.device, dtype: torch.dtype, index: int) -> torch.Tensor:
    values = [TAG_MAGIC, index >> 8 & 0xFF, index & 0xFF]
    return torch.tensor(values, dtype=dtype).to(device)  # once per unit: a host copy


def write_static_tag(tail: torch.Tensor, index: int) -> None:
    """The parts of an all-gather tag that never change: magic and unit index. One kernel from
    a device copy made once per unit, never a host copy per call (a post-forward reshard writes
    it every forward: NOTE [Resharding to a smaller group])."""
    tail[:3].copy_(_static_tag(tail.device, tail.dtype, index))


def write_dynamic_tag(tail: torch.Tensor, pos: Position) -> None:
    """Phase and sequence of this gather into ``tail[3:5]`` (one copy from a device table)."""
    write_phase_seq(tail[3:5], None, pos)


def phase_seq_rows(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """The table ``write_phase_seq`` copies a row of, for a caller that keeps it (a lookup by
    device and dtype costs more than the copy)."""
    return _tables(device, dtype)[0]


def write_phase_seq(slot: torch.Tensor, rows: torch.Tensor | None, pos: Position) -> None:
    """``write_dynamic_tag`` into ``slot``, the tag's last two elements (a view kept by the
    caller: one copy kernel and nothing else per gather); ``rows``: ``phase_seq_rows`` of the
    slot's device and dtype when the caller keeps it, else ``None``."""
    if rows is None:
        rows = _tables(slot.device, slot.dtype)[0]
    # a row of the table by index (a view), not a tuple of its 1280 rows kept: those cost
    # 0.8 MiB of tensor objects per dtype, against a microsecond per gather
    slot.copy_(rows[pos.phase_seq()])


def reduce_tag_row(
    pos: Position, present: list[bool], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """A reduce-scatter block's extra columns: one presence bit per trainable parameter, then
    the position's 40 tag bits (one ``cat`` kernel of table rows; no host copy)."""
    _, bits = _tables(device, dtype)
    parts = [bits[1 if p else 0, 7:] for p in present]
    parts += [bits[b] for b in pos.tag_bytes()]
    return torch.cat(parts)


def reduce_tag_columns(
    pos: Position, present: list[bool], dtype: torch.dtype, device: torch.device, world: int
) -> list[torch.Tensor]:
    """``reduce_tag_row`` in every rank's row (``(world, k + 40)``), as two contiguous parts
    the reduce-scatter's pack concatenates: the presence bits with the tag's first four bytes
    (alike in every step of a unit), and the sequence byte's bits (one of 256). Up to
    ``KEEP_TAG_ROWS`` ranks both are kept, so a step's tag costs no kernel of its own; in
    larger groups (a few kilobytes a unit) each is expanded at each reduce-scatter."""
    row = pos.phase_seq()  # tag bytes 3 and 4; bytes 1 and 2 are the unit's index
    phase, seq = row >> 8, row & 0xFF
    key = (tuple(present), pos.index & 0xFFFF, phase, dtype, device)
    if world > KEEP_TAG_ROWS:
        _, bits = _tables(device, dtype)
        head = _reduce_tag_head(*key).expand(world, -1).contiguous()
        return [head, bits[seq].expand(world, -1).contiguous()]
    # a sequence byte's rows: a view of the kept table by index (contiguous), not one of 256
    # tensor objects kept
    return [_reduce_tag_rows(*key, world), _sequence_bits(world, dtype, device)[seq]]


KEEP_TAG_ROWS = 256  # reduce_tag_columns keeps its rows up to this many ranks


@functools.lru_cache(maxsize=4096)
def _reduce_tag_head(
    present: tuple[bool, ...], index: int, phase: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    _, bits = _tables(device, dtype)
    parts = [bits[1 if p else 0, 7:] for p in present]
    parts += [bits[b] for b in (TAG_MAGIC, index >> 8 & 0xFF, index & 0xFF, phase)]
    return torch.cat(parts)


@functools.lru_cache(maxsize=4096)
def _reduce_tag_rows(
    present: tuple[bool, ...],
    index: int,
    phase: int,
    dtype: torch.dtype,
    device: torch.device,
    world: int,
) -> torch.Tensor:
    """``_reduce_tag_head`` in each of ``world`` rows, contiguous."""
    return _reduce_tag_head(present, index, phase, dtype, device).expand(world, -1).contiguous()


@functools.lru_cache(maxsize=32)
def _sequence_bits(world: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``(256, world, 8)``: per sequence byte, its 8 bits in each of ``world`` rows."""
    _, bits = _tables(device, dtype)
    return bits.unsqueeze(1).expand(256, world, 8).contiguous()


def _bits_to_bytes(bits: list[float]) -> list[int]:
    out = []
    for i in range(0, len(bits), 8):
        v = 0
        for b in bits[i : i + 8]:
            v = 2 * v + int(b)
        out.append(v)
    return out


def _describe(row: list[int], names: dict[int, str]) -> str:
    if row[0] != TAG_MAGIC:
        return "not a fullshard collective of this size (foreign collective)"
    index = row[1] * 256 + row[2]
    unit = names.get(index, f"#{index}")
    phase = PHASE_LABELS[row[3]] if 0 <= row[3] < len(PHASE_LABELS) else "?"
    return f"{phase} of unit '{unit}', collective #{row[4]} (mod 256)"


def _ranks(group: dist.ProcessGroup | None, world: int) -> list[int]:
    return dist.get_process_group_ranks(group) if group is not None else list(range(world))


def _mispaired(pos: Position, lines: list[str], late: bool) -> DesyncError:
    used = (
        "Its result was used before this check (GPU: verdicts are read once per step): "
        "restart from the last checkpoint."
        if late
        else "No result of this collective was used."
    )
    return DesyncError(
        f"rank {dist.get_rank()}: ranks paired different {pos.kind.replace('_', '-')}s "
        f"({'; '.join(lines)}); this rank was at {pos}. The ranks ran different forward/backward "
        "sequences (a skipped or extra forward, another branch, a different number of "
        f"micro-batches). {used}"
    )


@dataclass
class _Item:
    kind: str  # "gather": rows of tags; "rows": reduce-scatter blocks; "sums": summed blocks
    tensor: torch.Tensor
    pos: Position
    group: dist.ProcessGroup | None
    me: int
    world: int
    params: list[str] = field(default_factory=list)


MAX_PENDING_VERDICTS = 8  # closed verdicts left unread before poll() blocks (memory: tiny)


class Verdict:
    """The tag checks of one root's collectives (NOTE [Reading the verdict])."""

    def __init__(self, defer_cpu: bool = False) -> None:
        self.names: dict[int, str] = {}  # unit index -> name, to decode other ranks' tags
        self._items: list[_Item] = []
        self._pending: list[tuple[Any, torch.Tensor, list[_Item]]] = []  # (event | None, ...)
        self.defer_cpu = defer_cpu  # tests: CPU tensors take the GPU's deferred path

    # -- adding checks ----------------------------------------------------------------------
    def gather(
        self, rows: torch.Tensor, me: int, pos: Position, group: dist.ProcessGroup | None
    ) -> None:
        """All-gather tags: ``rows[r]`` is rank r's tag; every row must equal row ``me``."""
        if moves_data(group):  # NOTE [Backends that move no data]: no item to make
            self._add(_Item("gather", rows, pos, group, me, rows.shape[0]))

    def reduce_rows(
        self,
        rows: torch.Tensor,
        me: int,
        pos: Position,
        group: dist.ProcessGroup | None,
        params: list[str],
    ) -> None:
        """Reduce-scatter extra columns of every rank, before the sum (gloo)."""
        if moves_data(group):
            self._add(_Item("rows", rows, pos, group, me, rows.shape[0], params))

    def reduce_sums(
        self,
        sums: torch.Tensor,
        world: int,
        pos: Position,
        group: dist.ProcessGroup | None,
        params: list[str],
    ) -> None:
        """Reduce-scatter extra columns after the sum: each tag column must be 0 or ``world``."""
        if moves_data(group):
            self._add(_Item("sums", sums, pos, group, -1, world, params))

    def _add(self, item: _Item) -> None:
        """Check ``item`` now (host memory) or keep it for ``close`` (device memory); the
        callers made it only for a group that moves data (NOTE [Backends that move no
        data]: nothing came from another rank)."""
        deferred = self.defer_cpu or cuda_semantics(item.tensor.device)
        if not deferred:
            self._raise_if_bad(item, late=False)  # free to read: check before use
            return
        if item.tensor._base is not None:
            # a view would keep its whole buffer (a gradient shard) alive until the read
            item.tensor = item.tensor.clone()
        self._items.append(item)

    def take(self, other: Verdict) -> None:
        """Adopt another verdict's unread checks (a unit's own, once its root exists)."""
        self._items += other._items
        self._pending += other._pending
        other._items, other._pending = [], []

    # -- reading ------------------------------------------------------------------------------
    def close(self) -> None:
        """The step's collectives are issued: reduce their checks to flags on the device and
        start copying them to the host (no synchronisation). Checks of one shape are stacked,
        so a step costs a handful of kernels, not a few per collective."""
        items, self._items = self._items, []
        if not items:
            return
        groups: dict[tuple[str, tuple[int, ...], int, int], list[_Item]] = {}
        for item in items:
            key = (item.kind, tuple(item.tensor.shape), item.me, item.world)
            groups.setdefault(key, []).append(item)
        flags, ordered = [], []
        for (kind, _, me, world), members in groups.items():
            # presence bits may differ (NOTE [Which gradients exist]): only the tags must agree
            t = torch.stack([m.tensor[..., len(m.params) :] for m in members])
            bad = (t != 0) & (t != world) if kind == "sums" else t != t[:, me : me + 1]
            flags.append(bad.flatten(1).any(1))
            ordered += members
        flag = torch.cat(flags)
        event = None
        if cuda_semantics(flag.device):
            host = torch.empty(flag.shape, dtype=torch.bool, pin_memory=True)
            host.copy_(flag, non_blocking=True)
            event = new_event()
            event.record()
        else:
            host = flag
        self._pending.append((event, host, ordered))

    def poll(self, block: bool = False) -> None:
        """Read every closed verdict whose copy has landed (all of them with ``block``); raise
        ``DesyncError`` for the first bad collective. Reading one that has not landed blocks
        the host, so that happens only with ``block`` or past ``MAX_PENDING_VERDICTS`` (a
        device more than that many backwards behind the host): gradient accumulation closes
        a verdict per backward and must not synchronise at each forward."""
        while self._pending:
            event, host, items = self._pending[0]
            if event is not None and not event.query():
                if not (block or len(self._pending) > MAX_PENDING_VERDICTS):
                    return
                event.synchronize()
            self._pending.pop(0)
            for flag, item in zip(host.tolist(), items, strict=True):
                if flag:
                    self._raise_if_bad(item, late=True)

    def flush(self) -> None:
        """Close and read everything now (a host synchronisation: before a state dict)."""
        self.close()
        self.poll(block=True)

    def _raise_if_bad(self, item: _Item, late: bool) -> None:
        """Raise ``DesyncError`` when the ranks' tags disagree. Presence bits (the first
        ``len(item.params)`` columns of a reduce-scatter's) may differ: a rank that did not use
        a parameter sends zeros for it (NOTE [Which gradients exist])."""
        k = len(item.params)
        if item.kind != "sums" and item.tensor.device.type == "cpu":
            # host memory (gloo: every collective of a step): a few numbers a rank, compared
            # as numbers, with no tensor op (this runs three times a unit per step)
            rows = item.tensor.tolist()
            mine = rows[item.me][k:]
            if all(row[k:] == mine for row in rows):
                return
        t = item.tensor.detach().double().cpu()[..., k:]
        world = item.world
        if item.kind == "sums":
            if not ((t != 0) & (t != world)).any():
                return
        elif not (t != t[item.me : item.me + 1]).any():
            return
        ranks = _ranks(item.group, world)
        if item.kind == "sums":
            where = explain_failure(item.pos, str(item.pos), item.group)
            raise _mispaired(item.pos, [f"where every rank is: {where}"], late)
        rows = [[int(v) for v in r] for r in t.tolist()]
        if item.kind == "rows":
            rows = [_bits_to_bytes([float(b) for b in r]) for r in rows]
        lines = [
            f"rank {r}: {_describe(row, self.names)}" for r, row in zip(ranks, rows, strict=True)
        ]
        raise _mispaired(item.pos, lines, late)


# -- 2. explaining a failed wait ---------------------------------------------------------------
def explain_failure(pos: Position | None, what: str, group: dist.ProcessGroup | None) -> str:
    """Publish this rank's position in the store and collect the others' (best effort)."""
    if interrupt_for(group) is not None:  # under live recovery a failure is a lost rank
        return f"this rank was at {pos or what} (--elastic: not waiting for the others)"
    try:
        store = dist.distributed_c10d._get_default_store()
    except Exception:  # no store reachable: say what we know
        return f"this rank was at {pos or what}"
    rank = dist.get_rank()
    ranks = _ranks(group, dist.get_world_size(group))
    prefix = "fullshard/desync/"
    store.set(f"{prefix}{rank}", str(pos or what))
    lines = []
    for r in ranks:
        key = f"{prefix}{r}"
        try:
            store.wait([key], report_wait())
            lines.append(f"rank {r}: {store.get(key).decode()}")
        except Exception:
            lines.append(
                f"rank {r}: did not report within {report_wait().total_seconds():.0f}s "
                "(dead, or stuck outside a fullshard collective)"
            )
    return "; ".join(lines)


def store_exchange(
    key: str, values: list[int], group: dist.ProcessGroup | None, timeout: timedelta, what: str
) -> list[list[int]] | None:
    """Every rank's ``values`` (the group's rank order) through the job's c10d store instead
    of a collective: on the host path a check that must not add a collective (nor be counted
    as one) exchanges this way. ``None`` when no store is reachable, or the store's host was
    lost (live recovery's store, NOTE [Losing the store]: every rank's store fails alike, and
    the caller exchanges by a collective). A rank that does not arrive within ``timeout`` is
    named in a ``DesyncError``."""
    try:
        store = dist.distributed_c10d._get_default_store()
    except Exception:
        return None
    ranks = _ranks(group, dist.get_world_size(group))
    keys = [f"{key}/{r}" for r in ranks]
    interrupt = interrupt_for(group)
    try:
        store.set(f"{key}/{dist.get_rank()}", ",".join(map(str, values)))
        if interrupt is None:
            store.wait(keys, timeout)
        else:  # NOTE [Interrupts]: under live recovery the wait polls, as collectives' do
            deadline, pause = time.monotonic() + timeout.total_seconds(), 5e-5
            while not store.check(keys):
                interrupt.check()
                if time.monotonic() > deadline:
                    raise TimeoutError(key)
                time.sleep(pause)
                pause = min(pause * 2, 2e-3)
        return [[int(v) for v in store.get(k).decode().split(",") if v] for k in keys]
    except Interrupted:
        raise
    except dist.DistNetworkError:
        return None
    except Exception:
        missing = [r for r, k in zip(ranks, keys, strict=True) if not store.check([k])]
        raise DesyncError(
            f"rank {dist.get_rank()}: rank(s) {missing} did not reach {what} within "
            f"{timeout.total_seconds():.0f}s (they ran other collectives, or stopped)."
        ) from None


def store_round(name: str, group: dist.ProcessGroup | None) -> int | None:
    """A number every rank of ``group`` gets alike for its n-th call with ``name`` (SPMD ranks
    call in the same order): the store's counter for the group, read in rounds of the group's
    size. A key prefix for ``store_exchange`` that a process-local counter could not give (a
    replacement rank under ``--elastic`` starts its own at 0). ``None`` without a store."""
    try:
        store = dist.distributed_c10d._get_default_store()
    except Exception:
        return None
    ranks = _ranks(group, dist.get_world_size(group))
    n = store.add(f"fullshard/rounds/{name}/{'-'.join(map(str, ranks))}", 1)
    return (n - 1) // len(ranks)


# -- 3. debug-mode fingerprints ----------------------------------------------------------------
def fingerprint_check(
    pos: Position,
    numel: int,
    dtype: torch.dtype,
    group: dist.ProcessGroup | None,
    device: torch.device,
    timeout: timedelta,
    names: dict[int, str],
    first: str = "",
    previous: str = "",
) -> str:
    """Exchange and compare a fixed-size fingerprint before a collective (debug mode), or,
    with ``first`` (a key prefix), before a forward gather of a forward the units check
    watches (NOTE [Units every rank runs]): through the store on the host path, so that it adds
    no collective there. Returns the store key this rank wrote ('' if none); ``previous``, the
    one it wrote at its last check, is deleted once every rank has written this one (each rank
    finished reading that one first), so that the store keeps one key per rank."""
    world = dist.get_world_size(group)
    if first and not cuda_semantics(device):
        values = [pos.seq, KINDS.index(pos.kind), pos.index, numel, pos.step]
        key = f"{first}/{'-'.join(map(str, _ranks(group, world)))}/{pos.seq}"
        got = store_exchange(
            key, values, group, timeout, f"the checked forward's gather #{pos.seq}"
        )
        if got is not None:
            if any(row != values for row in got):
                rows_ = [[r[0], r[1], r[2], r[3], 0, r[4]] for r in got]
                _fingerprint_error(torch.tensor(rows_), group, world, names, True)
            if previous and previous.split("/")[-3] == key.split("/")[-2]:  # (the same group)
                dist.distributed_c10d._get_default_store().delete_key(previous)
            return f"{key}/{dist.get_rank()}"
    mine = torch.tensor(
        [
            pos.seq,
            KINDS.index(pos.kind) if pos.kind in KINDS else -1,
            pos.index,
            numel,
            zlib.crc32(str(dtype).encode()) % 10007,  # not hash(): it differs per process
            pos.step,
        ],
        dtype=torch.int64,
        device=device,
    )
    everyone = torch.empty(world * mine.numel(), dtype=torch.int64, device=device)
    work = dist.all_gather_into_tensor(everyone, mine, group=group, async_op=True)
    assert work is not None
    timed_wait(work, timeout, interrupt_for(group))
    rows = everyone.view(world, -1).cpu()
    if bool((rows == mine.cpu().reshape(1, -1)).all()):
        return ""
    _fingerprint_error(rows, group, world, names, bool(first))


def _fingerprint_error(
    rows: torch.Tensor,
    group: dist.ProcessGroup | None,
    world: int,
    names: dict[int, str],
    first: bool,
) -> NoReturn:
    lines = []
    for r, row in zip(_ranks(group, world), rows.tolist(), strict=True):
        kind = KINDS[row[1]] if 0 <= row[1] < len(KINDS) else "?"
        lines.append(
            f"rank {r}: {kind} of unit '{names.get(row[2], '#' + str(row[2]))}' ({row[3]} "
            f"elements) at step {row[5]}, collective #{row[0]}"
        )
    hint = ""
    units = {row[2] for row in rows.tolist()}
    if len(units) > 1 and all(row[1] == KINDS.index("all_gather") for row in rows.tolist()):
        shown = " or ".join(f"'{names.get(u, '#' + str(u))}'" for u in sorted(units))
        hint = (
            f" A unit ({shown}) ran on some ranks and not on others: declare a unit that some "
            "ranks skip optional (module.set_optional() on every rank before the forward), or "
            "run it on every rank."
        )
    raise DesyncError(
        f"rank {dist.get_rank()}: collective mismatch caught before it ran "
        f"({'the units check' if first else 'debug mode'}): {'; '.join(lines)}. The ranks "
        f"ran different forward/backward sequences.{hint}"
    )


class Interrupted(FullshardError):
    """A wait given up because the job's membership changed (``fullshard.elastic``)."""


class Interrupt:
    """NOTE [Interrupts]: a way out of this process's waits on one generation's collectives.

    Under live recovery (``fullshard.elastic``) a peer may die inside a collective. A gloo
    wait cannot be cut short from outside (neither the peers' abort nor this rank's own wakes
    an async work), so the waits poll: ``fired()`` turns true once the job's membership has
    moved past the generation the token was made for, and the wait raises
    :class:`Interrupted`. The token travels with the groups' communication context: a unit's
    ``Comm`` holds the one of its group (taken when the unit is built), and a control-plane
    collective takes its group's (:func:`interrupt_for`). A token fires for its own generation
    only: a unit or wait of the next generation is never cut short by the last one's."""

    def __init__(self, fired: Callable[[], bool], what: str) -> None:
        self.fired, self.what = fired, what

    def check(self) -> None:
        """Raise :class:`Interrupted` once the token fired."""
        if self.fired():
            raise Interrupted(f"{self.what} while this rank waited")


# the token of each process group that has one (its owner, fullshard.elastic, sets it), and
# whether one was ever set in this process (every collective asks: without live recovery the
# answer is then one read, not a weak dictionary's Python-level lookups)
_TOKENS: weakref.WeakKeyDictionary[Any, Interrupt] = weakref.WeakKeyDictionary()
_EVER_SET = [False]
# whether any token was ever set: a caller on a step's path tests it before ``interrupt_for``
INTERRUPTS_EVER_SET = _EVER_SET


def set_interrupt(token: Interrupt | None, group: dist.ProcessGroup | None = None) -> None:
    """Give waits on ``group``'s collectives (default: the default group, whose token the
    groups made from it share) the way out ``token``; ``None`` takes it away."""
    key = group if group is not None else dist.group.WORLD
    if key is None:  # no process group: nothing to wait on
        return
    if token is None:
        _TOKENS.pop(key, None)
    else:
        _TOKENS[key] = token
        _EVER_SET[0] = True


def interrupt_for(group: dist.ProcessGroup | None) -> Interrupt | None:
    """The token waits on ``group`` poll: the group's own, else the default group's (a group
    made from it, an HSDP shard group); ``None`` outside live recovery."""
    if not _EVER_SET[0] or not _TOKENS:
        return None
    found = _TOKENS.get(group) if group is not None else None
    world = dist.group.WORLD
    return found if found is not None or world is None else _TOKENS.get(world)


def _polled_wait(work: dist.Work, timeout: timedelta, interrupt: Interrupt) -> bool:
    deadline = time.monotonic() + timeout.total_seconds()
    pause = 5e-5
    while not work.is_completed():
        interrupt.check()
        if time.monotonic() > deadline:
            return False
        time.sleep(pause)
        pause = min(pause * 2, 2e-3)
    return bool(work.wait())


def timed_wait(work: dist.Work, timeout: timedelta, interrupt: Interrupt | None = None) -> bool:
    """``work.wait(timeout)``, or a plain ``wait()`` on a backend whose work objects take no
    timeout (torch's threaded test process group raises "with finite timeout not
    implemented"): there a hang is bounded by the process group's own timeout instead. With an
    ``interrupt`` (NOTE [Interrupts]) the wait polls it."""
    if interrupt is not None:
        return _polled_wait(work, timeout, interrupt)
    try:
        return bool(work.wait(timeout))
    except RuntimeError as exc:
        if "timeout not implemented" not in str(exc):
            raise
    return bool(work.wait())
