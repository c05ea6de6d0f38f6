"""Metric names, in one place: what ``grpo_step`` reports, what the recipes add, what the
evaluation logs, what the per-step line shows; and the step's peak memory.

Names are TRL 1.16's (``GRPOTrainer`` and the ``Trainer`` under it) where the quantity is
the same: ``loss``, ``grad_norm``, ``learning_rate``, ``num_tokens``, ``reward``,
``reward_std``, ``rewards/<func>/mean|std``, ``frac_reward_zero_std``, ``kl``, ``entropy``,
``clip_ratio/low_mean|high_mean|region_mean|low_min|high_max``, ``cispo_clip_ratio`` and
``completions/mean_length|min_length|max_length|clipped_ratio|mean_terminated_length|
min_terminated_length|max_terminated_length``. The rest are LongStraw's own (prefix-state
bytes by layer type, phase times ``time/<phase>``, peak memory, rollout throughput, skipped
steps, ...). No two sources report different quantities under one name: ``grpo_step``'s
statistics of the rewards it was given are ``group_reward_mean``/``group_reward_std``, while
``reward``/``reward_std`` are the reward set's (TRL's, over the scorable completions).

Evaluation (``longstraw_core.training.evaluation``) logs under ``eval/``: TRL's names for TRL's
quantities (``eval/reward``, ``eval/completions/mean_length``, ...: what W&B shows for TRL's
``eval_reward``, ``eval_completions/mean_length``, as transformers' W&B callback turns the
``eval_`` prefix into ``eval/``) and LongStraw's own ``eval/greedy_accuracy``,
``eval/greedy_reward``, ``eval/pass@<k>`` and ``eval/pass@1`` (TRL has no accuracy metric).

These are the names the console, ``metrics.csv`` and checkpoints use; W&B records them as a
TRL run's W&B callback does, ``train/<name>`` for every training metric
(``tracking.wandb_metrics``, ``tracking.trl_names``).
"""

from __future__ import annotations

import resource
from collections.abc import Sequence

import torch

# --- grpo_step (GRPOStepResult.metrics()) --------------------------------------------------
LOSS = "loss"
GROUP_REWARD_MEAN = "group_reward_mean"  # of the rewards grpo_step was given
GROUP_REWARD_STD = "group_reward_std"
ENTROPY = "entropy"
PROMPT_TOKENS = "prompt_tokens"
COMPLETION_TOKENS = "completion_tokens"
COMPLETIONS_MEAN_LENGTH = "completions/mean_length"  # TRL's; grpo_step's is its group's
COMPLETION_LENGTH_MEAN = COMPLETIONS_MEAN_LENGTH  # the former name of the constant
BRANCHES_REPLAYED = "branches_replayed"
STATE_BYTES = "state_bytes"
STATE_GRAD_BYTES = "state_grad_bytes"
ATTENTION_OUTPUT_BYTES = "attention_output_bytes"
PEAK_MEMORY_BYTES = "peak_memory_bytes"  # during grpo_step
REF_SECONDS = "ref_seconds"
PREFILL_SECONDS = "prefill_seconds"  # only when grpo_step prefilled the prompt itself
REPLAY_SECONDS = "replay_seconds"
SWEEP_SECONDS = "sweep_seconds"
KL = "kl"  # and clip_ratio/*, cispo_clip_ratio, vespo/phi_seq_mean: losses.reduce_branch_stats (TRL's)

# --- the reward set (rewards.RewardResult.metrics(), TRL's names) ---------------------------
REWARD = "reward"  # nan-mean of the weighted rewards, unscorable (all-None) rows left out
REWARD_STD = "reward_std"
REWARD_FUNC_MEAN = "rewards/{}/mean"  # per reward function, by its name; None rows left out
REWARD_FUNC_STD = "rewards/{}/std"
FRAC_REWARD_ZERO_STD = "frac_reward_zero_std"  # groups whose rewards have zero std
REWARD_UNSCORABLE_COUNT = "rewards/unscorable_count"  # LongStraw's: rows every function skipped
REWARD_FAILED_FUNCS = "rewards/failed_funcs"  # LongStraw's: functions that raised this step

# --- completions (TRL's names, completion_metrics: every rank's completions of the step) ------
COMPLETIONS_MIN_LENGTH = "completions/min_length"
COMPLETIONS_MAX_LENGTH = "completions/max_length"
# The share of completions cut at max_new_tokens (no EOS or stop string). TRL, which looks for
# an EOS only, would also count a response that ended at a stop string.
COMPLETIONS_CLIPPED_RATIO = "completions/clipped_ratio"
COMPLETIONS_MEAN_TERMINATED_LENGTH = "completions/mean_terminated_length"  # 0 if none ended
COMPLETIONS_MIN_TERMINATED_LENGTH = "completions/min_terminated_length"
COMPLETIONS_MAX_TERMINATED_LENGTH = "completions/max_terminated_length"
# TRL's num_tokens (Trainer's num_input_tokens_seen): prompt + completion tokens so far, each
# completion counting its prompt (as TRL's batch holds it). The recipes report each step's
# count; RunLogger logs the running total (RUNNING_TOTALS; a resumed run continues it).
NUM_TOKENS = "num_tokens"
TOOLS_CALL_FREQUENCY = "tools/call_frequency"
TOOLS_FAILURE_FREQUENCY = "tools/failure_frequency"
RUNNING_TOTALS = (NUM_TOKENS,)

