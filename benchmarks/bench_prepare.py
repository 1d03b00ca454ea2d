"""``fullshard prepare`` throughput, and train start-up and memory from prepared shards.

Usage::

    python benchmarks/bench_prepare.py                       # 1 GB corpus (the lead's measurement)
    python benchmarks/bench_prepare.py --size-mb 20 --small-mb 5 --out /tmp/prepare.json   # a check

1. Generates a synthetic corpus of ``--size-mb`` MB (deterministic word-like text: words drawn
   from a fixed vocabulary of made-up words, with lines and paragraphs; written in chunks to a
   folder of files of at most 64 MB, never held in memory), and a ``--small-mb`` one.
2. Trains a small BPE tokenizer (``tokenizers``, ``--bpe-vocab`` ids) on a 2 MB sample and saves
   it as a Hugging Face tokenizer directory (tokenizer.json + tokenizer_config.json).
3. Runs ``fullshard prepare`` on the large corpus with the byte tokenizer and with the BPE
   tokenizer: MB/s of input (wall clock of the command, and the command's own figure, which
   leaves out interpreter start-up).
4. Prepares the small corpus (byte) and trains from both prepared folders on ``--nproc`` ranks
   (``--model tiny``, ``--max-steps 2``): start-up = launch to the first logged step (the time
   the ``step 1/`` line appears), and every rank's peak RSS (VmHWM, polled from /proc while the
   ranks run) and RSS at step 1 (metrics.jsonl). Start-up and memory should not grow with the
   corpus.

Prints a table and writes JSON to ``--out`` (default docs/bench/prepare.json).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

SRC = Path(__file__).resolve().parents[1] / "src"
FILE_MB = 64
SYLLABLES = ["ka", "lo", "mi", "re", "tan", "su", "vel", "or", "in", "qu", "da", "phe", "ro", "ys"]


def _vocabulary(n: int, seed: int = 0) -> np.ndarray:
    """``n`` made-up words: every word of 1, 2, 3... syllables, shortest first (a Zipf-like draw
    then makes common words short), in a seeded order within each length."""
    rng = np.random.default_rng(seed)
    words: list[str] = []
    level = [""]
    while len(words) < n:
        level = [w + s for w in level for s in SYLLABLES]
        words += [level[i] for i in rng.permutation(len(level))]
    return np.array(words[:n])


def generate(folder: Path, size_mb: float, seed: int = 0) -> int:
    """Write ``size_mb`` MB of word-like text under ``folder`` in chunks; returns the bytes."""
    folder.mkdir(parents=True, exist_ok=True)
    vocab = _vocabulary(20_000, seed)
    weights = 1.0 / np.arange(1, len(vocab) + 1)
    weights /= weights.sum()
    rng = np.random.default_rng(seed + 1)
    target, written, file_no = int(size_mb * 1e6), 0, 0
    f = None
    while written < target:
        if f is None or f.tell() >= FILE_MB * 1_000_000:
            if f is not None:
                f.close()
            f = open(folder / f"part-{file_no:04d}.txt", "w", encoding="utf-8")  # noqa: SIM115
            file_no += 1
        words = vocab[rng.choice(len(vocab), size=200_000, p=weights)]
        # a newline after ~12 words, a blank line (paragraph) after ~8 lines
        seps = np.where(rng.random(len(words)) < 1 / 12, "\n", " ")
        seps[rng.random(len(words)) < 1 / 96] = "\n\n"
        chunk = "".join(np.char.add(words, seps).tolist())[: target - written]
        f.write(chunk)
        written += len(chunk.encode("utf-8"))
    if f is not None:
        f.close()
    return written


def bpe_tokenizer(corpus: Path, out: Path, vocab_size: int) -> Path:
    """A byte-level BPE trained on the first 2 MB of ``corpus``, as a HF tokenizer directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    first = sorted(corpus.glob("*.txt"))[0]
    with open(first, encoding="utf-8") as fh:
        sample = fh.read(2_000_000)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(sample.split("\n\n"), trainer)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>"}
    (out / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return out


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), env.get("PYTHONPATH", "")])
    return env


