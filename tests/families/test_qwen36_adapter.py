"""The Qwen3.6 adapter (Gated DeltaNet + gated full attention) against transformers itself.

References are the transformers models' own full-sequence forward and their own cache,
never numbers this adapter produced.

Tolerances. In float32, scores match the full-sequence forward to 1e-5 (as for the dense
adapter). In float64 the comparison cannot reach the dense adapter's 1e-12: transformers
computes the gated delta rule, its RMSNorms and RoPE in float32 whatever the model's dtype,
so a prompt prefilled in other chunks than the reference's rounds differently at ~1e-7
relative, which the layers above amplify. Measured: log-probs within ~2e-6, gradients within
~1e-5 of each parameter's own scale; the asserts leave a few times that as margin.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from reference import (
    assert_grads_close,
    assign_recurrent_states,
    detached_reference_logps,
    full_sequence_logps,
    group_reference,
    parameter_grads,
    step_grads,
    trl_group_loss,
    with_lora,
)
from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration
from transformers.cache_utils import LinearAttentionLayer

import longstraw_core as ls
from longstraw_core.adapters import registry
from longstraw_core.kinds.recurrent import BranchRecurrent, RecurrentState
from longstraw_core.models.tiny import slow_gated_deltanet_decay, tiny_model
from longstraw_core.state.prefix import BranchCache
from model_adapters import qwen36

VOCAB = 512
PROMPT_LENGTH = 45  # 44 stored positions: 7 and 16 do not divide it, 1000 exceeds it
FLOAT64_LOGP_ATOL = 1e-5  # float32 inside transformers' delta rule and norms (module doc)
FLOAT64_GRAD_RTOL = 5e-5


def _ids(length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(seed))


def cache_reference_with_state_leaves(
    model: torch.nn.Module, prompt: torch.Tensor, response: torch.Tensor
) -> tuple[torch.Tensor, dict[int, tuple[torch.Tensor, torch.Tensor]]]:
    """``detached_reference_logps``, with each linear layer's cached states made leaves.

    Returns the log-probs and, per linear layer index, the (conv, recurrent) leaves, so the
    gradient of the branch with respect to the prompt's recurrent state can be compared.
    transformers keeps ``kernel`` conv columns where the adapter keeps ``kernel - 1``.
    """
    with torch.no_grad():
        cache = model(input_ids=prompt[None, :-1], use_cache=True).past_key_values
    leaves = {}
    for index, layer in enumerate(cache.layers):
        if isinstance(layer, LinearAttentionLayer):
            conv = layer.conv_states[0].detach().clone().requires_grad_()
            recurrent = layer.recurrent_states[0].detach().clone().requires_grad_()
            layer.conv_states[0] = conv.clone()  # the cache writes into this one in place
            layer.recurrent_states[0] = recurrent
            leaves[index] = (conv, recurrent)
    branch = torch.cat([prompt[-1:], response[:-1]])[None]
    positions = torch.arange(len(prompt) - 1, len(prompt) - 1 + branch.shape[1])[None]
    logits = model(
        input_ids=branch,
        cache=assign_recurrent_states(cache),
        position_ids=positions,
        use_cache=True,
    ).logits[0]
    return torch.log_softmax(logits, -1).gather(-1, response[:, None])[:, 0], leaves


_MODELS: dict[tuple, torch.nn.Module] = {}


def _model(model_type: str = "qwen3_5_text", dtype: torch.dtype = torch.float32, **overrides):
    """Tiny models are built once per configuration (tests never change their weights)."""
    key = (model_type, dtype, *sorted(overrides.items()))
    if key not in _MODELS:
        _MODELS[key] = tiny_model(model_type, dtype=dtype, **overrides)
    return _MODELS[key]


def _conditional_generation_model() -> Qwen3_5ForConditionalGeneration:
    """Qwen3.6 as released: the multimodal wrapper (``qwen3_5``), used here for text only."""
    vision = {"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2}
    vision |= {"out_hidden_size": 64, "patch_size": 4, "temporal_patch_size": 1}
    text = {**registry.tiny_configs()["qwen3_5_text"], "initializer_range": 0.1}
    torch.manual_seed(0)
    model = Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=text, vision_config=vision))
    slow_gated_deltanet_decay(model)
    return model.eval()


# --- scores against the full-sequence forward (float32) -----------------------------------

LAYOUTS = {
    "interval4": {},  # 3 linear layers, then full attention
    "interval2": {"full_attention_interval": 2},
    "interval3_mha": {
        "full_attention_interval": 3,
        "num_hidden_layers": 6,
        "num_key_value_heads": 4,
    },
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("chunk_size", [7, 16, 1000])
def test_score_equals_full_sequence_forward(layout: str, chunk_size: int) -> None:
    model = _model(**LAYOUTS[layout])
    adapter = ls.adapt(model)
    assert isinstance(adapter, qwen36.Qwen36Adapter)
    prompt, response = _ids(PROMPT_LENGTH, 1), _ids(9, 2)
    with torch.no_grad():
        logps = adapter.score(adapter.prefill(prompt, chunk_size=chunk_size), response)
        expected = full_sequence_logps(model, prompt, response)
    assert logps.shape == (9,)
    assert (logps - expected).abs().max() <= 1e-5


@pytest.mark.parametrize(
    ("prompt_length", "chunk_size"),
    # conv kernel 4: prompts of 1..3 tokens store fewer positions than the conv window
    [(1, 1), (2, 1), (3, 1), (3, 2), (4, 3), (12, 1)],
)
def test_short_prompts_and_single_token_chunks(prompt_length: int, chunk_size: int) -> None:
    model = _model()
    adapter = ls.adapt(model)
    prompt, response = _ids(prompt_length, 3), _ids(5, 4)
    with torch.no_grad():
        state = adapter.prefill(prompt, chunk_size=chunk_size)
        for length in (5, 1):  # a one-token branch too
            got = adapter.score(state, response[:length])
            want = full_sequence_logps(model, prompt, response[:length])
            assert (got - want).abs().max() <= 1e-5
    assert state.length == prompt_length - 1


@pytest.mark.parametrize("variant", ["qwen3_5_moe_text", "qwen3_next", "qwen3_5"])
def test_other_model_types_equal_full_sequence_forward(variant: str) -> None:
    model = _conditional_generation_model() if variant == "qwen3_5" else _model(variant)
    adapter = ls.adapt(model)
    assert model.config.model_type == variant and isinstance(adapter, qwen36.Qwen36Adapter)
    prompt, response = _ids(PROMPT_LENGTH, 5), _ids(9, 6)
    with torch.no_grad():
        logps = adapter.score(adapter.prefill(prompt, chunk_size=7), response)
        expected = full_sequence_logps(model, prompt, response)
    assert (logps - expected).abs().max() <= 1e-5


# --- gradients against the transformers cache (float64) -----------------------------------


@pytest.mark.parametrize(("prompt_length", "chunk_size"), [(PROMPT_LENGTH, 7), (3, 1)])
def test_gradients_equal_cache_reference_for_parameters_and_state(
    prompt_length: int, chunk_size: int
) -> None:
    model = _model(dtype=torch.float64)
    adapter = ls.adapt(model)
    prompt, response = _ids(prompt_length, 7), _ids(11, 8)
    weights = torch.randn(11, dtype=torch.float64, generator=torch.Generator().manual_seed(9))

    state = adapter.prefill(prompt, chunk_size=chunk_size)
    linear = {i: r for i, r in enumerate(state.layers) if isinstance(r, RecurrentState)}
    for record in linear.values():  # the initial state as a leaf: exact mode will need dL/dS
        record.conv.requires_grad_(True)
        record.recurrent.requires_grad_(True)
    ours = adapter.score(state, response)
    reference, leaves = cache_reference_with_state_leaves(model, prompt, response)
    assert (ours - reference).abs().max() <= FLOAT64_LOGP_ATOL
    assert leaves.keys() == linear.keys()

    ours_state = [t for r in linear.values() for t in (r.conv, r.recurrent)]
    theirs = [t for pair in leaves.values() for t in pair]
    got = torch.autograd.grad((ours * weights).sum(), ours_state, retain_graph=True)
    want = torch.autograd.grad((reference * weights).sum(), theirs, retain_graph=True)

    expected = parameter_grads(model, (reference * weights).sum())
    assert sum(g.abs().sum() for g in expected.values()) > 0
    assert_grads_close(
        parameter_grads(model, (ours * weights).sum()), expected, rtol=FLOAT64_GRAD_RTOL
    )
    for index in range(len(linear)):
        conv_grad, recurrent_grad = got[2 * index], got[2 * index + 1]
        want_conv, want_recurrent = want[2 * index][0], want[2 * index + 1][0]
        assert want_conv[:, 0].abs().max() == 0  # the column the adapter does not keep
        assert want_recurrent.abs().max() > 0
        for mine, theirs_ in ((conv_grad, want_conv[:, 1:]), (recurrent_grad, want_recurrent)):
            scale = theirs_.abs().max()
            assert (mine - theirs_).abs().max() <= FLOAT64_GRAD_RTOL * scale


def test_one_chunk_prefill_equals_the_cache_to_float64_precision() -> None:
    """Prefilled in one chunk, as the reference prefills it, the two agree to 1e-12: the
    looser float64 tolerances elsewhere are float32 rounding, not a modelling difference."""
    model = _model(dtype=torch.float64)
    adapter = ls.adapt(model)
    prompt, response = _ids(PROMPT_LENGTH, 21), _ids(8, 22)
    ours = adapter.score(adapter.prefill(prompt, chunk_size=PROMPT_LENGTH), response)
    reference = detached_reference_logps(model, prompt, response)
    assert (ours - reference).abs().max() <= 1e-12


def test_lora_on_deltanet_and_attention_projections() -> None:
    model = tiny_model("qwen3_5_text", dtype=torch.float64, seed=1)
    targets = ["in_proj_qkv", "in_proj_z", "in_proj_b", "out_proj", "q_proj", "v_proj"]
    peft_model = with_lora(model, targets, lora_alpha=8)
    adapter = ls.adapt(peft_model)
    prompt, response = _ids(33, 10), _ids(7, 11)
    ours = adapter.score(adapter.prefill(prompt, chunk_size=10), response)
    reference = detached_reference_logps(peft_model, prompt, response)
    assert (ours - reference).abs().max() <= FLOAT64_LOGP_ATOL
    grads = parameter_grads(peft_model, ours.sum())
    assert grads and all("lora_" in name for name in grads)
    assert any("linear_attn.in_proj_qkv" in name for name in grads)
    expected = parameter_grads(peft_model, reference.sum())
    assert_grads_close(grads, expected, rtol=FLOAT64_GRAD_RTOL)


def test_grpo_step_detached_gradients_equal_whole_group_reference() -> None:
    model = _model(dtype=torch.float64)
    adapter = ls.adapt(model)
    prompt = _ids(23, 12)
    responses = [_ids(n, 13 + i) for i, n in enumerate([5, 9, 2])]
    rewards = [1.0, 0.5, -0.5]
    cfg = ls.GRPOConfig(loss_type="grpo", epsilon_high=0.28)
    with torch.no_grad():  # behaviour log-probs off the policy, so ratios clip on both sides
        state = adapter.prefill(prompt, chunk_size=5)
        old = [
            adapter.score(state, r) + 0.3 * torch.randn(len(r), dtype=torch.float64)
            for r in responses
        ]

    model.zero_grad(set_to_none=True)
    metrics = ls.grpo_step(
        adapter, prompt, responses, rewards, config=cfg, old_logps=old, chunk_size=5
    )
    grads = {
        name: torch.zeros_like(p) if p.grad is None else p.grad.clone()
        for name, p in model.named_parameters()
    }
    model.zero_grad(set_to_none=True)

    logps = [detached_reference_logps(model, prompt, r) for r in responses]
    width = max(len(r) for r in responses)
    padded = torch.stack([torch.nn.functional.pad(lp, (0, width - len(lp))) for lp in logps])
    old_padded = torch.stack([torch.nn.functional.pad(o, (0, width - len(o))) for o in old])
    mask = torch.stack([(torch.arange(width) < len(r)).double() for r in responses])
    r = torch.tensor(rewards, dtype=torch.float64)
    advantages = (r - r.mean()) / (r.std() + 1e-4)
    loss, _ = trl_group_loss(padded, old_padded, None, advantages, mask, cfg)
    expected = parameter_grads(model, loss)

    assert metrics.loss == pytest.approx(loss.item(), rel=1e-4)
    assert metrics.branch_stats["clip_ratio/region_mean"] > 0
    assert_grads_close(grads, expected, rtol=FLOAT64_GRAD_RTOL)


# --- the state ----------------------------------------------------------------------------


def test_branches_read_the_state_and_leave_it_unchanged() -> None:
    model = _model()
    adapter = ls.adapt(model)
    prompt, first, second = _ids(30, 14), _ids(6, 15), _ids(4, 16)
    state = adapter.prefill(prompt, chunk_size=8)
    snapshot = [
        (r.conv.clone(), r.recurrent.clone()) if isinstance(r, RecurrentState) else r.keys.clone()
        for r in state.layers
    ]
    with torch.no_grad():
        shared = [adapter.score(state, first), adapter.score(state, second)]
        fresh = [
            adapter.score(adapter.prefill(prompt, chunk_size=8), response)
            for response in (first, second)
        ]
    adapter.score(state, first).sum().backward()  # with autograd too
    model.zero_grad(set_to_none=True)
    for got, want in zip(shared, fresh, strict=True):
        assert torch.equal(got, want)
    for record, saved in zip(state.layers, snapshot, strict=True):
        if isinstance(record, RecurrentState):
            assert torch.equal(record.conv, saved[0]) and torch.equal(record.recurrent, saved[1])
            assert record.length == 29
        else:
            assert torch.equal(record.keys, saved)


def _branch_states(cache: BranchCache) -> list[torch.Tensor]:
    layers = [r for r in cache.layers if isinstance(r, BranchRecurrent)]
    return [t.clone() for r in layers for t in (r.conv, r.recurrent)]


def test_ragged_steps_skip_padding_and_match_lock_step_decoding() -> None:
    """Ragged steps (``decode(..., counts=)``): a row that sits a step out keeps its conv and
    recurrent states bit for bit, and every row ends with the states and logits of decoding
    its tokens one at a time in lock step. Here they agree to 2e-15 (the float32 recurrent
    states bit for bit), but transformers' delta rule runs in float32: inputs that differ in
    their last float64 bits (batch shapes) can round to the next float32, which other inputs
    showed as up to 5e-7 in the logits, hence the margin. The full-sequence forward is
    tests/grpo/test_ragged_decode.py's."""
    model = _model(dtype=torch.float64)
    adapter = ls.adapt(model)
    state = adapter.prefill(_ids(20, 30), chunk_size=8)
    streams = torch.stack([_ids(6, 31), _ids(6, 32)])
    schedule = [[1, 0], [3, 2], [0, 4], [2, 0]]  # padding after a row's tokens, rows sitting out
    lock_step = adapter.new_branch_cache(state, batch=2, capacity=6)
    ragged = adapter.new_branch_cache(state, batch=2, capacity=6)
    done, got = [0, 0], [[], []]
    with torch.no_grad():
        expected = [adapter.decode(state, lock_step, streams[:, i : i + 1]) for i in range(6)]
        for counts in schedule:
            inputs = torch.zeros(2, max(counts), dtype=torch.long)
            for row, count in enumerate(counts):
                inputs[row, :count] = streams[row, done[row] : done[row] + count]
            before = _branch_states(ragged)
            logits = adapter.decode(state, ragged, inputs, counts=counts)
            for row, count in enumerate(counts):
                got[row].append(logits[row, :count])
                done[row] += count
                for old, new in zip(before, _branch_states(ragged), strict=True):
                    assert torch.equal(old[row], new[row]) == (count == 0)
    expected = torch.cat(expected, dim=1)
    for row in range(2):
        torch.testing.assert_close(torch.cat(got[row]), expected[row], rtol=0, atol=2e-6)
    for mine, theirs in zip(_branch_states(ragged), _branch_states(lock_step), strict=True):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-6)


