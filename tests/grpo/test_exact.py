"""Exact mode: grpo_step gradients equal the full graph (every prompt + response through
the transformers model with autograd over everything, the group backpropagated at once)."""

from __future__ import annotations

import functools

import pytest
import torch
from reference import (
    assert_grads_close,
    full_sequence_logps,
    group_reference,
    step_grads,
    with_lora,
)

import longstraw_core as ls
import longstraw_core.adapters.lm_head as lm_head
from longstraw_core.kinds.attention import AttentionKV
from longstraw_core.kinds.base import attach_grad_sink
from longstraw_core.models.tiny import tiny_model
from longstraw_core.state.exact import new_state_grad

VOCAB = 512
LENGTHS = [6, 3, 8]
REWARDS = [0.9, -0.2, 0.4]


def _ids(length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(seed))


def _full_graph_grads(model, prompt, responses, old, ref, cfg):
    return group_reference(
        model, full_sequence_logps, prompt, responses, REWARDS, cfg, old=old, ref=ref
    )


def _step_grads(model, adapter, prompt, responses, cfg, **kwargs):
    return step_grads(model, adapter, prompt, responses, REWARDS, cfg, **kwargs)


@pytest.fixture(scope="module")
def models():
    return (
        tiny_model("qwen3", dtype=torch.float64, seed=3),
        tiny_model("qwen3", dtype=torch.float64, seed=4),
    )


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo", "cispo"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_exact_step_equals_full_graph(models, loss_type, beta):
    policy, reference = models
    adapter, ref_adapter = ls.adapt(policy), ls.adapt(reference)
    prompt = _ids(29, 0)
    responses = [_ids(n, 10 + i) for i, n in enumerate(LENGTHS)]
    cfg = ls.GRPOConfig(
        loss_type=loss_type,
        beta=beta,
        gradient="exact",
        epsilon_high=5.0 if loss_type == "cispo" else 0.28,
        max_completion_length=16,
    )
    with torch.no_grad():
        state = adapter.prefill(prompt)
        old = [adapter.score(state, r) + 0.3 * torch.randn(len(r), dtype=torch.float64)
               for r in responses]  # fmt: skip
        ref = [full_sequence_logps(reference, prompt, r) for r in responses] if beta else None

    metrics, grads = _step_grads(
        policy, adapter, prompt, responses, cfg, old_logps=old, ref_adapter=ref_adapter,
        chunk_size=5,
    )  # fmt: skip
    loss, expected = _full_graph_grads(policy, prompt, responses, old, ref, cfg)
    assert metrics.loss == pytest.approx(loss.item(), rel=1e-9, abs=1e-12)
    assert metrics.sweep_seconds > 0 and metrics.state_grad_bytes > 0
    assert_grads_close(grads, expected, rtol=1e-6)


@pytest.mark.threads
@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
@pytest.mark.parametrize("chunk_size", [1, 7, 1000])
def test_exact_chunkings_and_dense_types(model_type, chunk_size):
    model = tiny_model(model_type, dtype=torch.float64, seed=5)
    adapter = ls.adapt(model)
    prompt = _ids(17 if chunk_size == 1 else 31, 1)
    responses = [_ids(n, 20 + i) for i, n in enumerate(LENGTHS)]
    cfg = ls.GRPOConfig(loss_type="grpo", gradient="exact")
    _, grads = _step_grads(model, adapter, prompt, responses, cfg, chunk_size=chunk_size)
    _, expected = _full_graph_grads(model, prompt, responses, None, None, cfg)
    assert_grads_close(grads, expected, rtol=1e-6)


def test_exact_differs_from_detached(models):
    """The paths through the prompt matter: detached mode misses them."""
    policy, _ = models
    adapter = ls.adapt(policy)
    prompt, responses = _ids(29, 2), [_ids(n, 30 + i) for i, n in enumerate(LENGTHS)]
    _, exact = _step_grads(policy, adapter, prompt, responses, ls.GRPOConfig(gradient="exact"))
    _, detached = _step_grads(policy, adapter, prompt, responses, ls.GRPOConfig())
    name = "model.layers.0.self_attn.k_proj.weight"  # its prompt keys feed every branch
    assert (exact[name] - detached[name]).abs().max() > 0.1 * exact[name].abs().max()


