"""GRPO loss math: hand-computed values, and per-branch == TRL's whole-group computation."""

import itertools
import math
import warnings

import pytest
import torch
from reference import trl_group_loss

from longstraw_core.grpo.losses import (
    branch_loss,
    group_advantages,
    loss_weights,
    normaliser_share,
    per_token_loss,
    reduce_branch_stats,
)
from longstraw_core.schema.grpo import GRPOConfig

F64 = torch.float64
CLIPPED_LOSSES = ["grpo", "bnpo", "dr_grpo", "dapo"]


def t(values) -> torch.Tensor:
    return torch.tensor(values, dtype=F64)


def loss_and_grad(logps, old, ref, adv, cfg):
    """Per-token loss values and d(sum of per-token loss)/d(logps)."""
    lp = t(logps).requires_grad_()
    old_t = None if old is None else t(old)
    ref_t = None if ref is None else t(ref)
    loss, stats = per_token_loss(lp, old_t, ref_t, adv, cfg)
    loss.sum().backward()
    return loss.detach().tolist(), lp.grad.tolist(), stats


def assert_list_close(actual, expected, tol=1e-12):
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected, strict=True):
        assert a == pytest.approx(e, abs=tol, rel=tol), (actual, expected)


# ---------------------------------------------------------------------------------------------
# Hand-computed per-token values
# ---------------------------------------------------------------------------------------------

RATIOS = [1.5, 0.5, 1.1, 0.7]  # token ratios pi/pi_old; eps=0.2, eps_high=0.28: clip to [0.8, 1.28]
OLD = [-1.0, -1.0, -1.0, -1.0]
LOGPS = [-1.0 + math.log(r) for r in RATIOS]


@pytest.mark.parametrize("loss_type", CLIPPED_LOSSES)
def test_clipped_surrogate_positive_advantage_clips_high_side(loss_type):
    cfg = GRPOConfig(loss_type=loss_type, epsilon=0.2, epsilon_high=0.28)
    values, grads, stats = loss_and_grad(LOGPS, OLD, None, 2.0, cfg)
    # -min(r*A, clip(r)*A), A=2: r=1.5 -> clipped at 1.28; the others unclipped (r=0.5, 0.7
    # lie below 0.8, but with A>0 the min picks the unclipped, smaller term).
    assert_list_close(values, [-2.56, -1.0, -2.2, -1.4])
    # d/dlogp of -A*r is -A*r; zero on the clipped token.
    assert_list_close(grads, [0.0, -1.0, -2.2, -1.4])
    assert (stats["clip_high"].item(), stats["clip_low"].item()) == (1.0, 0.0)
    assert stats["clip_region"].item() == 1.0 and stats["clip_denom"].item() == 4.0


@pytest.mark.parametrize("loss_type", CLIPPED_LOSSES)
def test_clipped_surrogate_negative_advantage_clips_low_side(loss_type):
    cfg = GRPOConfig(loss_type=loss_type, epsilon=0.2, epsilon_high=0.28)
    values, grads, stats = loss_and_grad(LOGPS, OLD, None, -2.0, cfg)
    # A=-2: -min(-2r, -2clip(r)) = 2*max(r, clip(r)): r=0.5, 0.7 clipped up to 0.8.
    assert_list_close(values, [3.0, 1.6, 2.2, 1.6])
    assert_list_close(grads, [3.0, 0.0, 2.2, 0.0])
    assert (stats["clip_low"].item(), stats["clip_high"].item()) == (2.0, 0.0)


def test_epsilon_high_defaults_to_epsilon():
    cfg = GRPOConfig(loss_type="dapo", epsilon=0.2)
    values, grads, _ = loss_and_grad(LOGPS, OLD, None, 2.0, cfg)
    # Upper clip now at 1.2: r=1.5 -> 1.2 (the others are below it).
    assert_list_close(values, [-2.4, -1.0, -2.2, -1.4])
    assert_list_close(grads, [0.0, -1.0, -2.2, -1.4])


