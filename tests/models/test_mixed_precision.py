"""bf16 compute over float32 master weights without FSDP (``longstraw_core.models.mixed_precision``).

- What a step computes is bit-identical to FSDP2's ``MixedPrecisionPolicy(bf16, reduce
  float32)`` on a world of one rank (what ``distributed.fsdp=true`` runs), loss and float32
  gradients, for every model family, full and LoRA, in exact mode (prefill, replay, sweep).
- Against the float32 full-graph gradient of transformers' own forward (the true gradient),
  the bf16 step is off by what bf16 rounding brings: its relative error is at most 1.25x
  that of transformers' own model run in bf16 (observed 0.96x to 1.05x: 1.8%, 8.8% and 48%
  of the gradient for the qwen3, Qwen3.6 and GLM toys, whose MoE routing flips in bf16);
  and it is really computed in bf16 (a bf16 state, log-probs that differ from float32's).
- Master weights stay float32 (values untouched by the step, gradients float32, AdamW's
  moments float32); the no-grad passes (prefill, rollout's scoring) and the autograd ones
  (replay) give bit-identical log-probs, so on-policy ratios are exactly 1.
"""

from __future__ import annotations

import copy

import distributed_worker as worker
import pytest
import torch
from reference import full_sequence_logps, group_reference

import longstraw_core as ls
from longstraw_core.adapters.matrix import probe_types
from longstraw_core.adapters.probe import MIXED_PRECISION
from longstraw_core.models.mixed_precision import WorkingWeights
from longstraw_core.parallel.fsdp import shard_model

# Every family full, in exact mode; and the first one under LoRA.
FAMILIES = probe_types(MIXED_PRECISION)
CASES = [worker.Case(t, "exact") for t in FAMILIES] + [worker.Case(FAMILIES[0], "exact", lora=True)]
IDS = [*FAMILIES, f"{FAMILIES[0]}-lora"]


