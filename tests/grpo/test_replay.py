"""grpo_step (detached) against the whole group backpropagated at once through transformers."""

from __future__ import annotations

import functools
import itertools
import math

import pytest
import torch
from reference import (
    assert_grads_close,
    detached_reference_logps,
    group_reference,
    hand_advantages,
    step_grads,
    with_lora,
)

import longstraw_core as ls
from longstraw_core.data.tasks import Sample
from longstraw_core.metrics import names
from longstraw_core.models.tiny import tiny_model
from longstraw_core.rewards import RewardSet

VOCAB = 512
LENGTHS = [5, 9, 2]
REWARDS = [1.0, 0.5, -0.5]


def _ids(length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(seed))


def _group(seed: int = 0) -> tuple[torch.Tensor, list[torch.Tensor]]:
    return _ids(23, seed), [_ids(n, seed + 1 + i) for i, n in enumerate(LENGTHS)]


def _reference_grads(model, ref_logps_fn, prompt, responses, old, cfg, truncated=None):
    """Every response through the transformers cache reference, the group loss at once."""
    ref = [ref_logps_fn(r) for r in responses] if cfg.beta else None
    return group_reference(
        model, detached_reference_logps, prompt, responses, REWARDS, cfg,
        old=old, ref=ref, truncated=truncated,
    )  # fmt: skip


def _step_grads(adapter, model, prompt, responses, cfg, **kwargs):
    return step_grads(model, adapter, prompt, responses, REWARDS, cfg, **kwargs)


@pytest.fixture(scope="module")
def models():
    policy = tiny_model("qwen3", dtype=torch.float64, seed=0)
    reference = tiny_model("qwen3", dtype=torch.float64, seed=1)
    return policy, reference


CASES = list(
    itertools.product(
        ["grpo", "bnpo", "dr_grpo", "dapo", "cispo"], [0.0, 0.04], ["token", "sequence"]
    )
)


@pytest.mark.filterwarnings("ignore:.*importance_sampling_level.*")
@pytest.mark.parametrize(("loss_type", "beta", "level"), CASES)
def test_grpo_step_gradients_equal_whole_group_reference(models, loss_type, beta, level):
    policy, reference = models
    adapter, ref_adapter = ls.adapt(policy), ls.adapt(reference)
    prompt, responses = _group()
    cfg = ls.GRPOConfig(
        loss_type=loss_type,
        beta=beta,
        importance_sampling_level=level,
        epsilon_high=5.0 if loss_type == "cispo" else 0.28,
        max_completion_length=16,
    )
    # Behaviour log-probs that differ from the current policy, so ratios clip on both sides.
    with torch.no_grad():
        state = adapter.prefill(prompt)
        old = [
            adapter.score(state, r) + 0.3 * torch.randn(len(r), dtype=torch.float64)
            for r in responses
        ]
        ref_state = ref_adapter.prefill(prompt)

    metrics, grads = _step_grads(
        adapter, policy, prompt, responses, cfg, old_logps=old, ref_adapter=ref_adapter
    )
    loss, expected = _reference_grads(
        policy,
        lambda r: ref_adapter.score(ref_state, r).detach(),
        prompt,
        responses,
        old,
        cfg,
    )
    assert metrics.loss == pytest.approx(loss.item(), rel=1e-9, abs=1e-12)
    assert sum(g.abs().sum() for g in expected.values()) > 0
    assert_grads_close(grads, expected, rtol=1e-5)