def test_delta_two_sided_clipping_caps_the_unclipped_ratio():
    cfg = GRPOConfig(loss_type="grpo", epsilon=0.2, epsilon_high=0.28, delta=1.4)
    values, grads, stats = loss_and_grad(LOGPS, OLD, None, -2.0, cfg)
    # r=1.5 with A<0 would give 2*1.5=3; delta caps r at 1.4 -> 2.8, gradient 0.
    assert_list_close(values, [2.8, 1.6, 2.2, 1.6])
    assert_list_close(grads, [0.0, 0.0, 2.2, 0.0])
    assert stats["clip_low"].item() == 2.0


def test_cispo_clamps_the_detached_ratio_at_epsilon_high():
    cfg = GRPOConfig(loss_type="cispo", epsilon_high=1.3)
    lp = LOGPS[:2]  # ratios 1.5 (capped at 1.3) and 0.5
    values, grads, stats = loss_and_grad(lp, OLD[:2], None, 2.0, cfg)
    # -sg(min(r, 1.3)) * A * logp; the gradient is -sg(...) * A (the ratio is detached).
    assert_list_close(values, [-1.3 * 2.0 * lp[0], -0.5 * 2.0 * lp[1]])
    assert_list_close(grads, [-2.6, -1.0])
    assert stats["cispo_clip"].item() == 1.0
    _, _, stats_neg = loss_and_grad(lp, OLD[:2], None, -2.0, cfg)
    assert stats_neg["cispo_clip"].item() == 0.0  # TRL counts only A > 0


def test_sapo_gates_the_ratio_with_a_sigmoid_by_the_advantage_sign():
    cfg = GRPOConfig(loss_type="sapo", sapo_temperature_pos=1.0, sapo_temperature_neg=2.0)
    for adv, tau in ((2.0, 1.0), (-2.0, 2.0)):
        values, grads, stats = loss_and_grad(LOGPS, OLD, None, adv, cfg)
        # -A * 4/tau * sigmoid(tau (r - 1)); d/dlogp = -A * 4 * s (1 - s) * r (slope 1 at r=1)
        sig = [1 / (1 + math.exp(-tau * (r - 1))) for r in RATIOS]
        assert_list_close(values, [-adv * 4 / tau * g for g in sig])
        assert_list_close(
            grads, [-adv * 4 * g * (1 - g) * r for g, r in zip(sig, RATIOS, strict=True)]
        )
        assert "clip_low" not in stats and "cispo_clip" not in stats  # TRL logs no clip ratio


def test_vespo_weights_the_sequence_by_its_gamma_function():
    cfg = GRPOConfig(loss_type="vespo")
    lp, old = [-1.0, -2.0], [-1.1, -2.3]  # log w = 0.1 + 0.3 = 0.4, summed (not averaged)
    for adv, k, lam in ((0.5, 2.0, 3.0), (-0.5, 3.0, 2.0), (0.0, 2.0, 3.0)):  # A >= 0: pos
        values, grads, stats = loss_and_grad(lp, old, None, adv, cfg)
        w = math.exp(0.4)
        phi = math.exp(lam) * w**k * math.exp(-lam * w)
        # -phi * A * logp with phi a constant: the gradient is -phi * A on every token
        assert_list_close(values, [-phi * adv * x for x in lp])
        assert_list_close(grads, [-phi * adv] * 2)
        assert stats["vespo_phi"].item() == pytest.approx(phi, rel=1e-6)
    # log w is clamped to [log 1e-8, 20] (TRL's bounds): phi underflows to 0, no NaN
    values, grads, _ = loss_and_grad([0.0], [-30.0], None, 1.0, cfg)
    assert values == [0.0] and grads == [0.0]


@pytest.mark.filterwarnings("ignore:loss_type='luspo'")
def test_luspo_is_the_clipped_surrogate_with_weight_one_over_g():
    cfg = GRPOConfig(loss_type="luspo", epsilon=0.2, epsilon_high=0.28)
    values, grads, _ = loss_and_grad(LOGPS, OLD, None, 2.0, cfg)
    assert_list_close(values, [-2.56, -1.0, -2.2, -1.4])  # as grpo/dapo per token
    assert_list_close(grads, [0.0, -1.0, -2.2, -1.4])
    assert loss_weights([3, 7, 0], None, cfg) == [1 / 3] * 3  # a sum per sequence, mean over G


