"""GRPO group loss (TRL 1.16 ``GRPOTrainer._compute_loss``), split into per-branch pieces.

For every supported loss type TRL's group loss is

    L = sum_i w_i * sum_t l_it

where ``l_it`` (``per_token_loss``) reads only branch i's own log-probs and advantage, and
``w_i`` (``loss_weights``) reads only the response lengths and truncation flags, which are
known after rollout and before any branch is replayed. So replaying branch i alone and calling
``backward()`` on ``branch_loss`` (``w_i * sum_t l_it``) accumulates exactly ``dL/dtheta``;
a branch with ``w_i == 0`` need not be replayed at all.

The three loss types TRL 1.16 added keep that form. ``sapo`` gates each token's ratio with
a sigmoid instead of clipping it (``grpo``'s weights). ``luspo`` is the clipped surrogate with
weight ``1 / G`` on each sequence's token sum. ``vespo``'s term ``-phi(w_i) A_i logp_it``
reads a sequence-level quantity, ``phi`` of the branch's summed log-ratio ``w_i``, but only
branch i's own tokens, and TRL detaches it: it is computed from the branch's log-probs
within its own replay, with no gradient (``dapo``'s weights).

Tool masks (TRL's ``tool_mask``: 1 for the policy's own tokens, 0 for a tool's result inside
a response) keep that form too: TRL's loss mask is ``completion_mask * tool_mask``, so a
branch's mask ``m_i`` multiplies its per-token terms (``per_token_loss(mask=...)``), the
sequence-level ratio and vespo's ``w_i`` sum over ``m_i``'s tokens only, and the weights read
``sum_t m_it`` where they read lengths (``loss_weights(loss_tokens=...)``). The masked-out
tokens are still replayed: the later tokens attend to them.

Not supported (rejected by ``GRPOConfig``): ``top_entropy_quantile < 1`` (its threshold is a
quantile over all of the group's tokens), vLLM importance-sampling correction, off-policy
masking.
"""

import math
from collections.abc import Sequence

import torch

from longstraw_core.schema.grpo import GRPOConfig, normalize_scale_rewards
from longstraw_core.tensors.fake import is_fake, known_float

ADVANTAGE_STD_EPS = 1e-4  # TRL's constant: (R - mean) / (std + 1e-4)


def group_advantages(
    rewards: torch.Tensor | Sequence[float],
    scale_rewards: str | bool = "group",
    *,
    std: float | None = None,
) -> torch.Tensor:
    """[G] rewards -> [G] advantages, centred on the group mean, optionally std-scaled.

    Mirrors TRL's Bessel-corrected ``nanstd``. ``std``: what ``"batch"`` divides by, the std
    of every reward of the optimizer step (``distributed.step_reward_std``); None takes this
    group's, which is the batch's when the group is the whole step (one group, one rank).
    Equal rewards give exact zeros (TRL can leave float noise / 1e-4 there). Plain floats
    (a list) are taken as float64, as ``grpo_step`` takes its rewards.
    A NaN reward marks a completion no reward function could score (all returned None): as
    in TRL 1.16 (``_generate_and_score_completions``: ``torch.nanmean``, ``nanstd``, then
    ``nan_to_num(advantages, nan=0.0)``) it is left out of the group's mean and std and gets
    zero advantage; with fewer than two scorable rewards every advantage is zero. An infinite
    reward raises: TRL has no meaning for it (every advantage of its group would be NaN).
    """
    scale = normalize_scale_rewards(scale_rewards)
    r = rewards if torch.is_tensor(rewards) else torch.as_tensor(rewards, dtype=torch.float64)
    if not r.is_floating_point():
        r = r.to(torch.get_default_dtype())
    if r.ndim != 1 or r.numel() == 0:
        raise ValueError(f"rewards must be a non-empty 1-D tensor [G], got shape {tuple(r.shape)}")
    if bool(torch.isinf(r).any()):
        raise ValueError(f"rewards must be finite, or NaN for an unscorable one, got {r.tolist()}")
    if std is not None and scale != "batch":
        raise ValueError(f"std is the step's std for scale_rewards='batch', not {scale!r}")
    scorable = ~torch.isnan(r)
    if not bool(scorable.any()):
        return torch.zeros_like(r)
    kept = r[scorable]
    centred = r - kept.mean()
    all_equal = (kept == kept[0]).all()  # one scorable reward too: TRL's std is NaN, then 0
    if std is not None:
        centred = centred / (std + ADVANTAGE_STD_EPS)
    elif scale != "none":
        n = kept.numel()
        # TRL: mean squared deviation * n / (n - 1); a single reward has std 0 (TRL's eval case).
        var = (centred[scorable] ** 2).mean() * (n / (n - 1)) if n > 1 else torch.zeros_like(r[0])
        centred = centred / (var.sqrt() + ADVANTAGE_STD_EPS)
    zeros = torch.zeros_like(centred)
    return torch.where(all_equal | ~scorable, zeros, centred)