def _trained(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


def _bf16_step(model, adapter, group, config) -> tuple[ls.GRPOStepResult, dict]:
    """One ``grpo_step`` on working weights; the float32 gradients it leaves (then cleared)."""
    weights = WorkingWeights(model)
    with weights.step():
        result = ls.grpo_step(
            adapter, group.prompt, group.responses, group.rewards,
            config=config, chunk_size=worker.CHUNK_SIZE,
        )  # fmt: skip
    grads = {n: p.grad.clone() for n, p in _trained(model).items() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return result, grads


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_working_weights_equal_fsdp2_bf16_policy(world_of_one, case):
    group = worker.step_groups(0)[0]
    config = worker.grpo_config(case)
    model, adapter = worker.build(case)
    result, grads = _bf16_step(model, adapter, group, config)

    sharded_model, sharded = worker.build(case)
    shard_model(sharded, mixed_precision="bf16")
    expected = ls.grpo_step(
        sharded, group.prompt, group.responses, group.rewards,
        config=config, chunk_size=worker.CHUNK_SIZE,
    )  # fmt: skip
    want = {
        name: p.grad.full_tensor()
        for name, p in _trained(sharded_model).items()
        if p.grad is not None
    }
    assert grads.keys() == want.keys() and grads
    for name, grad in grads.items():
        assert grad.dtype == torch.float32
        assert torch.equal(grad, want[name]), name
    assert result.loss == expected.loss


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_bf16_gradients_match_the_float32_full_graph_within_bf16_rounding(case):
    group = worker.step_groups(0)[0]
    config = worker.grpo_config(case)
    model, adapter = worker.build(case)
    reference = copy.deepcopy(model)
    before = {name: p.detach().clone() for name, p in _trained(model).items()}
    with torch.no_grad():
        fp32_logps = full_sequence_logps(reference, group.prompt, group.responses[0])

    weights = WorkingWeights(model)
    with weights.step():
        assert adapter.dtype == torch.bfloat16
        state = adapter.prefill(group.prompt, chunk_size=worker.CHUNK_SIZE)
        fp32_state = ls.adapt(reference).prefill(group.prompt, chunk_size=worker.CHUNK_SIZE)
        assert state.nbytes() < fp32_state.nbytes()  # the state is kept in bf16
        with torch.no_grad():
            scored = adapter.score(state, group.responses[0])
        replayed = adapter.score(state, group.responses[0])  # with autograd, as replay runs
        assert torch.equal(scored, replayed.detach())
        assert not torch.equal(scored, fp32_logps)  # really computed in bf16
        del state, replayed
        ls.grpo_step(
            adapter, group.prompt, group.responses, group.rewards,
            config=config, chunk_size=worker.CHUNK_SIZE,
        )  # fmt: skip
    trained = _trained(model)
    for name, p in trained.items():  # the masters: float32, not moved by the step
        assert p.dtype == torch.float32 and torch.equal(p.detach(), before[name]), name
    # The true gradient (float32 full graph), and what transformers' own model computes in
    # bf16 (its full graph, every weight bf16): the rounding error bf16 itself brings.
    args = (full_sequence_logps, group.prompt, group.responses, group.rewards, config)
    _, want = group_reference(reference, *args)
    _, bf16_want = group_reference(reference.to(torch.bfloat16), *args)
    ours = theirs = scale = 0.0
    for name, p in trained.items():
        grad = torch.zeros_like(p) if p.grad is None else p.grad
        assert grad.dtype == torch.float32
        ours += (grad - want[name]).norm() ** 2
        theirs += (bf16_want[name].float() - want[name]).norm() ** 2
        scale += want[name].norm() ** 2
    ours, theirs = (ours / scale).sqrt(), (theirs / scale).sqrt()
    assert 0 < ours <= 1.25 * theirs, f"bf16 step {ours:.3g}, transformers in bf16 {theirs:.3g}"


def test_masters_and_adamw_state_stay_float32_over_steps():
    case = worker.Case("qwen3", "exact")
    model, adapter = worker.build(case)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    weights = WorkingWeights(model)
    for step in range(2):
        group = worker.step_groups(step)[1]
        with weights.step():
            ls.grpo_step(
                adapter, group.prompt, group.responses, group.rewards,
                config=worker.grpo_config(case), chunk_size=worker.CHUNK_SIZE,
            )  # fmt: skip
            weights.to_masters()  # what the recipe does before the clip
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    moments = [t for s in optimizer.state.values() for k, t in s.items() if k != "step"]
    assert moments and {t.dtype for t in moments} == {torch.float32}


def test_a_lora_base_and_a_frozen_reference_are_cast_once():
    case = worker.Case("qwen3", "exact", lora=True)
    model, _ = worker.build(case)
    reference, _ = worker.build(worker.Case("qwen3", "exact"))
    reference.requires_grad_(False)
    WorkingWeights(model, frozen=[reference])
    dtypes = {p.requires_grad: p.dtype for p in model.parameters()}
    assert dtypes == {True: torch.float32, False: torch.bfloat16}  # adapters stay masters
    assert {p.dtype for p in reference.parameters()} == {torch.bfloat16}


def test_a_step_refuses_gradients_left_from_before():
    model, _ = worker.build(worker.Case("qwen3", "detached"))
    next(model.parameters()).grad = torch.zeros_like(next(model.parameters()))
    with pytest.raises(RuntimeError, match="zero_grad"), WorkingWeights(model).step():
        pass


def test_a_generation_batchs_correction_scales_the_float32_sums():
    """Several prompts a step (``GenerationBatch.finish``): the correction of what the
    replays accumulated reaches the float32 sums a bf16 step keeps, not a ``.grad`` that is
    empty during the step."""
    model, adapter = worker.build(worker.Case("qwen3", "exact"))
    weights = WorkingWeights(model)
    group = worker.step_groups(0)[1]
    config = worker.grpo_config(worker.Case("qwen3", "exact"))
    grads = []
    for factor in (1.0, 0.25):
        with weights.step():
            ls.grpo_step(adapter, group.prompt, group.responses, group.rewards, config=config,
                         chunk_size=worker.CHUNK_SIZE)  # fmt: skip
            assert all(p.grad is None for p in weights.masters)  # in the float32 sums
            weights.scale_gradients(model.parameters(), factor)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        model.zero_grad(set_to_none=True)
    assert grads[0] and grads[0].keys() == grads[1].keys()
    for name, full in grads[0].items():
        assert torch.equal(grads[1][name], full * 0.25), name
