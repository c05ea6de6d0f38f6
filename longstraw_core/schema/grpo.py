"""GRPO hyper-parameters, with the names, defaults and meaning of TRL 1.16's ``GRPOConfig``.

Only the fields the loss math needs live here. A TRL user should be able to carry a config
over unchanged; anything TRL accepts that this package cannot reproduce exactly is rejected
with a ``GRPOConfigError`` (a ValueError naming the field) instead of being silently ignored.
"""

import math
import warnings
from dataclasses import dataclass

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
# Loss types whose per-token term has no hard clip: TRL reads neither delta nor epsilon_high.
SOFT_LOSS_TYPES = ("sapo", "vespo")
# TRL's warning list: these sum per-token terms, so a sequence-level ratio weights each
# sequence by its length.
TOKEN_SUM_LOSS_TYPES = ("bnpo", "dr_grpo", "dapo", "cispo")
SCALE_REWARDS = ("group", "batch", "none")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
GRADIENT_MODES = ("detached", "exact")


class GRPOConfigError(ValueError):
    """A bad ``GRPOConfig`` field: ``field`` names it, ``reason`` says what is allowed.

    The message is ``GRPOConfig.<field>=<value!r> is invalid; allowed: ...``; callers that
    map the field to their own key (``longstraw_core.config.grpo_config``) read ``field``.
    """

    def __init__(self, field: str, value: object, allowed: str) -> None:
        self.field = field
        self.value = value
        self.reason = f"{value!r} is invalid; allowed: {allowed}"
        super().__init__(f"GRPOConfig.{field}={self.reason}")


def _invalid(field: str, value: object, allowed: str) -> GRPOConfigError:
    """One message shape for every bad field, so a config error is always easy to trace."""
    return GRPOConfigError(field, value, allowed)


def _is_real(value: object) -> bool:
    # bool is an int subclass; a flag passed for a number is a mistake, not 1.0.
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def normalize_scale_rewards(value: object) -> str:
    """TRL accepts True/False for backward compatibility and maps them to "group"/"none"."""
    if value is True:
        return "group"
    if value is False:
        return "none"
    if value not in SCALE_REWARDS:
        raise _invalid("scale_rewards", value, f"one of {SCALE_REWARDS} or True/False")
    return value