def test_exact_with_lora_trains_only_adapters():
    model = tiny_model("qwen3", dtype=torch.float64, seed=6)
    peft_model = with_lora(model, ["q_proj", "k_proj", "v_proj", "down_proj"])
    adapter = ls.adapt(peft_model)
    prompt, responses = _ids(23, 3), [_ids(n, 40 + i) for i, n in enumerate(LENGTHS)]
    cfg = ls.GRPOConfig(loss_type="dapo", beta=0.05, gradient="exact")
    with torch.no_grad(), peft_model.disable_adapter():
        ref = [full_sequence_logps(peft_model, prompt, r) for r in responses]
    _, grads = _step_grads(
        peft_model, adapter, prompt, responses, cfg, ref_adapter=ls.lora_reference(adapter),
        chunk_size=6,
    )  # fmt: skip
    _, expected = _full_graph_grads(peft_model, prompt, responses, None, ref, cfg)
    assert all("lora_" in name for name in grads)
    assert_grads_close(grads, expected, rtol=1e-6)


@pytest.mark.parametrize(
    ("loss_type", "lora", "head_chunks"),
    [("dapo", False, False), ("grpo", True, True)],
    ids=["full", "lora-head-chunks"],
)
def test_exact_step_at_a_temperature_equals_full_graph(
    models, monkeypatch, loss_type, lora, head_chunks
):
    """At ``GRPOConfig.temperature=0.7`` every log-prob of the loss is TRL's
    ``log_softmax(logits / 0.7)``: the policy's (the sweep's gradient flows through them,
    and through the LM head's checkpointed row chunks), the old ones given, and the
    reference's, which ``grpo_step`` scores itself (a frozen model, or the LoRA model with
    its adapters off)."""
    temperature = 0.7
    if head_chunks:  # two rows a chunk: every branch's head runs in several
        monkeypatch.setattr(lm_head, "HEAD_CHUNK_ELEMENTS", 2 * VOCAB)
    if lora:
        policy = with_lora(tiny_model("qwen3", dtype=torch.float64, seed=6), ["q_proj", "v_proj"])
        adapter = ls.adapt(policy)
        ref_adapter, reference = ls.lora_reference(adapter), None
    else:
        policy, reference = models
        adapter, ref_adapter = ls.adapt(policy), ls.adapt(reference)
    prompt = _ids(29, 7)
    responses = [_ids(n, 50 + i) for i, n in enumerate(LENGTHS)]
    cfg = ls.GRPOConfig(loss_type=loss_type, beta=0.04, gradient="exact", temperature=temperature)
    tempered = functools.partial(full_sequence_logps, temperature=temperature)
    with torch.no_grad():
        old = [tempered(policy, prompt, r) + 0.2 * torch.randn(len(r), dtype=torch.float64)
               for r in responses]  # fmt: skip
        if lora:
            with policy.disable_adapter():
                ref = [tempered(policy, prompt, r) for r in responses]
        else:
            ref = [tempered(reference, prompt, r) for r in responses]

    metrics, grads = _step_grads(
        policy, adapter, prompt, responses, cfg, old_logps=old, ref_adapter=ref_adapter,
        chunk_size=5,
    )  # fmt: skip
    loss, expected = group_reference(policy, tempered, prompt, responses, REWARDS, cfg, old, ref)
    assert metrics.loss == pytest.approx(loss.item(), rel=1e-9, abs=1e-12)
    assert_grads_close(grads, expected, rtol=1e-6)
    # The untempered full graph is another loss: the temperature is not lost on the way.
    untempered, _ = _full_graph_grads(policy, prompt, responses, old, ref, cfg)
    assert abs(untempered.item() - loss.item()) > 1e-3 * abs(loss.item())