def run_prepare(inputs: Path, out: Path, tokenizer: str, workers: int) -> dict[str, Any]:
    """One ``fullshard prepare`` from scratch; its wall time and its own summary line."""
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "fullshard.app.cli", "prepare", str(inputs), "--out", str(out)]
    cmd += ["--tokenizer", tokenizer, "--no-progress"] + (
        ["--workers", str(workers)] if workers else []
    )
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(), check=False)
    wall = time.perf_counter() - start
    if proc.returncode:
        raise SystemExit(f"prepare failed:\n{proc.stderr[-3000:]}")
    line = proc.stdout.strip().splitlines()[-1]
    index = json.loads((out / "index.json").read_text())
    mb = sum(f["size"] for f in index["inputs"]) / 1e6
    own = re.search(r"([\d,.]+) MB/s", line)
    return {
        "tokenizer": "byte" if tokenizer == "byte" else "bpe",
        "input_mb": round(mb, 1),
        "tokens": index["tokens"],
        "shards": sum(len(s["shards"]) for s in index["splits"].values()),
        "wall_s": round(wall, 2),
        "mb_per_s": round(mb / wall, 1),
        "mb_per_s_own": float(own.group(1).replace(",", "")) if own else None,
        "line": line,
    }


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                kids = [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
            out += kids
            todo += kids
    return out


def _rank_peaks(pid: int, peaks: dict[int, float], stop: threading.Event) -> None:
    """Poll the ranks' VmHWM (peak RSS, MiB) until ``stop``; ranks are keyed by their RANK."""
    while not stop.is_set():
        for child in _descendants(pid):
            try:
                env = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
                status = Path(f"/proc/{child}/status").read_text()
            except OSError:
                continue
            rank = next((int(e[5:]) for e in env if e.startswith(b"RANK=")), None)
            hwm = re.search(r"VmHWM:\s+(\d+) kB", status)
            if (
                rank is not None
                and hwm
                and "fullshard" in Path(f"/proc/{child}/cmdline").read_text(errors="replace")
            ):
                peaks[rank] = max(peaks.get(rank, 0.0), int(hwm.group(1)) / 1024)
        stop.wait(0.1)


def run_train(data: Path, work: Path, name: str, nproc: int, model: str) -> dict[str, Any]:
    """Train a few steps from ``data``; start-up time and per-rank memory."""
    cmd = [
        sys.executable,
        "-m",
        "fullshard.app.cli",
        "train",
        "--data",
        str(data),
        "--model",
        model,
        "--nproc",
        str(nproc),
        *["--max-steps", "2", "--log-every", "1", "--eval-every", "0"],
        *["--eval-batches", "1", "--batch-size"],
        str(4 * nproc),
        *["--seq-len", "128", "--sample-tokens", "0", "--no-progress"],
        "--runs-dir",
        str(work / "runs"),
        "--name",
        name,
    ]
    shutil.rmtree(work / "runs" / name, ignore_errors=True)
    start = time.perf_counter()
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env()
    )
    peaks: dict[int, float] = {}
    stop = threading.Event()
    poller = threading.Thread(target=_rank_peaks, args=(proc.pid, peaks, stop), daemon=True)
    poller.start()
    first_step = None
    log = []
    assert proc.stdout is not None
    for line in proc.stdout:
        log.append(line)
        if first_step is None and line.startswith("step 1/"):
            first_step = time.perf_counter() - start
    proc.wait()
    stop.set()
    poller.join()
    if proc.returncode:
        raise SystemExit(f"train failed:\n{''.join(log)[-3000:]}")
    records = [
        json.loads(x) for x in (work / "runs" / name / "metrics.jsonl").read_text().splitlines()
    ]
    return {
        "startup_to_first_step_s": round(first_step or float("nan"), 2),
        "wall_s": round(time.perf_counter() - start, 2),
        "peak_rss_mib": [round(peaks.get(r, float("nan")), 1) for r in range(nproc)],
        "rss_at_step1_mib": records[0]["mem_mib"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--size-mb", type=float, default=1000.0, help="large corpus size (default 1000)"
    )
    ap.add_argument("--small-mb", type=float, default=10.0, help="small corpus size (default 10)")
    ap.add_argument("--bpe-vocab", type=int, default=8000, help="BPE vocabulary (default 8000)")
    ap.add_argument("--workers", type=int, default=0, help="prepare --workers (default: CPUs)")
    ap.add_argument("--nproc", type=int, default=2, help="training ranks (default 2)")
    ap.add_argument("--model", default="tiny", help="model for the start-up runs (default tiny)")
    ap.add_argument("--work", help="scratch folder (default: a temporary folder, removed after)")
    ap.add_argument("--out", default="docs/bench/prepare.json", help="JSON results")
    args = ap.parse_args()

    work = Path(args.work or tempfile.mkdtemp(prefix="bench_prepare-"))
    try:
        results = _bench(args, work)
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {args.out}")


def _bench(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    sizes = {"large": args.size_mb, "small": args.small_mb}
    for key, mb in sizes.items():
        t = time.perf_counter()
        n = generate(work / f"corpus-{key}", mb, seed=0 if key == "large" else 1)
        print(f"generated {n / 1e6:,.1f} MB ({key}) in {time.perf_counter() - t:.1f} s", flush=True)
    bpe = bpe_tokenizer(work / "corpus-large", work / "bpe", args.bpe_vocab)
    prep = []
    for tok in ("byte", str(bpe)):
        name = "byte" if tok == "byte" else "bpe"
        prep.append(run_prepare(work / "corpus-large", work / f"large-{name}", tok, args.workers))
        print(prep[-1]["line"], flush=True)
    shutil.rmtree(work / "large-bpe", ignore_errors=True)
    run_prepare(work / "corpus-small", work / "small-byte", "byte", args.workers)
    startup = []
    for key in ("small", "large"):
        res = run_train(work / f"{key}-byte", work, key, args.nproc, args.model)
        res.update(corpus_mb=sizes[key], data="prepared (byte)")
        startup.append(res)
        print(f"train from {sizes[key]} MB prepared: {res}", flush=True)

    print(f"\nfullshard prepare ({os.cpu_count()} CPUs, workers={args.workers or 'CPUs'})")
    print(
        f"{'tokenizer':>9} | {'input MB':>9} | {'tokens':>13} | {'wall s':>7} | {'MB/s':>6} | MB/s (own)"
    )
    for r in prep:
        print(
            f"{r['tokenizer']:>9} | {r['input_mb']:>9,.1f} | {r['tokens']:>13,} | {r['wall_s']:>7.1f} | "
            f"{r['mb_per_s']:>6.1f} | {r['mb_per_s_own']}"
        )
    print(f"\ntrain start-up, {args.nproc} ranks, --model {args.model}")
    print(
        f"{'corpus MB':>9} | {'launch->step 1 s':>16} | {'peak RSS MiB per rank':>22} | RSS at step 1"
    )
    for r in startup:
        print(
            f"{r['corpus_mb']:>9,.0f} | {r['startup_to_first_step_s']:>16.2f} | "
            f"{' '.join(f'{v:.0f}' for v in r['peak_rss_mib']):>22} | {r['rss_at_step1_mib']}"
        )
    return {
        "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]},
        "args": vars(args),
        "prepare": prep,
        "startup": startup,
    }


if __name__ == "__main__":
    main()