# --- the recipes ----------------------------------------------------------------------------
ADVANTAGE_ABS_MEAN = "advantage_abs_mean"
GRAD_NORM = "grad_norm"  # Trainer's: the norm before clipping
LEARNING_RATE = "learning_rate"  # Trainer's
ROLLOUT_TOKENS_PER_SECOND = "rollout_tokens_per_second"
STEP_PEAK_MEMORY_BYTES = "step_peak_memory_bytes"  # the whole step: prefill to optimizer
SKIPPED = "skipped"
SKIPPED_STEPS = "skipped_steps"
STATE_BYTES_BY_TYPE = "state_bytes/{}"  # per layer type, PrefixState.summary()
STEP_SECONDS = "time/step"  # and time/<phase>: progress.StepProgress (time/eval included)

# Reduced over the ranks by min / max rather than the mean (TRL's over its gathered batch).
MIN_OVER_RANKS = ("clip_ratio/low_min",)
MAX_OVER_RANKS = ("clip_ratio/high_max",)

# --- evaluation (longstraw_core.training.evaluation) -------------------------------------------------
EVAL_PREFIX = "eval/"  # + a TRL name: that quantity over the eval prompts' sampled completions
EVAL_GREEDY_ACCURACY = "eval/greedy_accuracy"  # prompts whose greedy completion is correct
EVAL_GREEDY_REWARD = "eval/greedy_reward"  # nan-mean weighted reward of the greedy completions
EVAL_PASS_AT_K = "eval/pass@{}"  # k = eval.num_generations: a correct one among k samples

# The per-step line, in this order: (key, label, format); "bytes" formats with format_bytes,
# "decimals" with three decimals or, below 0.01, two significant digits
# (tracking.format_value); a NaN shows as "-".
STEP_LINE: tuple[tuple[str, str, str], ...] = (
    (REWARD, "reward", "decimals"),
    (REWARD_STD, "±", "decimals"),
    (LOSS, "loss", "{:.4g}"),
    (KL, "kl", "{:.3g}"),
    (ENTROPY, "entropy", "{:.3f}"),
    (COMPLETIONS_MEAN_LENGTH, "len", "{:.0f}"),
    (ROLLOUT_TOKENS_PER_SECOND, "tok/s", "{:,.0f}"),
    (STEP_PEAK_MEMORY_BYTES, "peak", "bytes"),
    (STEP_SECONDS, "step", "{:.1f}s"),
    # On eval steps; a "{}" in a key matches any value there, shown in the label's "{}".
    (EVAL_GREEDY_ACCURACY, "eval greedy", "{:.3f}"),
    (EVAL_PASS_AT_K, "pass@{}", "{:.3f}"),
)


def completion_metrics(lengths: Sequence[int], truncated: Sequence[bool]) -> dict[str, float]:
    """TRL's ``completions/*`` statistics of a step's completions (every rank's: see
    ``RunTopology.completion_metrics``), as ``GRPOTrainer`` computes them: lengths in tokens,
    the clipped share, and the lengths of the completions that ended (all 0 when none did,
    TRL's edge case)."""
    if not lengths or len(lengths) != len(truncated):
        raise ValueError(f"{len(lengths)} lengths for {len(truncated)} truncation flags")
    ended = [n for n, cut in zip(lengths, truncated, strict=True) if not cut] or [0]
    return {
        COMPLETIONS_MEAN_LENGTH: sum(lengths) / len(lengths),
        COMPLETIONS_MIN_LENGTH: float(min(lengths)),
        COMPLETIONS_MAX_LENGTH: float(max(lengths)),
        COMPLETIONS_CLIPPED_RATIO: sum(map(bool, truncated)) / len(truncated),
        COMPLETIONS_MEAN_TERMINATED_LENGTH: sum(ended) / len(ended),
        COMPLETIONS_MIN_TERMINATED_LENGTH: float(min(ended)),
        COMPLETIONS_MAX_TERMINATED_LENGTH: float(max(ended)),
    }


def tool_metrics(calls: int, failures: int, completions: int) -> dict[str, float]:
    """TRL's ``tools/call_frequency`` (calls per completion) and ``tools/failure_frequency``
    (failed calls per call; 0 without calls), from counts summed over the ranks (an agent
    run: ``RunTopology.tool_metrics``)."""
    return {
        TOOLS_CALL_FREQUENCY: calls / completions if completions else 0.0,
        TOOLS_FAILURE_FREQUENCY: failures / calls if calls else 0.0,
    }


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
