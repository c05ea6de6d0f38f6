"""The GLM-5.x / DeepSeek-V3.2 adapter (MLA + DSA + MoE) against the transformers model itself.

Sparse cases pick ``index_topk`` far below the sequence length and record the index scores the
transformers model ranks: a tie at the k-th score would make the selection depend on kernel
order, so those tests first assert that the k-th and (k+1)-th scores differ.
"""

from __future__ import annotations

import pytest
import torch
from dispatch_probes import RecordIndexScores, RecordLargestOutput, assert_no_ties_at_k
from float64_internals import Float64Internals
from reference import (
    assert_grads_close,
    detached_reference_logps,
    full_sequence_logps,
    group_reference,
    parameter_grads,
    step_grads,
    trl_group_loss,
    with_lora,
)
from torch.utils._python_dispatch import TorchDispatchMode

import longstraw_core as ls
from longstraw_core import attention
from longstraw_core.kinds.latent import LatentKV, LatentKVGrad
from longstraw_core.models.tiny import tiny_model
from longstraw_core.state.exact import new_state_grad
from model_adapters import glm52
from model_adapters.glm52 import GlmMoeDsaAdapter, latent_attention

VOCAB = 512
DENSE_TOPK = 4096  # more than any sequence here: every query attends to all it sees
SPARSE_TOPK = 6  # far fewer than the ~50 positions the last queries see


def _ids(length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(seed))


# --- forward equivalence -------------------------------------------------------------------


@pytest.mark.parametrize("model_type", ["glm_moe_dsa", "deepseek_v32"])
@pytest.mark.parametrize(
    ("topk", "chunk_size"), [(DENSE_TOPK, 7), (SPARSE_TOPK, 7), (SPARSE_TOPK, 1000)]
)
def test_score_equals_full_sequence_forward(model_type: str, topk: int, chunk_size: int) -> None:
    model = tiny_model(model_type, index_topk=topk)
    adapter = ls.adapt(model)
    assert isinstance(adapter, GlmMoeDsaAdapter)
    prompt, response = _ids(45, 1), _ids(9, 2)
    recorder = RecordIndexScores(topk)
    with torch.no_grad():
        with recorder:
            expected = full_sequence_logps(model, prompt, response)
        logps = adapter.score(adapter.prefill(prompt, chunk_size=chunk_size), response)
    if topk == SPARSE_TOPK:
        assert_no_ties_at_k(recorder)
    assert logps.shape == (9,)
    assert (logps - expected).abs().max() <= 1e-5


