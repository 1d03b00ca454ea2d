"""``fullshard plan``: published figures, exact model-mode accounting, recommendations, CLI."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from fullshard.app.cli import main
from fullshard.app.commands.plan import make_plan
from fullshard.app.models.gpt import build_model, count_params, lm_loss, unit_types_of
from fullshard.app.models.planning import model_vocab, plan_builtin
from fullshard.comm.desync import TAG_LEN
from fullshard.engine.sharding import hybrid_shard_size
from fullshard.observe.rss import peak_rss_bytes, reset_peak_rss, rss_bytes
from fullshard.plan import (
    Plan,
    PlanConfig,
    fmt_bytes,
    load_hardware,
    measure_activations,
    model_units,
    plan_analytic,
    plan_model,
)
from fullshard.shard.layout import FlatLayout

GB = 1e9
ROOT = Path(__file__).resolve().parents[1]
# the planner is pure arithmetic over meta-device models: everything here is single-process and
# fast, except the two tests that launch the CLI (marked e2e)
pytestmark = pytest.mark.fast


def gb(x: float, digits: int) -> float:
    return round(x / GB, digits)


# -- the published figures (ZeRO paper section 5; the explainer's 70B case) -----------------------
def test_zero_ladder_7_5b_on_64() -> None:
    lad = plan_analytic(7.5e9, 64).ladder
    assert lad.bytes_per_param == 16  # mixed-precision Adam: 2 + 2 + K=12
    assert gb(lad.replicated, 0) == 120
    assert gb(lad.os, 1) == 31.4
    assert gb(lad.os_g, 1) == 16.6
    assert gb(lad.os_g_p, 2) == 1.88
    assert [fmt_bytes(x) for x in (lad.replicated, lad.os, lad.os_g, lad.os_g_p)] == [
        "120 GB",
        "31.4 GB",
        "16.6 GB",
        "1.88 GB",
    ]


def test_70b_figures() -> None:
    assert plan_analytic(70e9, 8).ladder.replicated == 1120 * GB
    assert fmt_bytes(plan_analytic(70e9, 8).ladder.replicated) == "1,120 GB"
    assert plan_analytic(70e9, 8).shard_bytes == pytest.approx(140 * GB)
    assert plan_analytic(70e9, 64).shard_bytes == pytest.approx(17.5 * GB)
    on_1024 = plan_analytic(70e9, 1024, layers=80)
    assert gb(on_1024.shard_bytes, 2) == 1.09
    assert on_1024.ladder.os_g_p == on_1024.shard_bytes
    # 80 layers of 875M parameters: 2 layers in bf16 forward, + 1 layer of grads in backward
    assert on_1024.window_forward == pytest.approx(3.5 * GB)
    assert on_1024.window_backward == pytest.approx(5.25 * GB)
    # the window, not the shard, sets the floor at this scale
    assert on_1024.window_forward > on_1024.shard_bytes


def test_communication_units() -> None:
    def units(strategy: str, world: int = 64) -> float:
        return plan_analytic(7.5e9, world, PlanConfig(strategy=strategy)).comm_units

    assert units("full_shard") == pytest.approx(3)  # 2 all-gathers + 1 reduce-scatter
    assert units("shard_grad_op") == pytest.approx(2)  # no backward all-gather
    assert units("no_shard") == pytest.approx(2)  # one all-reduce = RS + AG
    assert units("hybrid_shard") == pytest.approx(3 + 2 / 8)  # + all-reduce of the shard
    assert units("hybrid_shard_zero2") == pytest.approx(2 + 2 / 8)
    kinds = [c.kind for c in plan_analytic(7.5e9, 64).comm]
    assert kinds == ["all-gather (forward)", "all-gather (backward)", "reduce-scatter"]


def test_activation_checkpointing_keeps_layer_inputs() -> None:
    cfg = PlanConfig(batch=2, seq=1024)
    full = plan_analytic(7.5e9, 64, cfg, layers=32, hidden=4096, heads=32)
    ckpt = plan_analytic(
        7.5e9,
        64,
        PlanConfig(batch=2, seq=1024, activation_checkpointing=True),
        layers=32,
        hidden=4096,
        heads=32,
    )
    per_layer = 1024 * 2 * 4096 * (34 + 5 * 32 * 1024 / 4096)  # Korthikanti, 16-bit
    assert full.phases["forward"].activations == pytest.approx(32 * per_layer)
    # forward keeps the inputs of every layer (2 s b h bytes); backward rebuilds one layer (its
    # recomputed tensors are "other": the checkpoint's own hooks hold them)
    inputs = 32 * 2 * 1024 * 2 * 4096
    assert ckpt.phases["forward"].activations == pytest.approx(inputs)
    assert ckpt.phases["backward"].activations == pytest.approx(inputs)
    assert ckpt.phases["backward"].other == pytest.approx(per_layer)


# -- model mode: exactly what the engine would shard -------------------------------------------
@pytest.mark.parametrize("name", ["tiny", "demo", "small"])
def test_model_mode_counts_every_parameter(name: str) -> None:
    real = build_model(name, 256)
    plan = plan_builtin(name, 4, PlanConfig(precision="fp32", seq=64), with_recommendation=False)
    assert plan.params == count_params(real)
    assert plan.layers == real.cfg.n_layer  # type: ignore[union-attr]


def test_model_mode_large_model_costs_no_memory() -> None:
    meta = build_model("7b", 256, device="meta")
    cfg = PlanConfig(precision="bf16", seq=128)
    plan = plan_model(
        meta, unit_types_of(meta), 1024, cfg, loss_step=lm_loss, with_recommendation=False
    )
    assert plan.params == sum(p.numel() for p in meta.parameters())
    assert plan.params > 6e9


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_shard_bytes_follow_16_psi_over_n_plus_padding(world: int) -> None:
    model = build_model("small", 256, device="meta")
    psi = count_params(model)
    cfg = PlanConfig(precision="fp32")
    plan = plan_model(
        model, unit_types_of(model), world, cfg, loss_step=lm_loss, with_recommendation=False
    )
    units = model_units(model, unit_types_of(model), world)
    padded = sum(u.shard_numel for u in units)
    assert plan.shard_bytes == 16 * padded  # 4 B shard + 4 B grad + 8 B Adam state
    # padding: at most one row per parameter short of a full chunk
    slack = sum(p[0].numel() if p.dim() > 1 else 1 for p in model.parameters())
    assert 16 * psi / world <= plan.shard_bytes <= 16 * (psi / world + slack)
    if world == 1:
        assert plan.shard_bytes == 16 * psi
    # the same per-unit layout as the engine's (padding, and the position tags' tail)
    first_block = [p.shape for p in model.blocks[0].parameters()]  # type: ignore[union-attr]
    tail = TAG_LEN if world > 1 else 0
    assert units[1].shard_numel == FlatLayout(first_block, world, tail=tail).shard_numel


def test_model_units_root_first_then_blocks() -> None:
    model = build_model("tiny", 256, device="meta")
    units = model_units(model, unit_types_of(model), 2)
    assert [u.is_root for u in units] == [True, False, False, False]
    block = sum(p.numel() for p in model.blocks[0].parameters())  # type: ignore[union-attr]
    assert all(u.numel == block for u in units[1:])


def test_measured_activations_match_a_real_forward() -> None:
    """The fake-tensor count equals the bytes autograd saves in a real CPU forward + loss."""
    model = build_model("tiny", 256)
    acts = measure_activations(model, unit_types_of(model), lm_loss, 2, 32, torch.float32)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            saved[st.data_ptr()] = st.nbytes()
        return t

    idx = torch.zeros(2, 33, dtype=torch.long)  # 32 tokens in, 32 targets
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(idx[:, :-1])
        model_bytes = sum(saved.values())
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 256), idx[:, 1:].reshape(-1))
    assert sum(a for a, *_ in acts.values()) == sum(saved.values())
    del loss
    assert all(inp == 2 * 32 * 64 * 4 for _, inp, *_ in list(acts.values())[1:])  # block inputs
    root_saved, _, tail, loss_bytes = acts[0]
    assert loss_bytes == sum(saved.values()) - model_bytes > 0  # what the loss saves
    assert loss_bytes < tail < root_saved  # the head's saves too, but not the embedding's
    assert all(t == 0 and lb == 0 for _, _, t, lb in list(acts.values())[1:])


def test_phase_totals_order_strategies_by_memory() -> None:
    def peak(strategy: str) -> float:
        cfg = PlanConfig(strategy=strategy, precision="fp32", batch=2, seq=64)
        return plan_builtin("small", 4, cfg, with_recommendation=False).peak_bytes

    assert peak("full_shard") < peak("shard_grad_op") < peak("no_shard")


@pytest.mark.parametrize("strategy", ["full_shard", "shard_grad_op"])
def test_forward_window_is_the_engine_layout_of_the_units_it_holds(strategy: str) -> None:
    # computed here from the engine's layout, not from the planner's own unit costs: the root
    # and one block gathered under FULL_SHARD (the next block is still its all-gather buffer),
    # the root and every block under SHARD_GRAD_OP
    model = build_model("small", 256, device="meta")
    cfg = PlanConfig(strategy=strategy, precision="fp32", seq=64)
    plan = plan_builtin("small", 4, cfg, with_recommendation=False)
    blocks = list(model.blocks)  # type: ignore[union-attr,arg-type]
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    root = [p.shape for p in model.parameters() if id(p) not in in_blocks]

    def gathered(shapes: list[torch.Size]) -> int:
        return 4 * 4 * FlatLayout(shapes, 4, tail=TAG_LEN).shard_numel

    block = gathered([p.shape for p in blocks[0].parameters()])
    held = 1 if strategy == "full_shard" else len(blocks)
    assert plan.phases["forward"].gathered_window == gathered(root) + held * block


# -- recommendation ------------------------------------------------------------------------------
def test_recommendation_70b_on_8x80gb_shards_and_offloads() -> None:
    plan = make_plan(8, PlanConfig(device_memory=80 * GB), params=70e9, layers=80)
    rec = plan.recommendation
    assert rec is not None and rec.fits
    assert rec.strategy != "no_shard"
    assert rec.offload  # 140 GB of sharded state per device cannot stay on an 80 GB device
    assert "no_shard needs 1,400 GB" in rec.reason


def test_recommendation_70b_on_64_devices_needs_no_offload() -> None:
    cfg = PlanConfig(device_memory=80 * GB, activation_checkpointing=True)
    rec = make_plan(64, cfg, params=70e9, layers=80).recommendation
    assert rec is not None and rec.fits and not rec.offload
    assert rec.strategy in ("full_shard", "hybrid_shard", "hybrid_shard_zero2")


def test_recommendation_tiny_model_replicates() -> None:
    rec = make_plan(2, PlanConfig(precision="fp32", seq=64, device_memory=24 * GB), model="tiny")
    assert rec.recommendation is not None
    assert rec.recommendation.strategy in ("no_shard", "shard_grad_op")


def test_tensor_parallel_splits_the_matrices_and_adds_its_all_reduces() -> None:
    model = build_model("hf:llama-tiny", 256, device="meta")
    # every projection of attention and MLP is split (Llama's have no biases), and the
    # embedding and the head by vocabulary (torchtitan's plan, with loss parallel)
    split = sum(
        p.numel()
        for n, p in model.named_parameters()
        if n.endswith(("_proj.weight", "embed_tokens.weight", "lm_head.weight"))
    )
    whole = count_params(model)
    cfg = PlanConfig(precision="fp32", seq=32, batch=2, tp=2)
    plan = plan_builtin("hf:llama-tiny", 4, cfg, with_recommendation=False)
    assert plan.params == whole - split / 2  # this device's half of every split matrix
    assert plan.shard_group == 2  # 4 devices / tp 2
    hidden = model.config.hidden_size  # type: ignore[union-attr]
    layers = model.config.num_hidden_layers  # type: ignore[union-attr]
    (tp,) = [c for c in plan.comm if c.group == "tp"]
    assert tp.tensor_bytes == 4 * layers * 2 * 32 * hidden * 4  # 2 + 2 block-sized all-reduces
    assert main(["plan", "--params", "1e9", "--devices", "4", "--tp", "2"]) == 2


def test_hybrid_group_must_divide_the_world() -> None:
    with pytest.raises(ValueError, match="divides 4"):
        plan_analytic(1e9, 4, PlanConfig(strategy="hybrid_shard", hybrid_group=3))


@pytest.mark.parametrize(("world", "per_node", "group"), [(16, 8, 8), (8, 8, 4), (4, 2, 2)])
def test_hybrid_default_is_the_engines(world: int, per_node: int, group: int) -> None:
    # a node's devices shard when there are several nodes; on one node, half of them
    cfg = PlanConfig(strategy="hybrid_shard", devices_per_node=per_node)
    assert cfg.shard_group(world) == group
    assert hybrid_shard_size(world, 0, per_node) == group


# -- the command line -----------------------------------------------------------------------------
def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    return subprocess.run(
        [sys.executable, "-m", "fullshard.app.cli", "plan", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


@pytest.mark.e2e
def test_cli_analytic_prints_the_ladder(capsys: pytest.CaptureFixture[str]) -> None:
    # the console entry point once, as a user runs it (a fresh interpreter costs seconds) ...
    out = run_cli("--params", "7.5e9", "--devices", "64")
    assert out.returncode == 0, out.stderr
    for figure in ("120 GB", "31.4 GB", "16.6 GB", "1.88 GB", "Recommendation:", "why:"):
        assert figure in out.stdout
    # ... and the 70B case through the same main(), in this process
    assert main(["plan", "--params", "70e9", "--layers", "80", "--devices", "1024"]) == 0
    stdout = capsys.readouterr().out
    for figure in ("1,120 GB", "1.09 GB", "3.5 GB", "5.25 GB"):
        assert figure in stdout


def test_cli_model_mode_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    # in-process: the subprocess test above already covers the console entry point
    assert main(["plan", "--model", "small", "--devices", "4", "--batch", "8", "--seq", "128"]) == 0
    out = capsys.readouterr().out
    assert "small" in out and "fits" in out
    assert main(["plan", "--model", "tiny", "--devices", "2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["params"] == count_params(build_model("tiny", 256))
    assert set(data["phases"]) == {"forward", "backward", "optimizer"}
    assert data["recommendation"]["strategy"]


# Llama 3.1 8B's config.json: the published values, written here (nothing is downloaded)
LLAMA_3_1_8B = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "tie_word_embeddings": False,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
}


def test_cli_plans_a_hf_directory_with_its_own_vocabulary(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_3_1_8B))
    plans = {}
    for vocab in ([], ["--vocab", "256"]):  # the config's own, then --vocab overriding it
        argv = ["plan", "--model", f"hf:{tmp_path}", "--devices", "8", "--json", *vocab]
        assert main(argv) == 0
        plans[len(vocab)] = json.loads(capsys.readouterr().out)
    own, bytes_ = plans[0], plans[2]
    assert own["params"] == 8_030_261_248  # Meta's published count (embeddings and head untied)
    assert own["shape"]["vocab"] == 128_256
    assert bytes_["params"] == 6_981_685_248 and bytes_["shape"]["vocab"] == 256
    # the logits (fp32: batch 1 x 128 positions x the vocabulary) are in forward's activations
    logits = 1 * 128 * (128_256 - 256) * 4
    forward = own["phases"]["forward"]["activations"] - bytes_["phases"]["forward"]["activations"]
    assert forward >= logits


def test_a_hf_config_on_meta_never_holds_its_weights_on_the_host() -> None:
    # what lets an 8B config be planned on a laptop: the parameters are made on meta directly
    build_model("hf:llama-tiny", 256, device="meta")  # imports transformers' Llama first
    if not reset_peak_rss():
        pytest.skip("this system cannot reset the peak resident set")
    before = rss_bytes()
    model = build_model("hf:llama-1b", 256, device="meta")
    growth = peak_rss_bytes() - before
    fp32_bytes = 4 * count_params(model)  # 3.9 GB: what a CPU build then .to("meta") peaks at
    assert all(p.is_meta for p in model.parameters())
    assert growth < 0.1 * fp32_bytes, f"peak resident set grew {growth / 2**20:.0f} MiB"


def test_builtin_models_keep_the_byte_vocabulary() -> None:
    for name in ("tiny", "hf:llama-tiny"):  # HF_CONFIGS take theirs from the tokenizer
        assert model_vocab(name) == 256
        plan = plan_builtin(
            name, 2, PlanConfig(precision="fp32", seq=32), with_recommendation=False
        )
        assert plan.shape["vocab"] == 256
    assert model_vocab("hf:llama-tiny", 1000) == 1000


def test_cli_help_and_errors(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["plan", "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    for option in (
        *["--params", "--model", "--layers", "--devices", "--device-memory"],
        *["--precision", "--optimizer", "--strategy", "--hybrid-group"],
        *["--batch", "--seq", "--hidden", "--activation-checkpointing"],
        *["--offload", "--json"],
    ):
        assert option in out
    assert main(["plan", "--params", "1e9", "--devices", "2", "--strategy", "hybrid_shard"]) == 2
    assert "hybrid" in capsys.readouterr().err
    assert main(["plan", "--devices", "2"]) == 2  # neither --params nor --model (nor --calibrate)
    assert "--params" in capsys.readouterr().err


@pytest.mark.e2e
def test_check_mode_measures_what_it_predicts_within_10_percent(tmp_path: Path) -> None:
    """``plan --calibrate`` describes this machine; ``plan --check`` runs the model on 2 ranks:
    predicted peak vs the tracker's peak, and the step time predicted on that description next
    to the one measured (compared by the lead on a quiet machine; never asserted here)."""
    import json
    import subprocess
    import sys

    def cli(*args: str) -> str:
        proc = subprocess.run(
            [sys.executable, "-m", "fullshard.app.cli", "plan", *args],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
            cwd=tmp_path,
        )
        assert proc.returncode == 0, proc.stderr
        return proc.stdout

    cli("--calibrate", "--devices", "2", "--calibration", "here.json")
    machine = load_hardware(str(tmp_path / "here.json"))
    assert machine.kind == "cpu" and machine.rate("fp32") > 0 and machine.memory_bandwidth > 0
    out = cli(
        *["--model", "tiny", "--devices", "2", "--batch", "4", "--seq", "64"],
        *["--check", "--gpu", "here.json", "--json"],
    )
    res = json.loads(out[out.index("{") :])
    for phase in ("forward", "backward", "optimizer"):
        predicted = res["predicted"][phase]
        measured = res["measured"][phase]
        assert measured["total"] > 0
        assert abs(predicted["total"] - measured["total"]) <= 0.10 * measured["total"], phase
        # what the engine and optimizer own outright is predicted exactly (but the step scalars)
        for cat in ("sharded_params", "optimizer_state"):
            assert predicted[cat] == pytest.approx(measured[cat], rel=1e-3), (phase, cat)
    assert res["hardware"] == machine.name
    assert res["predicted_step_s"] > 0 and min(res["measured_step_s_per_rank"]) > 0


# -- step time, hardware, the new configurations ------------------------------------------------
LLAMA_DIR = ROOT / "tests" / "plan_runs" / "llama-3.1-8b"


def test_json_carries_memory_reserved_and_speed(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "plan",
        "--model",
        f"hf:{LLAMA_DIR}",
        *["--devices", "8", "--batch", "1", "--seq", "2048", "--precision", "bf16"],
        *["--activation-checkpointing", "selective", "--gpu", "h100-80gb", "--json"],
    ]
    assert main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    for key in (
        "peak_bytes",
        "peak_reserved_bytes",
        "step_time_s",
        "tokens_per_s_per_device",
        "mfu",
    ):
        assert data[key] > 0, key
    assert data["peak_reserved_bytes"] > data["peak_bytes"]  # the allocator's factor
    tps = 1 * 2048 / data["step_time_s"]
    assert data["tokens_per_s_per_device"] == pytest.approx(tps)
    assert sum(data["step_shares"].values()) == pytest.approx(1.0)
    assert data["recommendation"]["tokens_per_s_per_device"] > 0


def test_recommendation_is_the_fastest_that_fits() -> None:
    from fullshard.plan import recommend

    hw = load_hardware("h100-80gb")
    base = PlanConfig(precision="bf16", seq=2048, hardware=hw)
    fastest = {"full_shard": 900.0, "shard_grad_op": 800.0, "no_shard": 1e6}

    def evaluate(cfg: PlanConfig) -> Plan:
        plan = plan_analytic(7.5e9, 8, cfg)
        assert plan.step is not None
        speed = fastest.get(cfg.strategy, 100.0) - 50 * (cfg.checkpointing != "none")
        plan.step = dataclasses.replace(plan.step, tokens_per_s_per_device=speed)
        return plan

    rec = recommend(evaluate, base, 8)
    # no_shard would be fastest but does not fit (120 GB of state per device); full_shard
    # beats shard_grad_op here although it comes later in the order of least communication
    assert (rec.strategy, rec.activation_checkpointing) == ("full_shard", "none")
    assert rec.tokens_per_s_per_device == 900.0
    assert "Next fastest that fit: full_shard + selective" in rec.reason


def test_hardware_presets_and_json_round_trip(tmp_path: Path) -> None:
    from fullshard.plan import PRESETS, Hardware

    assert set(PRESETS) == {"h100-80gb", "h100-96gb-500w", "h200", "a100-80gb"}
    for hw in PRESETS.values():
        assert hw.rate("bf16") < hw.peak("bf16")  # an achieved rate, below the datasheet's
    with pytest.raises(ValueError, match="no fp8"):
        PRESETS["a100-80gb"].rate("fp8")
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps(PRESETS["h200"].to_dict()))
    assert load_hardware(str(path)) == PRESETS["h200"]
    path.write_text(json.dumps({**PRESETS["h200"].to_dict(), "hbm_bandwith": 1}))
    with pytest.raises(ValueError, match="unknown hardware keys"):
        load_hardware(str(path))
    with pytest.raises(ValueError, match="neither a preset"):
        load_hardware("h300")
    assert isinstance(Hardware.from_dict(PRESETS["h100-80gb"].to_dict()), Hardware)


def test_config_policies_and_scopes() -> None:
    assert PlanConfig(activation_checkpointing=True).checkpointing == "full"
    assert PlanConfig(activation_checkpointing=False).checkpointing == "none"
    assert PlanConfig(compile=True).compile == "all" and PlanConfig(compile="blocks").compile_blocks
    assert not PlanConfig(compile="blocks").compile_loss
    with pytest.raises(ValueError, match="one of none, selective, full"):
        PlanConfig(activation_checkpointing="some")
    with pytest.raises(ValueError, match="pipeline schedule"):
        PlanConfig(pp_schedule="gpipe")


def test_pipeline_stages_split_as_torchtitan_and_hold_microbatches() -> None:
    from fullshard.plan.pipeline import inflight, split_layers

    assert split_layers(126, 8) == [16] * 6 + [15] * 2  # 405B on 8 stages
    assert split_layers(126, 16) == [8] * 14 + [7] * 2  # interleaved: 2 stages per rank
    one = PlanConfig(pp=8)
    assert [inflight(one, r) for r in (0, 7)] == [8, 1]  # 1F1B: rank r holds pp - r
    inter = PlanConfig(pp=8, pp_schedule="interleaved")
    assert inflight(inter, 0) == 8  # all 16 stage-microbatches of its 2 stages, per stage
    with pytest.raises(ValueError, match="at most one per layer"):
        split_layers(4, 8)


def _plan8b(devices: int = 8, **kw: Any) -> Plan:
    """Llama 3.1 8B at batch 1 x 2048 on H100s, with ``kw`` changed."""
    cfg = PlanConfig(precision="bf16", batch=1, seq=2048, hardware=load_hardware("h100-80gb"))
    cfg = dataclasses.replace(cfg, **kw)
    return plan_builtin(f"hf:{LLAMA_DIR}", devices, cfg, with_recommendation=False)


def test_tensor_parallel_splits_activations_and_the_loss() -> None:
    from fullshard.plan.activations import analytic_activations
    from fullshard.plan.transformer import shape_of

    shape = shape_of(build_model(f"hf:{LLAMA_DIR}", 128256, device="meta"))
    assert shape is not None
    cfg = PlanConfig(precision="bf16", batch=1, seq=2048)
    one = analytic_activations(shape, 33, cfg)
    two = analytic_activations(shape, 33, dataclasses.replace(cfg, tp=2))
    # full checkpointing keeps each block's input (2 bytes x hidden per token): split by
    # sequence under TP
    assert one[1].input == 2048 * 4096 * 2 == 2 * two[1].input
    # loss parallel: the logits (vocabulary) are split, so the loss's transient halves
    assert one[0].loss_backward_extra == 2048 * 128256 * (12 - 4)
    assert two[0].loss_backward_extra == 2048 * 128256 / 2 * (16 - 4)  # DTensor's fused bwd
    # and the plan's activations under full checkpointing follow
    plans = [_plan8b(activation_checkpointing="full", tp=t, devices=8 * t) for t in (1, 2)]
    assert plans[1].phases["backward"].activations < 0.8 * plans[0].phases["backward"].activations


def test_float8_gathers_linear_weights_in_one_byte() -> None:
    bf16 = _plan8b(strategy="shard_grad_op")
    fp8 = _plan8b(strategy="shard_grad_op", float8=True)
    linears = sum(
        p.numel()
        for n, p in build_model(f"hf:{LLAMA_DIR}", 128256, device="meta").named_parameters()
        if n.endswith("_proj.weight")
    )
    # every block stays gathered under shard_grad_op: its linears at 1 byte instead of 2
    saved = bf16.phases["forward"].gathered_window - fp8.phases["forward"].gathered_window
    assert saved == pytest.approx(linears, rel=0.01)
    assert fp8.step is not None and bf16.step is not None
    assert fp8.step.parts["matmul"] < bf16.step.parts["matmul"]


def test_step_time_scales_with_work_and_hides_what_it_can() -> None:
    short, long_ = _plan8b(), _plan8b(batch=2)
    assert short.step is not None and long_.step is not None
    assert long_.step.parts["matmul"] == pytest.approx(2 * short.step.parts["matmul"])
    # eager elementwise ops move more bytes than compiled ones
    compiled = _plan8b(compile="all")
    assert compiled.step is not None
    assert compiled.step.parts["memory"] < 0.5 * short.step.parts["memory"]
    # async TP hides all-gathers under matmuls: less exposed, never more
    plain = _plan8b(tp=8, devices=64, activation_checkpointing="full")
    fused = _plan8b(tp=8, devices=64, activation_checkpointing="full", async_tp=True)
    assert plain.step is not None and fused.step is not None
    assert fused.step.exposed["tp_cp"] < plain.step.exposed["tp_cp"]
    assert fused.step.step_s < plain.step.step_s
