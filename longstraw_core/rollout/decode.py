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
temperature, top-k, top-p (nucleus) and min-p warpers; a token is drawn as
``torch.multinomial(probs, 1)`` draws it (its fast path: ``argmax(probs / q)``, ``q ~ Exp(1)``),
with the step's ``q`` drawn for the whole group at once from a ``torch.Generator`` seeded by
``seed``: the same seed gives the same responses, the ones ``generate`` gives, and on pipeline
stages, where the group is sampled in micro-groups, the same as one process. ``temperature=0``
decodes greedily: the argmax after the repetition penalty, as ``generate(do_sample=False)``.

On pipeline stages the group's micro-groups go around the ring of stages
(``_decode_on_stages``, ``pipeline.schedule.ring_program``): every stage decodes one while
the next decodes another; the last stage samples and sends each micro-group's tokens to the
first; one collective every ``stop_check_every`` decode steps decides whether every branch
has ended.

Host synchronisations: the decode loop reads nothing back to the host per token. Every
``stop_check_every`` steps (``k``, config ``rollout.stop_check_every``, default
``STOP_CHECK_EVERY``) one stop check reads whether every branch has ended and whether any
logits were non-finite (one ``.tolist()``; on FSDP ranks also ``everywhere_each``'s
collective, on stages the ring's one collective). Branches that ended meanwhile go on
decoding padding that is discarded, and a token's draw depends on its position only
(``NoiseBlocks``), so the responses, log-probs and lengths are the same for every ``k``;
only ``stats["steps"]`` counts up to ``k - 1`` padding steps more. Non-finite logits are
raised at the next check, naming the step they appeared at. Per rollout a few reads more:
the pad id, the lengths and ends at the end, and on stages the group sent to every stage.
Agents (``turns``) read each step's tokens (the environment needs them): one read a step.

Behaviour log-probs (``out.logps``) are ``log_softmax(logits / temperature)`` at the sampled
token, before any processor, as TRL computes the policy's log-probs; they equal
``adapter.score(state, response, temperature=temperature)``, which is how ``grpo_step``
scores at ``GRPOConfig.temperature`` (the run config's one ``rollout.temperature``), so the
on-policy importance ratio is 1. The processors choose which token is drawn, not how the
policy scores it. Greedy decoding reports the log-probs of the unscaled logits (temperature
1); it cannot be trained on (``GRPOConfig`` refuses temperature 0, as TRL cannot divide by it).

A response ends at an end-of-sequence token or at the token that completes one of the
``stop_strings`` (transformers' ``StopStringCriteria``: the decoded response contains the
string, also when it starts or ends inside a token, reading special tokens' text too); both
are kept in the response, as TRL keeps the token vLLM or ``generate`` stopped at, and such a
response is not truncated.
Unlike ``generate``, a stop string is looked for in the response only, never across the
prompt's end (vLLM's rule). Finished branches stay in the batch (their later tokens are
masked) until every branch has finished or ``max_new_tokens`` is reached.

Agents (``turns``, a ``TurnHandler``: ``longstraw_core.tools``): when a branch's turn ends (an
EOS or a stop string), the handler is given the branch's tokens so far and answers, when it is
ready, with tokens to append (the environment's turn, the next turn's header) or none (the
branch ends). The group then decodes in ragged steps (``rollout_turns``): a waiting branch
sits steps out while the others go on, and its answer is prefilled after the turn's end token
(one step on one process, one token a ring step on stages). Appended tokens are marked 0 in
``out.loss_masks`` (TRL's ``tool_mask``: replay scores them, as inputs later tokens read, but
they never enter the loss) and count against ``max_new_tokens``; what would overflow is cut.
A branch draws its token at response position ``k`` from its row of the ``k``-th draw
(``sampled_group.NoiseBlocks``), so when answers come changes nothing that is sampled.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase
from transformers.generation.stopping_criteria import StopStringCriteria

from longstraw_core.adapters.base import ModelAdapter
from longstraw_core.pipeline.runner import run_program
from longstraw_core.pipeline.schedule import Compute, Key, Message, Ring, micro_groups, ring_steps
from longstraw_core.pipeline.transport import MessageSpec, Payload, StageLink
from longstraw_core.process.progress import counter
from longstraw_core.rollout.agent_turns import decode_with_turns, decode_with_turns_on_stages
from longstraw_core.rollout.sampled_group import SampledGroup, TurnHandler
from longstraw_core.rollout.sampling import check_arguments, check_options, processors
from longstraw_core.state.prefix import PrefixState
from longstraw_core.tensors.fake import is_fake, known_bool, known_list

# Decode steps between two stop checks (the only host synchronisations of the decode loop):
# at most k - 1 steps decoded after every branch has ended, against one host read per k
# tokens (a GPU's queue drained once per k steps rather than every token).
STOP_CHECK_EVERY = 8


@dataclass
class RolloutOutput:
    """The sampled group.

    ``responses``: 1-D LongTensors, each ending at its first EOS or completed stop string
    (kept) or at ``max_new_tokens``. ``logps``: per-token behaviour log-probs (float32, or
    float64 for a float64 model), one tensor per response. ``truncated``: whether each
    response hit ``max_new_tokens`` without an EOS or a stop string. ``stats``: timing and
    throughput (see ``rollout``). ``loss_masks``: per response, 1 for the policy's own tokens
    and 0 for tokens a ``TurnHandler`` appended (TRL's ``tool_mask``; all ones without one),
    for ``grpo_step(..., loss_masks=)`` and ``GenerationBatch.add(loss_masks=)``.
    """

    responses: list[torch.Tensor]
    logps: list[torch.Tensor]
    truncated: list[bool]
    stats: dict[str, float | int] = field(default_factory=dict)
    loss_masks: list[torch.Tensor] = field(default_factory=list)


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
    turns: TurnHandler | None = None,
    stop_check_every: int = STOP_CHECK_EVERY,
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
        progress: a count of decode steps (``progress.counter``: ``None``, a live bar on a
            terminal and, inside a run, plain lines in its log; ``False``: none).
        gather_parameters: on a sharded (FSDP) model, gather each layer once for the whole
            rollout and keep it (``ModelAdapter.parameters_gathered``: the unsharded model's
            memory while decoding) instead of once per decode step (config
            ``distributed.rollout_gather``). No effect unsharded.
        turns: an agent's environment (``TurnHandler``): branches whose turn ends are handed
            to it, and go on with the tokens it appends while the others decode (see the
            module docstring). On pipeline stages it runs on the last stage, which samples.
        stop_check_every: decode steps between two stop checks (whether every branch has
            ended, whether logits were non-finite), the loop's only host reads: the results
            are the same for every value; larger values read less often and may decode up to
            ``stop_check_every - 1`` steps of padding at the end (config
            ``rollout.stop_check_every``).

    Returns:
        ``RolloutOutput``; ``stats`` holds ``decode_seconds``, ``steps`` (batched decode
        steps run), ``generated_tokens`` (sum of response lengths), ``tokens_per_second``
        (generated tokens over decode seconds), ``branch_cache_bytes`` (the branches' own
        state) and ``prefix_state_bytes``.
    """
    adapter.check_state(state)
    eos = check_arguments(
        adapter, num_generations, max_new_tokens, temperature, top_p, top_k, eos_token_ids
    )
    check_options(min_p, repetition_penalty, stop_strings, tokenizer)
    if (
        isinstance(stop_check_every, bool)
        or not isinstance(stop_check_every, int)
        or (stop_check_every < 1)
    ):
        raise ValueError(
            f"stop_check_every must be an int >= 1 (config rollout.stop_check_every), got "
            f"{stop_check_every!r}"
        )
    adapter._check_positions(state.prompt_length, max_new_tokens)
    generator = torch.Generator(device=adapter.device)
    generator.manual_seed(seed if seed is not None else int(torch.randint(2**62, ()).item()))
    group = SampledGroup(
        state,
        num_generations,
        max_new_tokens,
        temperature,
        processors(temperature, top_k, top_p, min_p, repetition_penalty),
        StopStringCriteria(tokenizer, list(stop_strings)) if stop_strings else None,
        torch.tensor(eos, dtype=torch.long, device=adapter.device),
        generator,
        torch.promote_types(adapter.dtype, torch.float32),
        repetition_penalty != 1.0,
        turns,
    )
    bar = counter(max_new_tokens, "rollout", "step", progress)  # decode steps
    started = time.perf_counter()
    gathered = adapter.parameters_gathered() if gather_parameters else nullcontext()
    with torch.no_grad(), bar, gathered:
        if adapter.stage is not None:
            on_stages = _decode_on_stages if turns is None else decode_with_turns_on_stages
            steps, cache_bytes = on_stages(adapter, state, group, bar, stop_check_every)
            _share_group(adapter.stage.link, group, min(steps, max_new_tokens))
            if known_bool(group.nonfinite, fake=False):
                group.raise_if_nonfinite()
        elif turns is not None:
            steps, cache_bytes = decode_with_turns(adapter, state, group, bar, stop_check_every)
        else:
            steps, cache_bytes = _decode(adapter, state, group, bar, stop_check_every)
    seconds = time.perf_counter() - started

    lengths_list = known_list(group.lengths, fake=steps)
    finished_list = known_list(group.finished, fake=False)
    responses = [group.tokens[i, :n].clone() for i, n in enumerate(lengths_list)]
    generated = sum(lengths_list)
    return RolloutOutput(
        responses=responses,
        logps=[group.logps[i, :n].clone() for i, n in enumerate(lengths_list)],
        loss_masks=[group.policy[i, :n].long() for i, n in enumerate(lengths_list)],
        truncated=[not done for done in finished_list],
        stats={
            "decode_seconds": seconds,
            "steps": steps,
            "generated_tokens": generated,
            "tokens_per_second": generated / seconds if seconds > 0 else float("inf"),
            "branch_cache_bytes": cache_bytes,
            "prefix_state_bytes": state.nbytes(),
        },
    )


def _decode(
    adapter: ModelAdapter, state: PrefixState, group: SampledGroup, bar: tqdm, every: int
) -> tuple[int, int]:
    """One process (or FSDP ranks in step): every branch decoded in one batch per step, the
    stop checked every ``every`` steps and after the last (module docstring). Returns the
    steps run and the branch cache's bytes."""
    last = group.tokens.shape[1] - 1
    cache = adapter.new_branch_cache(state, group.size, last + 1)
    inputs = state.last_token.expand(group.size)[:, None]
    steps = 0
    for step in range(last + 1):
        logits = adapter.decode(state, cache, inputs)[:, -1]
        tokens = group.sample(range(group.size), step, logits)
        steps += 1
        bar.update(1)
        if (step + 1) % every == 0 or step == last:
            # On a sharded model every rank checks at the same steps and joins one collective
            # there: every rank raises, or stops, together.
            finite, done = adapter.everywhere_each(*_local_check(group))
            if not finite:
                group.raise_if_nonfinite()
            if done:
                break
        inputs = tokens[:, None]
    return steps, cache.nbytes()


def _local_check(group: SampledGroup) -> tuple[bool, bool]:
    """Whether this process's logits were all finite, and whether every branch has ended:
    one host read (a dry run's fake logits are finite and its fake tokens end nothing)."""
    flags = torch.stack([group.nonfinite_at < 0, group.finished.all()])
    if is_fake(flags):
        return True, False
    finite, done = flags.tolist()
    return bool(finite), bool(done)


def _decode_on_stages(
    adapter: ModelAdapter, state: PrefixState, group: SampledGroup, bar: tqdm, every: int
) -> tuple[int, int]:
    """Pipeline stages: the group's micro-groups go around the ring of stages
    (``schedule.ring_program``): stage ``s`` decodes micro-group ``j`` while stage ``s - 1``
    decodes ``j + 1``; the last stage samples and sends the tokens to the first; one
    collective every ``every`` steps says whether every branch has ended, or some logits
    were non-finite (of every replica, when FSDP shards the stages over the replicas: their
    passes gather together). The last
    stage then sends the whole group to every stage. Returns the steps run and this stage's
    branch caches' bytes."""
    link = adapter.stage.link
    rows = micro_groups(group.size, link.stages)
    ring = Ring(link.stages, len(rows), group.tokens.shape[1], check_every=every)
    caches = [adapter.new_branch_cache(state, len(r), ring.max_steps) for r in rows]
    last = link.is_last

    def compute(step: Compute, received: dict[Key, Payload]) -> Payload | None:
        j, t = step.microbatch
        if link.is_first:
            ids = state.last_token.expand(len(rows[j])) if t == 0 else received[("T", j, t - 1)][0]
            output = adapter.ring_decode(state, caches[j], ids[:, None], None)
        else:
            output = adapter.ring_decode(state, caches[j], None, received[("H", j, t)])
        if j == len(rows) - 1:
            bar.update(1)
        if not last:
            return output
        logits = output[:, -1]
        return (group.sample(rows[j], t, logits),)

    def spec(message: Message) -> MessageSpec:
        kind, j, t = message.key
        if kind == "T":
            return (((len(rows[j]),), torch.long),)
        return adapter.decode_spec(state, len(rows[j]), t)

    def collective(name: Key) -> None:
        _, t = name
        flags = torch.zeros(2, dtype=torch.long, device=adapter.device)
        if last:
            flags[0] = (~group.finished).any()
            flags[1] = group.nonfinite
        going, nonfinite = link.signal_any(flags, every_replica=adapter.parallel is not None)
        if going == 0 or nonfinite:  # non-finite: raised once the group is shared
            ring.stop_at(t)

    run_program(link, ring_steps(ring, link.stage), compute, spec, collective)
    return ring.planned_steps, sum(cache.nbytes() for cache in caches)


def _share_group(link: StageLink, group: SampledGroup, steps: int) -> None:
    """The last stage's sampled group on every stage of the pipeline (one broadcast of the
    tokens, which are the policy's, lengths, ends and the first non-finite step, one of the
    log-probs)."""
    packed = torch.cat(
        [group.tokens[:, :steps], group.policy[:, :steps].long(), group.lengths[:, None],
         group.finished[:, None].long(), group.nonfinite_at.expand(group.size)[:, None]],
        dim=1,
    )  # fmt: skip
    packed = link.from_last(packed if link.is_last else None, like=packed)
    logps = link.from_last(group.logps[:, :steps] if link.is_last else None,
                           like=group.logps[:, :steps])  # fmt: skip
    if link.is_last:
        return
    group.tokens[:, :steps] = packed[:, :steps]
    group.policy[:, :steps] = packed[:, steps : 2 * steps].bool()
    group.lengths.copy_(packed[:, 2 * steps])
    group.finished.copy_(packed[:, 2 * steps + 1].bool())
    group.nonfinite_at = packed[0, 2 * steps + 2].clone()
    group.nonfinite.copy_(group.nonfinite_at >= 0)
    group.logps[:, :steps] = logps
