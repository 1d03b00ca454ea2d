"""Peak host memory per rank of loading a Hugging Face checkpoint: sharded vs full load.

Usage: ``python benchmarks/bench_load.py [--nprocs 2,4] [--out docs/bench/load.json]
[--checkpoint DIR] [--layers 12]``

Writes a GPT-2 124M-shaped safetensors checkpoint (``transformers`` GPT2 config: n_embd 768,
12 layers, vocabulary 50257, tied head; random weights) with ``save_pretrained`` to a temporary
folder (or uses ``--checkpoint``), then for each world size launches fresh gloo ranks twice:

- ``sharded``: build on the meta device, shard (FULL_SHARD, each decoder layer a unit), materialise
  and ``fullshard.checkpoint.load_safetensors`` (what ``fullshard train --model hf:DIR`` does);
- ``full``: ``from_pretrained`` on every rank (the whole model), then shard.

Each rank reports its peak resident set (``VmHWM``) before building (the baseline: torch and
transformers imported, process group up) and after loading, its shard's bytes, and a hash of its
local tensors: the two methods must give every rank the same bytes. RSS also counts the file
pages a rank touched through safetensors' memory map. ``MALLOC_MMAP_THRESHOLD_=65536`` is set for
the ranks so that freed tensors leave the resident set at once (as in docs/design.md). Prints a
table and writes JSON.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

MIB = 2**20


def _peak_mib() -> float:
    from fullshard.observe.rss import peak_rss_bytes

    return peak_rss_bytes() / MIB


def write_checkpoint(folder: Path, layers: int) -> int:
    """A random GPT-2-small-shaped checkpoint in ``folder``; returns its parameter count."""
    import transformers

    config = transformers.GPT2Config(n_embd=768, n_layer=layers, n_head=12, vocab_size=50257)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    model.save_pretrained(folder, safe_serialization=True)
    return sum(p.numel() for p in model.parameters())


def _worker(rank: int, world: int, store: str, folder: str, mode: str, results: Any) -> None:
    torch.set_num_threads(1)
    import torch.distributed as dist
    import transformers  # noqa: F401  # imported before the baseline: both methods need it

    from fullshard.app.config import ParallelismConfig
    from fullshard.app.models.gpt import unit_types_of
    from fullshard.app.models.hf import build_hf_model
    from fullshard.app.models.wrap import shard_model

    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    baseline = _peak_mib()
    t0 = time.perf_counter()
    model = build_hf_model(folder, None, lazy_weights=mode == "sharded")
    shard_model(model, ParallelismConfig(), unit_types_of(model))  # loads a lazily built model
    seconds = time.perf_counter() - t0
    peak = _peak_mib()
    digest = hashlib.sha256()
    shard_bytes = 0
    # named_parameters: a tied weight once (the state dict names it twice)
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        local = (t.to_local() if hasattr(t, "to_local") else t).detach().contiguous()
        digest.update(name.encode())
        digest.update(local.view(torch.uint8).numpy().tobytes() if local.numel() else b"")
        if hasattr(t, "to_local"):
            shard_bytes += local.numel() * local.element_size()
    results.put(
        {
            "rank": rank,
            "baseline_mib": round(baseline, 1),
            "peak_mib": round(peak, 1),
            "shard_mib": round(shard_bytes / MIB, 1),
            "load_s": round(seconds, 2),
            "hash": digest.hexdigest(),
        }
    )
    dist.destroy_process_group()


def measure(folder: Path, world: int, mode: str) -> list[dict[str, Any]]:
    """One launch of ``world`` fresh ranks loading ``folder`` by ``mode``; per-rank figures."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [
            ctx.Process(
                target=_worker,
                args=(r, world, os.path.join(tmp, "store"), str(folder), mode, results),
            )
            for r in range(world)
        ]
        for p in procs:
            p.start()
        out = [results.get(timeout=900) for _ in procs]
        for p in procs:
            p.join()
            if p.exitcode != 0:
                raise RuntimeError(f"{mode} load at {world} ranks: a rank exited with {p.exitcode}")
    return sorted(out, key=lambda r: r["rank"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nprocs", default="2,4", help="world sizes, comma-separated")
    parser.add_argument("--out", default="docs/bench/load.json", help="JSON output")
    parser.add_argument("--checkpoint", default="", help="an existing HF safetensors folder")
    parser.add_argument("--layers", type=int, default=12, help="decoder layers (12: GPT-2 small)")
    args = parser.parse_args()
    # the ranks inherit it: freed tensors go back to the system at once (see the docstring)
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.checkpoint) if args.checkpoint else Path(tmp) / "gpt2"
        params = None if args.checkpoint else write_checkpoint(folder, args.layers)
        file_mib = sum(f.stat().st_size for f in folder.glob("*.safetensors")) / MIB
        runs = []
        for world in (int(n) for n in args.nprocs.split(",")):
            sharded = measure(folder, world, "sharded")
            full = measure(folder, world, "full")
            equal = [s["hash"] == f["hash"] for s, f in zip(sharded, full, strict=True)]
            runs.append({"world_size": world, "sharded": sharded, "full": full, "equal": equal})
    print(f"checkpoint: {file_mib:.0f} MiB of safetensors ({params or '?'} parameters)")
    print(
        f"{'ranks':>5} {'rank':>4} {'baseline':>9} {'sharded peak':>13} {'full peak':>10} "
        f"{'sharded +':>10} {'full +':>7} {'shard':>6} {'equal':>6}   (MiB; +: over baseline)"
    )
    for run in runs:
        for s, f, eq in zip(run["sharded"], run["full"], run["equal"], strict=True):
            print(
                f"{run['world_size']:>5} {s['rank']:>4} {s['baseline_mib']:>9.0f} "
                f"{s['peak_mib']:>13.0f} {f['peak_mib']:>10.0f} "
                f"{s['peak_mib'] - s['baseline_mib']:>10.0f} {f['peak_mib'] - f['baseline_mib']:>7.0f} "
                f"{s['shard_mib']:>6.0f} {eq!s:>6}"
            )
    report = {
        "checkpoint_mib": round(file_mib, 1),
        "params": params,
        "malloc_mmap_threshold": os.environ["MALLOC_MMAP_THRESHOLD_"],
        "threads_per_rank": 1,
        "runs": runs,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {args.out}")
    if not all(all(r["equal"]) for r in runs):
        raise SystemExit("the sharded load differs from the full load on some rank")


if __name__ == "__main__":
    main()
