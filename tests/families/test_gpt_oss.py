"""gpt-oss (``model_adapters.gpt_oss``) against the transformers model's own forward,
``generate`` and full graph, in float64: sliding-window and full-attention layers in turn,
attention sinks, a mixture of experts. The window (6) is far shorter than the prompts, so a
wrong mask, window or sink, or a gradient lost through any of them, shows; the sinks and the
experts must get the full graph's gradients."""

from __future__ import annotations

from pathlib import Path

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
from longstraw_core.adapters import registry
from longstraw_core.config import load_config
from longstraw_core.kinds.window import WindowKV
from longstraw_core.models.tiny import tiny_model
from model_adapters import gpt_oss

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs/gpt_oss/tiny_grpo_cpu.yaml"
VOCAB = 512
WINDOW = 6
PROMPT_LENGTH = 45  # seven windows
REWARDS = [0.9, -0.2, 0.4]

_MODELS: dict[torch.dtype, torch.nn.Module] = {}


def _model(dtype: torch.dtype = torch.float64) -> torch.nn.Module:
    if dtype not in _MODELS:
        _MODELS[dtype] = tiny_model("gpt_oss", dtype=dtype, seed=3, sliding_window=WINDOW)
    return _MODELS[dtype]


def _ids(length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(seed))


def test_the_family_is_registered_and_its_tiny_model_has_what_gpt_oss_has() -> None:
    model = _model()
    assert registry.family_of("gpt_oss") is gpt_oss.FAMILY
    assert type(ls.adapt(model)) is gpt_oss.GptOssAdapter
    assert model.config.layer_types == ["sliding_attention", "full_attention"] * 2
    assert model.config.rope_parameters["rope_type"] == "yarn"
    assert all(layer.self_attn.sinks.abs().max() > 0 for layer in model.model.layers)
    kinds = [type(r) for r in ls.adapt(model).prefill(_ids(10, 0)).layers]
    assert kinds == [WindowKV, ls.AttentionKV] * 2


@pytest.mark.parametrize("chunk_size", [3, 7, 1000])
@pytest.mark.parametrize("offload", [None, "cpu"])
def test_score_equals_full_sequence_forward(chunk_size: int, offload) -> None:
    model = _model()
    adapter = ls.adapt(model)
    prompt, response = _ids(PROMPT_LENGTH, 1), _ids(9, 2)
    state = adapter.prefill(prompt, chunk_size=chunk_size, offload=offload)
    with torch.no_grad():
        logps = adapter.score(state, response)
        expected = full_sequence_logps(model, prompt, response)
    assert logps.shape == (9,)
    assert (logps - expected).abs().max() <= 1e-10


def test_the_sinks_matter() -> None:
    """Without its sinks the model scores otherwise: the equality above is not vacuous."""
    model = _model()
    adapter = ls.adapt(model)
    prompt, response = _ids(PROMPT_LENGTH, 1), _ids(9, 2)
    with torch.no_grad():
        expected = full_sequence_logps(model, prompt, response)
        adapter.attention_sink = lambda layer: None
        logps = adapter.score(adapter.prefill(prompt, chunk_size=7), response)
    assert (logps - expected).abs().max() > 1e-3


def test_the_window_state_has_one_size_at_any_prompt_length() -> None:
    adapter = ls.adapt(_model())
    short, long = (adapter.prefill(_ids(n, 3), chunk_size=7) for n in (20, 90))
    windows = [s.summary()["sliding_attention"] for s in (short, long)]
    assert windows[0]["bytes"] == windows[1]["bytes"] > 0
    assert not windows[0]["grows_with_prompt"]
    for a, b in zip(short.layers, long.layers, strict=True):
        if isinstance(a, WindowKV):
            assert a.keys.shape == b.keys.shape == (2, WINDOW - 1, 16)
    full = [s.summary()["full_attention"]["bytes"] for s in (short, long)]
    assert full[1] > full[0]


def test_greedy_rollout_equals_transformers_generate() -> None:
    model = _model()
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


def _sink_and_expert_names(grads: dict[str, torch.Tensor]) -> list[str]:
    names = [n for n in grads if n.endswith((".sinks", "experts.gate_up_proj", "down_proj"))]
    assert len(names) == 3 * 4  # every layer's sinks and both expert weights
    return names


