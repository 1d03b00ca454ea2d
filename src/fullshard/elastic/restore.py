"""Restoring a boundary at a new world size (layer 9): each rank receives only the blocks of its
new shards, from whoever holds them (NOTE [Restore by blocks]).

NOTE [Restore by blocks]
A boundary's pieces are each holder's blocks of the global tensors (NOTE [Ring copies]). A new
generation needs each rank's blocks of its *new* layout, which overlap the old ones anyhow (4
ranks to 3: old block 1 feeds new blocks 0 and 1). Gathering every piece on every rank and
loading the whole would cost each rank the whole model and its optimizer state in host memory
and in bytes received (84 GB per rank at 7B with AdamW). Instead:

1. every rank publishes its new blocks' boxes (shape and offset of each parameter's local
   block, from the model it just built): a few integers per parameter;
2. each provider (``choose_boundary``: one holder per shard key) cuts, for every rank, the
   intersection of each piece it holds with that rank's box of the same parameter (optimizer
   state follows its parameter's box), and packs them with a small header;
3. one all-to-all of uneven byte blocks (``control.all_to_all_bytes``) delivers them; each
   rank assembles its local blocks, checks that every element came (else
   :class:`~fullshard.elastic.pieces.Unrecoverable`), and loads them as DTensors of its new
   layout. Unsharded tensors (step counts, a device learning rate) and the loop's objects
   come from the lowest provider, to everyone: they are small.

Each rank then receives about its new shard (model and optimizer), whatever the world size;
:func:`plan_bytes` is the same cut, on boxes alone (``scripts/elastic_scale.py`` measures it).
"""

from __future__ import annotations

import pickle
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from fullshard.elastic.pieces import Copies, Unrecoverable, _lower, choose_boundary, unpacked

__all__ = [
    "Box",
    "assemble",
    "cut_for",
    "fqn_of",
    "plan_bytes",
    "restore_boundary",
    "state_dicts",
    "target_boxes",
    "unpacked_parts",
]

Box = tuple[list[int], list[int]]  # (shape, global offset) of a block


def fqn_of(path: str) -> str:
    """The parameter a piece's path belongs to: ``model\\0w`` and ``optim\\0w\\0exp_avg``: w."""
    return path.split("\0")[1]


def _overlap(a: Box, b: Box) -> Box | None:
    """The intersection of two boxes of one tensor (``None`` when empty)."""
    shape, offset = [], []
    for (na, oa), (nb, ob) in zip(zip(*a, strict=True), zip(*b, strict=True), strict=True):
        lo, hi = max(oa, ob), min(oa + na, ob + nb)
        if hi <= lo:
            return None
        shape.append(hi - lo)
        offset.append(lo)
    return shape, offset


def _slices(inner: Box, outer_offset: list[int]) -> tuple[slice, ...]:
    return tuple(
        slice(o - base, o - base + n) for n, o, base in zip(*inner, outer_offset, strict=True)
    )


def target_boxes(model_sd: dict[str, Any]) -> dict[str, Box]:
    """This rank's new block of each parameter (a DTensor's local box), by name."""
    from torch.distributed.tensor import DTensor

    from fullshard.elastic.pieces import _local_box

    return {fqn: _local_box(t) for fqn, t in model_sd.items() if isinstance(t, DTensor)}


def _wanted(path: str, global_shape: list[int], boxes: dict[str, Box]) -> Box | None:
    """The box ``path``'s rank wants of a piece of that global shape (a model parameter's, or
    its optimizer state's of the same shape), or ``None``."""
    box = boxes.get(fqn_of(path))
    if box is None or len(box[0]) != len(global_shape):
        return None
    return box


