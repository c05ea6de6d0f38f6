"""Sliding-window layers (``kinds.window``) in the dense adapter, against the transformers
model's own forward, ``generate`` and full graph: Qwen2 with its first layer full attention
and the second sliding (``max_window_layers=1``), Qwen3 with every layer sliding. The window
(6) is far shorter than the prompts, so a wrong mask, a wrong stored window or a lost
gradient through it shows."""

from __future__ import annotations

import pytest
import torch
from ragged_decode import assert_ragged_decode_matches_forward
from reference import (
    assert_grads_close,
    detached_reference_logps,
    full_sequence_logps,
    group_reference,
    parameter_grads,
    step_grads,
)

import longstraw_core as ls
from longstraw_core.kinds.window import WindowKV
from longstraw_core.models.tiny import tiny_model

VOCAB = 512
WINDOW = 6
PROMPT_LENGTH = 45  # 44 stored positions, seven windows
CASES = {"qwen2": {"max_window_layers": 1}, "qwen3": {"max_window_layers": 0}}
REWARDS = [0.9, -0.2, 0.4]

_MODELS: dict[tuple[str, torch.dtype], torch.nn.Module] = {}


def _model(model_type: str, dtype: torch.dtype = torch.float64) -> torch.nn.Module:
    key = (model_type, dtype)
    if key not in _MODELS:
        _MODELS[key] = tiny_model(
            model_type, dtype=dtype, seed=3, use_sliding_window=True, sliding_window=WINDOW,
            **CASES[model_type],
        )  # fmt: skip
    return _MODELS[key]


def _ids(length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(seed))


def test_the_tiny_models_have_sliding_layers() -> None:
    assert _model("qwen2").config.layer_types == ["full_attention", "sliding_attention"]
    assert set(_model("qwen3").config.layer_types) == {"sliding_attention"}
    kinds = [type(r) for r in ls.adapt(_model("qwen2")).prefill(_ids(10, 0)).layers]
    assert kinds == [ls.AttentionKV, WindowKV]


@pytest.mark.parametrize("model_type", list(CASES))
@pytest.mark.parametrize("chunk_size", [3, 7, 1000])
@pytest.mark.parametrize("offload", [None, "cpu"])
def test_score_equals_full_sequence_forward(model_type: str, chunk_size: int, offload) -> None:
    """Chunks shorter and longer than the window, and the whole prompt in one; the window
    records in CPU memory with the full-attention K/V (both placed by ``attention``)."""
    model = _model(model_type)
    adapter = ls.adapt(model)
    prompt, response = _ids(PROMPT_LENGTH, 1), _ids(9, 2)
    state = adapter.prefill(prompt, chunk_size=chunk_size, offload=offload)
    with torch.no_grad():
        logps = adapter.score(state, response)
        expected = full_sequence_logps(model, prompt, response)
    assert logps.shape == (9,)
    assert (logps - expected).abs().max() <= 1e-10


@pytest.mark.parametrize("model_type", list(CASES))
def test_the_window_state_has_one_size_at_any_prompt_length(model_type: str) -> None:
    adapter = ls.adapt(_model(model_type))
    short, long = (adapter.prefill(_ids(n, 3), chunk_size=7) for n in (20, 90))
    windows = [s.summary()["sliding_attention"] for s in (short, long)]
    assert windows[0]["bytes"] == windows[1]["bytes"] > 0
    assert not windows[0]["grows_with_prompt"]
    for a, b in zip(short.layers, long.layers, strict=True):
        if isinstance(a, WindowKV):
            assert a.keys.shape == b.keys.shape == (2, WINDOW - 1, 16)
    if model_type == "qwen2":  # the full-attention layer's state grows
        full = [s.summary()["full_attention"]["bytes"] for s in (short, long)]
        assert full[1] > full[0]


@pytest.mark.parametrize("model_type", list(CASES))
def test_greedy_rollout_equals_transformers_generate(model_type: str) -> None:
    model = _model(model_type)
    adapter = ls.adapt(model)
    prompt = _ids(PROMPT_LENGTH, 8)
    with torch.no_grad():
        generated = model.generate(
            prompt[None], max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0
        )[0, PROMPT_LENGTH:]
    state = adapter.prefill(prompt, chunk_size=16)
    out = ls.rollout(adapter, state, num_generations=2, max_new_tokens=12, temperature=0)
    assert all(torch.equal(response, generated) for response in out.responses)
    for response, logps in zip(out.responses, out.logps, strict=True):
        with torch.no_grad():
            expected = full_sequence_logps(model, prompt, response)
        assert (logps - expected).abs().max() <= 1e-10