# How each loss type normalises the step's sum of per-token terms (TRL's aggregation):
# by the active tokens of the whole batch, or per response (a mean over the responses).
TOKEN_NORMALISED = ("bnpo", "dapo", "cispo", "vespo")
RESPONSE_NORMALISED = ("grpo", "sapo", "dr_grpo", "luspo")


def loss_weights(
    completion_lengths: Sequence[int],
    truncated: Sequence[bool] | None,
    config: GRPOConfig,
    *,
    loss_tokens: Sequence[int] | None = None,
) -> list[float]:
    """Per-branch multiplier w_i of the summed per-token loss; fixed before replay.

    ``loss_tokens``: how many of each response's tokens enter the loss (the ones of its tool
    mask, ``loss_mask_counts``); None: all of them. The weights below read these counts
    where they say ``|o_i|`` and "tokens", as TRL's ``mask.sum()`` does; ``completion_lengths``
    stay the responses' lengths (dr_grpo's bound).

    grpo, sapo: 1 / (G * max(|o_i|, 1)); luspo: 1 / G; dr_grpo: 1 / (G * max_completion_length);
    bnpo, dapo, cispo, vespo: 1 / max(active tokens in the group, 1). With
    ``mask_truncated_completions`` a truncated branch gets weight 0 and its tokens leave the
    token count, but, as in TRL, it still counts in G. (bnpo is TRL's with the whole group in
    one micro-batch, hence equals dapo.) Pass every response of the optimizer step: several
    groups per step just concatenate (or use ``normaliser_share`` and
    ``distributed.group_loss_scales``).
    """
    lengths = [int(n) for n in completion_lengths]
    G = len(lengths)
    if G == 0 or min(lengths) < 0:
        raise ValueError(f"completion_lengths must be >= 0 for >= 1 branch, got {lengths}")
    counts = lengths if loss_tokens is None else [int(n) for n in loss_tokens]
    if len(counts) != G or any(not 0 <= c <= n for c, n in zip(counts, lengths, strict=True)):
        raise ValueError(
            f"loss_tokens {counts} must give one count in [0, length] per response of "
            f"completion_lengths {lengths}"
        )
    if truncated is None:
        truncated = [False] * G
    if len(truncated) != G:
        raise ValueError(f"truncated has {len(truncated)} entries for {G} completion_lengths")
    active = [not (config.mask_truncated_completions and bool(t)) for t in truncated]
    if config.loss_type in ("grpo", "sapo"):
        return [1.0 / (G * max(n, 1)) if a else 0.0 for n, a in zip(counts, active, strict=True)]
    if config.loss_type == "luspo":
        return [1.0 / G if a else 0.0 for a in active]
    if config.loss_type == "dr_grpo":
        cap = config.max_completion_length
        if max(lengths) > cap:
            raise ValueError(
                f"completion_lengths {lengths} exceed max_completion_length={cap}, the dr_grpo "
                "normaliser"
            )
        return [1.0 / (G * cap) if a else 0.0 for a in active]
    total = sum(n for n, a in zip(counts, active, strict=True) if a)
    return [1.0 / max(total, 1) if a else 0.0 for a in active]


