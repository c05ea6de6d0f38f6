"""Input checks of the adapter's public calls: errors that name the argument and the fix."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from longstraw_core.state.prefix import BranchCache, PrefixState
from longstraw_core.tensors.fake import is_fake


def as_token_ids(ids: torch.Tensor | Sequence[int], name: str, vocab_size: int) -> torch.Tensor:
    """Validate a 1-D sequence of token ids; errors name the argument and the fix."""
    ids = torch.as_tensor(ids)
    if ids.dim() != 1:
        raise ValueError(
            f"{name} must be a 1-D tensor of token ids (one sequence), got shape "
            f"{tuple(ids.shape)}; pass ids[0] for a batch of one"
        )
    if ids.numel() == 0:
        raise ValueError(f"{name} is empty: it needs at least one token")
    if ids.dtype.is_floating_point or ids.dtype == torch.bool or ids.is_complex():
        raise ValueError(f"{name} must hold integer token ids, got dtype {ids.dtype}")
    if is_fake(ids):  # a dry run's ids have no values to range-check
        return ids.long()
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise ValueError(
            f"{name} holds token id {bad}, outside the model's vocabulary [0, {vocab_size}); "
            "was it tokenized with another tokenizer?"
        )
    return ids.long()


def check_attention_dropout(config: Any) -> None:
    """Every adapter scores deterministically (RL compares log-probs of the same tokens):
    refuse a model whose (text) config has attention dropout."""
    if getattr(config, "attention_dropout", 0.0):
        raise ValueError(
            f"config.attention_dropout={config.attention_dropout}: scoring must be "
            "deterministic for RL; set attention_dropout=0.0 in the (text) config"
        )


def check_prefill_options(chunk_size: object, checkpoints: object) -> None:
    """``prefill``'s ``chunk_size`` (a positive int) and ``checkpoints``."""
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive integer, got {chunk_size!r}")
    if checkpoints not in (None, "device", "cpu"):
        raise ValueError(f"checkpoints must be None, 'device' or 'cpu', got {checkpoints!r}")


def check_temperature(temperature: object) -> None:
    """``score``'s ``temperature``: a finite number > 0 (the logits are divided by it)."""
    ok = isinstance(temperature, (int, float)) and not isinstance(temperature, bool)
    if not (ok and math.isfinite(temperature) and temperature > 0):
        raise ValueError(
            f"temperature must be a finite number > 0 (scores are log_softmax(logits / "
            f"temperature); a greedy rollout's temperature 0 has no distribution to score), "
            f"got {temperature!r}"
        )


def check_state(state: PrefixState, owner: str, device: torch.device) -> None:
    """``state`` is a ``PrefixState`` of the model ``owner`` names, on ``device``."""
    if not isinstance(state, PrefixState):
        raise ValueError(f"state must be a PrefixState from adapter.prefill, got {type(state)}")
    if state.owner != owner:
        raise ValueError(
            "state was prefilled by another model; prefill the prompt with this adapter "
            "(states cannot be shared between models)"
        )
    if state.device != device:
        raise ValueError(
            f"state is on {state.device} but the model is on {device}; "
            f"move it with state.to({str(device)!r})"
        )


def check_decode_inputs(state: PrefixState, branch: BranchCache, input_ids: torch.Tensor) -> None:
    """``decode``'s cache was made from ``state`` and ``input_ids`` is ``[batch, T]``."""
    if branch.prefix_length != state.length:
        raise ValueError(
            f"branch cache was made for a prefix of {branch.prefix_length} positions, "
            f"not this state's {state.length}; use adapter.new_branch_cache(state, ...)"
        )
    if input_ids.dim() != 2 or input_ids.shape[0] != branch.batch:
        raise ValueError(
            f"input_ids must be [{branch.batch}, T] for a cache of {branch.batch} branches, "
            f"got {tuple(input_ids.shape)}"
        )


def check_positions(limit: int | None, prompt_length: int, response_length: int) -> None:
    """A prompt and response fit the model's ``limit`` of positions (``None``: no limit)."""
    total = prompt_length + response_length
    if limit is not None and total > limit:
        raise ValueError(
            f"prompt ({prompt_length} tokens) + response ({response_length} tokens) = "
            f"{total} positions exceeds the model's limit of {limit} "
            "(config.max_position_embeddings); shorten the prompt or use a model "
            "configured for longer contexts"
        )