def cut_for(
    parts: Iterable[dict[str, Any]], boxes: dict[str, Box], with_whole: bool
) -> torch.Tensor:
    """The bytes one provider sends one rank: for each piece of ``parts`` (unpacked), its
    intersection with that rank's ``boxes``; ``with_whole``: the unsharded tensors and objects
    too. A header (pickled) says where each block goes; the blocks follow, contiguous."""
    header: list[tuple[str, list[int], list[int], list[int], torch.dtype, int]] = []
    blocks: list[torch.Tensor] = []
    whole: dict[str, Any] = {}
    at = 0
    for part in parts:
        for path, (shape, offset, local) in part["chunks"].items():
            want = _wanted(path, shape, boxes)
            got = None if want is None else _overlap(want, (list(local.shape), offset))
            if want is None:
                continue
            if got is None:  # nothing of it here: say so, so that the rank knows the tensor
                got = ([0] * len(want[0]), want[1])
            block = local[_slices(got, offset)].contiguous()
            raw = block.reshape(-1).view(torch.uint8)
            header.append((path, shape, got[0], got[1], block.dtype, at))
            blocks.append(raw)
            at += raw.numel()
        if with_whole and not whole:
            whole = {"fulls": part["fulls"], "objects": part["objects"]}
    meta = pickle.dumps({"blocks": header, "whole": whole if with_whole else None})
    head = torch.tensor(list(len(meta).to_bytes(8, "little")), dtype=torch.uint8)
    body = torch.frombuffer(bytearray(meta), dtype=torch.uint8)
    return torch.cat([head, body, *blocks]) if blocks else torch.cat([head, body])


def assemble(received: Iterable[torch.Tensor], boxes: dict[str, Box]) -> tuple[dict, dict]:
    """This rank's new blocks, from what every provider sent it: ``(blocks, whole)`` where
    ``blocks[path]`` is the local tensor of ``path`` (its box: the parameter's) and ``whole``
    holds the unsharded tensors and the objects. Raises :class:`Unrecoverable` naming a tensor
    some element of which no provider sent."""
    blocks: dict[str, torch.Tensor] = {}
    covered: dict[str, torch.Tensor] = {}
    whole: dict[str, Any] = {}
    for data in received:
        if not data.numel():
            continue
        n = int.from_bytes(bytes(data[:8].tolist()), "little")
        meta = pickle.loads(bytes(data[8 : 8 + n].numpy().tobytes()))
        payload = data[8 + n :]
        if meta["whole"] is not None and not whole:
            whole = meta["whole"]
        for path, shape, got_shape, got_offset, dtype, at in meta["blocks"]:
            box = _wanted(path, shape, boxes)
            assert box is not None, f"{path}: a block this rank did not ask for"
            if path not in blocks:
                blocks[path] = torch.empty(box[0], dtype=dtype)
                covered[path] = torch.zeros(box[0], dtype=torch.bool)
            count = int(torch.Size(got_shape).numel()) * dtype.itemsize
            # (a copy: the block sits at any byte offset of the received buffer)
            piece = payload[at : at + count].clone().view(dtype).view(got_shape)
            where = _slices((got_shape, got_offset), box[1])
            blocks[path][where] = piece
            covered[path][where] = True
    for path, mask in covered.items():
        if not bool(mask.all()):
            raise Unrecoverable(f"{path.replace(chr(0), '.')}: no survivor holds all of it")
    return blocks, whole


def plan_bytes(
    held: Iterable[tuple[int, dict[str, Box]]], wanted: dict[int, dict[str, Box]]
) -> dict[int, tuple[int, int]]:
    """The cut of :func:`cut_for` on boxes alone: for each rank of ``wanted`` (rank -> tensor
    -> its new box), the elements it receives from the other providers of ``held`` (``(provider,
    by the same rank numbers, tensor -> the box of a piece it provides)``) and from itself:
    ``{rank: (from others, from itself)}``. Dim-0 blocks are matched by their first rows (a
    sorted search), so a thousand ranks' plans take moments."""
    import bisect

    by_tensor: dict[str, list[tuple[int, int, Box]]] = {}
    for provider, boxes in held:
        for name, box in boxes.items():
            by_tensor.setdefault(name, []).append((box[1][0], provider, box))
    for pieces in by_tensor.values():
        pieces.sort(key=lambda x: (x[0], x[1]))
    out = {}
    for rank, boxes in wanted.items():
        others = mine = 0
        for name, box in boxes.items():
            pieces = by_tensor.get(name, [])
            starts = [p[0] for p in pieces]
            # every piece that starts before this box ends (and its last one before it)
            hi = bisect.bisect_left(starts, box[1][0] + box[0][0])
            lo = max(0, bisect.bisect_right(starts, box[1][0]) - 1)
            for _, provider, piece in pieces[lo:hi]:
                got = _overlap(box, piece)
                if got is not None:
                    n = int(torch.Size(got[0]).numel())
                    mine, others = (mine + n, others) if provider == rank else (mine, others + n)
        out[rank] = (others, mine)
    return out