@pytest.mark.parametrize("loss_type", ["cispo", "dapo"])
def test_detached_step_at_a_temperature_equals_reference(models, loss_type):
    """At ``GRPOConfig.temperature=1.6`` the policy's and the reference's log-probs (and the
    entropy) are those of ``log_softmax(logits / 1.6)``, in detached mode too."""
    temperature = 1.6
    policy, reference = models
    adapter, ref_adapter = ls.adapt(policy), ls.adapt(reference)
    prompt, responses = _group(seed=20)
    cap = {"epsilon_high": 5.0} if loss_type == "cispo" else {}
    cfg = ls.GRPOConfig(loss_type=loss_type, beta=0.04, temperature=temperature, **cap)
    tempered = functools.partial(detached_reference_logps, temperature=temperature)
    with torch.no_grad():
        old = [tempered(policy, prompt, r) + 0.3 * torch.randn(len(r), dtype=torch.float64)
               for r in responses]  # fmt: skip
        ref = [tempered(reference, prompt, r) for r in responses]
        sequence = torch.cat([prompt, responses[0]])[None]
        logits = policy(input_ids=sequence).logits[0, len(prompt) - 1 : -1] / temperature
        entropy = torch.distributions.Categorical(logits=logits).entropy()

    result, grads = _step_grads(
        adapter, policy, prompt, responses, cfg, old_logps=old, ref_adapter=ref_adapter
    )
    loss, expected = group_reference(policy, tempered, prompt, responses, REWARDS, cfg, old, ref)
    assert result.loss == pytest.approx(loss.item(), rel=1e-9, abs=1e-12)
    assert_grads_close(grads, expected, rtol=1e-6)
    state = adapter.prefill(prompt)
    with torch.no_grad():
        _, scored = adapter.score(state, responses[0], return_entropy=True, temperature=temperature)
    torch.testing.assert_close(scored, entropy, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="temperature must be a finite number > 0"):
        adapter.score(state, responses[0], temperature=0.0)  # a greedy rollout's


def test_on_policy_state_reuse_and_truncation_mask(models):
    policy, _ = models
    adapter = ls.adapt(policy)
    prompt, responses = _group(seed=10)
    cfg = ls.GRPOConfig(loss_type="dapo", mask_truncated_completions=True)
    truncated = [False, True, False]
    state = adapter.prefill(prompt, chunk_size=5)
    metrics, grads = _step_grads(
        adapter, policy, prompt, responses, cfg, state=state, truncated=truncated
    )
    loss, expected = _reference_grads(
        policy, None, prompt, responses, None, cfg, truncated=truncated
    )
    assert metrics.branches_replayed == 2 and metrics.prefill_seconds == 0.0
    assert not metrics.prefilled and "prefill_seconds" not in metrics.metrics()  # the caller's
    assert metrics.loss == pytest.approx(loss.item(), abs=1e-12)
    assert_grads_close(grads, expected, rtol=1e-5)


@pytest.mark.parametrize("rewards", [[1.0, float("nan"), -0.5], [float("nan")] * 3])
def test_unscorable_branches_get_zero_advantage_as_in_trl(models, rewards):
    """A NaN reward (every reward function returned None) is left out of the group's mean
    and std and its branch gets zero advantage, as in TRL; with beta=0 it is not replayed,
    and the gradient is TRL's group loss with those advantages (its tokens still count in
    the loss's normalisation, as TRL keeps the completion's mask)."""
    policy, _ = models
    adapter = ls.adapt(policy)
    prompt, responses = _group(seed=15)
    cfg = ls.GRPOConfig(loss_type="dapo")
    result, grads = step_grads(policy, adapter, prompt, responses, rewards, cfg)
    advantages = hand_advantages(rewards)
    assert result.advantages == pytest.approx(advantages.tolist(), abs=1e-12)
    assert result.advantages[1] == 0.0
    assert result.branches_replayed == sum(a != 0.0 for a in result.advantages)
    loss, expected = group_reference(
        policy, detached_reference_logps, prompt, responses, rewards, cfg
    )
    assert result.loss == pytest.approx(loss.item(), abs=1e-12)
    assert_grads_close(grads, expected, rtol=1e-5)
    scorable = [r for r in rewards if not math.isnan(r)]
    if scorable:
        assert result.group_reward_mean == pytest.approx(sum(scorable) / len(scorable))
    else:
        assert math.isnan(result.group_reward_mean)  # nothing scorable