def test_detached_gradients_equal_the_transformers_cache() -> None:
    """Detached mode: the branch alone over a constant prefix, as the transformers cache
    (its sliding and full layers) gives it; the sinks and experts included."""
    model = _model()
    adapter = ls.adapt(model)
    prompt, response = _ids(PROMPT_LENGTH, 3), _ids(11, 4)
    weights = torch.randn(11, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    state = adapter.prefill(prompt, chunk_size=7)
    ours = adapter.score(state, response)
    reference = detached_reference_logps(model, prompt, response)
    assert (ours - reference).abs().max() <= 1e-10
    expected = parameter_grads(model, (reference * weights).sum())
    got = parameter_grads(model, (ours * weights).sum())
    for name in _sink_and_expert_names(expected):
        assert expected[name].abs().max() > 0, name
    for name, want in expected.items():
        torch.testing.assert_close(got[name], want, rtol=1e-8, atol=1e-12, msg=name)


@pytest.mark.parametrize(
    ("chunk_size", "offload", "keep"), [(4, None, False), (9, None, False), (4, "cpu", True)]
)
def test_exact_step_equals_full_graph(chunk_size: int, offload, keep) -> None:
    """Exact mode: ``grpo_step`` against the whole group through the transformers model with
    autograd over prompt and responses, chunks shorter and longer than the window, and
    (last case) the records offloaded while the full layers keep their attention outputs
    (with the sinks folded in: the sweep's recompute reuses them)."""
    model = _model()
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
    for name in _sink_and_expert_names(expected):  # and each on its own scale (the sinks'
        # gradients are ~30x smaller than the largest entry)
        own = float(expected[name].abs().max())
        assert own > 0 and float((grads[name] - expected[name]).abs().max()) <= 1e-5 * own, name
    detached = ls.GRPOConfig(gradient="detached", max_completion_length=16)
    _, approximate = step_grads(
        model, adapter, prompt, responses, REWARDS, detached, chunk_size=chunk_size
    )
    largest = max(float(want.abs().max()) for want in expected.values())
    moved = max(float((approximate[n] - expected[n]).abs().max()) for n in expected)
    assert moved > 1e-3 * largest  # the prompt's own paths matter here: exact mode kept them


def test_ragged_decode_steps_equal_the_full_sequence_forward() -> None:
    assert_ragged_decode_matches_forward(_model(), _ids)


def test_lora_on_the_experts_through_peft_target_parameters() -> None:
    """peft reaches the experts' fused 3-D weights through ``target_parameters`` (its
    ``ParamWrapper``, rank ``r`` per expert); the adapter runs the wrapped module as it is:
    exact mode's gradients of those adapters equal the full graph's."""
    from peft import LoraConfig, get_peft_model

    model = tiny_model("gpt_oss", dtype=torch.float64, seed=4, sliding_window=WINDOW)
    config = LoraConfig(
        r=4, target_modules=["q_proj", "v_proj"], target_parameters=gpt_oss.EXPERT_PARAMETERS
    )
    peft_model = get_peft_model(model, config)
    with torch.no_grad():  # B off zero, so the adapters change the output and A learns
        for name, parameter in peft_model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0.0, 0.1, generator=torch.Generator().manual_seed(6))
    adapter = ls.adapt(peft_model)
    prompt = _ids(29, 0)
    responses = [_ids(n, 10 + i) for i, n in enumerate([6, 3, 8])]
    cfg = ls.GRPOConfig(gradient="exact", max_completion_length=16)
    metrics, grads = step_grads(peft_model, adapter, prompt, responses, REWARDS, cfg, chunk_size=4)
    loss, expected = group_reference(
        peft_model, full_sequence_logps, prompt, responses, REWARDS, cfg
    )
    experts = [name for name in expected if "mlp.experts" in name]
    assert len(experts) == 4 * 4  # A and B of gate_up_proj and down_proj, every layer
    assert all(expected[name].abs().max() > 0 for name in experts)
    assert metrics.loss == pytest.approx(loss.item(), rel=1e-9, abs=1e-12)
    assert_grads_close(grads, expected, rtol=1e-6)


def test_lora_target_parameters_in_the_config() -> None:
    """``lora.target_parameters`` reaches peft (``models.add_lora``); with a dropout, which
    peft's parameter adapters do not take, the config is refused."""
    from longstraw_core.config import ConfigError, LoraSection
    from longstraw_core.models import build as models

    section = LoraSection(enabled=True, r=4, target_parameters=gpt_oss.EXPERT_PARAMETERS)
    wrapped = models.add_lora(tiny_model("gpt_oss", seed=1), section)
    trainable = [name for name, p in wrapped.named_parameters() if p.requires_grad]
    assert sum("mlp.experts" in name for name in trainable) == 4 * 4
    assert sum("self_attn" in name for name in trainable) == 4 * 4 * 2  # q/k/v/o, A and B
    overrides = ["lora.enabled=true", "lora.dropout=0.1", "grpo.gradient=detached"]
    overrides.append("lora.target_parameters=[mlp.experts.gate_up_proj]")
    with pytest.raises(ConfigError, match="take no dropout"):
        load_config(CONFIG, overrides)
