"""Metric names, in one place: what ``grpo_step`` reports, what the recipes add, what the
per-step line shows; and the step's peak memory.

Names follow TRL where it has one (``loss``, ``reward``, ``reward_std``, ``rewards/<func>/mean``,
``kl``, ``entropy``, ``clip_ratio/low_mean``); the rest are LongStraw's own. No two sources
report the same name: ``grpo_step``'s statistics of the rewards it was given are
``group_reward_mean``/``group_reward_std``, while ``reward``/``reward_std`` are the reward
set's (TRL's, over the scorable completions).
"""

from __future__ import annotations

import resource

import torch

# --- grpo_step (GRPOStepResult.metrics()) --------------------------------------------------
LOSS = "loss"
GROUP_REWARD_MEAN = "group_reward_mean"  # of the rewards grpo_step was given
GROUP_REWARD_STD = "group_reward_std"
ENTROPY = "entropy"
PROMPT_TOKENS = "prompt_tokens"
COMPLETION_TOKENS = "completion_tokens"
COMPLETION_LENGTH_MEAN = "completion_length_mean"
BRANCHES_REPLAYED = "branches_replayed"
STATE_BYTES = "state_bytes"
STATE_GRAD_BYTES = "state_grad_bytes"
ATTENTION_OUTPUT_BYTES = "attention_output_bytes"
PEAK_MEMORY_BYTES = "peak_memory_bytes"  # during grpo_step
REF_SECONDS = "ref_seconds"
PREFILL_SECONDS = "prefill_seconds"  # only when grpo_step prefilled the prompt itself
REPLAY_SECONDS = "replay_seconds"
SWEEP_SECONDS = "sweep_seconds"
KL = "kl"  # and clip_ratio/*, cispo_clip_ratio: losses.reduce_branch_stats (TRL's names)

# --- the reward set (rewards.RewardResult.metrics(), TRL's names) ---------------------------
REWARD = "reward"  # nan-mean of the weighted rewards, unscorable (all-None) rows left out
REWARD_STD = "reward_std"
REWARD_FUNC_MEAN = "rewards/{}/mean"  # per reward function, by its name; None rows left out
REWARD_FUNC_STD = "rewards/{}/std"
FRAC_REWARD_ZERO_STD = "frac_reward_zero_std"  # groups whose rewards have zero std
REWARD_UNSCORABLE_COUNT = "rewards/unscorable_count"  # LongStraw's: rows every function skipped
REWARD_FAILED_FUNCS = "rewards/failed_funcs"  # LongStraw's: functions that raised this step

# --- the recipes ----------------------------------------------------------------------------
ADVANTAGE_ABS_MEAN = "advantage_abs_mean"
GRAD_NORM = "grad_norm"
LR = "lr"
ROLLOUT_TOKENS_PER_SECOND = "rollout_tokens_per_second"
TRUNCATED_FRACTION = "truncated_fraction"
STEP_PEAK_MEMORY_BYTES = "step_peak_memory_bytes"  # the whole step: prefill to optimizer
SKIPPED = "skipped"
SKIPPED_STEPS = "skipped_steps"
STATE_BYTES_BY_TYPE = "state_bytes/{}"  # per layer type, PrefixState.summary()
STEP_SECONDS = "time/step"  # and time/<phase>: progress.StepProgress

# The per-step line, in this order: (key, label, format); "bytes" formats with format_bytes.
STEP_LINE: tuple[tuple[str, str, str], ...] = (
    (REWARD, "reward", "{:.3f}"),
    (REWARD_STD, "±", "{:.3f}"),
    (LOSS, "loss", "{:.4g}"),
    (KL, "kl", "{:.3g}"),
    (ENTROPY, "entropy", "{:.3f}"),
    (COMPLETION_LENGTH_MEAN, "len", "{:.0f}"),
    (ROLLOUT_TOKENS_PER_SECOND, "tok/s", "{:,.0f}"),
    (STEP_PEAK_MEMORY_BYTES, "peak", "bytes"),
    (STEP_SECONDS, "step", "{:.1f}s"),
)


def reset_peak_memory(device: torch.device) -> None:
    """Start measuring a new peak (CUDA; on CPU the peak is the process's, see below)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_bytes(device: torch.device) -> int:
    """Peak GPU memory since ``reset_peak_memory`` on CUDA; on CPU, the process's lifetime
    peak RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
