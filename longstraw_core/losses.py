"""GRPO group loss (TRL 1.16 ``GRPOTrainer._compute_loss``), split into per-branch pieces.

For every supported loss type TRL's group loss is

    L = sum_i w_i * sum_t l_it

where ``l_it`` (``per_token_loss``) reads only branch i's own log-probs and advantage, and
``w_i`` (``loss_weights``) reads only the response lengths and truncation flags, which are
known after rollout and before any branch is replayed. So replaying branch i alone and calling
``backward()`` on ``branch_loss`` (``w_i * sum_t l_it``) accumulates exactly ``dL/dtheta``;
a branch with ``w_i == 0`` need not be replayed at all.

Not supported (rejected by ``GRPOConfig``): TRL's ``sapo``/``luspo``/``vespo`` losses,
``top_entropy_quantile < 1`` (its threshold is a quantile over all of the group's tokens),
tool masks inside a response, vLLM importance-sampling correction, off-policy masking.
"""

from collections.abc import Sequence

import torch

from longstraw_core.fake import is_fake
from longstraw_core.grpo_config import GRPOConfig, normalize_scale_rewards

ADVANTAGE_STD_EPS = 1e-4  # TRL's constant: (R - mean) / (std + 1e-4)


def group_advantages(
    rewards: torch.Tensor | Sequence[float], scale_rewards: str | bool = "group"
) -> torch.Tensor:
    """[G] rewards -> [G] advantages, centred on the group mean, optionally std-scaled.

    Mirrors TRL's Bessel-corrected ``nanstd``; with one group per step ``"batch"`` and
    ``"group"`` agree. Equal rewards give exact zeros (TRL can leave float noise / 1e-4 there).
    A NaN reward marks a completion no reward function could score (all returned None): as
    in TRL 1.16 (``_generate_and_score_completions``: ``torch.nanmean``, ``nanstd``, then
    ``nan_to_num(advantages, nan=0.0)``) it is left out of the group's mean and std and gets
    zero advantage; with fewer than two scorable rewards every advantage is zero. An infinite
    reward raises: TRL has no meaning for it (every advantage of its group would be NaN).
    """
    scale = normalize_scale_rewards(scale_rewards)
    r = torch.as_tensor(rewards)
    if not r.is_floating_point():
        r = r.to(torch.get_default_dtype())
    if r.ndim != 1 or r.numel() == 0:
        raise ValueError(f"rewards must be a non-empty 1-D tensor [G], got shape {tuple(r.shape)}")
    if bool(torch.isinf(r).any()):
        raise ValueError(f"rewards must be finite, or NaN for an unscorable one, got {r.tolist()}")
    scorable = ~torch.isnan(r)
    if not bool(scorable.any()):
        return torch.zeros_like(r)
    kept = r[scorable]
    centred = r - kept.mean()
    all_equal = (kept == kept[0]).all()  # one scorable reward too: TRL's std is NaN, then 0
    if scale != "none":
        n = kept.numel()
        # TRL: mean squared deviation * n / (n - 1); a single reward has std 0 (TRL's eval case).
        var = (centred[scorable] ** 2).mean() * (n / (n - 1)) if n > 1 else torch.zeros_like(r[0])
        centred = centred / (var.sqrt() + ADVANTAGE_STD_EPS)
    zeros = torch.zeros_like(centred)
    return torch.where(all_equal | ~scorable, zeros, centred)


def loss_weights(
    completion_lengths: Sequence[int],
    truncated: Sequence[bool] | None,
    config: GRPOConfig,
) -> list[float]:
    """Per-branch multiplier w_i of the summed per-token loss; fixed before replay.

    grpo: 1 / (G * max(|o_i|, 1)); bnpo, dapo, cispo: 1 / max(active tokens in the group, 1);
    dr_grpo: 1 / (G * max_completion_length). With ``mask_truncated_completions`` a truncated
    branch gets weight 0 and its tokens leave the token count, but, as in TRL, it still
    counts in G. (bnpo is TRL's with the whole group in one micro-batch, hence equals dapo.)
    Pass every response of the optimizer step: several groups per step just concatenate.
    """
    lengths = [int(n) for n in completion_lengths]
    G = len(lengths)
    if G == 0 or min(lengths) < 0:
        raise ValueError(f"completion_lengths must be >= 0 for >= 1 branch, got {lengths}")
    if truncated is None:
        truncated = [False] * G
    if len(truncated) != G:
        raise ValueError(f"truncated has {len(truncated)} entries for {G} completion_lengths")
    active = [not (config.mask_truncated_completions and bool(t)) for t in truncated]
    if config.loss_type == "grpo":
        return [1.0 / (G * max(n, 1)) if a else 0.0 for n, a in zip(lengths, active, strict=True)]
    if config.loss_type == "dr_grpo":
        cap = config.max_completion_length
        if max(lengths) > cap:
            raise ValueError(
                f"completion_lengths {lengths} exceed max_completion_length={cap}, the dr_grpo "
                "normaliser"
            )
        return [1.0 / (G * cap) if a else 0.0 for a in active]
    total = sum(n for n, a in zip(lengths, active, strict=True) if a)
    return [1.0 / max(total, 1) if a else 0.0 for a in active]


def _check_branch(
    logps: torch.Tensor,
    old_logps: torch.Tensor | None,
    ref_logps: torch.Tensor | None,
    config: GRPOConfig,
) -> None:
    if logps.ndim != 1 or not logps.is_floating_point():
        raise ValueError(f"logps must be a 1-D float tensor [R], got {logps.dtype} {logps.shape}")
    for name, t in (("old_logps", old_logps), ("ref_logps", ref_logps)):
        if t is not None and t.shape != logps.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, logps {tuple(logps.shape)}")
    if config.beta != 0.0 and ref_logps is None:
        raise ValueError(f"ref_logps is required when beta={config.beta} != 0")


