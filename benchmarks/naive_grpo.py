"""The naive GRPO step LongStraw is compared against: what TRL's ``GRPOTrainer`` does.

Every ``prompt + response`` sequence goes through the transformers model with autograd,
gradient checkpointing on, one sequence per micro-batch, and ``logits_to_keep`` set to the
response length + 1 so logits are only built for the completion (TRL's
``_get_per_token_logps_and_entropies``). The loss is the same one LongStraw computes, from
``longstraw_core.grpo.losses`` (pure tensor functions), so the two steps optimise the same
objective and their gradients can be compared directly. Not part of the library: it lives
beside the benchmark that uses it.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence

import torch
from transformers import PreTrainedModel

from longstraw_core.grpo.losses import branch_loss, group_advantages, loss_weights
from longstraw_core.schema.grpo import GRPOConfig


def prepare_naive(model: PreTrainedModel) -> PreTrainedModel:
    """Train mode with gradient checkpointing, as TRL runs the policy; refuses dropout.

    Dropout would make the two methods' gradients differ for reasons unrelated to the
    comparison, so every dropout probability in the config must be zero.
    """
    config = model.config
    for name in ("attention_dropout", "hidden_dropout", "dropout"):
        if getattr(config, name, 0.0):
            raise ValueError(f"config.{name}={getattr(config, name)}: set it to 0.0")
    model.gradient_checkpointing_enable()
    model.config.use_cache = False
    return model.train()


def sequence_logps(
    model: PreTrainedModel, prompt_ids: torch.Tensor, response_ids: torch.Tensor
) -> torch.Tensor:
    """``[R]`` log p(response[t] | prompt, response[:t]) from one full-sequence forward.

    ``logits_to_keep = R + 1`` keeps the positions from the last prompt token on; the last
    position predicts past the response and is dropped, as in TRL.
    """
    input_ids = torch.cat([prompt_ids, response_ids])[None]
    length = len(response_ids)
    logits = model(
        input_ids=input_ids,
        attention_mask=torch.ones_like(input_ids),
        logits_to_keep=length + 1,
        use_cache=False,
    ).logits[0, :-1]
    log_probs = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), -1)
    return log_probs.gather(-1, response_ids[:, None])[:, 0]


def detached_prompt_logps(
    model: PreTrainedModel, prompt_ids: torch.Tensor, response_ids: torch.Tensor
) -> torch.Tensor:
    """Like ``sequence_logps``, but the prompt's keys/values are constants (no gradient).

    The transformers cache of all prompt tokens but the last, built under ``no_grad``; then
    the last prompt token and the response run with autograd. This is the objective
    LongStraw's ``gradient="detached"`` differentiates; only the correctness check uses it.
    """
    cache = None
    if len(prompt_ids) > 1:
        with torch.no_grad():
            cache = model(input_ids=prompt_ids[None, :-1], use_cache=True).cache
        cache = copy.deepcopy(cache)  # the branch forward appends to it
    branch = torch.cat([prompt_ids[-1:], response_ids[:-1]])[None]
    positions = torch.arange(len(prompt_ids) - 1, len(prompt_ids) - 1 + branch.shape[1])[None]
    logits = model(
        input_ids=branch,
        cache=cache,
        position_ids=positions,
        use_cache=cache is not None,
    ).logits[0]
    log_probs = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), -1)
    return log_probs.gather(-1, response_ids[:, None])[:, 0]


def naive_grpo_step(
    model: PreTrainedModel,
    prompt_ids: torch.Tensor,
    responses: Sequence[torch.Tensor],
    rewards: Sequence[float] | torch.Tensor,
    config: GRPOConfig | None = None,
    *,
    detach_prompt: bool = False,
) -> dict[str, float]:
    """Accumulate the GRPO loss gradient of one group into ``.grad``, one sequence at a time.

    On-policy, no KL term (``config.beta`` must be 0). Every branch is run, even one whose
    advantage is zero, as TRL does. Returns the loss and wall time split into forward and
    backward. ``detach_prompt`` switches to ``detached_prompt_logps`` (correctness check).
    """
    config = config or GRPOConfig()
    if config.beta != 0.0:
        raise ValueError("the naive baseline has no reference model; use beta=0.0")
    logps_of = detached_prompt_logps if detach_prompt else sequence_logps
    advantages = group_advantages(
        torch.as_tensor(rewards, dtype=torch.float64), config.scale_rewards
    )
    weights = loss_weights([len(r) for r in responses], None, config)
    total_loss, forward_seconds, backward_seconds = 0.0, 0.0, 0.0
    for response, advantage, weight in zip(responses, advantages, weights, strict=True):
        started = time.perf_counter()
        logps = logps_of(model, prompt_ids, response)
        loss, _ = branch_loss(logps, None, None, advantage, weight, config)
        forward_seconds += time.perf_counter() - started
        started = time.perf_counter()
        loss.backward()
        backward_seconds += time.perf_counter() - started
        total_loss += loss.item()
    return {
        "loss": total_loss,
        "forward_seconds": forward_seconds,
        "backward_seconds": backward_seconds,
    }
