"""References written against the transformers model itself, never against LongStraw code.

- ``full_sequence_logps``: the model's own forward over prompt + response.
- Each takes a ``temperature``: the log-probs of ``log_softmax(logits / temperature)``, what
  TRL's GRPO scores (its fused head divides the logits by ``GRPOConfig.temperature``).
- ``trl_group_loss``: TRL's ``GRPOTrainer._compute_loss`` on padded ``[G, T]`` tensors.
- ``detached_reference_logps``: the transformers cache of all prompt tokens but the last,
  computed under ``no_grad``; then the last prompt token and the response run with autograd
  on a copy of that cache. This is what LongStraw's detached mode must equal, gradients
  included. ``assign_recurrent_states`` lets a cache run a linear-attention (Gated
  DeltaNet) model with autograd (``detached_reference_logps`` applies it).
"""

from __future__ import annotations

import copy
import functools

import torch
from peft import LoraConfig, get_peft_model
from transformers import PreTrainedModel
from transformers.cache_utils import Cache, LinearAttentionLayer


def _gather_logps(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, targets[:, None])[:, 0]


def full_sequence_logps(
    model: PreTrainedModel, prompt: torch.Tensor, response: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """``log p(response[t] | prompt, response[:t])`` from one forward over the whole sequence."""
    sequence = torch.cat([prompt, response])[None]
    logits = model(input_ids=sequence).logits[0]
    return _gather_logps(logits[len(prompt) - 1 : -1], response, temperature)


def detached_reference_logps(
    model: PreTrainedModel, prompt: torch.Tensor, response: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """Response log-probs with the prompt's cache detached, as the transformers cache gives it."""
    cache = None
    if len(prompt) > 1:
        with torch.no_grad():
            cache = model(input_ids=prompt[None, :-1], use_cache=True).past_key_values
        cache = assign_recurrent_states(copy.deepcopy(cache))
    branch = torch.cat([prompt[-1:], response[:-1]])[None]
    positions = torch.arange(len(prompt) - 1, len(prompt) - 1 + branch.shape[1])[None]
    logits = model(
        input_ids=branch, cache=cache, position_ids=positions, use_cache=cache is not None
    ).logits[0]
    return _gather_logps(logits, response, temperature)


def parameter_grads(model: torch.nn.Module, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    """Gradients of ``loss`` for every trainable parameter, by name (zeros where unused)."""
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, [p for _, p in named], allow_unused=True)
    return {
        name: torch.zeros_like(p) if g is None else g
        for (name, p), g in zip(named, grads, strict=True)
    }


# float32's machine epsilon (2^-23): the unit of the float32-limited tolerances below.
FLOAT32_EPS = torch.finfo(torch.float32).eps


def float32_sum_rtol(length: int) -> float:
    """A relative bound on the round-off of float32 sums ``length`` long, as TRL's head and
    transformers' float32 casts compute them: each addition rounds by at most eps/2, with
    signs that vary, so the error grows like sqrt(length) x eps/2 times the terms' size;
    this is twice that (``sqrt(length) x eps``). Not the worst case (length x eps/2), which
    orderings that differ between machines and thread counts do not reach."""
    return length**0.5 * FLOAT32_EPS


def assert_grads_close(
    actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], rtol: float
) -> None:
    """Each parameter's gradient within ``rtol`` of the model's largest gradient entry.

    Round-off enters where every parameter's gradient starts (the log-probs, the hidden
    states' gradient) and the backward carries it linearly to each parameter, at a size set
    by the terms it sums, not by what they sum to: a parameter whose contributions cancel (a
    norm's weight) has a small gradient and the same absolute error. Relative to its own
    largest entry it passes on one machine's rounding and fails on another's (issue 38:
    ``k_norm.weight`` at 1.02e-6 against 1e-6); relative to the model's largest entry (an
    absolute floor for every parameter), a wrong gradient still fails wherever the error
    exceeds ``rtol`` x that entry. All-zero expected gradients (no advantage) need zeros.
    """
    assert actual.keys() == expected.keys() and expected
    largest = max(float(want.abs().max()) for want in expected.values())
    for name, want in expected.items():
        err = float((actual[name] - want).abs().max())
        own = float(want.abs().max())
        assert err <= rtol * largest, (
            f"{name}: max error {err:.3e} > {rtol:.1e} x the largest gradient entry "
            f"{largest:.3e} (its own largest entry: {own:.3e})"
        )


def trl_group_loss(lp, old, ref, adv, mask, cfg):
    """TRL 1.16 ``_compute_loss`` on padded [G, T] tensors (one micro-batch, one process)."""
    log_ratio = lp - old
    if cfg.importance_sampling_level == "token":
        log_iw = log_ratio
    else:
        log_iw = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    coef_1 = torch.exp(log_iw)
    per_token_kl = None
    if cfg.beta != 0.0:
        per_token_kl = torch.exp(ref - lp) - (ref - lp) - 1
        if cfg.use_bias_correction_kl:
            per_token_kl = per_token_kl * coef_1
    a = adv.unsqueeze(1)
    eps_low = cfg.epsilon
    eps_high = cfg.epsilon_high if cfg.epsilon_high is not None else cfg.epsilon
    if cfg.loss_type == "cispo":
        ptl = -torch.clamp(coef_1, max=eps_high).detach() * a * lp
    else:
        coef_2 = torch.clamp(coef_1, 1 - eps_low, 1 + eps_high)
        if cfg.delta is not None:
            coef_1 = torch.clamp(coef_1, max=cfg.delta)
        ptl = -torch.min(coef_1 * a, coef_2 * a)
    if cfg.beta != 0.0:
        ptl = ptl + cfg.beta * per_token_kl
    if cfg.loss_type == "grpo":
        loss = ((ptl * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    elif cfg.loss_type == "bnpo":
        loss = (ptl * mask).sum() / mask.sum().clamp(min=1.0)
    elif cfg.loss_type == "dr_grpo":
        loss = (ptl * mask).sum() / (ptl.size(0) * cfg.max_completion_length)
    else:  # dapo, cispo: num_items_in_batch = mask.sum() of the generation batch
        loss = (ptl * mask).sum() / mask.sum().clamp(min=1.0)

    def gmm(x):  # TRL's global_masked_mean
        if x.shape[1] == 1:
            return (x.sum() / x.shape[0]).item()
        return ((x * mask).sum() / mask.sum().clamp(min=1.0)).item()

    def seq_mean(x):  # TRL's masked_seq_mean
        return x.squeeze(1) if x.shape[1] == 1 else (x * mask).sum(-1) / mask.sum(-1)

    metrics = {}
    if per_token_kl is not None:
        metrics["kl"] = gmm(per_token_kl)
    if cfg.loss_type == "cispo":
        metrics["cispo_clip_ratio"] = gmm(((coef_1 > eps_high) & (a > 0)).to(torch.float64))
    else:
        low = ((coef_1 < 1 - eps_low) & (a < 0)).to(torch.float64)
        high = ((coef_1 > 1 + eps_high) & (a > 0)).to(torch.float64)
        metrics["clip_ratio/low_mean"] = gmm(low)
        metrics["clip_ratio/high_mean"] = gmm(high)
        metrics["clip_ratio/region_mean"] = gmm(torch.maximum(low, high))
        low_seq, high_seq = seq_mean(low), seq_mean(high)
        metrics["clip_ratio/low_min"] = low_seq[~low_seq.isnan()].min().item()
        metrics["clip_ratio/high_max"] = high_seq[~high_seq.isnan()].max().item()
    return loss, metrics


def pad_rows(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``[G, T]`` right-padded rows (padding holds junk the mask removes) and the mask."""
    width = max(len(row) for row in rows)
    padded = torch.stack(
        [torch.cat([row, row.new_full((width - len(row),), -3.0)]) for row in rows]
    )
    mask = torch.stack([(torch.arange(width) < len(row)).double() for row in rows])
    return padded, mask


def hand_advantages(rewards: list[float]) -> torch.Tensor:
    """``(R - mean) / (std + 1e-4)`` with the Bessel-corrected std, written out by hand.

    A NaN reward (an unscorable completion) as in TRL 1.16 ``_generate_and_score_completions``
    (trl/trainer/grpo_trainer.py, "sum_then_normalize": ``torch.nanmean``, ``nanstd``, then
    ``advantages = torch.nan_to_num(advantages, nan=0.0)``): left out of the mean and std,
    zero advantage; one scorable reward has a NaN std, so every advantage is 0.
    """
    r = torch.tensor(rewards, dtype=torch.float64)
    kept = r[~torch.isnan(r)]
    return torch.nan_to_num((r - kept.mean()) / (kept.std() + 1e-4), nan=0.0)


def group_reference(
    model: torch.nn.Module,
    logps_fn,
    prompt: torch.Tensor,
    responses: list[torch.Tensor],
    rewards: list[float],
    config,
    old: list[torch.Tensor] | None = None,
    ref: list[torch.Tensor] | None = None,
    truncated: list[bool] | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The whole group through ``logps_fn(model, prompt, response)``, TRL's loss, its grads.

    ``logps_fn`` is ``full_sequence_logps`` (the full graph: exact mode's reference) or
    ``detached_reference_logps`` (detached mode's).
    """
    logps, mask = pad_rows([logps_fn(model, prompt, r) for r in responses])
    if truncated is not None and config.mask_truncated_completions:
        mask = mask * torch.tensor([0.0 if t else 1.0 for t in truncated])[:, None]
    old_padded = logps.detach() if old is None else pad_rows(old)[0]
    ref_padded = None if ref is None else pad_rows(ref)[0]
    advantages = hand_advantages(rewards)
    loss, _ = trl_group_loss(logps, old_padded, ref_padded, advantages, mask, config)
    return loss, parameter_grads(model, loss)


def step_grads(model, adapter, prompt, responses, rewards, config, **kwargs):
    """``grpo_step``'s metrics and the gradients it left in ``.grad`` (then cleared)."""
    import longstraw_core as ls

    model.zero_grad(set_to_none=True)
    metrics = ls.grpo_step(adapter, prompt, responses, rewards, config=config, **kwargs)
    grads = {
        name: torch.zeros_like(p) if p.grad is None else p.grad.clone()
        for name, p in model.named_parameters()
        if p.requires_grad
    }
    model.zero_grad(set_to_none=True)
    return metrics, grads


def with_lora(
    model: torch.nn.Module,
    targets: list[str],
    *,
    std: float = 0.1,
    seed: int | None = None,
    **config,
) -> torch.nn.Module:
    """``model`` with peft LoRA (``r=4`` unless given) on ``targets``, B drawn off zero.

    peft starts B at zero, so LoRA would change no output and A would get no gradient.
    ``seed``: draw B from its own generator instead of the global one.
    """
    peft_model = get_peft_model(model, LoraConfig(**{"r": 4, **config}, target_modules=targets))
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in peft_model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0.0, std, generator=generator)
    return peft_model


def assign_recurrent_states(cache: Cache) -> Cache:
    """``cache`` with each linear-attention layer assigning its new recurrent state, not
    copying it into the cached tensor in place; returns ``cache``.

    transformers' cache copies each new state into the tensor the delta rule saved for
    backward, so a cached continuation run with autograd fails. Each such layer becomes an
    instance of a subclass that assigns instead (``_assigning``); only the references use
    it, the adapter never uses the transformers cache.
    """
    for layer in cache.layers:
        if isinstance(layer, LinearAttentionLayer):
            layer.__class__ = _assigning(type(layer))
    return cache


@functools.cache
def _assigning(layer_class: type[LinearAttentionLayer]) -> type[LinearAttentionLayer]:
    def update_recurrent_state(self, recurrent_states, state_idx=0, **kwargs):
        if not self.is_recurrent_states_initialized[state_idx]:
            self.lazy_initialization(recurrent_states=recurrent_states, state_idx=state_idx)
        self.recurrent_states[state_idx] = recurrent_states
        return recurrent_states

    name = f"Assigning{layer_class.__name__}"
    return type(name, (layer_class,), {"update_recurrent_state": update_recurrent_state})