def test_k3_kl_on_policy_without_bias_correction():
    cfg = GRPOConfig(loss_type="dapo", beta=0.04, use_bias_correction_kl=False)
    lp, ref = [-1.0, -2.0], [-1.5, -1.0]
    values, grads, stats = loss_and_grad(lp, None, ref, 0.5, cfg)
    d = [-0.5, 1.0]  # ref - logp
    kl = [math.exp(x) - x - 1 for x in d]  # 0.1065..., 0.7182...
    # On-policy ratio is 1: policy term -A; its gradient -A (the ratio's own gradient).
    assert_list_close(values, [-0.5 + 0.04 * k for k in kl])
    # d kl / d logp = 1 - exp(ref - logp)
    assert_list_close(grads, [-0.5 + 0.04 * (1 - math.exp(x)) for x in d])
    assert stats["kl_sum"].item() == pytest.approx(sum(kl), rel=1e-6)


def test_k3_kl_with_bias_correction_off_policy():
    cfg = GRPOConfig(loss_type="dapo", beta=0.04, epsilon=0.2, epsilon_high=0.28)
    lp, ref = [-1.0, -2.0], [-1.5, -1.0]
    old = [x - math.log(1.1) for x in lp]  # ratio 1.1 on both tokens, inside the clip range
    values, grads, _ = loss_and_grad(lp, old, ref, 0.5, cfg)
    d = [-0.5, 1.0]
    kl = [math.exp(x) - x - 1 for x in d]
    # kl * r is differentiable in r: d/dlogp = r * (dkl + kl); policy: -A*r.
    assert_list_close(values, [-0.5 * 1.1 + 0.04 * 1.1 * k for k in kl])
    expected = [
        -0.5 * 1.1 + 0.04 * 1.1 * ((1 - math.exp(x)) + k) for x, k in zip(d, kl, strict=True)
    ]
    assert_list_close(grads, expected)


def test_k3_kl_bias_correction_changes_the_on_policy_gradient_only():
    cfg = GRPOConfig(loss_type="dapo", beta=0.04)
    lp, ref = [-1.0, -2.0], [-1.5, -1.0]
    values, grads, _ = loss_and_grad(lp, None, ref, 0.5, cfg)
    d = [-0.5, 1.0]
    kl = [math.exp(x) - x - 1 for x in d]
    assert_list_close(values, [-0.5 + 0.04 * k for k in kl])
    assert_list_close(
        grads, [-0.5 + 0.04 * (1 - math.exp(x) + k) for x, k in zip(d, kl, strict=True)]
    )


def test_token_vs_sequence_importance_level():
    lp, old = [0.0, 0.0], [-0.5, 0.1]
    token = GRPOConfig(loss_type="grpo", epsilon=0.2, epsilon_high=0.28)
    values, grads, stats = loss_and_grad(lp, old, None, 1.0, token)
    # token ratios e^0.5 = 1.6487 (clipped to 1.28) and e^-0.1 = 0.9048
    assert_list_close(values, [-1.28, -math.exp(-0.1)])
    assert_list_close(grads, [0.0, -math.exp(-0.1)])
    assert stats["clip_high"].item() == 1.0 and stats["clip_denom"].item() == 2.0

    seq = GRPOConfig(
        loss_type="grpo", epsilon=0.2, epsilon_high=0.28, importance_sampling_level="sequence"
    )
    values, grads, stats = loss_and_grad(lp, old, None, 1.0, seq)
    # one ratio s = exp(mean(0.5, -0.1)) = e^0.2 = 1.2214 for every token, unclipped;
    # sum of losses = -2*A*s; d/dlogp_j = -2*A*s * (1/2) = -A*s
    s = math.exp(0.2)
    assert_list_close(values, [-s, -s])
    assert_list_close(grads, [-s, -s])
    assert stats["clip_high"].item() == 0.0 and stats["clip_denom"].item() == 1.0


