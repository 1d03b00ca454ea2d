"""The built-in GPT: sizes, shapes, deterministic init, sampling, and name errors."""

from __future__ import annotations

import pytest
import torch

from fullshard.app.models.gpt import (
    GPT,
    MODEL_SIZES,
    Block,
    build_model,
    count_params,
    generate,
    unit_types_of,
)


def expected_params(name: str, vocab: int) -> int:
    """Closed-form parameter count of a GPT size (untied head, biases, LayerNorm with bias)."""
    c = MODEL_SIZES[name]
    d, f = c.d_model, c.mlp_ratio * c.d_model
    block = (d * 3 * d + 3 * d) + (d * d + d) + (d * f + f) + (f * d + d) + 2 * (2 * d)
    return vocab * d + c.max_seq_len * d + c.n_layer * block + 2 * d + d * vocab


@pytest.mark.parametrize("name", list(MODEL_SIZES))
def test_param_count_matches_closed_form(name: str) -> None:
    # The meta device builds even the 7b configuration instantly, without memory.
    model = build_model(name, 256, device="meta")
    assert count_params(model) == expected_params(name, 256)
    assert len(model.blocks) == MODEL_SIZES[name].n_layer
    assert unit_types_of(model) == (Block,)


def test_named_sizes_are_in_their_advertised_ranges() -> None:
    counts = {n: expected_params(n, 256) for n in MODEL_SIZES}
    assert 0.1e6 < counts["tiny"] < 0.3e6
    assert 1e6 < counts["demo"] < 3e6
    assert 9e6 < counts["small"] < 11e6
    # GPT-2 ties its head to the embedding: 124M = our untied count minus one vocab x d matrix.
    assert 123e6 < expected_params("gpt2-124m", 50257) - 50257 * 768 < 125e6
    assert 0.9e9 < counts["1b"] < 1.2e9
    assert 6e9 < counts["7b"] < 8e9


def test_forward_shape_and_causality() -> None:
    model = build_model("tiny", 256, seed=0)
    x = torch.randint(0, 256, (2, 16))
    logits = model(x)
    assert logits.shape == (2, 16, 256)
    # Changing a later token must not change earlier positions' logits, by a single bit: the
    # same kernels on the same shapes, and the causal mask gives the later position an exact
    # zero weight (exp(-inf)), which adds nothing to the earlier rows' sums.
    y = x.clone()
    y[:, 10] = (y[:, 10] + 1) % 256
    assert torch.equal(model(y)[:, :10], logits[:, :10])
    assert not torch.allclose(model(y)[:, 10:], logits[:, 10:])


def test_init_is_deterministic_and_ignores_global_rng() -> None:
    torch.manual_seed(1)
    a = build_model("tiny", 256, seed=7)
    torch.manual_seed(2)
    b = build_model("tiny", 256, seed=7)
    c = build_model("tiny", 256, seed=8)
    for (n, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters(), strict=True):
        assert torch.equal(pa, pb), n
        if pa.dim() == 2:
            assert not torch.equal(pa, pc), n


def test_too_long_sequence_is_refused() -> None:
    model = build_model("tiny", 256)
    assert isinstance(model, GPT)
    with pytest.raises(ValueError, match="exceeds"):
        model(torch.zeros(1, model.cfg.max_seq_len + 1, dtype=torch.long))


def test_generate_is_seeded_and_crops_context() -> None:
    model = build_model("tiny", 256, seed=0)
    prompt = torch.tensor([84, 104, 101])
    n = model.cfg.max_seq_len  # longer than the context: the sampler must crop
    out1 = generate(model, prompt, n, 0.8, 10, generator=torch.Generator().manual_seed(3))
    out2 = generate(model, prompt, n, 0.8, 10, generator=torch.Generator().manual_seed(3))
    assert out1.shape == (3 + n,)
    assert torch.equal(out1[:3], prompt)
    assert torch.equal(out1, out2)
    greedy = generate(model, prompt.unsqueeze(0), 5, temperature=0)
    assert greedy.shape == (1, 8)
    assert model.training  # restored


def test_unknown_model_name_lists_the_known_ones() -> None:
    with pytest.raises(ValueError) as info:
        build_model("gpt5", 256)
    msg = str(info.value)
    assert "unknown model 'gpt5'" in msg
    for name in MODEL_SIZES:
        assert name in msg
    assert "hf:llama-tiny" in msg