@dataclass
class GRPOConfig:
    """Loss and advantage settings for one GRPO step over one group of G responses.

    Field meanings follow TRL's ``GRPOConfig``; ``gradient`` is LongStraw's own.

    - ``num_generations``: G, responses sampled per prompt (TRL requires at least 2).
    - ``max_completion_length``: generation cap; also the ``dr_grpo`` normaliser constant.
    - ``temperature``: the sampling temperature, and the one every log-prob of the loss is
      taken at (the policy's, the old and the reference's, and the entropy): TRL's
      ``log_softmax(logits / temperature)``, so that the on-policy ratio is 1 for responses
      sampled at it. It must be > 0: greedy decoding (0) has no distribution to train on
      (TRL would divide by zero).
    - ``beta``: KL coefficient (k3 estimator against a reference policy); 0 disables it.
    - ``epsilon``: lower clip, the ratio is clipped below at ``1 - epsilon``.
    - ``epsilon_high``: upper clip, ratio clipped above at ``1 + epsilon_high``; ``None`` means
      ``epsilon``. For ``cispo`` it is the absolute cap on the ratio (ScaleRL's eps_max,
      recommended 5.0), not an offset from 1.
    - ``delta``: INTELLECT-2 two-sided clipping, caps the unclipped ratio at ``delta``.
    - ``importance_sampling_level``: ``"token"`` ratios, or one ``"sequence"`` ratio per branch
      from the mean log-ratio over its tokens (GSPO).
    - ``num_iterations``: optimizer updates per generation (TRL's mu). Updates after the first
      read the behaviour log-probs of the first (``old_logps``) and clip the ratio with
      ``epsilon``/``epsilon_high``; each costs one prefill per prompt (the prefix state
      depends on the weights). ``grpo_step`` takes one update; the recipes loop
      (``longstraw_core.grpo.generation.GenerationBatch``).
    - ``scale_rewards``: divide centred rewards by the group's std (``"group"``), by the std of
      every reward of the optimizer step on every rank (``"batch"``: pass
      ``grpo_step(reward_std=...)``, see ``GenerationBatch``), or not (``"none"``).
    - ``loss_type``: the per-token term and how it is normalised (``losses.per_token_loss``,
      ``losses.loss_weights``). ``sapo``: a sigmoid gate of temperature
      ``sapo_temperature_pos``/``sapo_temperature_neg`` (by the advantage's sign) instead of
      the clip. ``vespo``: ``-phi(w) * A * logp`` with ``w`` the sequence's ratio and
      ``phi(w) = exp(lambda) * w**k * exp(-lambda * w)`` (``vespo_k_*``, ``vespo_lambda_*``
      by the sign of A), token-normalised like ``dapo``. ``luspo``: the clipped surrogate
      summed over each sequence's tokens, averaged over sequences (GSPO scaled by length; TRL
      recommends ``importance_sampling_level="sequence"``).
    - ``mask_truncated_completions``: truncated responses get no loss and no token count.
    - ``use_bias_correction_kl``: multiply the KL term by the (differentiable) ratio, TRL's
      default since the DeepSeek-V3.2 correction.
    - ``top_entropy_quantile``: only 1.0 is supported (its threshold is a quantile over every
      token of the group, which is not known before the branches are replayed).
    - ``gradient``: ``"detached"`` (prompt state is a constant) or ``"exact"`` (gradients
      also flow through the prompt state; ``docs/design.md``, "Exact mode").
    - ``recurrent_checkpoints``: where exact mode keeps the state at each prefill chunk start
      of the layers whose kinds need it (recurrent states, sliding windows) (``"device"``, or ``"cpu"`` to save accelerator memory).
    - ``keep_attention_outputs``: exact mode only. Prefill keeps every full-attention
      layer's output and log-sum-exp, so the sweep's recompute skips the attention forward:
      a faster sweep for ``heads x value_dim`` (plus ``heads`` fp32) per prompt token per
      full-attention layer, e.g. 1x the K/V for the benchmark's model and 3x for
      Qwen3.6-27B's. Latent (MLA) and linear-attention layers are unaffected.
    """

    num_generations: int = 8
    max_completion_length: int | None = 512
    temperature: float = 1.0
    beta: float = 0.0
    num_iterations: int = 1
    epsilon: float = 0.2
    epsilon_high: float | None = None
    delta: float | None = None
    sapo_temperature_neg: float = 1.05
    sapo_temperature_pos: float = 1.0
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    importance_sampling_level: str = "token"
    scale_rewards: str = "group"
    loss_type: str = "dapo"
    mask_truncated_completions: bool = False
    use_bias_correction_kl: bool = True
    top_entropy_quantile: float = 1.0
    gradient: str = "detached"
    recurrent_checkpoints: str = "device"
    keep_attention_outputs: bool = False

    def __post_init__(self) -> None:
        self.scale_rewards = normalize_scale_rewards(self.scale_rewards)
        self._check_choices()
        self._check_numbers()
        self._check_combinations()

    @property
    def epsilon_low(self) -> float:
        return self.epsilon

    @property
    def effective_epsilon_high(self) -> float:
        """TRL resolves ``epsilon_high=None`` to ``epsilon`` in the trainer, not the config."""
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    def prefill_options(self) -> dict[str, str | bool | None]:
        """What ``adapter.prefill`` needs for this config's gradient mode, as keyword arguments.

        ``checkpoints``: ``recurrent_checkpoints`` with ``gradient="exact"`` (the sweep restarts
        recurrent layers from them), else None. ``keep_attention_outputs``: as configured.
        Both are harmless on models without recurrent or full-attention layers (nothing to
        keep), so every recipe can pass them::

            state = adapter.prefill(prompt_ids, chunk_size=..., **config.prefill_options())
        """
        exact = self.gradient == "exact"
        return {
            "checkpoints": self.recurrent_checkpoints if exact else None,
            "keep_attention_outputs": self.keep_attention_outputs,
        }

    def _check_choices(self) -> None:
        if self.loss_type not in LOSS_TYPES:
            raise _invalid("loss_type", self.loss_type, f"one of {LOSS_TYPES}")
        if self.importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
            raise _invalid(
                "importance_sampling_level",
                self.importance_sampling_level,
                f"one of {IMPORTANCE_SAMPLING_LEVELS}",
            )
        if self.gradient not in GRADIENT_MODES:
            raise _invalid("gradient", self.gradient, f"one of {GRADIENT_MODES}")
        if self.recurrent_checkpoints not in ("device", "cpu"):
            raise _invalid("recurrent_checkpoints", self.recurrent_checkpoints, "'device' or 'cpu'")
        for name in (
            "mask_truncated_completions",
            "use_bias_correction_kl",
            "keep_attention_outputs",
        ):
            if not isinstance(getattr(self, name), bool):
                raise _invalid(name, getattr(self, name), "True or False")

    def _check_numbers(self) -> None:
        if not _is_int(self.num_generations) or self.num_generations < 2:
            raise _invalid(
                "num_generations", self.num_generations, "an int >= 2 (advantages need a group)"
            )
        mcl = self.max_completion_length
        if mcl is not None and (not _is_int(mcl) or mcl < 1):
            raise _invalid("max_completion_length", mcl, "None or an int >= 1")
        if not _is_real(self.temperature) or self.temperature <= 0:
            raise _invalid(
                "temperature",
                self.temperature,
                "a finite float > 0 (the loss's log-probs are log_softmax(logits / temperature), "
                "as TRL's; greedy decoding, 0, has no sampling distribution to train on)",
            )
        if not _is_real(self.beta) or self.beta < 0:
            raise _invalid("beta", self.beta, "a finite float >= 0")
        if not _is_int(self.num_iterations) or self.num_iterations < 1:
            raise _invalid(
                "num_iterations", self.num_iterations, "an int >= 1 (updates per generation)"
            )
        for name in ("sapo_temperature_neg", "sapo_temperature_pos"):
            value = getattr(self, name)
            if not _is_real(value) or value <= 0:
                raise _invalid(name, value, "a finite float > 0 (the sapo gate divides by it)")
        for name in ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"):
            if not _is_real(getattr(self, name)):
                raise _invalid(name, getattr(self, name), "a finite float")
        if not _is_real(self.epsilon) or self.epsilon < 0:
            raise _invalid("epsilon", self.epsilon, "a finite float >= 0")
        if self.epsilon_high is not None and (
            not _is_real(self.epsilon_high) or self.epsilon_high < 0
        ):
            raise _invalid("epsilon_high", self.epsilon_high, "None or a finite float >= 0")
        if self.delta is not None and (not _is_real(self.delta) or self.delta <= 1.0):
            raise _invalid(
                "delta", self.delta, "None or a finite float > 1 (TRL recommends > 1 + epsilon)"
            )
        q = self.top_entropy_quantile
        if not _is_real(q) or q != 1.0:
            raise _invalid(
                "top_entropy_quantile",
                q,
                "1.0 only (the entropy quantile spans the whole group, unknown per branch)",
            )

    def _check_combinations(self) -> None:
        if self.keep_attention_outputs and self.gradient != "exact":
            raise _invalid(
                "keep_attention_outputs",
                True,
                "False with gradient='detached' (it only speeds up exact mode's sweep)",
            )
        if self.loss_type == "dr_grpo" and self.max_completion_length is None:
            raise _invalid(
                "max_completion_length", None, "an int >= 1 with loss_type='dr_grpo' (normaliser)"
            )
        if self.loss_type == "cispo":
            # TRL would silently cap every ratio at epsilon (0.2): all tokens clipped, gradient /5.
            if self.epsilon_high is None or self.epsilon_high <= 0:
                raise _invalid(
                    "epsilon_high",
                    self.epsilon_high,
                    "an explicit float > 0 with loss_type='cispo' (the ratio cap; ScaleRL uses 5.0)",
                )
            if self.delta is not None:
                raise _invalid("delta", self.delta, "None with loss_type='cispo' (TRL ignores it)")
        if self.loss_type in SOFT_LOSS_TYPES:
            # TRL would silently ignore them: no clip in these losses.
            for name in ("delta", "epsilon_high"):
                if getattr(self, name) is not None:
                    raise _invalid(
                        name,
                        getattr(self, name),
                        f"None with loss_type={self.loss_type!r} (it has no clip; TRL ignores it)",
                    )
        # TRL's warnings, in its words' sense (it only warns: the loss is still defined).
        level = self.importance_sampling_level
        if level == "sequence" and self.loss_type in TOKEN_SUM_LOSS_TYPES:
            warnings.warn(
                f"importance_sampling_level='sequence' with loss_type={self.loss_type!r} sums "
                "per-token terms, weighting each sequence by its length; GSPO uses loss_type='grpo'.",
                stacklevel=4,
            )
        if self.loss_type == "luspo" and level != "sequence":
            warnings.warn(
                "loss_type='luspo' is GSPO's sequence-level loss scaled by length: the LUSPO "
                "paper uses importance_sampling_level='sequence'.",
                stacklevel=4,
            )
        if self.loss_type == "vespo" and level != "token":
            warnings.warn(
                "loss_type='vespo' computes its sequence-level weight itself from the token "
                "log-ratios; importance_sampling_level should be 'token' (it only changes the "
                "KL term's bias correction here).",
                stacklevel=4,
            )