def test_sequence_level_clips_the_whole_branch():
    seq = GRPOConfig(
        loss_type="grpo", epsilon=0.2, epsilon_high=0.28, importance_sampling_level="sequence"
    )
    values, grads, stats = loss_and_grad([0.0, 0.0], [-0.5, -0.3], None, 1.0, seq)
    # s = exp(0.4) = 1.4918 > 1.28: clipped, no gradient, one clipped sequence
    assert_list_close(values, [-1.28, -1.28])
    assert_list_close(grads, [0.0, 0.0])
    assert stats["clip_high"].item() == 1.0


@pytest.mark.filterwarnings("ignore:importance_sampling_level='sequence'")
def test_sequence_level_cispo_and_kl():
    cfg = GRPOConfig(
        loss_type="cispo",
        epsilon_high=1.2,
        beta=0.1,
        importance_sampling_level="sequence",
        use_bias_correction_kl=False,
    )
    lp, old, ref = [-1.0, -3.0], [-1.2, -3.0], [-1.0, -2.5]
    values, grads, _ = loss_and_grad(lp, old, ref, 1.0, cfg)
    s = math.exp(0.1)  # mean log-ratio (0.2 + 0) / 2, below the 1.2 cap
    kl = [0.0, math.exp(0.5) - 0.5 - 1]
    assert_list_close(values, [-s * lp[0] + 0.1 * kl[0], -s * lp[1] + 0.1 * kl[1]])
    assert_list_close(grads, [-s + 0.1 * (1 - 1), -s + 0.1 * (1 - math.exp(0.5))])


def test_branch_loss_is_weight_times_token_sum_and_accumulates_bf16_in_fp32():
    cfg = GRPOConfig(loss_type="dapo")
    lp = torch.tensor([-1.0, -2.0, -0.5], dtype=torch.bfloat16, requires_grad=True)
    loss, _ = branch_loss(lp, None, None, 2.0, 0.25, cfg)
    assert loss.dtype == torch.float32
    assert loss.item() == pytest.approx(0.25 * 3 * -2.0)
    loss.backward()
    assert lp.grad.dtype == torch.bfloat16 and lp.grad.tolist() == [-0.5, -0.5, -0.5]


def test_per_token_loss_input_errors_name_the_argument():
    lp = t([-1.0, -2.0]).requires_grad_()
    with pytest.raises(ValueError, match="ref_logps"):
        per_token_loss(lp, None, None, 1.0, GRPOConfig(beta=0.04))
    with pytest.raises(ValueError, match="old_logps"):
        per_token_loss(lp, t([-1.0]), None, 1.0, GRPOConfig())
    with pytest.raises(ValueError, match="logps"):
        per_token_loss(t([[-1.0]]), None, None, 1.0, GRPOConfig())


# ---------------------------------------------------------------------------------------------
# Loss weights
# ---------------------------------------------------------------------------------------------

LENGTHS = [3, 7, 1, 5]
TRUNC = [False, True, False, True]


@pytest.mark.parametrize(
    ("loss_type", "mask", "expected"),
    [
        ("grpo", False, [1 / 12, 1 / 28, 1 / 4, 1 / 20]),
        ("grpo", True, [1 / 12, 0.0, 1 / 4, 0.0]),  # G stays 4, as TRL's .mean()
        ("bnpo", False, [1 / 16] * 4),
        ("dapo", False, [1 / 16] * 4),
        ("cispo", False, [1 / 16] * 4),
        ("dapo", True, [1 / 4, 0.0, 1 / 4, 0.0]),  # 3 + 1 active tokens
        ("bnpo", True, [1 / 4, 0.0, 1 / 4, 0.0]),
        ("dr_grpo", False, [1 / 40] * 4),  # G * max_completion_length = 4 * 10
        ("dr_grpo", True, [1 / 40, 0.0, 1 / 40, 0.0]),
        ("sapo", True, [1 / 12, 0.0, 1 / 4, 0.0]),  # grpo's
        ("luspo", True, [1 / 4, 0.0, 1 / 4, 0.0]),  # 1 / G on the token sum
        ("vespo", True, [1 / 4, 0.0, 1 / 4, 0.0]),  # dapo's
    ],
)
@pytest.mark.filterwarnings("ignore:loss_type='luspo'")
def test_loss_weights(loss_type, mask, expected):
    extra = {"epsilon_high": 5.0} if loss_type == "cispo" else {}
    cfg = GRPOConfig(
        loss_type=loss_type, mask_truncated_completions=mask, max_completion_length=10, **extra
    )
    assert_list_close(loss_weights(LENGTHS, TRUNC, cfg), expected, tol=1e-15)