def test_state_grad_is_shaped_like_the_state_and_refuses_another():
    adapter = ls.adapt(tiny_model("qwen3"))
    state = adapter.prefill(_ids(40, 4), chunk_size=16)
    grad = new_state_grad(state)
    assert grad.nbytes() == state.nbytes()
    other = adapter.prefill(_ids(12, 5))
    with pytest.raises(ValueError, match="state_grad was made for another state"):
        adapter.score(other, _ids(3, 6), state_grad=grad)


def test_grad_sink_adds_the_gradient_into_its_buffer():
    x = torch.randn(3, 4, dtype=torch.float64)
    sink = torch.ones(3, 4, dtype=torch.float64)
    weight = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    (attach_grad_sink(x, sink) * weight).sum().backward()
    assert torch.allclose(sink, 1 + weight.detach())
    assert torch.allclose(weight.grad, x)


@pytest.mark.parametrize(
    ("offload", "checkpointing", "head_rows"),
    [(True, False, 0), (False, True, 0), (False, False, 3), (True, True, 3)],
    ids=["offload", "checkpointing", "head-chunks", "all"],
)
def test_memory_savers_keep_the_full_graph_gradient(monkeypatch, offload, checkpointing, head_rows):
    """CPU offload of the state (one layer resident), per-layer activation checkpointing and
    the LM head in row chunks change where memory goes, not the gradient: still the full
    graph's, from the transformers model itself."""
    import longstraw_core.adapters.lm_head as lm_head
    from longstraw_core.offload import OffloadPolicy

    if head_rows:
        monkeypatch.setattr(lm_head, "HEAD_CHUNK_ELEMENTS", head_rows * VOCAB)
    model = tiny_model("qwen3", dtype=torch.float64, seed=5, num_hidden_layers=3)
    adapter = ls.adapt(model)
    adapter.activation_checkpointing = checkpointing
    prompt = _ids(29, 1)
    responses = [_ids(n, 20 + i) for i, n in enumerate(LENGTHS)]
    cfg = ls.GRPOConfig(loss_type="dapo", gradient="exact")
    policy = OffloadPolicy.cpu(resident_layers=1) if offload else None
    _, grads = _step_grads(model, adapter, prompt, responses, cfg, chunk_size=7, offload=policy)
    _, expected = _full_graph_grads(model, prompt, responses, None, None, cfg)
    assert_grads_close(grads, expected, rtol=1e-6)