def test_small_blocks_and_a_one_token_prompt(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tiny scratch budgets force every loop (key blocks and top-k merges, indexer heads,
    query blocks) through many iterations; a one-token prompt leaves the prefix empty, so the
    branch's own keys are all the indexer can pick from."""
    monkeypatch.setattr(glm52.family, "_WORK_ELEMENTS", 64)
    model = tiny_model("glm_moe_dsa", index_topk=SPARSE_TOPK)
    adapter = ls.adapt(model)
    for prompt, response in ((_ids(45, 1), _ids(9, 2)), (_ids(1, 3), _ids(14, 4))):
        recorder = RecordIndexScores(SPARSE_TOPK)
        with torch.no_grad():
            with recorder:
                expected = full_sequence_logps(model, prompt, response)
            logps = adapter.score(adapter.prefill(prompt, chunk_size=5), response)
        assert_no_ties_at_k(recorder)
        assert (logps - expected).abs().max() <= 1e-5


# --- gradients -----------------------------------------------------------------------------


def _float64_model(topk: int, seed: int = 0):
    # The MoE's grouped matmul has no float64 kernel on CPU: use the eager experts loop.
    return tiny_model(
        "glm_moe_dsa",
        dtype=torch.float64,
        seed=seed,
        index_topk=topk,
        experts_implementation="eager",
    )


@pytest.mark.parametrize("topk", [DENSE_TOPK, SPARSE_TOPK])
def test_grpo_step_gradients_equal_detached_reference(topk: int) -> None:
    model = _float64_model(topk)
    adapter = ls.adapt(model)
    prompt, responses = _ids(30, 3), [_ids(n, 4 + n) for n in (7, 3, 5)]
    rewards = [1.0, -0.5, 0.25]
    config = ls.GRPOConfig(loss_type="grpo")

    model.zero_grad(set_to_none=True)
    metrics = ls.grpo_step(adapter, prompt, responses, rewards, config=config, chunk_size=8)
    grads = {
        name: torch.zeros_like(p) if p.grad is None else p.grad.clone()
        for name, p in model.named_parameters()
    }

    recorder = RecordIndexScores(topk)
    with recorder:
        logps = [detached_reference_logps(model, prompt, r) for r in responses]
    if topk == SPARSE_TOPK:
        assert_no_ties_at_k(recorder)
    width = max(len(r) for r in responses)
    padded = torch.stack([torch.nn.functional.pad(lp, (0, width - len(lp))) for lp in logps])
    mask = torch.stack([(torch.arange(width) < len(r)).double() for r in responses])
    reward_tensor = torch.tensor(rewards, dtype=torch.float64)
    advantages = (reward_tensor - reward_tensor.mean()) / (reward_tensor.std() + 1e-4)
    loss, _ = trl_group_loss(padded, padded.detach(), None, advantages, mask, config)
    expected = parameter_grads(model, loss)

    assert metrics.loss == pytest.approx(loss.item(), rel=1e-9, abs=1e-12)
    assert sum(g.abs().sum() for g in expected.values()) > 0
    indexer_grads = [g for name, g in grads.items() if ".indexer." in name]
    assert indexer_grads and all(g.abs().sum() == 0 for g in indexer_grads)  # frozen
    assert_grads_close(grads, expected, rtol=1e-6)


def test_lora_on_kv_b_proj_uses_the_effective_weight() -> None:
    model = _float64_model(SPARSE_TOPK, seed=1)
    peft_model = with_lora(model, ["q_b_proj", "kv_b_proj", "o_proj"], lora_alpha=8)
    adapter = ls.adapt(peft_model)
    prompt, response = _ids(33, 12), _ids(7, 13)
    state = adapter.prefill(prompt, chunk_size=10)
    ours = adapter.score(state, response)
    # 1e-6, not float64 round-off: the MoE router computes in float32 even in a float64 model.
    with torch.no_grad():
        assert (ours - full_sequence_logps(peft_model, prompt, response)).abs().max() <= 1e-6
        with peft_model.disable_adapter():  # the reference policy: base weights, same code
            base = adapter.score(adapter.prefill(prompt, chunk_size=10), response)
            assert (base - full_sequence_logps(peft_model, prompt, response)).abs().max() <= 1e-6
    assert (base - ours).abs().max() > 1e-3
    grads = parameter_grads(peft_model, ours.sum())
    assert any("kv_b_proj.lora_" in name and g.abs().sum() > 0 for name, g in grads.items())
    assert grads and all("lora_" in name for name in grads)
    reference = detached_reference_logps(peft_model, prompt, response)
    assert_grads_close(grads, parameter_grads(peft_model, reference.sum()), rtol=1e-6)


@pytest.mark.parametrize("work_elements", [1, 1 << 22])
def test_sparse_latent_attention_matches_masked_softmax_and_gradcheck(
    monkeypatch: pytest.MonkeyPatch, work_elements: int
) -> None:
    """The gathered sparse attention against plain masked softmax over prefix + span rows,
    and its backward (queries, span rows, prefix rows) against finite differences, with one
    query per block and with all queries in one block."""
    monkeypatch.setattr(glm52.family, "_WORK_ELEMENTS", work_elements)
    generator = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        x = torch.randn(*shape, dtype=torch.float64, generator=generator)
        return x.requires_grad_()

    heads, span, prefix_length, dim, value_dim, topk = 3, 5, 7, 6, 4, 4
    queries, span_latent, prefix_latent = (
        rand(1, heads, span, dim),
        rand(span, dim),
        rand(prefix_length, dim),
    )
    positions = torch.full((span, topk), -1)
    for t in range(span):  # query t sits at prefix_length + t; the first ones see < topk keys
        visible = torch.randperm(prefix_length + t + 1, generator=generator)
        positions[t, : min(topk, len(visible))] = visible[:topk]
    positions[1, 0] = -1  # padding inside a row

    output = latent_attention(queries, span_latent, prefix_latent, positions, value_dim, 0.7)
    keys = torch.cat([prefix_latent, span_latent])
    selected = torch.zeros(span, prefix_length + span, dtype=torch.bool)
    for t in range(span):
        selected[t, positions[t][positions[t] >= 0]] = True
    scores = (queries @ keys.T * 0.7).masked_fill(~selected, float("-inf"))
    expected = torch.softmax(scores, -1) @ keys[:, :value_dim]
    assert (output - expected).abs().max() <= 1e-12

    torch.autograd.gradcheck(
        lambda q, s, p: latent_attention(q, s, p, positions, value_dim, 0.7),
        (queries, span_latent, prefix_latent),
    )


# --- memory: the latent is never expanded --------------------------------------------------


@pytest.mark.parametrize("topk", [DENSE_TOPK, SPARSE_TOPK])
def test_prefill_and_scoring_never_expand_the_prefix_per_head(topk: int) -> None:
    """No tensor as large as the per-head K or V over the prompt exists, forward or backward.

    Heads x head dims (8 x 32) are made larger than everything else a chunk or branch of 8
    tokens builds (indexer scores 8 x 16 heads per position, attention scores 8 x 8 heads),
    so any tensor of ``heads x prompt x head_dim`` elements would be the expanded prefix.
    """
    heads, head_dim = 8, 32
    model = tiny_model(
        "glm_moe_dsa",
        index_topk=topk,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        qk_nope_head_dim=head_dim,
        v_head_dim=head_dim,
    )
    adapter = ls.adapt(model)
    prompt, response = _ids(301, 20), _ids(8, 21)
    stored = len(prompt) - 1
    recorder = RecordLargestOutput()
    with recorder:
        state = adapter.prefill(prompt, chunk_size=8)
        adapter.score(state, response).sum().backward()
    assert recorder.largest >= stored * (model.config.kv_lora_rank + 8)  # the state was seen
    assert recorder.largest < heads * stored * head_dim


# --- the state ---------------------------------------------------------------------------


def test_state_holds_only_latent_and_index_keys() -> None:
    model = tiny_model("glm_moe_dsa", index_topk=SPARSE_TOPK)
    adapter = ls.adapt(model)
    prompt = _ids(41, 30)
    state = adapter.prefill(prompt, chunk_size=16)
    config = model.config
    rank, rope, index_dim = config.kv_lora_rank, config.qk_rope_head_dim, config.index_head_dim
    assert all(isinstance(record, LatentKV) for record in state.layers)
    for record, kind in zip(state.layers, config.indexer_types, strict=True):
        assert record.c_kv.shape == (40, rank) and record.k_pe.shape == (40, rope)
        assert record.c_kv.data_ptr() == record.latent.data_ptr()  # views, not copies
        if kind == "full":
            assert record.index_keys.shape == (40, index_dim)
        else:
            assert record.index_keys is None

    full_layers = config.indexer_types.count("full")
    per_token = 4 * (4 * (rank + rope) + full_layers * index_dim)  # float32
    expanded_per_token = 4 * 4 * 4 * ((16 + 8) + 16)  # 4 layers x 4 heads x (K + V dims)
    assert state.nbytes() == 40 * per_token
    row = state.summary()["mla_dsa"]
    assert row["layers"] == 4 and row["bytes_per_token"] == per_token
    assert row["expanded_bytes_per_token"] == expanded_per_token
    assert row["expanded_bytes"] == 40 * expanded_per_token
    assert state.to("cpu").nbytes() == state.nbytes()

    # Scoring only reads: two branches from one state equal each from a fresh prefill.
    snapshot = [r.latent.clone() for r in state.layers]
    first, second = _ids(6, 31), _ids(4, 32)
    with torch.no_grad():
        shared = [adapter.score(state, first), adapter.score(state, second)]
        fresh = [adapter.score(adapter.prefill(prompt, chunk_size=16), r) for r in (first, second)]
    for got, want in zip(shared, fresh, strict=True):
        assert torch.equal(got, want)
    for record, latent in zip(state.layers, snapshot, strict=True):
        assert torch.equal(record.latent, latent)


def test_a_shared_first_layer_is_refused() -> None:
    model = tiny_model("glm_moe_dsa", indexer_types=["shared", "full", "shared", "full"])
    with pytest.raises(ValueError, match="first layer must be 'full'"):
        ls.adapt(model)


# --- exact gradients: the full graph -------------------------------------------------------
#
# ``grpo_step(gradient="exact")`` against the full graph: every ``prompt + response`` through
# the transformers model with autograd over everything, TRL's group loss, one backward. In
# sparse cases the DSA selection is discrete: both sides differentiate the loss with the
# selection fixed (the indexer runs under no_grad in transformers too).
#
# The models keep float32 islands even in float64: every RMSNorm computes in float32, and the
# MoE router casts its input and its (float32) weight to float32. They bound the agreement at
# ~1e-7 relative whatever the mechanism does. ``Float64Internals`` turns those casts into
# no-ops (and the routers' parameters into float64) on both sides alike, so the comparison
# shows float64 round-off; one test keeps the models' own float32 internals.

EXACT_RTOL = 1e-10  # float64 throughout (observed: ~1e-14)
LENGTHS = [7, 3, 5]
REWARDS = [1.0, -0.5, 0.25]


def _exact_model(model_type: str, topk: int, seed: int = 0, float64_internals: bool = True):
    model = tiny_model(
        model_type,
        dtype=torch.float64,
        seed=seed,
        index_topk=topk,
        experts_implementation="eager",
    )
    if float64_internals:
        for module in model.modules():
            if hasattr(module, "e_score_correction_bias"):  # the MoE router
                module.weight.data = module.weight.data.double()
                module.e_score_correction_bias.data = module.e_score_correction_bias.double()
    return model


def _step_grads(model, adapter, prompt, responses, config, **kwargs):
    return step_grads(model, adapter, prompt, responses, REWARDS, config, **kwargs)


def _full_graph(model, prompt, responses, old, ref, config):
    """The group loss over full-sequence forwards and its parameter gradients."""
    return group_reference(
        model, full_sequence_logps, prompt, responses, REWARDS, config, old=old, ref=ref
    )


def _check_exact(
    model,
    prompt,
    responses,
    config,
    *,
    chunk_size,
    topk,
    ref_model=None,
    ref_adapter=None,
    off_policy=True,
    rtol=EXACT_RTOL,
):
    """``grpo_step(gradient="exact")`` equals the full graph; returns the step's gradients."""
    adapter = ls.adapt(model)
    old = None
    if off_policy:  # behaviour log-probs off the current policy, so ratios and clips engage
        noise = torch.Generator().manual_seed(7)
        with torch.no_grad():
            state = adapter.prefill(prompt, chunk_size=chunk_size)
            old = [
                adapter.score(state, r) + 0.3 * torch.randn(len(r), generator=noise).double()
                for r in responses
            ]
    if ref_model is not None and ref_adapter is None:
        ref_adapter = ls.adapt(ref_model)
    metrics, grads = _step_grads(
        model, adapter, prompt, responses, config, old_logps=old, ref_adapter=ref_adapter,
        chunk_size=chunk_size,
    )  # fmt: skip
    recorder = RecordIndexScores(topk)
    with recorder:
        ref = None
        if config.beta:
            with torch.no_grad():
                if ref_model is not None:
                    ref = [full_sequence_logps(ref_model, prompt, r) for r in responses]
                else:  # a LoRA policy's reference: the base weights
                    with model.disable_adapter():
                        ref = [full_sequence_logps(model, prompt, r) for r in responses]
        loss, expected = _full_graph(model, prompt, responses, old, ref, config)
    if topk == SPARSE_TOPK:
        assert_no_ties_at_k(recorder)
    assert metrics.loss == pytest.approx(loss.item(), rel=max(rtol, 1e-9), abs=1e-12)
    assert metrics.sweep_seconds > 0 and metrics.state_grad_bytes > 0
    assert sum(g.abs().sum() for g in expected.values()) > 0
    assert_grads_close(grads, expected, rtol=rtol)
    return grads


def _exact_config(loss_type: str, beta: float) -> ls.GRPOConfig:
    return ls.GRPOConfig(
        loss_type=loss_type,
        beta=beta,
        gradient="exact",
        epsilon_high=5.0 if loss_type == "cispo" else 0.28,
        max_completion_length=16,
    )


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo", "cispo"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_exact_step_equals_full_graph(loss_type: str, beta: float) -> None:
    """Sparse GLM (layers that select and layers that reuse), uneven chunks of 7."""
    prompt, responses = _ids(30, 3), [_ids(n, 40 + n) for n in LENGTHS]
    model = _exact_model("glm_moe_dsa", SPARSE_TOPK)
    ref_model = _exact_model("glm_moe_dsa", SPARSE_TOPK, seed=1) if beta else None
    with Float64Internals():
        _check_exact(
            model, prompt, responses, _exact_config(loss_type, beta), chunk_size=7,
            topk=SPARSE_TOPK, ref_model=ref_model,
        )  # fmt: skip


@pytest.mark.parametrize("model_type", ["glm_moe_dsa", "deepseek_v32"])
@pytest.mark.parametrize(
    ("topk", "chunk_size"),
    # chunks of 5 with top-6: the first chunk attends densely, the rest sparsely
    [(DENSE_TOPK, 7), (DENSE_TOPK, 1000), (SPARSE_TOPK, 5), (SPARSE_TOPK, 1000)],
)
def test_exact_dense_sparse_and_chunkings(model_type: str, topk: int, chunk_size: int) -> None:
    prompt, responses = _ids(30, 5), [_ids(n, 50 + n) for n in LENGTHS]
    model = _exact_model(model_type, topk, seed=2)
    with Float64Internals():
        _check_exact(
            model, prompt, responses, _exact_config("dapo", 0.0), chunk_size=chunk_size,
            topk=topk, off_policy=False,
        )  # fmt: skip


@pytest.mark.parametrize("model_type", ["glm_moe_dsa", "deepseek_v32"])
def test_exact_with_the_models_float32_internals(model_type: str) -> None:
    """The models as they are (float32 norms and router): 1e-6 relative (observed <= ~5e-7,
    worst on the float32 router weights)."""
    prompt, responses = _ids(30, 6), [_ids(n, 60 + n) for n in LENGTHS]
    model = _exact_model(model_type, SPARSE_TOPK, seed=3, float64_internals=False)
    ref_model = _exact_model(model_type, SPARSE_TOPK, seed=4, float64_internals=False)
    _check_exact(
        model, prompt, responses, _exact_config("grpo", 0.04), chunk_size=7, topk=SPARSE_TOPK,
        ref_model=ref_model, rtol=1e-6,
    )  # fmt: skip


def test_exact_with_lora_trains_only_adapters() -> None:
    prompt, responses = _ids(33, 12), [_ids(n, 70 + n) for n in LENGTHS]
    model = _exact_model("glm_moe_dsa", SPARSE_TOPK, seed=5)
    peft_model = with_lora(model, ["q_b_proj", "kv_b_proj", "o_proj"], lora_alpha=8)
    adapter = ls.adapt(peft_model)
    with Float64Internals():
        grads = _check_exact(
            peft_model, prompt, responses, _exact_config("dapo", 0.05), chunk_size=6,
            topk=SPARSE_TOPK, ref_adapter=ls.lora_reference(adapter),
        )  # fmt: skip
    assert grads and all("lora_" in name for name in grads)
    assert any("kv_b_proj.lora_" in name and g.abs().sum() > 0 for name, g in grads.items())


def test_exact_differs_from_detached() -> None:
    """The prompt's latents depend on the parameters; detached mode drops those paths."""
    model = _exact_model("glm_moe_dsa", SPARSE_TOPK, seed=6)
    adapter = ls.adapt(model)
    prompt, responses = _ids(30, 8), [_ids(n, 80 + n) for n in LENGTHS]
    _, exact = _step_grads(model, adapter, prompt, responses, ls.GRPOConfig(gradient="exact"))
    _, detached = _step_grads(model, adapter, prompt, responses, ls.GRPOConfig())
    name = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"  # the prompt's latent
    assert (exact[name] - detached[name]).abs().max() > 0.1 * exact[name].abs().max()
    indexer = [g for name, g in exact.items() if ".indexer." in name]
    assert indexer and all(g.abs().sum() == 0 for g in indexer)  # frozen, as in transformers


class RecordPrefixShapedAllocations(TorchDispatchMode):
    """Ops whose output ends in ``shape`` and lives in new memory (not a view of an input)."""

    def __init__(self, shape: tuple[int, int]) -> None:
        super().__init__()
        self.shape, self.found = shape, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        inputs = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
        storages = {t.untyped_storage().data_ptr() for t in inputs}
        for out in result if isinstance(result, tuple | list) else (result,):
            if (
                isinstance(out, torch.Tensor)
                and tuple(out.shape[-2:]) == self.shape
                and out.untyped_storage().data_ptr() not in storages
            ):
                self.found.append((func, tuple(out.shape)))
        return result


@pytest.mark.parametrize("topk", [DENSE_TOPK, SPARSE_TOPK])
def test_exact_prefix_gradients_go_into_the_buffer_without_temporaries(
    monkeypatch: pytest.MonkeyPatch, topk: int
) -> None:
    """Branch backward and the sweep add prefix gradients into ``dS`` in place: no tensor
    shaped like a layer's prefix latent is allocated (the buffer itself exists beforehand).
    Dense attention works in key blocks, made smaller than the prefix here."""
    monkeypatch.setattr(attention.blocks, "MAX_SCORE_ELEMENTS", 2048)
    model = tiny_model("glm_moe_dsa", index_topk=topk)
    adapter = ls.adapt(model)
    prompt, response = _ids(101, 22), _ids(8, 23)
    state = adapter.prefill(prompt, chunk_size=16)
    state_grad = new_state_grad(state)
    assert all(isinstance(layer, LatentKVGrad) for layer in state_grad.layers)
    width = model.config.kv_lora_rank + model.config.qk_rope_head_dim
    assert state_grad.nbytes() == 4 * 4 * 100 * width  # the latent only: 4 layers, float32
    recorder = RecordPrefixShapedAllocations((100, width))
    with recorder:
        adapter.score(state, response, state_grad=state_grad).sum().backward()
    assert all(layer.latent.abs().sum() > 0 for layer in state_grad.layers)
    with recorder:
        adapter.backprop_prompt(state, state_grad)
    assert not recorder.found


@pytest.mark.parametrize("work_elements", [1, 1 << 22])
def test_sparse_latent_attention_adds_the_prefix_gradient_into_a_sink(
    monkeypatch: pytest.MonkeyPatch, work_elements: int
) -> None:
    """With a sink, the prefix rows' gradient is added into it (one query block or many)."""
    monkeypatch.setattr(glm52.family, "_WORK_ELEMENTS", work_elements)
    generator = torch.Generator().manual_seed(1)
    heads, span, prefix_length, dim, value_dim, topk = 3, 5, 7, 6, 4, 4
    queries = torch.randn(1, heads, span, dim, dtype=torch.float64, generator=generator)
    span_latent = torch.randn(span, dim, dtype=torch.float64, generator=generator)
    prefix_latent = torch.randn(prefix_length, dim, dtype=torch.float64, generator=generator)
    queries.requires_grad_()
    positions = torch.stack([torch.randperm(prefix_length + 1, generator=generator)[:topk]] * span)
    weights = torch.randn(1, heads, span, value_dim, dtype=torch.float64, generator=generator)

    prefix = prefix_latent.clone().requires_grad_()
    expected = torch.autograd.grad(
        (latent_attention(queries, span_latent, prefix, positions, value_dim, 0.7) * weights).sum(),
        prefix,
    )[0]
    sink = torch.ones(prefix_length, dim, dtype=torch.float64)
    output = latent_attention(
        queries, span_latent, prefix_latent, positions, value_dim, 0.7, prefix_grad=sink
    )
    (output * weights).sum().backward()
    assert expected.abs().sum() > 0
    assert (sink - 1 - expected).abs().max() <= 1e-12