@pytest.mark.filterwarnings("ignore:loss_type='luspo'")
@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo", "sapo", "luspo", "vespo"])
def test_normaliser_shares_make_groups_one_batch(loss_type):
    """Each group's weights times its share of the step's normaliser are the weights of the
    step's concatenated batch (what group_loss_scales and GenerationBatch rely on)."""
    cfg = GRPOConfig(loss_type=loss_type, max_completion_length=10, mask_truncated_completions=True)
    groups = [(LENGTHS, TRUNC), ([4, 9], [False, False]), ([2, 2, 6], [True, False, False])]
    shares = [normaliser_share(lengths, flags, cfg) for lengths, flags in groups]
    batch = loss_weights(
        [n for lengths, _ in groups for n in lengths], [t for _, f in groups for t in f], cfg
    )
    scaled = [
        weight * share / sum(shares)
        for (lengths, flags), share in zip(groups, shares, strict=True)
        for weight in loss_weights(lengths, flags, cfg)
    ]
    assert scaled == pytest.approx(batch, rel=1e-12)


def test_loss_weights_edge_cases():
    dapo = GRPOConfig(loss_type="dapo", mask_truncated_completions=True)
    assert loss_weights([4, 2], [True, True], dapo) == [0.0, 0.0]
    assert loss_weights([4, 2], None, dapo) == [1 / 6, 1 / 6]
    assert loss_weights([0, 2], None, GRPOConfig(loss_type="grpo")) == [1 / 2, 1 / 4]
    with pytest.raises(ValueError, match="truncated"):
        loss_weights([4, 2], [True], dapo)
    with pytest.raises(ValueError, match="completion_lengths"):
        loss_weights([], None, dapo)
    with pytest.raises(ValueError, match="max_completion_length"):
        loss_weights([11], None, GRPOConfig(loss_type="dr_grpo", max_completion_length=10))


# ---------------------------------------------------------------------------------------------
# Per-branch decomposition == TRL's padded whole-group loss (value, gradient, metrics)
# ---------------------------------------------------------------------------------------------


def make_group(seed=0):
    g = torch.Generator().manual_seed(seed)
    G, T = len(LENGTHS), max(LENGTHS)
    lp = torch.randn(G, T, generator=g, dtype=F64) * 0.5 - 1.5  # padding holds junk, masked
    # Per-branch drift so sequence-level ratios clip too: branch 0 (A>0) high, branch 2 (A<0)
    # low, and branch 3 (A<0) above delta.
    drift = t([-0.6, 0.1, 0.4, -0.5])[:, None]
    old = lp + drift + 0.4 * torch.randn(G, T, generator=g, dtype=F64)
    ref = lp + 0.5 * torch.randn(G, T, generator=g, dtype=F64)
    adv = group_advantages(t([1.0, 0.75, -0.5, -1.0]))
    mask = (torch.arange(T)[None, :] < torch.tensor(LENGTHS)[:, None]).to(F64)
    return lp, old, ref, adv, mask


def grid():
    for loss_type, beta, level, mask_trunc, bias_kl, delta, on_policy in itertools.product(
        ["grpo", "bnpo", "dr_grpo", "dapo", "cispo"],
        [0.0, 0.04],
        ["token", "sequence"],
        [False, True],
        [True, False],
        [None, 1.3],
        [False, True],
    ):
        if loss_type == "cispo" and delta is not None:
            continue
        if beta == 0.0 and not bias_kl:
            continue  # bias correction only touches the KL term
        yield loss_type, beta, level, mask_trunc, bias_kl, delta, on_policy