def test_state_accounting_by_layer_type() -> None:
    model = _model()
    adapter = ls.adapt(model)
    config = model.config
    conv_dim = 2 * 2 * 8 + 4 * 12  # q, k: 2 key heads x 8; v: 4 value heads x 12
    linear_bytes = conv_dim * (4 - 1) * 4 + 4 * 8 * 12 * 4  # conv window + fp32 state
    summaries = []
    for prompt_length in (20, 61):
        state = adapter.prefill(_ids(prompt_length, 17), chunk_size=16)
        summary = state.summary()
        summaries.append(summary)
        assert set(summary) == {"linear_attention", "full_attention"}
        linear, full = summary["linear_attention"], summary["full_attention"]
        assert linear["layers"] == 3 and full["layers"] == 1
        assert linear["grows_with_prompt"] is False and full["grows_with_prompt"] is True
        assert linear["bytes"] == 3 * linear_bytes
        kv_bytes = 2 * config.num_key_value_heads * config.head_dim * 4
        assert full["bytes"] == kv_bytes * (prompt_length - 1)
        for record in state.layers:
            if isinstance(record, RecurrentState):
                assert record.conv.shape == (conv_dim, 3)
                assert record.recurrent.shape == (4, 8, 12)
                assert record.recurrent.dtype == torch.float32
    assert summaries[0]["linear_attention"]["bytes"] == summaries[1]["linear_attention"]["bytes"]
    moved = state.to("cpu")
    assert moved.nbytes() == state.nbytes() and moved.prompt_length == 61
    assert "linear_attention: 3 layers" in repr(state)


