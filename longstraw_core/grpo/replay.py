"""One GRPO update for one group, by branch replay.

The prompt is prefilled once (or the rollout's state is reused); then each response is
replayed alone with autograd against that state, its share of the group loss is computed
with denominators fixed up front, and ``backward()`` runs before the next branch starts.
Parameter gradients accumulate in ``.grad``; the memory of the step is the state plus one
branch's graph, whatever the group size. With ``adapter.activation_checkpointing`` that graph
keeps only each decoder layer's input, and backward recomputes one layer at a time (exact
mode's sweep recomputes its chunks' layers the same way).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from longstraw_core.adapters.base import ModelAdapter, as_token_ids
from longstraw_core.grpo.losses import (
    branch_loss,
    check_loss_masks,
    group_advantages,
    loss_mask_counts,
    loss_weights,
    reduce_branch_stats,
)
from longstraw_core.grpo.replay_totals import totals_from_last
from longstraw_core.metrics import names
from longstraw_core.offload import OffloadPolicy
from longstraw_core.process.progress import counter
from longstraw_core.schema.grpo import GRPOConfig
from longstraw_core.state.exact import StateGrad, new_state_grad
from longstraw_core.state.prefix import PrefixState
from longstraw_core.tensors.fake import known_float, real_values


class Policy(Protocol):
    """What a reference policy must offer: an adapter, or ``lora_reference(adapter)``.

    ``score`` takes the ``temperature`` the loss's log-probs are taken at (TRL scores the
    reference at its sampling temperature too).

    ``in_step`` and ``idle_forward`` keep the ranks of a sharded model in step (see
    ``ModelAdapter.in_step``).
    """

    def prefill(self, prompt_ids: torch.Tensor, chunk_size: int = ...) -> PrefixState: ...

    def score(
        self, state: PrefixState, response_ids: torch.Tensor, *, temperature: float = ...
    ) -> torch.Tensor: ...

    def in_step(self, items: Sequence[int]) -> Iterator[int | None]: ...

    def idle_forward(self) -> None: ...


@dataclass
class GRPOStepResult:
    """What one ``grpo_step`` did: typed fields, and ``metrics()``, the flat scalars to log.

    ``loss`` is the group's loss (not multiplied by ``loss_scale``); ``advantages`` one per
    response; ``group_reward_mean``/``group_reward_std`` describe the scorable (non-NaN)
    rewards as given; ``completion_tokens`` and ``completion_length_mean`` count the tokens
    of the loss masks (TRL's ``completions/mean_length`` with a ``tool_mask``), every token
    without them (a reward set reports TRL's ``reward``/``reward_std`` itself).
    ``prefill_seconds`` is 0.0 and left out of ``metrics()`` when a ``state`` was passed
    (``prefilled`` is False): the prefill was the caller's. ``branch_stats``: TRL's clip
    ratios and ``kl`` (``losses.reduce_branch_stats``; empty when no branch was replayed).
    ``extra``: metrics of the caller's, logged with the others.
    """

    loss: float
    advantages: list[float]
    group_reward_mean: float
    group_reward_std: float
    entropy: float
    prompt_tokens: int
    completion_tokens: int
    completion_length_mean: float
    branches_replayed: int
    state_bytes: int
    state_grad_bytes: int
    attention_output_bytes: int
    peak_memory_bytes: int
    ref_seconds: float = 0.0
    replay_seconds: float = 0.0
    sweep_seconds: float = 0.0
    prefill_seconds: float = 0.0
    prefilled: bool = False
    branch_stats: dict[str, float] = field(default_factory=dict)
    extra: dict[str, float] = field(default_factory=dict)
    logps: list[torch.Tensor | None] = field(default_factory=list)
    ref_logps: list[torch.Tensor | None] = field(default_factory=list)

    def metrics(self) -> dict[str, float]:
        """The scalars to log, by the names of ``longstraw_core.metrics.names``."""
        out = {
            names.LOSS: self.loss,
            names.GROUP_REWARD_MEAN: self.group_reward_mean,
            names.GROUP_REWARD_STD: self.group_reward_std,
            names.ENTROPY: self.entropy,
            names.PROMPT_TOKENS: self.prompt_tokens,
            names.COMPLETION_TOKENS: self.completion_tokens,
            names.COMPLETION_LENGTH_MEAN: self.completion_length_mean,
            names.BRANCHES_REPLAYED: self.branches_replayed,
            names.STATE_BYTES: self.state_bytes,
            names.STATE_GRAD_BYTES: self.state_grad_bytes,
            names.ATTENTION_OUTPUT_BYTES: self.attention_output_bytes,
            names.PEAK_MEMORY_BYTES: self.peak_memory_bytes,
            names.REF_SECONDS: self.ref_seconds,
        }
        if self.prefilled:
            out[names.PREFILL_SECONDS] = self.prefill_seconds
        out[names.REPLAY_SECONDS] = self.replay_seconds
        out[names.SWEEP_SECONDS] = self.sweep_seconds
        return out | self.branch_stats | self.extra


def grpo_step(
    adapter: ModelAdapter,
    prompt_ids: torch.Tensor | Sequence[int],
    responses: Sequence[torch.Tensor | Sequence[int]],
    rewards: Sequence[float] | torch.Tensor,
    *,
    advantages: Sequence[float] | torch.Tensor | None = None,
    config: GRPOConfig | None = None,
    old_logps: Sequence[torch.Tensor | None] | None = None,
    ref_adapter: Policy | None = None,
    ref_logps: Sequence[torch.Tensor | None] | None = None,
    state: PrefixState | None = None,
    truncated: Sequence[bool] | None = None,
    loss_masks: Sequence[torch.Tensor | Sequence[int] | None] | None = None,
    chunk_size: int = 4096,
    loss_scale: float = 1.0,
    reward_std: float | None = None,
    offload: OffloadPolicy | str | dict | None = None,
    progress: bool | None = None,
) -> GRPOStepResult:
    """Accumulate the gradient of the GRPO loss of one group into ``.grad``; return what it did
    (``GRPOStepResult``: typed fields, and ``.metrics()`` to log).

    ``responses`` are 1-D token ids (lengths may differ) and ``rewards`` one float each;
    NaN marks a completion no reward function could score (``RewardSet``'s all-None rows):
    as in TRL it gets zero advantage and stays out of the group's mean and std.
    ``advantages``: one per response, the caller's (``group_advantages`` of ``rewards``, as
    the recipes compute them); None computes them here from ``rewards`` with
    ``config.scale_rewards`` (and ``reward_std``). ``rewards`` are the reported group metrics.
    Every log-prob of the loss (the policy's, the reference's, the entropy) is taken at
    ``config.temperature``, TRL's ``log_softmax(logits / temperature)``; ``old_logps`` must be
    too (a rollout's ``out.logps`` at that temperature are, and so are ``result.logps``).
    ``old_logps`` are the behaviour policy's per-token log-probs (``None``, or a ``None``
    entry: on-policy; a later update on the same rollout passes the first's
    ``result.logps``). ``ref_adapter`` scores the reference policy when ``config.beta > 0``,
    unless ``ref_logps`` gives its log-probs already (a later update's ``result.ref_logps``:
    the reference does not change, so it is scored once per rollout). ``state`` reuses a
    prefill of ``prompt_ids`` (from rollout); otherwise the prompt is prefilled here.
    ``truncated`` marks responses cut at the length limit (for
    ``mask_truncated_completions``). ``loss_masks``: one per response, its loss mask (TRL's
    ``tool_mask``): a 1-D 0/1 tensor or int list of the response's length, 1 on the policy's
    own tokens, 0 on tokens it did not sample (a tool's result), or None (all ones, as is a
    None ``loss_masks``). The whole response is replayed (its later tokens attend to the
    tool's), but only its masked-in tokens enter the loss, the normalisers, the entropy, the
    KL and clip metrics and the completion lengths, exactly as TRL's ``completion_mask *
    tool_mask``; a response with no masked-in token is not replayed (it has no loss and no
    gradient). All-ones masks give the unmasked step bit for bit. No optimizer step is taken. ``offload`` places the prefix
    state of a prefill made here (the policy's and the reference's; see
    ``longstraw_core.offload``); a given ``state`` keeps the placement it was prefilled with.

    ``config.gradient="exact"`` also backpropagates through the prompt: each branch adds its
    gradient of the prefix state into a buffer shaped like the state, and a reverse sweep
    over the prompt's chunks turns it into parameter gradients (``longstraw_core.state.exact``).

    ``chunk_size``: the prompt tokens a chunk of a prefill made here holds (``state=None``),
    which is also the sweep's recompute unit (a given ``state`` keeps the chunk it was
    prefilled with). Exact mode's peak grows with it: one chunk's graph is alive at a time.
    The default stays 4096 (the algorithms do not import the planner); the recipes'
    ``train.chunk_size: null`` is the planner's choice, which a caller can make too:
    ``plan.auto_chunk(plan.ModelSpec.from_model(model, name), plan.Workload(...)).chunk``
    (``longstraw_core.plan.chunking``).

    ``loss_scale`` multiplies the gradient (not the reported ``loss``): the group's share of
    an optimizer step over several groups, from ``longstraw_core.distributed.group_loss_scales``
    or ``longstraw_core.grpo.generation.GenerationBatch``. ``reward_std``: with
    ``scale_rewards="batch"``, the std of every reward of the optimizer step
    (``distributed.step_reward_std``); None uses this group's, right for one group per step.
    On a sharded model every rank must call ``grpo_step`` the same number of times; the
    replay and the sweep are padded with idle passes so that their collectives pair up.
    ``progress``: counts of the branches replayed, and of a prefill's and the sweep's prompt
    tokens (``progress.counter``: None, a live bar on a terminal and plain lines in a run's
    log; False: none).
    """
    config = config or GRPOConfig()
    if isinstance(loss_scale, bool) or not (
        isinstance(loss_scale, (int, float)) and math.isfinite(loss_scale) and loss_scale >= 0
    ):
        raise ValueError(
            f"loss_scale must be a finite number >= 0 (the group's share of the step's loss), "
            f"got {loss_scale!r}"
        )
    if advantages is not None and reward_std is not None:
        raise ValueError("pass advantages or reward_std (what they are computed with), not both")
    if reward_std is not None and config.scale_rewards != "batch":
        raise ValueError(
            f"reward_std={reward_std!r} is the optimizer step's std for scale_rewards='batch'; "
            f"this config scales by {config.scale_rewards!r}: pass reward_std=None"
        )
    prompt_ids = as_token_ids(prompt_ids, "prompt_ids", adapter.vocab_size)
    responses = _check_responses(responses, adapter.vocab_size)
    with real_values():  # rewards are values even in a dry run on fake tensors
        reward_tensor = _check_rewards(rewards, len(responses))
        if advantages is None:
            advantages = group_advantages(reward_tensor, config.scale_rewards, std=reward_std)
        else:
            advantages = _check_advantages(advantages, len(responses))
        advantage_values = [float(a) for a in advantages]
        reward_mean, reward_std = _scorable_mean_std(reward_tensor)
    old_logps = _check_logps(old_logps, responses, "old_logps")
    given_ref_logps = None if ref_logps is None else _check_logps(ref_logps, responses, "ref_logps")
    if truncated is not None and len(truncated) != len(responses):
        raise ValueError(f"truncated has {len(truncated)} entries for {len(responses)} responses")
    with real_values():
        masks = check_loss_masks(loss_masks, [len(r) for r in responses])
    if config.beta != 0.0 and ref_adapter is None and given_ref_logps is None:
        raise ValueError(
            f"config.beta={config.beta} needs a reference policy: pass ref_adapter "
            "(ls.lora_reference(adapter) for LoRA, or ls.adapt(frozen_model)) or ref_logps"
        )
    if state is not None:
        adapter.check_state(state)
        if not state.holds_prompt(prompt_ids):
            raise ValueError("state was prefilled from a different prompt than prompt_ids")
        if config.keep_attention_outputs and not state.keeps_attention_outputs():
            raise ValueError(
                "config.keep_attention_outputs=True, but state was prefilled without them: "
                "pass keep_attention_outputs=True to adapter.prefill"
            )

    names.reset_peak_memory(adapter.device)
    lengths = [len(response) for response in responses]
    counts = loss_mask_counts(masks, lengths)
    weights = loss_weights(lengths, truncated, config, loss_tokens=counts)
    timings = {"ref_seconds": 0.0, "prefill_seconds": 0.0, "replay_seconds": 0.0}
    timings["sweep_seconds"] = 0.0
    prefilled = state is None

    ref_logps = given_ref_logps or [None] * len(responses)
    if config.beta != 0.0 and given_ref_logps is None:
        started = time.perf_counter()
        ref_logps = _reference_logps(
            ref_adapter, prompt_ids, responses, weights, chunk_size, config.temperature, offload
        )
        timings["ref_seconds"] = time.perf_counter() - started

    if state is None:
        started = time.perf_counter()
        state = adapter.prefill(
            prompt_ids, chunk_size=chunk_size, offload=offload, progress=progress,
            **config.prefill_options(),
        )  # fmt: skip
        timings["prefill_seconds"] = time.perf_counter() - started

    state_grad = new_state_grad(state) if config.gradient == "exact" else None
    started = time.perf_counter()
    total_loss, branch_stats, entropy_sum, replayed, idle = 0.0, [], 0.0, 0, 0
    policy_logps: list[torch.Tensor | None] = [None] * len(responses)
    contributing = [
        index
        for index in range(len(responses))
        if counts[index]
        and not _contributes_nothing(weights[index], advantage_values[index], config)
    ]
    bar = counter(len(contributing), "replay", "branch", progress)
    if adapter.stage is not None:  # pipeline stages: the branches as 1F1B microbatches
        total_loss, entropy_sum, branch_stats, idle = _replay_on_stages(
            adapter, state, responses, contributing, old_logps, ref_logps, advantages,
            weights, config, loss_scale, state_grad, policy_logps, masks, bar.update,
        )  # fmt: skip
        replayed, contributing = len(contributing), []
    for index in adapter.in_step(contributing):
        if index is None:  # a sharded model's other rank still replays: join its collectives
            adapter.idle_branch(state, state_grad)
            idle += 1
            continue
        logps, entropy = adapter.score(
            state, responses[index], return_entropy=True, state_grad=state_grad,
            temperature=config.temperature,
        )  # fmt: skip
        loss, stats = branch_loss(
            logps, old_logps[index], ref_logps[index], advantages[index], weights[index], config,
            masks[index],
        )  # fmt: skip
        (loss * loss_scale).backward()  # frees this branch's graph before the next one
        policy_logps[index] = logps.detach()
        total_loss += known_float(loss)
        entropy_sum += known_float(_masked_sum(entropy, masks[index]))
        branch_stats.append(stats)
        replayed += 1
        bar.update(1)
    bar.close()
    timings["replay_seconds"] = time.perf_counter() - started
    if state_grad is not None and (replayed or idle):  # sharded: all ranks sweep, or none
        started = time.perf_counter()
        adapter.backprop_prompt(state, state_grad, progress=progress)
        timings["sweep_seconds"] = time.perf_counter() - started
    if not (replayed or idle):  # no backward freed what the no-grad passes gathered
        adapter.release_parameters()

    replayed_tokens = sum(int(known_float(s["num_tokens"], 0)) for s in branch_stats)
    return GRPOStepResult(
        loss=total_loss,
        advantages=advantage_values,
        group_reward_mean=reward_mean,
        group_reward_std=reward_std,
        entropy=entropy_sum / replayed_tokens if replayed_tokens else math.nan,
        prompt_tokens=state.prompt_length,
        completion_tokens=sum(counts),
        completion_length_mean=sum(counts) / len(counts),
        branches_replayed=replayed,
        state_bytes=state.nbytes(),
        state_grad_bytes=state_grad.nbytes() if state_grad is not None else 0,
        attention_output_bytes=state.output_nbytes(),
        peak_memory_bytes=names.peak_memory_bytes(adapter.device),
        prefilled=prefilled,
        branch_stats=reduce_branch_stats(branch_stats),
        logps=policy_logps,
        ref_logps=list(ref_logps),
        **timings,
    )


def _replay_on_stages(
    adapter: ModelAdapter,
    state: PrefixState,
    responses: list[torch.Tensor],
    contributing: list[int],
    old_logps: list[torch.Tensor | None],
    ref_logps: list[torch.Tensor | None],
    advantages: torch.Tensor,
    weights: list[float],
    config: GRPOConfig,
    loss_scale: float,
    state_grad: StateGrad | None,
    policy_logps: list[torch.Tensor | None],
    masks: list[torch.Tensor | None],
    on_branch: Callable[[int], object],
) -> tuple[float, float, list[dict[str, Any]], int]:
    """The replay loop on pipeline stages: every contributing branch is replayed in pieces
    through the stages' schedule (``ModelAdapter.replay_branches``), its loss computed and
    backpropagated on the last stage; replicas sharded together pad with idle branches
    (``in_step``). Returns the group's loss, the entropy sum and the branches' stats, which
    the last stage sends to every stage, and the number of idle branches; the last stage
    also fills ``policy_logps``. ``on_branch(1)``: a branch is done on this stage (its last
    backward; idle ones not counted). The loss masks apply there, on the last stage, as in
    ``grpo_step``'s own loop. The values stay on the device until the replay ends: reading
    one back per branch would stall the last stage's queue between branches; they are then
    read once, as one tensor every stage receives (``replay_totals``)."""
    losses, entropies, stats = [], [], []
    items = list(adapter.in_step(contributing))

    def loss_of(m: int, logps: torch.Tensor, entropy: torch.Tensor | None) -> torch.Tensor:
        index = items[m]
        loss, branch_stats = branch_loss(
            logps, old_logps[index], ref_logps[index], advantages[index], weights[index], config,
            masks[index],
        )  # fmt: skip
        policy_logps[index] = logps.detach()
        losses.append(loss.detach())
        entropies.append(_masked_sum(entropy, masks[index]))
        stats.append({key: value.detach() for key, value in branch_stats.items()})
        return loss * loss_scale

    branches = [None if index is None else responses[index] for index in items]
    pieces = adapter.stage.pieces_for(len(branches))
    adapter.replay_branches(
        state, branches, loss_of, state_grad, config.temperature, pieces, on_branch=on_branch
    )
    link = adapter.stage.link  # one tensor broadcast, one host read (replay_totals)
    loss, entropy, stats = totals_from_last(
        link, len(contributing), losses, entropies, stats, config
    )
    return loss, entropy, stats, len(items) - len(contributing)


def _masked_sum(values: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """The sum of a branch's per-token ``values`` over its loss mask (TRL's ``x * mask``)."""
    if mask is None:
        return values.sum()
    return (values * mask.to(device=values.device, dtype=values.dtype)).sum()


def _contributes_nothing(weight: float, advantage: float, config: GRPOConfig) -> bool:
    """A branch with zero weight, or zero advantage and no KL term, has zero loss and gradient.

    Skipping it is exact, and turns a group whose rewards are all equal into a free step.
    """
    return weight == 0.0 or (advantage == 0.0 and config.beta == 0.0)


def _reference_logps(
    ref_adapter: Policy,
    prompt_ids: torch.Tensor,
    responses: list[torch.Tensor],
    weights: list[float],
    chunk_size: int,
    temperature: float,
    offload: OffloadPolicy | str | dict | None = None,
) -> list[torch.Tensor | None]:
    """The reference policy's log-probs at ``temperature``, from its own prefill (freed
    before the policy's)."""
    logps: list[torch.Tensor | None] = [None] * len(responses)
    options = {} if offload is None else {"offload": offload}  # other policies may not take it
    with torch.no_grad():
        ref_state = ref_adapter.prefill(prompt_ids, chunk_size=chunk_size, **options)
        for index in ref_adapter.in_step([i for i, weight in enumerate(weights) if weight]):
            if index is None:
                ref_adapter.idle_forward()
            else:
                logps[index] = ref_adapter.score(
                    ref_state, responses[index], temperature=temperature
                ).detach()
    del ref_state
    return logps


def _check_responses(
    responses: Sequence[torch.Tensor | Sequence[int]], vocab_size: int
) -> list[torch.Tensor]:
    if isinstance(responses, torch.Tensor) or not isinstance(responses, Sequence):
        raise ValueError("responses must be a list of 1-D token id tensors, one per response")
    if len(responses) < 2:
        raise ValueError(
            f"responses has {len(responses)} response(s); GRPO needs a group of at least 2 "
            "(advantages are relative to the group)"
        )
    return [as_token_ids(r, f"responses[{i}]", vocab_size) for i, r in enumerate(responses)]


def _check_rewards(rewards: Sequence[float] | torch.Tensor, count: int) -> torch.Tensor:
    """The rewards as float64; NaN is allowed (an unscorable completion, TRL's meaning: zero
    advantage, out of the group's statistics), an infinity is not (no meaning in TRL)."""
    reward_tensor = torch.as_tensor(rewards, dtype=torch.float64).flatten()
    if len(reward_tensor) != count:
        raise ValueError(f"rewards has {len(reward_tensor)} values for {count} responses")
    bad = [i for i, r in enumerate(reward_tensor.tolist()) if math.isinf(r)]
    if bad:
        raise ValueError(
            f"rewards[{bad[0]}] is {reward_tensor[bad[0]].item()}: every reward must be finite, "
            "or NaN for a completion no reward function could score (it then gets zero "
            "advantage, as in TRL)"
        )
    return reward_tensor


def _check_advantages(advantages: Sequence[float] | torch.Tensor, count: int) -> torch.Tensor:
    """The caller's advantages as float64, one finite value per response."""
    values = torch.as_tensor(advantages, dtype=torch.float64).flatten()
    if len(values) != count or not bool(torch.isfinite(values).all()):
        raise ValueError(f"advantages must be {count} finite values, got {values.tolist()}")
    return values


def _scorable_mean_std(rewards: torch.Tensor) -> tuple[float, float]:
    """Mean and Bessel std of the scorable (non-NaN) rewards; std 0.0 below two of them,
    both NaN when none is scorable."""
    kept = rewards[~torch.isnan(rewards)]
    if kept.numel() == 0:
        return math.nan, math.nan
    return float(kept.mean()), float(kept.std()) if kept.numel() > 1 else 0.0


def _check_logps(
    logps: Sequence[torch.Tensor | None] | None, responses: list[torch.Tensor], name: str
) -> list[torch.Tensor | None]:
    """One per-token log-prob tensor (or None) per response, each shaped like it."""
    if logps is None:
        return [None] * len(responses)
    if len(logps) != len(responses):
        raise ValueError(f"{name} has {len(logps)} entries for {len(responses)} responses")
    for index, (values, response) in enumerate(zip(logps, responses, strict=True)):
        if values is not None and values.shape != response.shape:
            raise ValueError(
                f"{name}[{index}] has shape {tuple(values.shape)}, but responses[{index}] has "
                f"{len(response)} tokens"
            )
    return list(logps)
