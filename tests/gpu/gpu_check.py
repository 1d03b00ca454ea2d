"""GPU check: every CLI command on NCCL, and every strategy with ranks sharing one GPU over gloo.

The driver of the GPU checks: ``make test-gpu`` runs them as tests (``tests/gpu/test_gpu.py``,
one test per check, skipped without CUDA); ``python scripts/gpu_check.py`` runs this driver as
one command (a few minutes on one GPU), printing one ``PASS``/``FAIL`` line per check, and exits
non-zero if any check fails (or none ran).

1. ``cli.*``: the real CLI (``python -m fullshard.app.cli ...``, a subprocess each) at world
   size 1 on NCCL: ``train`` with saves and ``--stop-after``, ``--resume latest``, ``convert``,
   a Hugging Face model (``hf:llama-tiny``), ``trace``, ``bench --mixed-precision bf16``,
   ``plan --check``, ``train`` on 2 ranks sharing the GPU over gloo, and ``train --elastic`` on
   them with rank 1 killed (under torch's CUDA sanitizer); each checks the exit status and the
   files the command must write. ``cli.device_step`` and ``cli.offload_step`` (issue 32) train 4
   steps with the device-decided step (fused AdamW, a float32 device learning rate) and with
   ``--cpu-offload`` (the host decides), learning rates and losses against a CPU run's;
   ``det.slice_sums`` sums the same rows' squares at 8 to 512 rows on the GPU, bit for bit
   (``--deterministic``'s gradient norm).
2. ``nccl1.*``, ``gloo2.*``, ``gloo4.*``: parity of every strategy against one unsharded
   model, bf16, CPU offload and a sharded checkpoint save/load, in spawned ranks: NCCL with one
   GPU per rank (world size = visible GPUs), then 2 and 4 ranks all on ``cuda:0`` over gloo
   (gloo moves CUDA tensors; NCCL refuses two ranks on one GPU). See ``gpu_check_ranks.py``.
3. ``nccl1.bf16_offload``, ``gloo2.bf16_offload``: bf16 parameters and reduce with CPU offload
   (pinned): every step's gradient shards against a bf16 reference and against the same run
   without offload (bitwise at the first step).
4. ``csan.nccl1``, ``csan.gloo4``: two steps of every strategy (and of bf16 with offload) in the
   group's ranks under torch's CUDA sanitizer (``TORCH_CUDA_SANITIZER=1``), in a subprocess:
   a PASS needs exit status 0 and no "CSAN" report.
5. ``fake8.steps``, ``fake8.no_host_sync``: rank 3 of 8 on torch's fake process group with the
   model on CUDA, every strategy: the engine's streams and stream-ordered collectives are used,
   and a quiet step synchronises the host nowhere (torch's GPU trace, sync debug mode).
   See ``gpu_checks_cuda.py`` for 3-5.

``--cpu`` (or ``FULLSHARD_GPU_CHECKS_ON_CPU=1`` for the tests) runs the same checks on gloo/CPU (``gloo1``, ``gloo2``, ``gloo4``), so the script
itself is tested where no GPU exists; ``--quick`` or ``--only PATTERNS`` pick a subset and
``--list`` prints the names. On CPU, 3 and 4 run their CPU forms (4 without the sanitizer,
which needs CUDA), ``fake8.steps`` runs its steps and ``fake8.no_host_sync`` prints a ``SKIP``
line (not counted). The ranks and the CLI run from this checkout: ``src`` is put on
``PYTHONPATH`` for every child, so no install is needed.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SRC = HERE.parents[1] / "src"
sys.path[:0] = [str(SRC), str(HERE)]  # this checkout's fullshard, and gpu_check_ranks
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (str(SRC), os.environ.get("PYTHONPATH", "")) if p
)  # for every child: spawned ranks, the CLI and its torchrun ranks

import gpu_check_ranks as ranks  # noqa: E402
import gpu_checks_cuda as cuda_checks  # noqa: E402
import torch  # noqa: E402

# the spawn and merge of a group live below this driver (the csan child runs groups too);
# merge is named here for the tests
from gpu_checks_cuda import merge, run_group  # noqa: E402, F401

QUICK = ("cli.train", "cli.resume", "cli.convert", "*2.parity.full_shard", "*2.checkpoint")
CLI_TIMEOUT_S = 300.0  # one CLI command (torchrun and its ranks included)
CSAN_TIMEOUT_S = 240.0  # one sanitizer subprocess (its group's spawn included)
FAKE_TIMEOUT_S = 180.0  # the fake-group subprocess
FAKE_WORLD = 8
Check = Callable[["Cli"], tuple[bool, str]]


class Cli:
    """Runs ``python -m fullshard.app.cli`` in a scratch folder, on ``device`` ("cuda"/"cpu")."""

    def __init__(self, work: Path, device: str, deadline: float) -> None:
        self.work = work
        self.device = device
        self.deadline = deadline  # time.monotonic() by which every check must be done
        self.runs = work / "runs"
        self._base: subprocess.CompletedProcess[str] | None = None

    def run(
        self, *args: str, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "fullshard.app.cli", *args]
        limit = min(CLI_TIMEOUT_S, self.deadline - time.monotonic())
        return run_bounded(cmd, limit, extra=env)

    def train(self, name: str, *extra: str) -> subprocess.CompletedProcess[str]:
        """A short tiny-model run on one rank, on this device."""
        return self.run(
            *["train", "--model", "tiny", "--nproc", "1", "--device"],
            self.device,
            *["--seq-len", "32", "--batch-size", "4", "--warmup-steps", "1"],
            *["--log-every", "1", "--eval-every", "0", "--eval-batches", "1"],
            *["--sample-tokens", "8", "--timeout", "120", "--runs-dir"],
            str(self.runs),
            "--name",
            name,
            *extra,
        )

    def base(self) -> subprocess.CompletedProcess[str]:
        """The run ``cli.train`` makes (and ``cli.resume`` / ``cli.convert`` continue)."""
        if self._base is None:
            self._base = self.train(
                "base", "--max-steps", "6", "--save-every", "2", "--stop-after", "4", "--keep", "5"
            )
        return self._base


def run_bounded(
    cmd: list[str], limit: float, drop: tuple[str, ...] = (), extra: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` (a child of this checkout, one thread per rank, gloo on loopback) for at most
    ``limit`` seconds: on timeout it and everything it started are killed (exit status 124).
    ``drop``: environment variables the child must not inherit; ``extra``: ones it gets."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", *drop)}
    env.update(extra or {})
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    env.setdefault("OMP_NUM_THREADS", "1")
    limit = max(1.0, limit)
    # its own session: on timeout the child, its torchrun or spawn and the ranks end together
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        return subprocess.CompletedProcess(cmd, 124, out, err + f"\ntimed out after {limit:.0f} s")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _failed(proc: subprocess.CompletedProcess[str]) -> str:
    tail = (proc.stderr.strip() or proc.stdout.strip()).splitlines()[-3:]
    return f"exit status {proc.returncode}: " + " | ".join(line[:200] for line in tail)


def _records(run: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _missing(folder: Path, names: tuple[str, ...]) -> list[str]:
    return [n for n in names if not (folder / n).is_file()]


RUN_FILES = ("config.toml", "metrics.jsonl", "loss.png", "sample.txt", "summary.json")


def cli_train(cli: Cli) -> tuple[bool, str]:
    proc = cli.base()
    if proc.returncode != 0:
        return False, _failed(proc)
    run = cli.runs / "base"
    ckpts = sorted(p.name for p in (run / "checkpoints").glob("step_*"))
    steps = [r["step"] for r in _records(run)]
    missing = _missing(run, ("config.toml", "metrics.jsonl"))
    ok = ckpts == ["step_00000002", "step_00000004"] and steps == [1, 2, 3, 4] and not missing
    ok = ok and all((run / "checkpoints" / c / "manifest.json").is_file() for c in ckpts)
    ok = ok and "stopped after step 4" in proc.stdout
    return ok, f"4 of 6 steps (--stop-after), checkpoints {ckpts}, missing files {missing}"


def cli_resume(cli: Cli) -> tuple[bool, str]:
    if cli.base().returncode != 0:
        return False, "the cli.train run failed"
    proc = cli.train("base", "--max-steps", "6", "--save-every", "2", "--resume", "latest")
    if proc.returncode != 0:
        return False, _failed(proc)
    run = cli.runs / "base"
    steps = [r["step"] for r in _records(run)]
    last = _records(run)[-1]
    ok = "resumed from step 4" in proc.stdout and steps == [1, 2, 3, 4, 5, 6]
    ok = ok and math.isfinite(last["loss"]) and not _missing(run, RUN_FILES)
    ok = ok and (run / "checkpoints" / "step_00000006" / "manifest.json").is_file()
    return ok, f"resumed from step 4 to 6, logged steps {steps}, final loss {last['loss']}"


def cli_convert(cli: Cli) -> tuple[bool, str]:
    if cli.base().returncode != 0:
        return False, "the cli.train run failed"
    out = cli.work / "converted"
    proc = cli.run("convert", str(cli.runs / "base" / "checkpoints"), str(out))
    if proc.returncode != 0:
        return False, _failed(proc)
    from safetensors.torch import load_file

    weights = load_file(out / "model.safetensors")
    n = sum(t.numel() for t in weights.values())
    finite = all(bool(torch.isfinite(t).all()) for t in weights.values())
    ok = "tok_embed.weight" in weights and n == 191_040 and finite  # the tiny model, unsharded
    return ok, f"{len(weights)} tensors, {n:,} parameters (tiny: 191,040), finite {finite}"


def cli_hf(cli: Cli) -> tuple[bool, str]:
    proc = cli.train("hf", "--model", "hf:llama-tiny", "--max-steps", "3")
    if proc.returncode != 0:
        return False, _failed(proc)
    run = cli.runs / "hf"
    summary = json.loads((run / "summary.json").read_text())
    ok = math.isfinite(summary["end_loss"]) and not _missing(run, RUN_FILES)
    return (
        ok,
        f"hf:llama-tiny, 3 steps, loss {summary['start_loss']:.3f} -> {summary['end_loss']:.3f}",
    )


def cli_trace(cli: Cli) -> tuple[bool, str]:
    out = cli.work / "trace"
    proc = cli.run(
        "trace",
        "--nproc",
        "1",
        "--device",
        cli.device,
        *["--model", "tiny", "--steps", "2", "--warmup", "1", "--batch-size", "2"],
        *["--seq-len", "32", "--out"],
        str(out),
    )
    if proc.returncode != 0:
        return False, _failed(proc)
    missing = _missing(out, ("trace.json", "trace.png", "trace_summary.json"))
    summary = json.loads((out / "trace_summary.json").read_text()) if not missing else {}
    events = len(json.loads((out / "trace.json").read_text())["traceEvents"]) if not missing else 0
    ok = not missing and summary.get("step_ms", 0) > 0 and events > 10
    return ok, f"{events} trace events, step {summary.get('step_ms', 0):.1f} ms, missing {missing}"


def cli_bench(cli: Cli) -> tuple[bool, str]:
    out = cli.work / "bench"
    proc = cli.run(
        "bench",
        "--nproc",
        "1",
        "--device",
        cli.device,
        *["--model", "tiny", "--variants", "full_shard,fsdp2,ddp,single"],
        *["--mixed-precision", "bf16", "--batch-size", "2", "--seq-len", "32", "--warmup", "1"],
        *["--rounds", "2", "--memory-steps", "2", "--timeout", "240", "--out"],
        str(out),
    )
    if proc.returncode != 0:
        return False, _failed(proc)
    missing = _missing(out, ("bench.json", "bench.md", "bench.png"))
    if missing:
        return False, f"missing {missing}"
    summary = json.loads((out / "bench.json").read_text())
    figs = summary["variants"]
    ok = summary["config"]["dtype"] == "bfloat16" and len(figs) == 4
    ok = ok and all(0 < f["issue_ms_median"] <= f["step_ms_median"] for f in figs.values())
    peaks = ""
    if cli.device == "cuda":  # the caching allocator's peaks, per variant
        alloc = [f["memory"]["cuda_max_allocated_mib"] or 0 for f in figs.values()]
        ok = ok and all(a > 0 for a in alloc)
        peaks = ", CUDA peak allocated MiB " + ", ".join(f"{a:.1f}" for a in alloc)
    issue = ", ".join(f"{n} {100 * f['issue_fraction']:.0f}%" for n, f in figs.items())
    return ok, f"bf16, issue/step: {issue}{peaks}"


def cli_plan(cli: Cli) -> tuple[bool, str]:
    proc = cli.run(
        *["plan", "--model", "tiny", "--devices", "1", "--batch", "2"],
        *["--seq", "32", "--check", "--check-device"],
        cli.device,
    )
    if proc.returncode != 0:
        return False, _failed(proc)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("peak per rank")), "")
    return bool(line), line or "no 'peak per rank' line"


def cli_share(cli: Cli) -> tuple[bool, str]:
    proc = cli.run(
        *["train", "--model", "tiny", "--nproc", "2", "--backend", "gloo"],
        "--device",
        cli.device,
        *["--max-steps", "3", "--seq-len", "32", "--batch-size", "4"],
        *["--log-every", "1", "--eval-every", "0", "--eval-batches", "1"],
        *["--sample-tokens", "0", "--timeout", "120", "--runs-dir"],
        str(cli.runs),
        "--name",
        "share",
    )
    if proc.returncode != 0:
        return False, _failed(proc)
    records = _records(cli.runs / "share")
    last = records[-1]
    ok = "2 ranks (gloo)" in proc.stdout and len(last["mem_mib"]) == 2
    mem = f"RSS MiB per rank {last['mem_mib']}"
    if cli.device == "cuda":
        ok = ok and len(last.get("cuda_peak_mib", [])) == 2
        mem = f"CUDA peak MiB per rank {last.get('cuda_peak_mib')}"
    return ok, f"2 ranks on one {cli.device} device over gloo, 3 steps, loss {last['loss']}, {mem}"


def cli_elastic(cli: Cli) -> tuple[bool, str]:
    """``train --elastic`` on 2 ranks sharing the device over gloo, rank 1 killed at step 3: the
    CUDA path's copies (pinned, on a side stream), the recovery's drain and rebuild, under
    torch's CUDA sanitizer on a GPU."""
    env = {"FULLSHARD_FAULT": "kill:rank=1:step=3"}
    if cli.device == "cuda":
        env["TORCH_CUDA_SANITIZER"] = "1"
    proc = cli.run(
        *["train", "--model", "tiny", "--nproc", "2", "--backend", "gloo"],
        "--device",
        cli.device,
        *["--elastic", "--deterministic", "--max-steps", "6", "--seq-len", "32"],
        *["--batch-size", "8", "--micro-batch-size", "2", "--log-every", "6", "--eval-every", "0"],
        *["--sample-tokens", "0", "--timeout", "120", "--runs-dir"],
        str(cli.runs),
        "--name",
        "elastic",
        env=env,
    )
    if proc.returncode != 0 or "CSAN" in proc.stderr:
        return False, _failed(proc)
    summary = json.loads((cli.runs / "elastic" / "summary.json").read_text())
    changes = [(c["ranks_lost"], c["ranks_joined"]) for c in summary.get("membership", [])]
    kept = summary["pids"][0] == summary["pids_at_start"][0]
    ok = changes == [([1], [1])] and kept and summary["process_restarts"] == 0
    return ok, f"rank 1 lost and replaced in memory {changes}, rank 0 kept its process: {kept}"