def check_loss_masks(
    loss_masks: Sequence[torch.Tensor | Sequence[int] | None] | None,
    lengths: Sequence[int],
) -> list[torch.Tensor | None]:
    """The responses' loss masks (TRL's ``tool_mask``), checked: one per response, each None
    or a 1-D tensor or int list of that response's length holding only 0 and 1. Returns them
    as bool tensors (on the device they came on), None for an all-ones mask (the unmasked
    computation, bit for bit) and for every entry of a None ``loss_masks``. A mask of zeros
    is allowed, as in TRL: the response then has no loss (its denominators are clamped at 1).
    """
    if loss_masks is None:
        return [None] * len(lengths)
    if isinstance(loss_masks, (torch.Tensor, str)) or not isinstance(loss_masks, Sequence):
        raise ValueError(
            "loss_masks must be a list with one entry per response (a 1-D 0/1 tensor or int "
            f"list of its length, or None), got {type(loss_masks).__name__}"
        )
    if len(loss_masks) != len(lengths):
        raise ValueError(f"loss_masks has {len(loss_masks)} entries for {len(lengths)} responses")
    masks: list[torch.Tensor | None] = []
    for index, (mask, length) in enumerate(zip(loss_masks, lengths, strict=True)):
        if mask is None:
            masks.append(None)
            continue
        try:
            values = torch.as_tensor(mask)
        except (TypeError, ValueError, RuntimeError) as error:
            raise ValueError(
                f"loss_masks[{index}] must be a 1-D 0/1 tensor or int list, got {mask!r}"
            ) from error
        if values.ndim != 1 or len(values) != length:
            raise ValueError(
                f"loss_masks[{index}] has shape {tuple(values.shape)}, but responses[{index}] has "
                f"{length} tokens: a loss mask has one 0/1 value per response token"
            )
        if values.is_complex() or not bool(((values == 0) | (values == 1)).all()):
            bad = [v for v in values.tolist() if v not in (0, 1)][:3]
            raise ValueError(
                f"loss_masks[{index}] holds {bad}: a loss mask holds only 0 (a token left out of "
                "the loss, e.g. a tool's result) and 1 (the policy's own token)"
            )
        flags = values == 1
        masks.append(None if bool(flags.all()) else flags)
    return masks


def loss_mask_counts(masks: Sequence[torch.Tensor | None], lengths: Sequence[int]) -> list[int]:
    """How many tokens of each response enter the loss: its loss mask's ones, or its length
    (no mask). TRL's completion lengths with a ``tool_mask``, and ``loss_weights``'
    ``loss_tokens``."""
    return [
        int(length) if mask is None else int(mask.sum())
        for mask, length in zip(masks, lengths, strict=True)
    ]


def normaliser_share(
    completion_lengths: Sequence[int], truncated: Sequence[bool] | None, config: GRPOConfig
) -> int:
    """This group's part of the step's loss normaliser: its active tokens for the
    token-normalised losses, its responses for the others (truncated ones included, as TRL's
    mean over the batch counts them). A group's loss times ``share / step total`` is its
    part of TRL's loss over the step's whole batch. With tool masks pass each response's
    count of masked-in tokens (``loss_mask_counts``) as its length: TRL's ``num_items_in_batch``
    is the sum of its loss mask."""
    if config.loss_type in RESPONSE_NORMALISED:
        return len(completion_lengths)
    flags = [False] * len(completion_lengths) if truncated is None else list(truncated)
    if len(flags) != len(completion_lengths):
        raise ValueError(
            f"truncated has {len(flags)} flags for {len(completion_lengths)} responses"
        )
    masked = config.mask_truncated_completions
    return sum(int(n) for n, t in zip(completion_lengths, flags, strict=True) if not (masked and t))


