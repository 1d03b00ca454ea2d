"""``fullshard.optim`` in one process: the owners' arithmetic, the rule for which parameters are
whole matrices, and Muon without a process group (torch's answer, bit for bit)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fullshard.app.models.gpt import build_model
from fullshard.optim import Muon, hidden_matrix, matrix_groups
from fullshard.optim.exchange import assign_owners, ns_flops

pytestmark = pytest.mark.fast


def test_owners_balance_the_work_longest_first() -> None:
    # eight alike: 8/N each; ties go to the lowest rank, so every rank computes the same list
    assert assign_owners([1.0] * 8, 2) == [0, 1, 0, 1, 0, 1, 0, 1]
    assert [assign_owners([1.0] * 8, 3).count(r) for r in range(3)] == [3, 3, 2]
    # the largest first: 4 then 3 and 3 on the other rank, 2 + 2 back on the first
    costs = [3.0, 2.0, 4.0, 3.0, 2.0]
    owners = assign_owners(costs, 2)
    loads = [sum(c for c, o in zip(costs, owners, strict=True) if o == r) for r in range(2)]
    assert owners[2] == 0 and sorted(loads) == [6.0, 8.0]
    assert assign_owners([5.0, 1.0], 4) == [0, 1]  # more ranks than matrices: some own none


def test_newton_schulz_flops_count_the_short_side_squared() -> None:
    # per iteration: X X^T (2 s^2 l), A A (2 s^3), B X (2 s^2 l); the orientation does not matter
    assert ns_flops((256, 256), 5) == 5 * 6 * 256**3
    assert ns_flops((512, 128), 1) == ns_flops((128, 512), 1) == 4 * 128 * 128 * 512 + 2 * 128**3


def test_the_rule_keeps_embeddings_head_norms_and_biases_for_adamw() -> None:
    model = build_model("tiny", 256, seed=0, device="cpu")
    matrices, others = (g["params"] for g in matrix_groups(model))
    names = {id(p): n for n, p in model.named_parameters()}
    mat = {names[id(p)] for p in matrices}
    rest = {names[id(p)] for p in others}
    assert {"tok_embed.weight", "pos_embed.weight", "head.weight"} <= rest
    assert all(
        n.endswith(("bias", "ln_1.weight", "ln_2.weight"))
        or "embed" in n
        or n.startswith(("ln_f", "head"))
        for n in rest
    )
    assert "blocks.0.attn.q.weight" in mat and "blocks.0.mlp.proj.weight" in mat
    assert all(p.ndim == 2 for p in matrices)
    assert not hidden_matrix("lm_head.weight", torch.zeros(3, 3), nn.Linear(3, 3))


def _pair() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    a = nn.Sequential(nn.Embedding(9, 6), nn.Linear(6, 13), nn.Linear(13, 4, bias=False))
    b = nn.Sequential(nn.Embedding(9, 6), nn.Linear(6, 13), nn.Linear(13, 4, bias=False))
    b.load_state_dict(a.state_dict())
    return a, b


@pytest.mark.parametrize("nesterov", [True, False])
def test_without_a_process_group_it_is_torchs_muon_and_adamw(nesterov: bool) -> None:
    ours, ref = _pair()
    opt = Muon(matrix_groups(ours), lr=0.02, weight_decay=0.1, nesterov=nesterov)
    matrices, others = (g["params"] for g in matrix_groups(ref))
    refs = [
        torch.optim.Muon(matrices, lr=0.02, weight_decay=0.1, nesterov=nesterov),
        torch.optim.AdamW(others, lr=0.02, weight_decay=0.1),
    ]
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        for p, q in zip(ours.parameters(), ref.parameters(), strict=True):
            p.grad = torch.randn(p.shape, generator=g)
            q.grad = p.grad.clone()
        opt.step()
        for o in refs:
            o.step()
    for p, q in zip(ours.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, q)
    # AdamW's own keys in the AdamW group, Muon's lr and weight decay unless it sets them
    adamw = opt.param_groups[1]
    assert adamw["betas"] == (0.9, 0.999) and adamw["eps"] == 1e-8 and adamw["lr"] == 0.02
    assert opt.state_dict()["param_groups"][0]["use_muon"] is True


def test_bad_arguments_are_torchs_errors_and_vectors_go_to_adamw() -> None:
    model, _ = _pair()
    with pytest.raises(ValueError, match="Learning rate should be >= 0"):
        Muon(model.parameters(), lr=-1.0)
    with pytest.raises(ValueError, match="Adjust learning rate function x is not supported"):
        Muon(model.parameters(), adjust_lr_fn="x")
    with pytest.raises(ValueError, match="'use_muon': False"):
        Muon(model.parameters())  # the embedding is 2-D, the bias is not