@pytest.mark.parametrize("model_type", list(CASES))
def test_detached_gradients_equal_the_transformers_cache(model_type: str) -> None:
    """Detached mode: the gradient of the branch alone over a constant prefix, as the
    transformers cache (its sliding-window layers) gives it."""
    model = _model(model_type)
    adapter = ls.adapt(model)
    prompt, response = _ids(PROMPT_LENGTH, 3), _ids(11, 4)
    weights = torch.randn(11, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    state = adapter.prefill(prompt, chunk_size=7)
    ours = adapter.score(state, response)
    reference = detached_reference_logps(model, prompt, response)
    assert (ours - reference).abs().max() <= 1e-10
    expected = parameter_grads(model, (reference * weights).sum())
    got = parameter_grads(model, (ours * weights).sum())
    for name, want in expected.items():
        torch.testing.assert_close(got[name], want, rtol=1e-8, atol=1e-12, msg=name)


@pytest.mark.parametrize("model_type", list(CASES))
@pytest.mark.parametrize(
    ("chunk_size", "offload", "keep"), [(4, None, False), (9, None, False), (4, "cpu", True)]
)
def test_exact_step_equals_full_graph(model_type: str, chunk_size: int, offload, keep) -> None:
    """Exact mode: ``grpo_step`` against the whole group through the transformers model with
    autograd over prompt and responses (``tests/grpo/test_exact.py``'s reference), with
    chunks shorter and longer than the window, and the window records offloaded while the
    full-attention layers keep their attention outputs (the window layers keep none)."""
    model = _model(model_type)
    adapter = ls.adapt(model)
    prompt = _ids(29, 0)
    responses = [_ids(n, 10 + i) for i, n in enumerate([6, 3, 8])]
    cfg = ls.GRPOConfig(gradient="exact", max_completion_length=16, keep_attention_outputs=keep)
    metrics, grads = step_grads(
        model, adapter, prompt, responses, REWARDS, cfg, chunk_size=chunk_size, offload=offload
    )
    loss, expected = group_reference(model, full_sequence_logps, prompt, responses, REWARDS, cfg)
    assert metrics.loss == pytest.approx(loss.item(), rel=1e-9, abs=1e-12)
    assert_grads_close(grads, expected, rtol=1e-6)  # as tests/grpo/test_exact.py
    detached = ls.GRPOConfig(gradient="detached", max_completion_length=16)
    _, approximate = step_grads(
        model, adapter, prompt, responses, REWARDS, detached, chunk_size=chunk_size
    )
    largest = max(float(want.abs().max()) for want in expected.values())
    moved = max(float((approximate[n] - expected[n]).abs().max()) for n in expected)
    assert moved > 1e-3 * largest  # the prompt's own paths matter here: exact mode kept them


@pytest.mark.parametrize("model_type", list(CASES))
def test_ragged_decode_steps_equal_the_full_sequence_forward(model_type: str) -> None:
    """Branches at their own positions: each row's window is its own (the stored window's
    part it sees shrinks as its branch grows)."""
    assert_ragged_decode_matches_forward(_model(model_type), _ids)


@pytest.mark.parametrize("offload", [None, "cpu"])
def test_activation_checkpointing_changes_no_exact_gradient(monkeypatch, offload) -> None:
    """Checkpointed layers run their window reads again in backward (the writes are not
    handed over twice): bit-identical exact-mode gradients, streamed from CPU memory too."""
    from longstraw_core.adapters import base

    replays = []
    replaying = base.LayerRecord.replaying

    def counted(self, tensors):
        replays.append(self)
        return replaying(self, tensors)

    monkeypatch.setattr(base.LayerRecord, "replaying", counted)
    model = _model("qwen2")
    prompt = _ids(29, 0)
    responses = [_ids(n, 10 + i) for i, n in enumerate([6, 3, 8])]
    cfg = ls.GRPOConfig(gradient="exact", max_completion_length=16)
    results = []
    for checkpointing in (False, True):
        adapter = ls.adapt(model)
        adapter.activation_checkpointing = checkpointing
        _, grads = step_grads(
            model, adapter, prompt, responses, REWARDS, cfg, chunk_size=4, offload=offload
        )
        results.append(grads)
    assert replays  # the checkpointed run recomputed its layers
    for name, want in results[0].items():
        assert torch.equal(results[1][name], want), name


def test_a_window_record_keeps_the_last_positions_and_its_chunk_starts() -> None:
    """The record alone: after each chunk it holds the last ``W - 1`` positions, oldest
    first; with checkpoints, the window before every chunk (what the sweep restarts from)."""
    record = WindowKV.empty(1, 4, 1, dtype=torch.float64, device=torch.device("cpu"))
    record.keep_checkpoints(torch.device("cpu"))
    positions = torch.arange(10, dtype=torch.float64).reshape(1, 10, 1)
    for start, stop in [(0, 2), (2, 7), (7, 8), (8, 10)]:
        record.write(start, positions[:, start:stop], -positions[:, start:stop])
        keys, values = record.read(None)
        assert keys.flatten().tolist() == list(range(max(stop - 3, 0), stop))
        assert torch.equal(values, -keys)
    assert sorted(record.checkpoints) == [0, 2, 7, 8]
    assert record.read(7)[0].flatten().tolist() == [4, 5, 6]
    assert record.read(2)[0].flatten().tolist() == [0, 1]
    assert record.window(8).read(8)[0].flatten().tolist() == [5, 6, 7]
    with pytest.raises(RuntimeError, match="chunks must be written in order"):
        record.write(3, positions[:, :1], positions[:, :1])
    with pytest.raises(RuntimeError, match="no sliding window at position 5"):
        record.read(5)


def test_exact_mode_names_the_kinds_a_state_lacks_checkpoints_of() -> None:
    """A state prefilled without checkpoints: the error names the kinds that need them (the
    window layers'), read from the records, and how to prefill; with them the step runs."""
    adapter = ls.adapt(_model("qwen2"))
    prompt, responses = _ids(20, 5), [_ids(3, 6), _ids(4, 7)]
    config = ls.GRPOConfig(gradient="exact")
    state = adapter.prefill(prompt, chunk_size=6)
    assert state.lacking_checkpoints() == [WindowKV.kind]
    match = r"through sliding_attention layers .*checkpoints='device'"
    with pytest.raises(ValueError, match=match):
        ls.grpo_step(adapter, prompt, responses, [1.0, 0.0], config=config, state=state)
    state = adapter.prefill(prompt, chunk_size=6, checkpoints="cpu")
    assert state.lacking_checkpoints() == [] and not state.needs_checkpoints()
    ls.grpo_step(adapter, prompt, responses, [1.0, 0.0], config=config, state=state)