@pytest.mark.filterwarnings("ignore:importance_sampling_level='sequence'")
@pytest.mark.parametrize(
    ("loss_type", "beta", "level", "mask_trunc", "bias_kl", "delta", "on_policy"), list(grid())
)
def test_per_branch_sum_equals_trl_group_loss(
    loss_type, beta, level, mask_trunc, bias_kl, delta, on_policy
):
    cfg = GRPOConfig(
        loss_type=loss_type,
        beta=beta,
        epsilon=0.2,
        epsilon_high=1.2 if loss_type == "cispo" else 0.28,
        delta=delta,
        importance_sampling_level=level,
        mask_truncated_completions=mask_trunc,
        use_bias_correction_kl=bias_kl,
        max_completion_length=10,
    )
    lp0, old, ref, adv, mask = make_group()
    if mask_trunc:
        mask = mask * (~torch.tensor(TRUNC))[:, None].to(F64)

    lp_ref = lp0.clone().requires_grad_()
    old_ref = lp_ref.detach() if on_policy else old
    expected, trl_metrics = trl_group_loss(lp_ref, old_ref, ref, adv, mask, cfg)
    expected.backward()

    weights = loss_weights(LENGTHS, TRUNC, cfg)
    total, grads, stats = 0.0, [], []
    for i, (n, w) in enumerate(zip(LENGTHS, weights, strict=True)):
        lp_i = lp0[i, :n].clone().requires_grad_()
        old_i = None if on_policy else old[i, :n]
        loss_i, stats_i = branch_loss(lp_i, old_i, ref[i, :n], adv[i], w, cfg)
        loss_i.backward()
        total = total + loss_i
        grads.append(lp_i.grad)
        if w != 0.0:
            stats.append(stats_i)

    torch.testing.assert_close(total, expected.detach(), atol=1e-12, rtol=0)
    for i, n in enumerate(LENGTHS):
        torch.testing.assert_close(grads[i], lp_ref.grad[i, :n], atol=1e-12, rtol=0)
        assert torch.all(lp_ref.grad[i, n:] == 0)

    metrics = reduce_branch_stats(stats)
    if mask_trunc and level == "sequence":  # TRL still counts masked sequences in clip metrics
        trl_metrics = {k: v for k, v in trl_metrics.items() if k == "kl"}
    for key, value in trl_metrics.items():
        assert metrics[key] == pytest.approx(value, abs=1e-6), key


def test_decomposition_grid_exercises_both_clip_sides():
    """Guard against a grid whose random ratios never clip (the test above would be weak)."""
    cfg = GRPOConfig(loss_type="dapo", epsilon=0.2, epsilon_high=0.28)
    lp, old, _, adv, _ = make_group()
    stats = [
        per_token_loss(lp[i, :n], old[i, :n], None, adv[i], cfg)[1] for i, n in enumerate(LENGTHS)
    ]
    metrics = reduce_branch_stats(stats)
    assert metrics["clip_ratio/low_mean"] > 0 and metrics["clip_ratio/high_mean"] > 0
    seq = GRPOConfig(
        loss_type="grpo", epsilon=0.2, epsilon_high=0.28, importance_sampling_level="sequence"
    )
    stats = [
        per_token_loss(lp[i, :n], old[i, :n], None, adv[i], seq)[1] for i, n in enumerate(LENGTHS)
    ]
    metrics = reduce_branch_stats(stats)
    assert metrics["clip_ratio/low_mean"] > 0 and metrics["clip_ratio/high_mean"] > 0
    cispo = GRPOConfig(loss_type="cispo", epsilon_high=1.2, importance_sampling_level="token")
    stats = [
        per_token_loss(lp[i, :n], old[i, :n], None, adv[i], cispo)[1] for i, n in enumerate(LENGTHS)
    ]
    assert reduce_branch_stats(stats)["cispo_clip_ratio"] > 0
    assert reduce_branch_stats([]) == {}