def _lrs_against_cpu(cli: Cli, name: str, *extra: str) -> tuple[bool, str]:
    """4 logged steps on this device and the same on the CPU: the learning rates per step
    (the device schedule's float32 against the host's float64) and the losses. On the CPU
    (``--cpu``) the first run takes the CUDA path under the emulation."""
    runs = {}
    emulated = {"FULLSHARD_CUDA_EMULATION": "1"} if cli.device == "cpu" else {}
    for label, device, env in (("device", cli.device, emulated), ("cpu", "cpu", {})):
        proc = cli.run(
            *["train", "--model", "tiny", "--nproc", "1", "--device"],
            device,
            *["--max-steps", "4", "--seq-len", "32", "--batch-size", "4"],
            *["--warmup-steps", "2", "--log-every", "1", "--eval-every", "0"],
            *["--eval-batches", "1", "--sample-tokens", "0", "--timeout", "120"],
            "--runs-dir",
            str(cli.runs),
            "--name",
            f"{name}-{label}",
            *extra,
            env=env,
        )
        if proc.returncode != 0:
            return False, f"{label}: {_failed(proc)}"
        runs[label] = [r for r in _records(cli.runs / f"{name}-{label}") if "lr" in r]
    got, want = runs["device"], runs["cpu"]
    steps_ok = [r["step"] for r in got] == [r["step"] for r in want] == [1, 2, 3, 4]
    lr_err = max(abs(a["lr"] - b["lr"]) / b["lr"] for a, b in zip(got, want, strict=False))
    loss_err = max(abs(a["loss"] - b["loss"]) for a, b in zip(got, want, strict=False))
    ok = steps_ok and lr_err < 1e-6 and loss_err < 0.05
    lrs = ", ".join(f"{r['lr']:.6g}" for r in got)
    return ok, f"lr per step {lrs}; vs CPU: lr rel. err {lr_err:.1e}, loss err {loss_err:.4f}"