def per_token_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor | None,
    ref_logps: torch.Tensor | None,
    advantage: float | torch.Tensor,
    config: GRPOConfig,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One branch's [R] per-token loss (policy term + beta * KL), TRL's formulas verbatim.

    ``old_logps=None`` means on-policy (ratio 1, gradient of the ratio kept), as TRL does with
    ``logps.detach()``. ``ref_logps`` is read only when ``beta != 0``. The stats are detached
    sums, so ``reduce_branch_stats`` can rebuild TRL's group-level metrics exactly.
    """
    _check_branch(logps, old_logps, ref_logps, config)
    n = logps.shape[0]
    old = logps.detach() if old_logps is None else old_logps.detach()
    # At least float32, as TRL keeps advantages: a bf16 advantage would lose ~3 digits.
    adv_dtype = torch.promote_types(logps.dtype, torch.float32)
    adv = torch.as_tensor(advantage, dtype=adv_dtype, device=logps.device).detach()
    log_ratio = logps - old
    if config.importance_sampling_level == "token":
        log_weights = log_ratio
    else:  # GSPO: mean log-ratio over this branch's own tokens, so still per-branch.
        log_weights = (log_ratio.sum() / max(n, 1)).reshape(1)
    coef_1 = torch.exp(log_weights)

    kl = None
    if config.beta != 0.0:
        ref = ref_logps.detach()
        kl = torch.exp(ref - logps) - (ref - logps) - 1  # k3 estimator
        if config.use_bias_correction_kl:
            kl = kl * coef_1  # before delta clamps coef_1, as in TRL

    eps_high = config.effective_epsilon_high
    if config.loss_type == "cispo":
        clamped = torch.clamp(coef_1, max=eps_high).detach()
        loss = -clamped * adv * logps
        clipped = {"cispo_clip": (coef_1 > eps_high) & (adv > 0)}
    else:
        coef_2 = torch.clamp(coef_1, 1 - config.epsilon_low, 1 + eps_high)
        if config.delta is not None:
            coef_1 = torch.clamp(coef_1, max=config.delta)
        loss = -torch.min(coef_1 * adv, coef_2 * adv)
        low = (coef_1 < 1 - config.epsilon_low) & (adv < 0)
        high = (coef_1 > 1 + eps_high) & (adv > 0)
        clipped = {"clip_low": low, "clip_high": high, "clip_region": low | high}
    if kl is not None:
        loss = loss + config.beta * kl
    return loss.expand_as(logps), _branch_stats(n, log_weights.numel(), clipped, kl)


def _branch_stats(
    n: int, clip_denom: int, clipped: dict[str, torch.Tensor], kl: torch.Tensor | None
) -> dict[str, torch.Tensor]:
    # float32 sums: exact counts up to 2**24 tokens per branch, no host sync per branch.
    device = next(iter(clipped.values())).device
    stats = {k: v.detach().sum(dtype=torch.float32) for k, v in clipped.items()}
    stats["clip_denom"] = torch.tensor(float(clip_denom), device=device)
    stats["num_tokens"] = torch.tensor(float(n), device=device)
    if kl is not None:
        stats["kl_sum"] = kl.detach().sum(dtype=torch.float32)
    return stats


def branch_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor | None,
    ref_logps: torch.Tensor | None,
    advantage: float | torch.Tensor,
    weight: float,
    config: GRPOConfig,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """This branch's share ``w_i * sum_t l_it`` of the group loss; call backward() on it."""
    per_token, stats = per_token_loss(logps, old_logps, ref_logps, advantage, config)
    acc_dtype = torch.promote_types(per_token.dtype, torch.float32)  # no bf16 token sums
    return per_token.sum(dtype=acc_dtype) * weight, stats


def reduce_branch_stats(stats: Sequence[dict[str, torch.Tensor]]) -> dict[str, float]:
    """TRL's logged metrics for the group, from the replayed branches' stats.

    Pass the stats of the branches with non-zero weight: TRL excludes masked (truncated)
    branches from every metric, except that at sequence level it still counts them in the
    clip-ratio denominators; we do not.
    """
    if not stats or any(is_fake(value) for value in stats[0].values()):
        return {}  # none, or a dry run's (fake tensors: no values to log)
    keys = list(stats[0])
    sums = torch.stack([torch.stack([s[k].float().cpu() for k in keys]) for s in stats])
    col = {k: sums[:, j] for j, k in enumerate(keys)}
    out: dict[str, float] = {}
    denom = col["clip_denom"]

    def mean(key: str) -> float:
        return float(col[key].sum() / denom.sum().clamp(min=1.0))

    if "clip_low" in col:
        out["clip_ratio/low_mean"] = mean("clip_low")
        out["clip_ratio/high_mean"] = mean("clip_high")
        out["clip_ratio/region_mean"] = mean("clip_region")
        low, high = col["clip_low"] / denom, col["clip_high"] / denom  # NaN for empty branches
        out["clip_ratio/low_min"] = _nan_reduce(low, torch.min)
        out["clip_ratio/high_max"] = _nan_reduce(high, torch.max)
    if "cispo_clip" in col:
        out["cispo_clip_ratio"] = mean("cispo_clip")
    if "kl_sum" in col:
        out["kl"] = float(col["kl_sum"].sum() / col["num_tokens"].sum().clamp(min=1.0))
    return out


def _nan_reduce(x: torch.Tensor, op) -> float:
    # TRL's nanmin / nanmax: ignore NaN, all-NaN gives NaN.
    x = x[~torch.isnan(x)]
    return float(op(x)) if x.numel() else float("nan")