def _check_branch(
    logps: torch.Tensor,
    old_logps: torch.Tensor | None,
    ref_logps: torch.Tensor | None,
    config: GRPOConfig,
    mask: torch.Tensor | None = None,
) -> None:
    if logps.ndim != 1 or not logps.is_floating_point():
        raise ValueError(f"logps must be a 1-D float tensor [R], got {logps.dtype} {logps.shape}")
    for name, t in (("old_logps", old_logps), ("ref_logps", ref_logps), ("mask", mask)):
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
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One branch's [R] per-token loss (policy term + beta * KL), TRL's formulas.

    ``old_logps=None`` means on-policy (ratio 1, gradient of the ratio kept), as TRL does with
    ``logps.detach()``. ``ref_logps`` is read only when ``beta != 0``. The stats are detached
    sums, so ``reduce_branch_stats`` can rebuild TRL's group-level metrics exactly.

    ``mask``: the branch's loss mask [R] (TRL's ``completion_mask * tool_mask``: 0 on a tool's
    result tokens), or None (all ones: the unmasked computation, bit for bit). As in TRL the
    per-token loss is multiplied by it, the sequence-level ratio and vespo's weight sum over
    its tokens, and the stats count only them.
    """
    _check_branch(logps, old_logps, ref_logps, config, mask)
    n = logps.shape[0] if mask is None else int(known_float(mask.sum(), logps.shape[0]))
    m = None if mask is None else mask.detach().to(device=logps.device, dtype=logps.dtype)
    old = logps.detach() if old_logps is None else old_logps.detach()
    # At least float32, as TRL keeps advantages (a bf16 advantage would lose ~3 digits), and
    # the advantage's own dtype when wider: grpo_step's are float64, like its rewards. Shape
    # [1], not a scalar, so that it promotes the per-token terms as TRL's [B, 1] does.
    adv_dtype = torch.promote_types(logps.dtype, torch.float32)
    if isinstance(advantage, torch.Tensor) and advantage.is_floating_point():
        adv_dtype = torch.promote_types(adv_dtype, advantage.dtype)
    adv = torch.as_tensor(advantage, dtype=adv_dtype, device=logps.device).detach().reshape(1)
    log_ratio = logps - old
    if config.importance_sampling_level == "token":
        log_weights = log_ratio
    else:  # GSPO: mean log-ratio over this branch's own tokens, so still per-branch.
        # Summed in the log-probs' dtype, divided in the advantage's, as TRL's masked mean.
        masked_ratio = log_ratio if m is None else log_ratio * m
        log_weights = masked_ratio.sum() / adv.new_tensor(float(max(n, 1)))
    coef_1 = torch.exp(log_weights)

    kl = None
    if config.beta != 0.0:
        ref = ref_logps.detach()
        kl = torch.exp(ref - logps) - (ref - logps) - 1  # k3 estimator
        if config.use_bias_correction_kl:
            kl = kl * coef_1  # before delta clamps coef_1, as in TRL

    loss, flags, extra = _policy_term(logps, log_ratio, coef_1, adv, config, m)
    if kl is not None:
        loss = loss + config.beta * kl
    clip_denom = n if config.importance_sampling_level == "token" else 1
    stats = _branch_stats(n, clip_denom, flags, kl, logps.device, m)
    loss = loss.expand_as(logps)
    return (loss if m is None else loss * m), stats | extra


def _policy_term(
    logps: torch.Tensor,
    log_ratio: torch.Tensor,
    coef_1: torch.Tensor,
    adv: torch.Tensor,
    config: GRPOConfig,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The loss type's per-token policy term, the flags TRL's clip metrics count, and any
    extra statistic (vespo's weight, from the ``mask``'s tokens)."""
    eps_high = config.effective_epsilon_high
    if config.loss_type == "cispo":
        clamped = torch.clamp(coef_1, max=eps_high).detach()
        flags = {"cispo_clip": (coef_1 > eps_high) & (adv > 0)}
        return -clamped * adv * logps, flags, {}
    if config.loss_type == "sapo":
        # A smooth gate instead of the clip: 4/tau * sigmoid(tau * (r - 1)), slope 1 at r = 1.
        pos, neg = config.sapo_temperature_pos, config.sapo_temperature_neg
        tau = torch.where(adv > 0, adv.new_tensor(pos), adv.new_tensor(neg))
        gate = torch.sigmoid(tau * (coef_1 - 1)) * 4 / tau
        return -gate * adv, {}, {}
    if config.loss_type == "vespo":
        phi = _vespo_weight(log_ratio.detach(), adv, config, mask)
        return -phi * adv * logps, {}, {"vespo_phi": phi.detach().sum(dtype=torch.float32)}
    # grpo, bnpo, dr_grpo, dapo, luspo: PPO's clipped surrogate.
    coef_2 = torch.clamp(coef_1, 1 - config.epsilon_low, 1 + eps_high)
    if config.delta is not None:
        coef_1 = torch.clamp(coef_1, max=config.delta)
    loss = -torch.min(coef_1 * adv, coef_2 * adv)
    low = (coef_1 < 1 - config.epsilon_low) & (adv < 0)
    high = (coef_1 > 1 + eps_high) & (adv > 0)
    return loss, {"clip_low": low, "clip_high": high, "clip_region": low | high}, {}