@pytest.mark.parametrize(
    ("model_type", "chunk_size", "checkpointing", "offload"),
    [("qwen3", 7, False, False), ("qwen3", 1000, False, False), ("qwen3", 5, True, False),
     ("qwen3", 7, True, True), ("qwen3_5_text", 6, False, False),
     ("qwen3_5_text", 6, False, True), ("glm_moe_dsa", 7, False, False)],
    ids=["dense", "dense-one-chunk", "dense-checkpointed", "dense-offloaded-checkpointed",
         "qwen36-hybrid", "qwen36-offloaded", "glm52-latent"],
)  # fmt: skip
def test_kept_attention_outputs_keep_the_full_graph_gradient(
    model_type, chunk_size, checkpointing, offload
):
    """``keep_attention_outputs``: the sweep reuses the prefill's attention outputs instead
    of recomputing them. The gradient is still the transformers full graph's, and bit for bit
    the gradient without the option, also with the state offloaded to the CPU (one layer
    resident); the kept bytes are heads x (value_dim + 1) per stored token per
    full-attention layer but the last (none for the latent MLA layers)."""
    from longstraw_core.offload import OffloadPolicy

    # Eight hybrid layers, so a full-attention layer (every 4th) is not the state-only last.
    layers = {"num_hidden_layers": 8} if model_type == "qwen3_5_text" else {}
    model = tiny_model(model_type, dtype=torch.float64, seed=6, **layers)
    adapter = ls.adapt(model)
    adapter.activation_checkpointing = checkpointing
    prompt = _ids(29, 2)
    responses = [_ids(n, 30 + i) for i, n in enumerate(LENGTHS)]
    plain = ls.GRPOConfig(loss_type="dapo", gradient="exact")
    keeping = ls.GRPOConfig(loss_type="dapo", gradient="exact", keep_attention_outputs=True)
    options = {"chunk_size": chunk_size, "offload": OffloadPolicy.cpu(1) if offload else None}
    metrics, grads = _step_grads(model, adapter, prompt, responses, keeping, **options)
    _, without = _step_grads(model, adapter, prompt, responses, plain, **options)
    _, expected = _full_graph_grads(model, prompt, responses, None, None, plain)
    # transformers' delta rule runs in float32 inside (see tests/families/test_qwen36_adapter.py)
    assert_grads_close(grads, expected, rtol=5e-5 if model_type == "qwen3_5_text" else 1e-6)
    for name, grad in grads.items():
        assert torch.equal(grad, without[name]), name

    state = adapter.prefill(prompt, keep_attention_outputs=True, **options)
    # The last layer of a prefill chunk only writes its state: it attends to nothing.
    attention = [layer for layer in state.layers[:-1] if isinstance(layer, AttentionKV)]
    assert bool(attention) == (model_type != "glm_moe_dsa")
    heads = model.config.num_attention_heads
    per_token = sum(heads * (layer.values.shape[-1] + 1) * 8 for layer in attention)
    assert metrics.attention_output_bytes == state.output_nbytes() == per_token * state.length
    kept_rows = [row.get("kept_output_bytes", 0) for row in state.summary().values()]
    assert sum(kept_rows) == state.output_nbytes()


@pytest.mark.parametrize("offload", [False, True], ids=["resident", "offloaded"])
def test_the_sweep_reads_the_kept_attention_outputs(offload):
    """The kept outputs are what the sweep's recompute uses: shift them and the gradient moves
    (so the bit-identical gradient above comes from reusing them, not from recomputing)."""
    from longstraw_core.offload import OffloadPolicy

    policy = OffloadPolicy.cpu(1) if offload else None
    model = tiny_model("qwen3", dtype=torch.float64, seed=6)
    adapter = ls.adapt(model)
    prompt = _ids(29, 2)
    responses = [_ids(n, 30 + i) for i, n in enumerate(LENGTHS)]
    cfg = ls.GRPOConfig(loss_type="dapo", gradient="exact", keep_attention_outputs=True)

    def grads(shift: float) -> dict[str, torch.Tensor]:
        state = adapter.prefill(prompt, chunk_size=7, keep_attention_outputs=True, offload=policy)
        for layer in state.layers:
            if layer.outputs is not None:
                layer.outputs += shift
        options = {"state": state, "chunk_size": 7, "offload": policy}
        return _step_grads(model, adapter, prompt, responses, cfg, **options)[1]

    same, shifted = grads(0.0), grads(0.5)
    _, expected = _full_graph_grads(model, prompt, responses, None, None, cfg)
    assert_grads_close(same, expected, rtol=1e-6)
    moved = [n for n in same if not torch.allclose(same[n], shifted[n], rtol=1e-3)]
    assert "model.layers.0.self_attn.o_proj.weight" in moved


def test_keep_attention_outputs_is_refused_in_detached_mode():
    with pytest.raises(ValueError, match="keep_attention_outputs"):
        ls.GRPOConfig(gradient="detached", keep_attention_outputs=True)


def test_a_state_without_kept_outputs_is_refused_when_the_config_asks_for_them():
    adapter = ls.adapt(tiny_model("qwen3", seed=6))
    prompt, responses = _ids(20, 1), [_ids(4, 2), _ids(5, 3)]
    cfg = ls.GRPOConfig(num_generations=2, gradient="exact", keep_attention_outputs=True)
    with pytest.raises(ValueError, match="prefilled without them"):
        ls.grpo_step(adapter, prompt, responses, [0.0, 1.0], config=cfg,
                     state=adapter.prefill(prompt))  # fmt: skip