def unpacked_parts(packed: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> list[dict[str, Any]]:
    """The pieces a provider holds, unpacked (views of their flat buffers)."""
    return [unpacked(meta, flat) for meta, flat in packed]


def state_dicts(
    blocks: dict[str, torch.Tensor], whole: dict[str, Any], like: dict[str, Any] | None = None
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """The model and optimizer state dicts and the loop state of :func:`assemble`'s result: each
    block a DTensor placed as the parameter of the same name in ``like`` (the new model's state
    dict; ``None``: the local blocks as they are), the unsharded tensors and objects as the
    boundary held them."""
    tensors: dict[str, Any] = dict(whole["fulls"])
    for path, local in blocks.items():
        spec = None if like is None else like.get(fqn_of(path))
        tensors[path] = local if spec is None else _placed(local, spec)
    objects = _lower(whole["objects"], tensors)
    model_sd: dict[str, Any] = {}
    optim_state: dict[str, dict[str, Any]] = {}
    for path, t in tensors.items():
        kind, *rest = path.split("\0")
        if kind == "model":
            model_sd[rest[0]] = t
        elif kind == "optim":
            optim_state.setdefault(rest[0], {})[rest[1]] = t
    for path, v in objects.items():
        if path.startswith("optim\0"):
            _, fqn, k = path.split("\0")
            optim_state.setdefault(fqn, {})[k] = v
    optim_sd = {"state": optim_state, "param_groups": objects["param_groups"]}
    return model_sd, optim_sd, objects["state"]


def _placed(local: torch.Tensor, like: Any) -> Any:
    """``local`` (this rank's block) as a DTensor placed as ``like``, on its device."""
    from torch.distributed.tensor import DTensor

    local = local.to(like.to_local().device)
    return DTensor.from_local(
        local,
        like.device_mesh,
        like.placements,
        run_check=False,
        shape=like.shape,
        stride=like.stride(),
    )


def restore_boundary(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    copies: Copies,
    member: int,
    rank: int,
    generation: int,
    group: Any,
) -> tuple[int, dict[str, Any], int]:
    """Choose the newest boundary the participants hold in full and load it into ``model`` and
    ``optimizer`` at their new layout (call on every rank of the new generation, ``member``
    being rank ``rank`` of ``generation``; ``group`` the host group). Returns the boundary's
    step, its loop state and the bytes this rank received. :class:`Unrecoverable` when some
    shard is held by no participant."""
    from fullshard.checkpoint.state_dict import get_state_dict, set_state_dict
    from fullshard.comm import control

    everyone = control.all_gather_objects((member, copies.held()), group)
    held = {m: h for m, h in everyone}
    layouts = {int(g): n for _, h in everyone for g, n in h["layouts"].items()}
    chosen = choose_boundary(held, layouts)
    if chosen is None:
        newest = max(layouts, default=generation)
        have = {k for h in held.values() for kind in ("own", "copy") for k in h[kind].values()}
        missing = sorted({k for k in range(layouts.get(newest, 0)) if f"{newest}:{k}" not in have})
        raise Unrecoverable(
            f"the shards of rank(s) {missing} of generation {newest} are held by no "
            "survivor (ring neighbours, or every replica of a shard, lost together)"
        )
    step, providers = chosen
    # NOTE [Restore by blocks]: each rank receives the blocks of its new shards only
    parts = unpacked_parts(
        copies.provide(step, sorted(k for k, p in providers.items() if p == member))
    )
    like, _ = get_state_dict(model, optimizer)  # the new layout, as built
    boxes = control.all_gather_objects(target_boxes(like), group)
    first = min(providers.values())  # the unsharded tensors and objects: from one
    sends = [cut_for(parts, box, with_whole=member == first) for box in boxes]
    received = control.all_to_all_bytes(sends, group)
    nbytes = sum(r.numel() for r in received)
    del parts, sends  # (views of this rank's host copies, which the caller clears)
    blocks, whole = assemble(received, boxes[rank])
    model_sd, optim_sd, loop_state = state_dicts(blocks, whole, like)
    if optim_sd["param_groups"] is not None:
        set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
    else:  # before the first update: as built, and a built optimizer holds no state (the
        # layout read above made some, with AdamW's step count at 1: a replayed step 1
        # would then correct its moments as a second step's)
        optimizer.state.clear()
    return step, loop_state, nbytes