def cli_device_step(cli: Cli) -> tuple[bool, str]:
    """The device-decided step (fused AdamW with a device learning rate, float32 as its CUDA
    kernel reads it): 4 steps, learning rates as the CPU run's."""
    return _lrs_against_cpu(cli, "device-step")


def cli_offload_step(cli: Cli) -> tuple[bool, str]:
    """``--cpu-offload``: the host decides the step (a device lr or found_inf read by the host
    kernel before its copy lands would corrupt it silently); learning rates and losses as on
    the CPU."""
    return _lrs_against_cpu(cli, "offload-step", "--cpu-offload")


def det_slice_sums(cli: Cli) -> tuple[bool, str]:
    """``--deterministic``'s per-slice sums of squares on this device: the same rows give the
    same bits whatever the number of rows around them (as a rank's shard at 2 or 8 ranks). The
    plain reduction kernel (``sum(dim=1)``) is shown beside it, for the record."""
    from fullshard.deterministic import _slice_squares

    gen = torch.Generator().manual_seed(0)
    full = torch.randn(512, 3000, generator=gen).to(cli.device)
    ref = _slice_squares(full[:8], 0)
    fixed = [_slice_squares(full[: 8 * k], 0)[:8] for k in (1, 4, 16, 64)]
    plain = [full[: 8 * k].double().pow(2).sum(dim=1)[:8] for k in (1, 4, 16, 64)]
    same = all(torch.equal(ref, f) for f in fixed)
    plain_same = all(torch.equal(plain[0], x) for x in plain)
    exact = full[:8].double().pow(2).sum(dim=1)
    err = float(((ref - exact).abs() / exact).max())
    return same and err < 1e-12, (
        f"fixed tree: same bits at 8/32/128/512 rows {same} (rel. err {err:.1e}); "
        f"sum(dim=1): same bits {plain_same}"
    )


