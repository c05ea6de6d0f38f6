"""``GRPOConfig.prefill_options``: one derivation of what prefill needs, harmless everywhere."""

from __future__ import annotations

import pytest
import torch

import longstraw_core as ls
from longstraw_core.adapters.matrix import probe_types
from longstraw_core.adapters.probe import PREFILL_OPTIONS
from longstraw_core.models.tiny import tiny_model

VOCAB = 512


def _ids(length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ({}, {"checkpoints": None, "keep_attention_outputs": False}),
        ({"recurrent_checkpoints": "cpu"}, {"checkpoints": None, "keep_attention_outputs": False}),
        ({"gradient": "exact"}, {"checkpoints": "device", "keep_attention_outputs": False}),
        (
            {"gradient": "exact", "recurrent_checkpoints": "cpu", "keep_attention_outputs": True},
            {"checkpoints": "cpu", "keep_attention_outputs": True},
        ),
    ],
)
def test_prefill_options_follow_the_gradient_mode(config: dict, expected: dict) -> None:
    assert ls.GRPOConfig(**config).prefill_options() == expected


@pytest.mark.parametrize("model_type", probe_types(PREFILL_OPTIONS))
def test_a_state_prefilled_with_the_options_serves_exact_mode(model_type: str) -> None:
    """Recurrent (Qwen3.6), latent-only (GLM-5.2) and dense models all take the options; an
    exact step on the state equals one that prefills itself. On GLM-5.2 (no recurrent layer,
    no full-attention K/V) they keep nothing extra."""
    model = tiny_model(model_type, dtype=torch.float64, seed=3)
    adapter = ls.adapt(model)
    prompt = _ids(21, 1)
    responses = [_ids(n, 10 + n) for n in (4, 6, 3)]
    rewards = [1.0, 0.0, 0.5]
    config = ls.GRPOConfig(gradient="exact", keep_attention_outputs=True, loss_type="grpo")
    state = adapter.prefill(prompt, chunk_size=8, **config.prefill_options())
    if model_type == "glm_moe_dsa":
        assert state.nbytes() == adapter.prefill(prompt, chunk_size=8).nbytes()
        assert state.output_nbytes() == 0
    if model_type == "qwen3":  # every layer but the last attends during prefill
        assert state.output_nbytes() > 0
    assert state.keeps_attention_outputs() and not state.needs_checkpoints()

    results = []
    for given in (state, None):
        model.zero_grad(set_to_none=True)
        result = ls.grpo_step(
            adapter, prompt, responses, rewards, config=config, state=given, chunk_size=8
        )
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append((result, grads))
    model.zero_grad(set_to_none=True)
    (reused, reused_grads), (own, own_grads) = results
    assert reused.loss == pytest.approx(own.loss, rel=1e-12, abs=1e-15)
    assert reused_grads.keys() == own_grads.keys() and reused_grads
    for name, grad in own_grads.items():
        torch.testing.assert_close(reused_grads[name], grad, rtol=1e-9, atol=1e-12)
