"""The dense adapter against the transformers model's own forward and backward."""

from __future__ import annotations

import pytest
import torch
from reference import (
    assert_grads_close,
    detached_reference_logps,
    full_sequence_logps,
    parameter_grads,
    with_lora,
)
from transformers import GPT2Config, GPT2LMHeadModel

import longstraw_core as ls
from longstraw_core.adapters.base import ModelAdapter
from longstraw_core.models.tiny import tiny_model

DENSE_TYPES = ["qwen3", "llama", "qwen2"]
PROMPT_LENGTH = 45  # 44 stored positions: 7 and 16 do not divide it, 1000 exceeds it


def _ids(length: int, vocab: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("model_type", DENSE_TYPES)
@pytest.mark.parametrize("chunk_size", [7, 16, 1000])
def test_score_equals_full_sequence_forward(model_type: str, chunk_size: int) -> None:
    model = tiny_model(model_type)
    adapter = ls.adapt(model)
    prompt, response = _ids(PROMPT_LENGTH, 512, 1), _ids(9, 512, 2)
    state = adapter.prefill(prompt, chunk_size=chunk_size)
    with torch.no_grad():
        logps = adapter.score(state, response)
        expected = full_sequence_logps(model, prompt, response)
    assert logps.shape == (9,)
    assert (logps - expected).abs().max() <= 1e-5


@pytest.mark.parametrize("model_type", DENSE_TYPES)
def test_gradients_equal_detached_cache_reference(model_type: str) -> None:
    model = tiny_model(model_type, dtype=torch.float64)
    adapter = ls.adapt(model)
    prompt, response = _ids(PROMPT_LENGTH, 512, 3), _ids(11, 512, 4)
    weights = torch.randn(11, dtype=torch.float64, generator=torch.Generator().manual_seed(5))

    state = adapter.prefill(prompt, chunk_size=7)
    ours = adapter.score(state, response)
    reference = detached_reference_logps(model, prompt, response)
    assert (ours - reference).abs().max() <= 1e-12

    expected = parameter_grads(model, (reference * weights).sum())
    assert sum(g.abs().sum() for g in expected.values()) > 0
    assert_grads_close(parameter_grads(model, (ours * weights).sum()), expected, rtol=1e-6)


def test_single_token_prompt_and_response() -> None:
    model = tiny_model("qwen3")
    adapter = ls.adapt(model)
    prompt, response = _ids(1, 512, 6), _ids(1, 512, 7)
    state = adapter.prefill(prompt)
    assert state.length == 0 and state.nbytes() == 0
    with torch.no_grad():
        got = adapter.score(state, response)
        want = full_sequence_logps(model, prompt, response)
    assert (got - want).abs().max() <= 1e-5


def test_scoring_never_mutates_the_state() -> None:
    model = tiny_model("qwen3")
    adapter = ls.adapt(model)
    prompt = _ids(30, 512, 8)
    first, second = _ids(6, 512, 9), _ids(4, 512, 10)
    state = adapter.prefill(prompt, chunk_size=8)
    snapshot = [(r.keys.clone(), r.values.clone()) for r in state.layers]
    with torch.no_grad():
        shared = [adapter.score(state, first), adapter.score(state, second)]
        fresh = [
            adapter.score(adapter.prefill(prompt, chunk_size=8), response)
            for response in (first, second)
        ]
    for got, want in zip(shared, fresh, strict=True):
        assert torch.equal(got, want)
    for record, (keys, values) in zip(state.layers, snapshot, strict=True):
        assert torch.equal(record.keys, keys) and torch.equal(record.values, values)
    assert state.length == 29


def test_state_accounting_and_device_move() -> None:
    model = tiny_model("llama")
    adapter = ls.adapt(model)
    state = adapter.prefill(_ids(101, 512, 11), chunk_size=32)
    # 2 layers x (K + V) x 2 kv heads x 100 positions x 16 dims x 4 bytes
    assert state.nbytes() == 2 * 2 * 2 * 100 * 16 * 4
    summary = state.summary()
    assert list(summary) == ["full_attention"]
    assert summary["full_attention"]["layers"] == 2
    assert summary["full_attention"]["bytes_per_token"] == 2 * 2 * 2 * 16 * 4
    moved = state.to("cpu")
    assert moved.nbytes() == state.nbytes() and moved.prompt_length == 101
    assert "full_attention: 2 layers" in repr(state)


def test_lora_wrapped_model_scores_and_trains_only_adapters() -> None:
    model = tiny_model("qwen3", dtype=torch.float64)
    peft_model = with_lora(model, ["q_proj", "k_proj", "v_proj", "o_proj"], lora_alpha=8)
    adapter = ls.adapt(peft_model)
    prompt, response = _ids(33, 512, 12), _ids(7, 512, 13)
    ours = adapter.score(adapter.prefill(prompt, chunk_size=10), response)
    reference = detached_reference_logps(peft_model, prompt, response)
    with torch.no_grad():
        assert (ours - full_sequence_logps(peft_model, prompt, response)).abs().max() <= 1e-12
    grads = parameter_grads(peft_model, ours.sum())
    assert grads and all("lora_" in name for name in grads)
    assert_grads_close(grads, parameter_grads(peft_model, reference.sum()), rtol=1e-6)


# --- bad input --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def adapter() -> ModelAdapter:
    return ls.adapt(tiny_model("qwen3", max_position_embeddings=64))


@pytest.mark.parametrize(
    ("prompt", "kwargs", "message"),
    [
        (torch.tensor([], dtype=torch.long), {}, "prompt_ids is empty"),
        (torch.zeros(1, 5, dtype=torch.long), {}, "prompt_ids must be a 1-D"),
        (torch.tensor([1, 2, 512]), {}, "token id 512, outside the model's vocabulary"),
        (torch.tensor([1, -3, 2]), {}, "token id -3"),
        (torch.tensor([0.5, 1.0]), {}, "integer token ids"),
        (torch.arange(65) % 512, {}, "exceeds the model's limit of 64"),
        (torch.arange(10), {"chunk_size": 0}, "chunk_size must be a positive integer"),
    ],
)
def test_prefill_rejects_bad_input(adapter, prompt, kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        adapter.prefill(prompt, **kwargs)


def test_score_rejects_bad_input(adapter) -> None:
    state = adapter.prefill(torch.arange(60))
    with pytest.raises(ValueError, match="response_ids is empty"):
        adapter.score(state, torch.tensor([], dtype=torch.long))
    with pytest.raises(ValueError, match="response_ids holds token id 9999"):
        adapter.score(state, torch.tensor([1, 9999]))
    with pytest.raises(ValueError, match=r"prompt \(60 tokens\) \+ response \(5 tokens\) = 65"):
        adapter.score(state, torch.arange(5))
    other = ls.adapt(tiny_model("qwen3", max_position_embeddings=64))
    with pytest.raises(ValueError, match="prefilled by another model"):
        other.score(state, torch.arange(3))
    assert adapter.score(state, torch.arange(4)).shape == (4,)


def test_unknown_model_type_lists_supported_types() -> None:
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32))
    with pytest.raises(ValueError, match=r"model_type .gpt2.*supported model types: .*llama"):
        ls.adapt(gpt2)