# ---------------------------------------------------------------------------------------------
# Advantages
# ---------------------------------------------------------------------------------------------


def test_group_advantages_known_values():
    std = math.sqrt(((1.5**2) + (0.5**2) + (0.5**2) + (1.5**2)) / 3)  # Bessel-corrected
    expected = [x / (std + 1e-4) for x in (-1.5, -0.5, 0.5, 1.5)]
    for scale in ("group", "batch", True):
        assert_list_close(group_advantages(t([1.0, 2.0, 3.0, 4.0]), scale).tolist(), expected)
    assert_list_close(group_advantages([1, 2, 3, 4], "group").tolist(), expected, tol=1e-6)


def test_batch_scaling_divides_by_the_given_step_std():
    rewards = t([1.0, 2.0, 3.0, 4.0])
    out = group_advantages(rewards, "batch", std=2.5)
    assert_list_close(out.tolist(), [x / (2.5 + 1e-4) for x in (-1.5, -0.5, 0.5, 1.5)])
    assert torch.equal(group_advantages(t([0.5] * 3), "batch", std=2.5), torch.zeros(3, dtype=F64))
    with pytest.raises(ValueError, match="batch"):
        group_advantages(rewards, "group", std=2.5)


def test_group_advantages_without_scaling():
    for scale in ("none", False):
        out = group_advantages(t([1.0, 2.0, 3.0, 4.0]), scale)
        assert_list_close(out.tolist(), [-1.5, -0.5, 0.5, 1.5])


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_group_advantages_equal_rewards_are_exactly_zero(scale):
    for rewards in (t([0.1] * 7), torch.tensor([0.3] * 5, dtype=torch.float32), t([2.0])):
        out = group_advantages(rewards, scale)
        assert torch.equal(out, torch.zeros_like(rewards))


@pytest.mark.parametrize("bad", [float("inf"), -float("inf")])
def test_group_advantages_rejects_infinite_rewards(bad):
    with pytest.raises(ValueError, match="finite, or NaN for an unscorable one"):
        group_advantages(t([1.0, bad, 0.0]))


NAN = float("nan")


@pytest.mark.parametrize("scale", ["group", "none"])
@pytest.mark.parametrize(
    "rewards",
    [
        [NAN, 1.0, 0.0, NAN],
        [0.5, NAN, 3.0, -1.0, 2.0],
        [NAN, NAN, NAN],
        [NAN, 2.0, NAN],  # one scorable reward: TRL's std is NaN, so every advantage is 0
        [1.5, NAN, 1.5, 1.5],
        [NAN],
        [0.25],
    ],
)
def test_group_advantages_of_unscorable_rewards_are_trl_s(rewards, scale):
    """TRL 1.16's formula, with its own ``nanstd``: trl/trainer/grpo_trainer.py,
    ``_generate_and_score_completions`` ("sum_then_normalize"): the group's
    ``torch.nanmean``, ``nanstd`` (zeros for a group of one), ``(R - mean) / (std + 1e-4)``
    unless scale_rewards="none", then ``torch.nan_to_num(advantages, nan=0.0)``."""
    from trl.trainer.utils import nanstd

    r = t(rewards)
    std = nanstd(r) if len(rewards) > 1 else torch.zeros((), dtype=F64)
    trl = r - torch.nanmean(r)
    if scale != "none":
        trl = trl / (std + 1e-4)
    trl = torch.nan_to_num(trl, nan=0.0)
    ours = group_advantages(r, scale)
    # TRL's nanstd computes its Bessel factor count / (count - 1) in float32 (~1e-8 off).
    torch.testing.assert_close(ours, trl, rtol=1e-7, atol=1e-12)
    assert not bool(torch.isnan(ours).any())


def test_group_advantages_shape_and_scale_errors():
    with pytest.raises(ValueError, match="rewards"):
        group_advantages(t([[1.0, 2.0]]))
    with pytest.raises(ValueError, match="scale_rewards"):
        group_advantages(t([1.0, 2.0]), "per_token")


