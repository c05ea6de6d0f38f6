"""References written against the transformers model itself, never against LongStraw code.

- ``full_sequence_logps``: the model's own forward over prompt + response.
- ``detached_reference_logps``: the transformers cache of all prompt tokens but the last,
  computed under ``no_grad``; then the last prompt token and the response run with autograd
  on a copy of that cache. This is what LongStraw's detached mode must equal, gradients
  included.
"""

from __future__ import annotations

import copy

import torch
from transformers import PreTrainedModel


def _gather_logps(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return torch.log_softmax(logits, dim=-1).gather(-1, targets[:, None])[:, 0]


def full_sequence_logps(
    model: PreTrainedModel, prompt: torch.Tensor, response: torch.Tensor
) -> torch.Tensor:
    """``log p(response[t] | prompt, response[:t])`` from one forward over the whole sequence."""
    sequence = torch.cat([prompt, response])[None]
    logits = model(input_ids=sequence).logits[0]
    return _gather_logps(logits[len(prompt) - 1 : -1], response)


def detached_reference_logps(
    model: PreTrainedModel, prompt: torch.Tensor, response: torch.Tensor
) -> torch.Tensor:
    """Response log-probs with the prompt's cache detached, as the transformers cache gives it."""
    cache = None
    if len(prompt) > 1:
        with torch.no_grad():
            cache = model(input_ids=prompt[None, :-1], use_cache=True).past_key_values
        cache = copy.deepcopy(cache)
    branch = torch.cat([prompt[-1:], response[:-1]])[None]
    positions = torch.arange(len(prompt) - 1, len(prompt) - 1 + branch.shape[1])[None]
    logits = model(
        input_ids=branch, cache=cache, position_ids=positions, use_cache=cache is not None
    ).logits[0]
    return _gather_logps(logits, response)


def parameter_grads(model: torch.nn.Module, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    """Gradients of ``loss`` for every trainable parameter, by name (zeros where unused)."""
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, [p for _, p in named], allow_unused=True)
    return {
        name: torch.zeros_like(p) if g is None else g
        for (name, p), g in zip(named, grads, strict=True)
    }


def assert_grads_close(
    actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], rtol: float
) -> None:
    """Each parameter's gradient matches, relative to that gradient's own scale."""
    assert actual.keys() == expected.keys()
    for name, want in expected.items():
        got = actual[name]
        scale = want.abs().max().clamp_min(1e-30)
        err = (got - want).abs().max() / scale
        assert err <= rtol, f"{name}: max relative error {err:.3e} > {rtol:.1e}"