_VESPO_LOG_MIN = math.log(1e-8)  # TRL's lower clamp of log w (w >= 1e-8)


@torch.no_grad()
def _vespo_weight(
    log_ratio: torch.Tensor,
    adv: torch.Tensor,
    config: GRPOConfig,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """VESPO's gamma weight phi(w) = e^lambda * w^k * e^(-lambda * w) of the branch's
    sequence ratio w = exp(sum_t m_t clamp(log r_t, -20, 20)) (``mask`` m, or all ones), with
    log w clamped to [log 1e-8, 20]; (k, lambda) by the advantage's sign (A >= 0: the positive
    pair), lambda at least 1e-4. A constant of the replay (no gradient), shape [1]."""
    clamped = log_ratio.clamp(-20.0, 20.0)
    log_w = torch.clamp((clamped if mask is None else clamped * mask).sum(), _VESPO_LOG_MIN, 20.0)
    positive = adv >= 0  # a tensor condition: no host sync, and dry runs' fake tensors pass
    k = torch.where(positive, adv.new_tensor(config.vespo_k_pos), config.vespo_k_neg)
    lam = torch.where(positive, adv.new_tensor(config.vespo_lambda_pos), config.vespo_lambda_neg)
    lam = lam.clamp(min=1e-4)
    phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
    return torch.nan_to_num(phi, nan=0.0, posinf=0.0, neginf=0.0).reshape(1)


def _branch_stats(
    n: int,
    clip_denom: int,
    clipped: dict[str, torch.Tensor],
    kl: torch.Tensor | None,
    device: torch.device,
    mask: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Detached sums over the branch's tokens, or its ``mask``'s (a sequence-level flag,
    shape [1], is one value per branch: TRL does not mask it)."""

    def masked(x: torch.Tensor) -> torch.Tensor:
        return x if mask is None or x.numel() == 1 else x * mask

    # float32 sums: exact counts up to 2**24 tokens per branch, no host sync per branch.
    stats = {k: masked(v.detach()).sum(dtype=torch.float32) for k, v in clipped.items()}
    stats["clip_denom"] = torch.tensor(float(clip_denom), device=device)
    stats["num_tokens"] = torch.tensor(float(n), device=device)
    if kl is not None:
        stats["kl_sum"] = masked(kl.detach()).sum(dtype=torch.float32)
    return stats


def branch_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor | None,
    ref_logps: torch.Tensor | None,
    advantage: float | torch.Tensor,
    weight: float,
    config: GRPOConfig,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """This branch's share ``w_i * sum_t m_it l_it`` of the group loss; call backward() on it.
    ``mask``: its loss mask (``per_token_loss``), None for all ones."""
    per_token, stats = per_token_loss(logps, old_logps, ref_logps, advantage, config, mask)
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
    if "vespo_phi" in col:  # TRL: the mean over sequences of their weight
        out["vespo/phi_seq_mean"] = float(col["vespo_phi"].mean())
    if "kl_sum" in col:
        out["kl"] = float(col["kl_sum"].sum() / col["num_tokens"].sum().clamp(min=1.0))
    return out


def _nan_reduce(x: torch.Tensor, op) -> float:
    # TRL's nanmin / nanmax: ignore NaN, all-NaN gives NaN.
    x = x[~torch.isnan(x)]
    return float(op(x)) if x.numel() else float("nan")