def test_a_later_update_reads_the_first_ones_log_probs(models):
    """``result.logps`` / ``result.ref_logps`` of one update are the next update's
    ``old_logps`` / ``ref_logps``: given them, grpo_step scores no reference and equals a call
    that scored it. Without KL a branch of zero advantage is skipped: it has none, and
    needs none."""
    policy, reference = models
    adapter, ref_adapter = ls.adapt(policy), ls.adapt(reference)
    prompt, responses = _group(seed=30)
    rewards = [1.0, 0.5, 0.0]  # the mean: branch 1 has no advantage and is skipped
    cfg = ls.GRPOConfig(loss_type="dapo", beta=0.04)
    first, grads = step_grads(policy, adapter, prompt, responses, rewards, cfg,
                              ref_adapter=ref_adapter)  # fmt: skip
    assert all(lp is not None for lp in first.logps + first.ref_logps)  # KL: all replayed
    cfg0 = ls.GRPOConfig(loss_type="dapo")
    on_policy, _ = step_grads(policy, adapter, prompt, responses, rewards, cfg0)
    assert on_policy.logps[1] is None and on_policy.ref_logps == [None] * 3
    for i in range(3):
        with torch.no_grad():
            assert torch.equal(first.logps[i], adapter.score(adapter.prefill(prompt), responses[i]))
    again, same = step_grads(policy, adapter, prompt, responses, rewards, cfg,
                             old_logps=first.logps, ref_logps=first.ref_logps)  # fmt: skip
    assert again.ref_seconds == 0.0 and again.loss == pytest.approx(first.loss, rel=1e-12)
    assert_grads_close(same, grads, rtol=1e-12)  # same weights: the ratios are exactly 1
    with pytest.raises(ValueError, match="reward_std"):
        ls.grpo_step(adapter, prompt, responses, rewards, config=cfg0, reward_std=1.0)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_given_advantages_step_exactly_as_computed_ones(models, scale):
    """The recipes compute each group's advantages (``group_advantages`` of its rewards, with
    the step's std for ``"batch"``) and pass them: the same step, bit for bit, as
    ``grpo_step`` computing them from ``rewards`` and ``reward_std``."""
    policy, _ = models
    adapter = ls.adapt(policy)
    prompt, responses = _group(seed=40)
    cfg = ls.GRPOConfig(loss_type="dapo", scale_rewards=scale)
    std = 0.7 if scale == "batch" else None
    inside, grads = _step_grads(adapter, policy, prompt, responses, cfg, reward_std=std)
    advantages = ls.group_advantages(REWARDS, scale, std=std)
    assert advantages.dtype == torch.float64 and advantages.tolist() == inside.advantages
    given, same = _step_grads(adapter, policy, prompt, responses, cfg, advantages=advantages)
    assert given.advantages == inside.advantages and given.loss == inside.loss
    assert (given.group_reward_mean, given.group_reward_std) == (
        inside.group_reward_mean,
        inside.group_reward_std,
    )
    assert all(torch.equal(same[name], grads[name]) for name in grads)
    with pytest.raises(ValueError, match="not both"):
        ls.grpo_step(adapter, prompt, responses, REWARDS, advantages=advantages, reward_std=1.0)
    with pytest.raises(ValueError, match="3 finite values"):
        ls.grpo_step(adapter, prompt, responses, REWARDS, advantages=[0.0, math.nan, 1.0])


def test_lora_reference_uses_the_same_weights_with_adapters_disabled():
    model = tiny_model("qwen3", dtype=torch.float64, seed=2)
    peft_model = with_lora(model, ["q_proj", "v_proj"], std=0.2)
    adapter = ls.adapt(peft_model)
    prompt, responses = _group(seed=20)
    cfg = ls.GRPOConfig(loss_type="grpo", beta=0.1)

    def base_logps(response):
        with torch.no_grad(), peft_model.disable_adapter():
            return detached_reference_logps(peft_model, prompt, response)

    metrics, grads = _step_grads(
        adapter, peft_model, prompt, responses, cfg, ref_adapter=ls.lora_reference(adapter)
    )
    loss, expected = _reference_grads(peft_model, base_logps, prompt, responses, None, cfg)
    assert metrics.branch_stats["kl"] > 0  # LoRA moved the policy away from its base weights
    assert metrics.loss == pytest.approx(loss.item(), rel=1e-9)
    assert all("lora_" in name for name, g in grads.items() if g.abs().sum() > 0)
    assert_grads_close(grads, expected, rtol=1e-5)


def test_equal_rewards_skip_every_branch_and_leave_no_gradient(models):
    policy, _ = models
    adapter = ls.adapt(policy)
    prompt, responses = _group(seed=30)
    policy.zero_grad(set_to_none=True)
    metrics = ls.grpo_step(adapter, prompt, responses, [0.5, 0.5, 0.5])
    assert metrics.branches_replayed == 0 and metrics.loss == 0.0
    assert all(p.grad is None for p in policy.parameters())