CLI_CHECKS: dict[str, Check] = {
    "cli.train": cli_train,
    "cli.resume": cli_resume,
    "cli.convert": cli_convert,
    "cli.hf": cli_hf,
    "cli.trace": cli_trace,
    "cli.bench": cli_bench,
    "cli.plan": cli_plan,
    "cli.share": cli_share,
    "cli.elastic": cli_elastic,
    "cli.device_step": cli_device_step,
    "cli.offload_step": cli_offload_step,
    "det.slice_sums": det_slice_sums,
}


def groups(cpu: bool) -> list[tuple[str, str, int]]:
    """``(backend, device type, world size)`` of each spawned group."""
    if cpu:
        return [("gloo", "cpu", 1), ("gloo", "cpu", 2), ("gloo", "cpu", 4)]
    return [("nccl", "cuda", torch.cuda.device_count()), ("gloo", "cuda", 2), ("gloo", "cuda", 4)]


def bf16_groups(cpu: bool) -> list[tuple[str, str, int]]:
    """The groups of ``<group>.bf16_offload``: NCCL (gloo1 on CPU) and 2 ranks sharing one device."""
    return groups(cpu)[:2]


def csan_groups(cpu: bool) -> list[tuple[str, str, int]]:
    """The groups run under the sanitizer: NCCL (gloo1 on CPU), and gloo4 for the hybrids."""
    return [groups(cpu)[0], groups(cpu)[2]]