# ---------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------


def test_config_defaults_match_trl():
    cfg = GRPOConfig()
    assert (cfg.loss_type, cfg.beta, cfg.epsilon, cfg.epsilon_high, cfg.delta) == (
        "dapo",
        0.0,
        0.2,
        None,
        None,
    )
    assert cfg.effective_epsilon_high == 0.2 and cfg.epsilon_low == 0.2
    assert (cfg.scale_rewards, cfg.importance_sampling_level) == ("group", "token")
    assert (cfg.mask_truncated_completions, cfg.max_completion_length) == (False, 512)
    assert (cfg.num_generations, cfg.use_bias_correction_kl, cfg.top_entropy_quantile) == (
        8,
        True,
        1.0,
    )
    assert cfg.gradient == "detached"


def test_config_maps_boolean_scale_rewards_like_trl():
    assert GRPOConfig(scale_rewards=True).scale_rewards == "group"
    assert GRPOConfig(scale_rewards=False).scale_rewards == "none"
    assert GRPOConfig(scale_rewards="batch").scale_rewards == "batch"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("loss_type", "ppo"),
        ("loss_type", "GRPO"),
        ("num_iterations", 0),
        ("num_iterations", 2.0),
        ("sapo_temperature_pos", 0.0),
        ("sapo_temperature_neg", -1.0),
        ("vespo_k_pos", float("nan")),
        ("vespo_lambda_neg", "2"),
        ("beta", -0.1),
        ("beta", float("nan")),
        ("epsilon", -0.2),
        ("epsilon", "0.2"),
        ("epsilon_high", -1.0),
        ("delta", 1.0),
        ("delta", float("inf")),
        ("scale_rewards", "token"),
        ("scale_rewards", 1),
        ("importance_sampling_level", "batch"),
        ("mask_truncated_completions", 1),
        ("use_bias_correction_kl", "yes"),
        ("max_completion_length", 0),
        ("max_completion_length", 12.0),
        ("num_generations", 1),
        ("top_entropy_quantile", 0.2),
        ("gradient", "full"),
    ],
)
def test_config_rejects_bad_values_naming_field_and_value(field, value):
    with pytest.raises(ValueError, match=field) as err:
        GRPOConfig(**{field: value})
    assert repr(value) in str(err.value) and "allowed" in str(err.value)


def test_config_combination_errors():
    with pytest.raises(ValueError, match="max_completion_length"):
        GRPOConfig(loss_type="dr_grpo", max_completion_length=None)
    with pytest.raises(ValueError, match="epsilon_high"):
        GRPOConfig(loss_type="cispo")  # TRL would cap every ratio at epsilon = 0.2
    with pytest.raises(ValueError, match="delta"):
        GRPOConfig(loss_type="cispo", epsilon_high=5.0, delta=2.0)
    assert GRPOConfig(loss_type="dr_grpo").max_completion_length == 512
    for soft in ("sapo", "vespo"):  # no clip: TRL would ignore them
        with pytest.raises(ValueError, match="delta"):
            GRPOConfig(loss_type=soft, delta=2.0)
        with pytest.raises(ValueError, match="epsilon_high"):
            GRPOConfig(loss_type=soft, epsilon_high=0.28)


def test_config_warns_like_trl_on_sequence_level_with_token_sum_losses():
    with pytest.warns(UserWarning, match="sequence"):
        GRPOConfig(loss_type="dapo", importance_sampling_level="sequence")


def test_config_warns_where_trl_warns_on_the_new_losses():
    with pytest.warns(UserWarning, match="luspo"):
        GRPOConfig(loss_type="luspo")  # TRL: the paper's luspo is sequence-level
    with pytest.warns(UserWarning, match="vespo"):
        GRPOConfig(loss_type="vespo", importance_sampling_level="sequence")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the settings TRL recommends: no warning
        GRPOConfig(loss_type="luspo", importance_sampling_level="sequence")
        GRPOConfig(loss_type="sapo", importance_sampling_level="sequence")
        GRPOConfig(loss_type="vespo")