def test_metrics_report_the_step(models):
    policy, _ = models
    adapter = ls.adapt(policy)
    prompt, responses = _group(seed=40)
    metrics = ls.grpo_step(adapter, prompt, responses, REWARDS)
    policy.zero_grad(set_to_none=True)
    assert metrics.completion_tokens == sum(LENGTHS)
    assert metrics.prompt_tokens == 23
    assert metrics.branches_replayed == 3
    assert metrics.advantages == pytest.approx(hand_advantages(REWARDS).tolist())
    assert metrics.state_bytes == ls.adapt(policy).prefill(prompt).nbytes() > 0
    assert metrics.entropy > 0 and metrics.peak_memory_bytes > 0
    # on-policy: ratio 1, nothing clipped
    assert metrics.branch_stats["clip_ratio/region_mean"] == 0.0
    for key in ("prefill_seconds", "replay_seconds", "group_reward_mean", "group_reward_std"):
        assert key in metrics.metrics()


def test_step_result_is_typed_and_logs_flat_scalars(models):
    policy, _ = models
    adapter = ls.adapt(policy)
    prompt, responses = _group(seed=40)
    result = ls.grpo_step(adapter, prompt, responses, REWARDS)
    policy.zero_grad(set_to_none=True)
    assert isinstance(result, ls.GRPOStepResult) and result.prefilled
    # Detached: a float, and log-probs without a graph (the backward already ran; holding
    # a graph here would keep every branch's activations alive).
    assert type(result.loss) is float
    assert not any(logps.requires_grad for logps in result.logps)
    assert result.advantages == pytest.approx(hand_advantages(REWARDS).tolist())
    flat = result.metrics()
    assert all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in flat.values())
    assert flat[names.LOSS] == result.loss and flat[names.PREFILL_SECONDS] > 0
    assert flat[names.GROUP_REWARD_STD] == pytest.approx(torch.tensor(REWARDS).std().item())
    assert flat[names.COMPLETION_LENGTH_MEAN] == sum(LENGTHS) / len(LENGTHS)
    assert "advantages" not in flat and "clip_ratio/low_mean" in flat
    result.extra["checkpoint_bytes"] = 7  # a caller's own metric joins the logged ones
    assert result.metrics()["checkpoint_bytes"] == 7
    # No name clashes with the reward set's (TRL's reward, reward_std, rewards/...).
    samples = [Sample(id="s", prompt="q", answer="a")] * 3
    scored = RewardSet(["exact_match"])(["a", "b", "a"], samples, completion_ids=[[1]] * 3)
    assert not flat.keys() & scored.metrics().keys()


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"rewards": [1.0, 0.0]}, ValueError, "rewards has 2 values for 3 responses"),
        ({"responses_count": 1, "rewards": [1.0]}, ValueError, "at least 2"),
        ({"empty": True}, ValueError, r"responses\[1\] is empty"),
        ({"rewards": [1.0, float("inf"), 0.0]}, ValueError, r"rewards\[1\] is inf.*or NaN"),
        ({"config": {"beta": 0.1}}, ValueError, "needs a reference policy"),
        ({"other_prompt_state": True}, ValueError, "different prompt"),
    ],
)
def test_bad_input_is_refused_with_the_argument_named(models, kwargs, error, message):
    policy, _ = models
    adapter = ls.adapt(policy)
    prompt, responses = _group(seed=50)
    responses = responses[: kwargs.get("responses_count", 3)]
    if kwargs.get("empty"):
        responses[1] = torch.tensor([], dtype=torch.long)
    state = adapter.prefill(_ids(23, 99)) if kwargs.get("other_prompt_state") else None
    with pytest.raises(error, match=message):
        ls.grpo_step(
            adapter,
            prompt,
            responses,
            kwargs.get("rewards", REWARDS),
            config=ls.GRPOConfig(**kwargs.get("config", {})),
            state=state,
        )


def test_unknown_loss_type_names_the_field():
    with pytest.raises(ValueError, match="loss_type"):
        ls.GRPOConfig(loss_type="ppo")