def all_names(cpu: bool) -> list[str]:
    names = list(CLI_CHECKS)
    for backend, _, world in groups(cpu):
        names += [f"{backend}{world}.{c}" for c in ranks.check_names(world)]
    names += [f"{b}{w}.{cuda_checks.BF16_OFFLOAD}" for b, _, w in bf16_groups(cpu)]
    names += [f"csan.{b}{w}" for b, _, w in csan_groups(cpu)]
    names += [f"fake{FAKE_WORLD}.{c}" for c in cuda_checks.FAKE_CHECKS]
    return names


class Report:
    """The PASS/FAIL (and SKIP) lines, printed as they come, and the time budget they share."""

    def __init__(self, budget_s: float) -> None:
        self.budget_s = budget_s
        self.deadline = time.monotonic() + budget_s
        self.results: list[tuple[str, bool]] = []
        self.skipped: list[str] = []

    def add(self, name: str, ok: bool | None, info: str, seconds: float) -> None:
        """One verdict; ``ok`` None is a SKIP (a check that needs CUDA, on CPU): not counted."""
        if ok is None:
            self.skipped.append(name)
            print(f"SKIP  {name}: {info}", flush=True)
            return
        self.results.append((name, ok))
        print(f"{'PASS' if ok else 'FAIL'}  {name}: {info} ({seconds:.1f} s)", flush=True)

    def spent(self, names: list[str]) -> bool:
        """True (and each of ``names`` a FAIL) once the budget is gone."""
        if time.monotonic() < self.deadline:
            return False
        for name in names:
            self.add(name, False, f"not run: the --budget of {self.budget_s:.0f} s is spent", 0)
        return True


