"""Rollout: sample a group of responses from the prefix state the update will read.

The prompt is prefilled once per step (``adapter.prefill``); ``rollout`` decodes all ``G``
branches of the group in one batch from that state, and ``grpo_step`` then scores and
replays them from the same state (``docs/design.md``, "One GRPO step")::

    state = adapter.prefill(prompt_ids)
    out = ls.rollout(adapter, state, num_generations=8, max_new_tokens=256, eos_token_ids=[eos])
    ls.grpo_step(adapter, prompt_ids, out.responses, rewards, state=state,
                 old_logps=out.logps, truncated=out.truncated)

The branches share the prefix state, which is read and never copied, expanded over the batch
or written: full-attention layers attend to the shared prefix K/V plus each branch's own
K/V, preallocated to ``max_new_tokens`` and filled step by step; recurrent layers start from
per-branch copies of their (small) state; MLA layers read the shared latent and indexer keys
plus each branch's own rows. The per-layer code is the adapters' own ``run_layers``, given a
``BranchCache`` (``ModelAdapter.new_branch_cache`` / ``decode``).

Sampling follows transformers' ``generate`` with transformers' own processors, in its order:
``repetition_penalty`` (``RepetitionPenaltyLogitsProcessor``: every token of the prompt and
of the branch so far counts, as in ``generate`` and vLLM), then, when sampling, the
temperature, top-k, top-p (nucleus) and min-p warpers; a token is drawn with
``torch.multinomial`` from a ``torch.Generator`` seeded by ``seed`` (the same seed gives the
same responses). ``temperature=0`` decodes greedily: the argmax after the repetition penalty,
as ``generate(do_sample=False)``.

Behaviour log-probs (``out.logps``) are ``log_softmax(logits / temperature)`` at the sampled
token, before any processor, as TRL computes the policy's log-probs; at temperature 1 they
equal ``adapter.score(state, response)`` (so the on-policy importance ratio is 1). The
processors choose which token is drawn, not how the policy scores it. Greedy decoding reports
the log-probs of the unscaled logits (temperature 1).

A response ends at an end-of-sequence token or at the token that completes one of the
``stop_strings`` (transformers' ``StopStringCriteria``: the decoded response contains the
string, also when it starts or ends inside a token, reading special tokens' text too); both
are kept in the response, as TRL keeps the token vLLM or ``generate`` stopped at, and such a
response is not truncated.
Unlike ``generate``, a stop string is looked for in the response only, never across the
prompt's end (vLLM's rule). Finished branches stay in the batch (their later tokens are
masked) until every branch has finished or ``max_new_tokens`` is reached.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase
from transformers.generation.logits_process import (
    LogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)
from transformers.generation.stopping_criteria import StopStringCriteria

from longstraw_core.fake import known_bool, known_list
from longstraw_core.guard import NonFiniteError
from longstraw_core.state import PrefixState
from model_adapters.base import ModelAdapter


@dataclass
class RolloutOutput:
    """The sampled group.

    ``responses``: 1-D LongTensors, each ending at its first EOS or completed stop string
    (kept) or at ``max_new_tokens``. ``logps``: per-token behaviour log-probs (float32, or
    float64 for a float64 model), one tensor per response. ``truncated``: whether each
    response hit ``max_new_tokens`` without an EOS or a stop string. ``stats``: timing and
    throughput (see ``rollout``).
    """

    responses: list[torch.Tensor]
    logps: list[torch.Tensor]
    truncated: list[bool]
    stats: dict[str, float | int] = field(default_factory=dict)


def rollout(
    adapter: ModelAdapter,
    state: PrefixState,
    num_generations: int = 8,
    max_new_tokens: int = 256,
    *,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    repetition_penalty: float = 1.0,
    eos_token_ids: Sequence[int] | int | None = None,
    stop_strings: Sequence[str] = (),
    tokenizer: PreTrainedTokenizerBase | None = None,
    seed: int | None = 0,
    progress: bool | None = None,
    gather_parameters: bool = True,
) -> RolloutOutput:
    """Sample ``num_generations`` responses to the prompt held by ``state``, in one batch.

    Args:
        adapter: the policy's adapter (the one that prefilled ``state``).
        state: the prompt's prefix state; only read (bitwise unchanged afterwards), so it
            can be passed on to ``grpo_step``.
        num_generations: ``G``, branches decoded together.
        max_new_tokens: the most tokens a response gets.
        temperature: softmax temperature; ``0`` decodes greedily.
        top_p: nucleus sampling mass, in ``(0, 1]`` (``1``: off).
        top_k: keep the ``top_k`` most likely tokens (``0``: off).
        min_p: drop tokens less likely than ``min_p`` times the most likely one, after the
            temperature (``0``: off).
        repetition_penalty: divide positive (multiply negative) logits of the tokens in the
            prompt and the branch by it (``1``: off), as ``generate`` does.
        eos_token_ids: token ids that end a response (``None``: responses run to
            ``max_new_tokens``).
        stop_strings: strings that end a response once its text contains one (needs
            ``tokenizer``, whose vocabulary ``StopStringCriteria`` reads).
        tokenizer: the tokenizer, for ``stop_strings``.
        seed: seeds the sampling generator (``None``: a random seed).
        progress: a progress bar over decode steps (``None``: only on a terminal).
        gather_parameters: on a sharded (FSDP) model, gather each layer once for the whole
            rollout and keep it (``ModelAdapter.parameters_gathered``: the unsharded model's
            memory while decoding) instead of once per decode step (config
            ``distributed.rollout_gather``). No effect unsharded.

    Returns:
        ``RolloutOutput``; ``stats`` holds ``decode_seconds``, ``steps`` (batched decode
        steps run), ``generated_tokens`` (sum of response lengths), ``tokens_per_second``
        (generated tokens over decode seconds), ``branch_cache_bytes`` (the branches' own
        state) and ``prefix_state_bytes``.
    """
    adapter.check_state(state)
    eos = _check_arguments(
        adapter, num_generations, max_new_tokens, temperature, top_p, top_k, eos_token_ids
    )
    _check_options(min_p, repetition_penalty, stop_strings, tokenizer)
    adapter._check_positions(state.prompt_length, max_new_tokens)
    device, group = adapter.device, num_generations
    generator = torch.Generator(device=device)
    generator.manual_seed(seed if seed is not None else int(torch.randint(2**62, ()).item()))
    processors = _processors(temperature, top_k, top_p, min_p, repetition_penalty)
    stop = StopStringCriteria(tokenizer, list(stop_strings)) if stop_strings else None
    eos = torch.tensor(eos, dtype=torch.long, device=device)
    pad_id = int(eos[0]) if len(eos) else 0
    # What the processors see as the sequence: the prompt's distinct tokens (the repetition
    # penalty needs only which tokens occur), then each branch's tokens, filled step by step.
    seen = torch.unique(state.prompt_ids) if repetition_penalty != 1.0 else state.prompt_ids[:0]
    sequence = torch.cat(
        [
            seen.to(device).expand(group, -1),
            torch.full((group, max_new_tokens), pad_id, dtype=torch.long, device=device),
        ],
        dim=1,
    )
    tokens = sequence[:, len(seen) :]  # a view: the responses
    logps: torch.Tensor | None = None
    finished = torch.zeros(group, dtype=torch.bool, device=device)
    lengths = torch.full((group,), max_new_tokens, dtype=torch.long, device=device)
    inputs = state.last_token.expand(group)[:, None]
    bar = tqdm(
        total=max_new_tokens,
        desc="rollout",
        unit="step",
        disable=(not progress) if progress is not None else None,
        leave=False,
    )
    started = time.perf_counter()
    steps = 0
    gathered = adapter.parameters_gathered() if gather_parameters else nullcontext()
    with torch.no_grad(), bar, gathered:
        cache = adapter.new_branch_cache(state, group, max_new_tokens)
        logps_dtype = torch.promote_types(adapter.dtype, torch.float32)
        for step in range(max_new_tokens):
            logits = adapter.decode(state, cache, inputs)
            # On pipeline stages only the last one has logits: it samples, every stage gets
            # the tokens (and whether the logits were finite).
            finite, next_tokens, next_logps = _sample_on_last_stage(
                adapter, logits, temperature, processors, sequence[:, : len(seen) + step],
                generator, group, logps_dtype,
            )  # fmt: skip
            # Sampling would fail on them (or worse); sharded, every rank stops together.
            if not adapter.everywhere(finite):
                raise NonFiniteError(
                    f"rollout: non-finite logits at decode step {step}: the weights or the "
                    "prompt's state hold inf/NaN (diverged training?)"
                )
            if logps is None:
                logps = torch.zeros(group, max_new_tokens, dtype=logps_dtype, device=device)
            next_tokens = next_tokens.masked_fill(finished, pad_id)
            tokens[:, step] = next_tokens
            logps[:, step] = next_logps.masked_fill(finished, 0.0)
            ended = torch.isin(next_tokens, eos)
            if stop is not None:  # every stage has the tokens: each checks them alike
                ended |= stop(tokens[:, : step + 1], None)
            ended &= ~finished
            lengths = torch.where(ended, step + 1, lengths)
            finished |= ended
            steps += 1
            bar.update(1)
            # sharded: every rank decodes on; a dry run's fake tokens never end a response
            if adapter.everywhere(known_bool(finished.all(), fake=False)):
                break
            inputs = next_tokens[:, None]
    seconds = time.perf_counter() - started

    lengths_list = known_list(lengths, fake=steps)
    finished_list = known_list(finished, fake=False)
    responses = [tokens[i, :n].clone() for i, n in enumerate(lengths_list)]
    generated = sum(lengths_list)
    return RolloutOutput(
        responses=responses,
        logps=[logps[i, :n].clone() for i, n in enumerate(lengths_list)],
        truncated=[not done for done in finished_list],
        stats={
            "decode_seconds": seconds,
            "steps": steps,
            "generated_tokens": generated,
            "tokens_per_second": generated / seconds if seconds > 0 else float("inf"),
            "branch_cache_bytes": cache.nbytes(),
            "prefix_state_bytes": state.nbytes(),
        },
    )


def _check_arguments(
    adapter: ModelAdapter,
    num_generations: int,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    top_k: int,
    eos_token_ids: Sequence[int] | int | None,
) -> list[int]:
    """Validate the sampling arguments; return the EOS ids as a list."""
    for name, value in (("num_generations", num_generations), ("max_new_tokens", max_new_tokens)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if not temperature >= 0:  # also refuses NaN
        raise ValueError(f"temperature must be >= 0 (0: greedy), got {temperature!r}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1] (1: off), got {top_p!r}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise ValueError(f"top_k must be a non-negative integer (0: off), got {top_k!r}")
    if eos_token_ids is None:
        return []
    eos = [eos_token_ids] if isinstance(eos_token_ids, int) else [int(t) for t in eos_token_ids]
    bad = [t for t in eos if not 0 <= t < adapter.vocab_size]
    if bad:
        raise ValueError(
            f"eos_token_ids holds {bad[0]}, outside the model's vocabulary "
            f"[0, {adapter.vocab_size})"
        )
    return eos


def _check_options(
    min_p: float,
    repetition_penalty: float,
    stop_strings: Sequence[str],
    tokenizer: PreTrainedTokenizerBase | None,
) -> None:
    if not 0 <= min_p <= 1:
        raise ValueError(f"min_p must be in [0, 1] (0: off), got {min_p!r}")
    if not repetition_penalty > 0:  # also refuses NaN
        raise ValueError(f"repetition_penalty must be > 0 (1: off), got {repetition_penalty!r}")
    if isinstance(stop_strings, str):
        raise ValueError(f"stop_strings must be a list of strings, got the string {stop_strings!r}")
    if stop_strings and tokenizer is None:
        raise ValueError("stop_strings need the tokenizer: pass tokenizer=")
    if any(not isinstance(s, str) or not s for s in stop_strings):
        raise ValueError(f"stop_strings must be non-empty strings, got {list(stop_strings)!r}")


def _processors(
    temperature: float, top_k: int, top_p: float, min_p: float, repetition_penalty: float
) -> list[LogitsProcessor]:
    """transformers' logits processors in ``generate``'s order: the repetition penalty, then
    (only when sampling) the warpers."""
    processors: list[LogitsProcessor] = []
    if repetition_penalty != 1.0:
        processors.append(RepetitionPenaltyLogitsProcessor(float(repetition_penalty)))
    if temperature == 0:
        return processors
    if temperature != 1.0:
        processors.append(TemperatureLogitsWarper(temperature))
    if top_k > 0:
        processors.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        processors.append(TopPLogitsWarper(top_p))
    if min_p > 0:
        processors.append(MinPLogitsWarper(float(min_p)))
    return processors


def _sample_on_last_stage(
    adapter: ModelAdapter,
    logits: torch.Tensor | None,
    temperature: float,
    processors: list[LogitsProcessor],
    sequence: torch.Tensor,
    generator: torch.Generator,
    group: int,
    logps_dtype: torch.dtype,
) -> tuple[bool, torch.Tensor, torch.Tensor]:
    """Whether the step's logits are finite, the next tokens ``[B]`` and their log-probs.

    ``sequence`` ``[B, L]``: what the processors read (the prompt's tokens and each branch's
    so far). In one process (or sharded) ``logits`` are this rank's. On pipeline stages the
    last stage has them: it samples with its generator (the same draws as one process), and
    every stage receives the tokens, log-probs and finiteness (the others' generators stay
    unused).
    """
    finite = tokens = logps = None
    if logits is not None:
        logits = logits[:, -1].to(logps_dtype)
        finite = known_bool(torch.isfinite(logits).all(), fake=True)
        tokens = torch.zeros(group, dtype=torch.long, device=logits.device)
        logps = torch.zeros(group, dtype=logps_dtype, device=logits.device)
        if finite:
            tokens, logps = _sample(logits, temperature, processors, sequence, generator)
    if adapter.stage is None:
        return finite, tokens, logps
    link = adapter.stage.link
    device = adapter.device
    flag = link.from_last(
        None if finite is None else torch.tensor([int(finite)], device=device),
        like=torch.empty(1, dtype=torch.long, device=device),
    )
    tokens = link.from_last(tokens, like=torch.empty(group, dtype=torch.long, device=device))
    logps = link.from_last(logps, like=torch.empty(group, dtype=logps_dtype, device=device))
    return known_bool(flag[0], fake=True), tokens, logps


def _sample(
    logits: torch.Tensor,
    temperature: float,
    processors: list[LogitsProcessor],
    sequence: torch.Tensor,
    generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Next tokens ``[B]`` and their behaviour log-probs ``[B]`` from logits ``[B, vocab]``."""
    scores = logits
    for processor in processors:
        scores = processor(sequence, scores)
    if temperature == 0:
        next_tokens = scores.argmax(-1)
        log_probs = torch.log_softmax(logits, -1)
    else:
        log_probs = torch.log_softmax(logits / temperature, -1)
        probs = torch.softmax(scores, -1)
        next_tokens = torch.multinomial(probs, 1, generator=generator)[:, 0]
    return next_tokens, log_probs.gather(-1, next_tokens[:, None])[:, 0]