# --- refusals and kernels -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"attention_dropout": 0.1}, "attention_dropout=0.1"),
        (
            {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}},
            "rope_type='dynamic'",
        ),
    ],
)
def test_unsupported_configs_are_refused(overrides: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ls.adapt(tiny_model("qwen3_5_text", **overrides))


def test_vision_placeholder_tokens_are_refused() -> None:
    model = _conditional_generation_model()
    model.config.image_token_id = 7  # inside the tiny vocabulary
    adapter = ls.adapt(model)
    with pytest.raises(ValueError, match=r"prompt_ids holds token 7 \(config.image_token_id\)"):
        adapter.prefill(torch.tensor([1, 7, 3]))
    state = adapter.prefill(torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match=r"response_ids holds token 7"):
        adapter.score(state, torch.tensor([7]))


def test_kernel_choice_and_fla_argument_handling(monkeypatch) -> None:
    deltanet = _model().model.layers[0].linear_attn
    kernels = qwen36.deltanet_kernels(deltanet, torch.device("cpu"), torch.bfloat16)
    assert kernels.names == ("torch", "torch")
    torch_rule = kernels.delta_rule

    calls = []

    def fla_stand_in(q, k, v, *, g, beta, initial_state, output_final_state, **kwargs):
        """fla's contract as the wrapper must meet it: equal head counts, fp32 state."""
        assert q.shape[2] == k.shape[2] == v.shape[2]
        assert initial_state.dtype == torch.float32 and initial_state.is_contiguous()
        calls.append(kwargs)
        return torch_rule(
            q, k, v, g=g, beta=beta, initial_state=initial_state,
            output_final_state=output_final_state, **kwargs,
        )  # fmt: skip

    monkeypatch.setattr(qwen36.kernels, "_fla_chunk_gated_delta_rule", lambda: fla_stand_in)
    monkeypatch.setattr(qwen36.kernels, "_causal_conv1d_package", lambda: kernels.conv)
    cuda = torch.device("cuda")  # only the choice is made; nothing runs on it
    assert qwen36.deltanet_kernels(deltanet, cuda, torch.float32).names == (
        "causal_conv1d",
        "torch",
    )
    fla = qwen36.deltanet_kernels(deltanet, cuda, torch.bfloat16)
    assert fla.names == ("causal_conv1d", "fla")

    generator = torch.Generator().manual_seed(18)
    q, k = (torch.randn(1, 5, 2, 8, generator=generator) for _ in range(2))
    v = torch.randn(1, 5, 4, 12, generator=generator)
    g, beta = -torch.rand(1, 5, 4, generator=generator), torch.rand(1, 5, 4, generator=generator)
    h0 = torch.randn(4, 12, 8, generator=generator).transpose(1, 2)[None]  # non-contiguous
    options = {"g": g, "beta": beta, "output_final_state": True, "use_qk_l2norm_in_kernel": True}
    got = fla.delta_rule(q, k, v, initial_state=h0, **options)
    want = torch_rule(q, k, v, initial_state=h0, **options)
    assert calls == [{"use_qk_l2norm_in_kernel": True}]
    for a, b in zip(got, want, strict=True):
        assert torch.allclose(a, b, atol=1e-6)


def test_decode_steps_use_the_fused_recurrent_kernel_without_autograd(monkeypatch) -> None:
    """With fla, single-token steps go through its fused recurrent kernel (no backward in
    fla), and through the chunked one when autograd records the step."""
    deltanet = _model().model.layers[0].linear_attn
    torch_kernels = qwen36.deltanet_kernels(deltanet, torch.device("cpu"), torch.float32)
    calls: list[str] = []

    def stand_in(name, rule):
        def kernel(q, k, v, **options):
            calls.append(name)
            return rule(q, k, v, **options)

        return kernel

    monkeypatch.setattr(
        qwen36.kernels,
        "_fla_chunk_gated_delta_rule",
        lambda: stand_in("chunk", torch_kernels.delta_rule),
    )
    monkeypatch.setattr(
        qwen36.kernels,
        "_fla_fused_recurrent_gated_delta_rule",
        lambda: stand_in("fused", torch_kernels.step),
    )
    kernels = qwen36.deltanet_kernels(deltanet, torch.device("cuda"), torch.bfloat16)
    assert kernels.names[1] == "fla" and kernels.rule_for(1) is kernels.step
    assert kernels.rule_for(5) is kernels.delta_rule
    assert kernels.rule_for(5, ragged=True) is kernels.step  # padding steps are the identity

    generator = torch.Generator().manual_seed(21)
    q, k = (torch.randn(2, 1, 2, 8, generator=generator) for _ in range(2))
    v = torch.randn(2, 1, 4, 12, generator=generator, requires_grad=True)
    g, beta = -torch.rand(2, 1, 4, generator=generator), torch.rand(2, 1, 4, generator=generator)
    h0 = torch.randn(2, 4, 8, 12, generator=generator)
    options = {"g": g, "beta": beta, "initial_state": h0, "output_final_state": True}
    options["use_qk_l2norm_in_kernel"] = True
    with torch.no_grad():
        fused = kernels.step(q, k, v, **options)
    chunked = kernels.step(q, k, v, **options)
    assert calls == ["fused", "chunk"]
    want = torch_kernels.step(q, k, v, **options)
    for got in (fused, chunked):
        for a, b in zip(got, want, strict=True):
            assert torch.allclose(a, b, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_decode_step_matches_the_torch_recurrent_rule() -> None:
    """fla's fused recurrent kernel (decoding one token) against transformers' torch one, at
    GPU head dims (fla's kernels want 64 and up), bfloat16 inputs, float32 state."""
    if qwen36.kernels._fla_fused_recurrent_gated_delta_rule() is None:
        pytest.skip("flash-linear-attention is not installed")
    dims = {"linear_key_head_dim": 64, "linear_value_head_dim": 64, "head_dim": 64}
    deltanet = tiny_model("qwen3_5_text", **dims).model.layers[0].linear_attn
    cuda = torch.device("cuda")
    fast = qwen36.deltanet_kernels(deltanet, cuda, torch.bfloat16)
    slow = qwen36.deltanet_kernels(deltanet, torch.device("cpu"), torch.bfloat16)
    generator = torch.Generator().manual_seed(22)
    heads_k, heads_v = 2, 4
    q, k = (torch.randn(3, 1, heads_k, 64, generator=generator) for _ in range(2))
    v = torch.randn(3, 1, heads_v, 64, generator=generator)
    g = -torch.rand(3, 1, heads_v, generator=generator)
    beta = torch.rand(3, 1, heads_v, generator=generator)
    h0 = torch.randn(3, heads_v, 64, 64, generator=generator) * 0.1
    inputs = [t.to(cuda, torch.bfloat16) for t in (q, k, v, beta)]
    with torch.no_grad():
        out, state = fast.rule_for(1)(
            *inputs[:3], g=g.to(cuda), beta=inputs[3], initial_state=h0.to(cuda),
            output_final_state=True, use_qk_l2norm_in_kernel=True,
        )  # fmt: skip
        want_out, want_state = slow.rule_for(1)(
            *(t.cpu().float() for t in inputs[:3]), g=g, beta=inputs[3].cpu().float(),
            initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True,
        )  # fmt: skip
    assert (out.float().cpu() - want_out).abs().max() <= 0.05
    assert (state.float().cpu() - want_state).abs().max() <= 0.05


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_kernels_match_the_torch_path() -> None:
    if qwen36.kernels._fla_chunk_gated_delta_rule() is None:
        pytest.skip("flash-linear-attention is not installed")
    # fla's triton kernels are tuned for head dims of 16 and up
    dims = {"linear_key_head_dim": 16, "linear_value_head_dim": 32, "head_dim": 32}
    model = tiny_model("qwen3_5_text", dtype=torch.bfloat16, **dims).cuda()
    adapter = ls.adapt(model)
    assert (
        qwen36.deltanet_kernels(
            model.model.layers[0].linear_attn, adapter.device, adapter.dtype
        ).names[1]
        == "fla"
    )
    prompt, response = _ids(300, 19).cuda(), _ids(40, 20).cuda()
    with torch.no_grad():
        fast = adapter.score(adapter.prefill(prompt, chunk_size=128), response)
        with (
            mock.patch.object(qwen36.kernels, "_fla_chunk_gated_delta_rule", lambda: None),
            mock.patch.object(qwen36.kernels, "_causal_conv1d_package", lambda: None),
        ):
            slow = adapter.score(adapter.prefill(prompt, chunk_size=128), response)
    assert (fast - slow).abs().max() <= 0.1  # bfloat16


# --- exact mode against the full graph (float64) --------------------------------------------


@pytest.mark.parametrize(
    ("model_type", "chunk_size", "checkpoints", "loss_type", "beta"),
    [
        ("qwen3_5_text", 7, "device", "dapo", 0.0),
        ("qwen3_5_text", 2, "cpu", "grpo", 0.04),
        ("qwen3_5_text", 1000, "device", "cispo", 0.0),
        ("qwen3_next", 5, "device", "dr_grpo", 0.0),
    ],
)
def test_exact_grpo_step_equals_full_graph(model_type, chunk_size, checkpoints, loss_type, beta):
    """Gradients through the prompt's keys, values, conv windows and recurrent states."""
    model = _model(model_type, torch.float64)
    adapter = ls.adapt(model)
    prompt = _ids(12 if chunk_size == 2 else 31, 60)
    responses = [_ids(n, 61 + i) for i, n in enumerate([5, 2, 7])]
    rewards = [0.7, -0.4, 0.1]
    cfg = ls.GRPOConfig(
        loss_type=loss_type,
        beta=beta,
        gradient="exact",
        recurrent_checkpoints=checkpoints,
        epsilon_high=5.0 if loss_type == "cispo" else None,
        max_completion_length=8,
    )
    ref_adapter, ref = None, None
    if beta:  # a separately initialised reference policy
        ref_adapter = ls.adapt(_model(model_type, torch.float64, seed=9))
        with torch.no_grad():
            ref = [full_sequence_logps(ref_adapter.causal_lm, prompt, r) for r in responses]

    metrics, grads = step_grads(
        model, adapter, prompt, responses, rewards, cfg, ref_adapter=ref_adapter,
        chunk_size=chunk_size,
    )  # fmt: skip
    loss, expected = group_reference(
        model, full_sequence_logps, prompt, responses, rewards, cfg, ref=ref
    )
    grads = {n: g for n, g in grads.items() if g.abs().sum() > 0 or expected[n].abs().sum() > 0}
    expected = {n: expected[n] for n in grads}
    assert metrics.loss == pytest.approx(loss.item(), rel=1e-5)
    assert_grads_close(grads, expected, rtol=FLOAT64_GRAD_RTOL)
    if chunk_size < len(prompt) - 1:
        state = adapter.prefill(prompt, chunk_size=chunk_size, checkpoints=checkpoints)
        assert state.checkpoint_nbytes() > 0
        assert "checkpoint_bytes" in state.summary()["linear_attention"]


def test_exact_mode_needs_checkpoints_for_a_given_state():
    adapter = ls.adapt(_model("qwen3_5_text", torch.float64))
    prompt = _ids(20, 70)
    state = adapter.prefill(prompt, chunk_size=6)  # no checkpoints
    with pytest.raises(ValueError, match=r"through linear_attention layers .*checkpoints='device'"):
        ls.grpo_step(adapter, prompt, [_ids(3, 71), _ids(4, 72)], [1.0, 0.0],
                     config=ls.GRPOConfig(gradient="exact"), state=state)  # fmt: skip


def test_exact_with_lora_on_deltanet_and_attention():
    model = tiny_model("qwen3_5_text", dtype=torch.float64, seed=3)
    targets = ["in_proj_qkv", "in_proj_z", "in_proj_a", "out_proj", "k_proj", "v_proj"]
    peft_model = with_lora(model, targets, lora_alpha=8)
    adapter = ls.adapt(peft_model)
    prompt = _ids(26, 80)
    responses = [_ids(n, 81 + i) for i, n in enumerate([4, 6, 3])]
    rewards = [0.2, 1.0, -0.6]
    cfg = ls.GRPOConfig(loss_type="dapo", beta=0.05, gradient="exact")
    with torch.no_grad(), peft_model.disable_adapter():
        ref = [full_sequence_logps(peft_model, prompt, r) for r in responses]

    _, grads = step_grads(
        peft_model, adapter, prompt, responses, rewards, cfg,
        ref_adapter=ls.lora_reference(adapter), chunk_size=6,
    )  # fmt: skip
    _, expected = group_reference(
        peft_model, full_sequence_logps, prompt, responses, rewards, cfg, ref=ref
    )
    assert grads and all("lora_" in name for name in grads)
    assert_grads_close(grads, expected, rtol=FLOAT64_GRAD_RTOL)