def run_checks(chosen: list[str], cpu: bool, report: Report) -> None:
    """The chosen CLI checks, then each group's chosen checks, in a scratch folder."""
    with tempfile.TemporaryDirectory(prefix="fullshard-gpu-check-") as tmp:
        cli = Cli(Path(tmp), "cpu" if cpu else "cuda", report.deadline)
        for name in [n for n in chosen if n in CLI_CHECKS]:
            if report.spent([name]):
                continue
            t0 = time.perf_counter()
            try:
                ok, info = CLI_CHECKS[name](cli)
            except Exception as exc:  # a check's own bug is a FAIL line, not a crash
                ok, info = False, f"raised {type(exc).__name__}: {exc}"
            report.add(name, ok, info, time.perf_counter() - t0)
        for backend, device_type, world in groups(cpu):
            prefix = f"{backend}{world}."
            checks = [n[len(prefix) :] for n in chosen if n.startswith(prefix)]
            checks = [c for c in checks if c != cuda_checks.BF16_OFFLOAD]  # below, its own spawn
            if checks and not report.spent([prefix + c for c in checks]):
                group = run_group(backend, device_type, world, checks, Path(tmp), report.deadline)
                for result in group:
                    report.add(*result)
        run_cuda_checks(chosen, cpu, report, Path(tmp))


def run_cuda_checks(chosen: list[str], cpu: bool, report: Report, work: Path) -> None:
    """``<group>.bf16_offload`` (spawned ranks), ``csan.<group>`` and ``fake8.*`` (a subprocess
    each): see ``gpu_checks_cuda.py``."""
    device_type = "cpu" if cpu else "cuda"
    for backend, dev, world in bf16_groups(cpu):
        name = f"{backend}{world}.{cuda_checks.BF16_OFFLOAD}"
        if name in chosen and not report.spent([name]):
            for result in run_group(
                backend,
                dev,
                world,
                [cuda_checks.BF16_OFFLOAD],
                work,
                report.deadline,
                target=cuda_checks.run_rank,
            ):
                report.add(*result)
    for backend, dev, world in csan_groups(cpu):
        name = f"csan.{backend}{world}"
        if name in chosen and not report.spent([name]):
            t0 = time.perf_counter()
            ok, info = run_csan(backend, dev, world, work, report.deadline)
            report.add(name, ok, info, time.perf_counter() - t0)
    fake = [n for n in chosen if n.startswith(f"fake{FAKE_WORLD}.")]
    if fake and not report.spent(fake):
        t0 = time.perf_counter()
        for fake_name, verdict, fake_info in run_fake(device_type, work, report.deadline):
            if fake_name in fake:
                report.add(fake_name, verdict, fake_info, time.perf_counter() - t0)


def _child(what: str, *args: str) -> list[str]:
    return [sys.executable, str(HERE / "gpu_checks_cuda.py"), what, *args]


NO_SANITIZER = ("TORCH_CUDA_SANITIZER",)  # the csan child sets it for its ranks alone


def run_csan(
    backend: str, device_type: str, world: int, work: Path, deadline: float
) -> tuple[bool, str]:
    """One step per strategy in the group's ranks under ``TORCH_CUDA_SANITIZER=1``, in a
    subprocess bounded by ``CSAN_TIMEOUT_S`` (the group inside it 30 s less)."""
    out = work / f"csan.{backend}{world}.json"
    limit = min(CSAN_TIMEOUT_S, deadline - time.monotonic())
    proc = run_bounded(
        _child(
            "csan",
            "--backend",
            backend,
            "--device",
            device_type,
            "--world",
            str(world),
            "--out",
            str(out),
            "--work",
            str(work),
            "--timeout",
            str(max(10.0, limit - 30)),
        ),
        limit,
        NO_SANITIZER,
    )
    results = json.loads(out.read_text()) if out.is_file() else []
    return cuda_checks.csan_verdict(
        proc.returncode, proc.stdout + proc.stderr, results, sanitized=device_type == "cuda"
    )


def run_fake(device_type: str, work: Path, deadline: float) -> list[tuple[str, bool | None, str]]:
    """``fake8.*`` from one subprocess; both FAIL (with its output's tail) if it gave none."""
    out = work / f"fake{FAKE_WORLD}.json"
    limit = min(FAKE_TIMEOUT_S, deadline - time.monotonic())
    proc = run_bounded(
        _child("fake", "--device", device_type, "--world", str(FAKE_WORLD), "--out", str(out)),
        limit,
        NO_SANITIZER,
    )
    names = [f"fake{FAKE_WORLD}.{c}" for c in cuda_checks.FAKE_CHECKS]
    if not out.is_file():
        return [(n, False, _failed(proc)) for n in names]
    return [(name, ok, info) for name, ok, info, _ in json.loads(out.read_text())]


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--cpu", action="store_true", help="run the same checks on gloo/CPU")
    ap.add_argument("--quick", action="store_true", help="a short subset: " + ", ".join(QUICK))
    ap.add_argument("--only", default="", help="comma list of check names or fnmatch patterns")
    ap.add_argument("--list", action="store_true", help="print the check names and exit")
    ap.add_argument(
        "--budget",
        type=float,
        default=470.0,
        help="seconds for all checks; a check that would start later fails as not run "
        "(default: 470, under 8 minutes)",
    )
    args = ap.parse_args()
    if not args.cpu and not torch.cuda.is_available():
        print("no CUDA GPU visible: nothing to check (use --cpu for a dry run on gloo)")
        return 0
    names = all_names(args.cpu)
    if args.list:
        print("\n".join(names))
        return 0
    patterns = list(QUICK) if args.quick else [p.strip() for p in args.only.split(",") if p.strip()]
    chosen = [n for n in names if not patterns or any(fnmatch.fnmatch(n, p) for p in patterns)]
    where = "CPU (gloo)"
    if not args.cpu:
        # the count only: naming the GPU would open a CUDA context in this process, which a
        # GPU in exclusive mode would then refuse to the ranks
        where = f"{torch.cuda.device_count()} CUDA device(s)"
    print(f"fullshard GPU check on {where}, torch {torch.__version__}: {len(chosen)} checks")
    started = time.perf_counter()
    report = Report(args.budget)
    run_checks(chosen, args.cpu, report)
    failed = [name for name, ok in report.results if not ok]
    print(
        f"{len(report.results) - len(failed)} of {len(report.results)} checks passed in "
        f"{time.perf_counter() - started:.0f} s"
        + (f"; failed: {', '.join(failed)}" if failed else "")
        + (f"; skipped (need CUDA): {', '.join(report.skipped)}" if report.skipped else "")
    )
    return 0 if report.results and not failed else 1


if __name__ == "__main__":
    sys.exit(main())
