"""LongStraw on a real pretrained model: SmolLM2-135M-Instruct (llama, 30 layers, hidden 576,
vocabulary 49152, tied embeddings; its own tokenizer, ChatML template and EOS ``<|im_end|>``),
in float32, against the transformers model's own forward and ``generate`` and TRL 1.16's own
``GRPOTrainer._compute_loss``.

The prompts are real text: Python standard-library docstrings (``inspect.getdoc`` of a fixed
list of objects) and a question, rendered through the model's chat template as TRL renders a
conversational prompt (``tokenizer.encode_prompt``). The model is loaded once for the file
(``tests/support/real_model.py``: skipped, with the reason, where it cannot be had).

Tolerances are float32's, from the model's dimensions: a decoder layer's longest float32 sums
are ``K`` terms long (the MLP's intermediate width, or the attention's context), each rounding
by ``float32_sum_rtol(K)`` relative, and a value at the top has passed through the ``L``
layers' round-off (forward, and for gradients backward too). transformers' own float32 full
graph is no closer: it differs from TRL's gradients as much as LongStraw does (measured on a
1.5K-token prompt: LongStraw against transformers' full graph 3.7e-6 of the largest entry,
each of them against TRL 3.4e-5), and even the float64 model is no exact reference, since
the model's RMSNorm computes in float32 whatever its dtype.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import copy
import dataclasses
import functools
import heapq
import inspect
import itertools
import json
import operator
import textwrap

import pytest
import torch
from real_model import smollm2_dir
from reference import (
    assert_grads_close,
    detached_reference_logps,
    float32_sum_rtol,
    full_sequence_logps,
    group_reference,
    step_grads,
    with_lora,
)
from transformers import AutoModelForCausalLM
from trl_trainer import grpo_args, grpo_trainer

import longstraw_core as ls
from longstraw_core.adapters import registry
from longstraw_core.data.tokenizer import encode_prompt, load_tokenizer
from longstraw_core.grpo.losses import group_advantages

# The prompts' text: the docstrings of these, in this order, as many as a prompt's length
# needs (they differ a little between Python versions: the lengths are checked, not fixed).
SOURCES = (
    textwrap.wrap, textwrap.dedent, functools.reduce, functools.lru_cache, itertools.groupby,
    bisect.bisect_left, contextlib.contextmanager, contextlib.ExitStack, dataclasses.dataclass,
    dataclasses.field, operator.itemgetter, json.loads, json.dumps, collections.Counter, heapq,
    collections.deque, functools.partial, json,
)  # fmt: skip
EOS = 2  # <|im_end|>
LAYERS = 30
INTERMEDIATE = 1536  # the MLP's width: the longest sum of a layer over a short context
# A log-prob is a logit less its row's log-sum-exp: its error is the logits', the last hidden
# state's relative error times their size (max |logp| bounds how far a target sits below the
# largest). Over ~2.3K tokens, worst case (layers_rtol) that is 1.6e-3, adding the layers'
# round-off as a random walk (sqrt(30) in place of 30) 3e-4: the 1e-4 is tighter
# than both and holds with a margin of 7 (measured 1.3e-5 for score, 8.6e-6 for rollout).
LOGP_ATOL = 1e-4


def real_prompt(tokenizer, min_tokens: int, question: str) -> torch.Tensor:
    """A chat prompt of at least ``min_tokens`` tokens: the docstrings of ``SOURCES`` in
    order, as few as reach the length, then ``question``; one user message through the
    model's chat template (its system message first, the assistant's turn opened)."""
    parts = []
    for source in SOURCES:
        parts += [f"{source.__name__}:", inspect.getdoc(source)]
        content = "\n\n".join([*parts, question])
        ids = encode_prompt(tokenizer, [{"role": "user", "content": content}])
        if len(ids) >= min_tokens:
            return torch.tensor(ids)
    raise AssertionError(f"the docstrings of SOURCES make fewer than {min_tokens} tokens")


def layers_rtol(length: int) -> float:
    """float32's relative round-off after ``LAYERS`` layers whose longest sums are ``length``
    (or the MLP's width) long: each layer's ``float32_sum_rtol``, added up over the layers
    as the worst case does (each layer's error carried on by the next, with the same sign)."""
    return LAYERS * float32_sum_rtol(max(length, INTERMEDIATE))


@pytest.fixture(scope="module")
def smollm2():
    """The model (float32, eval mode) and its tokenizer, loaded once for the file."""
    directory = smollm2_dir()
    model = AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch.float32, local_files_only=True
    )
    return model.eval(), load_tokenizer(directory)


@pytest.fixture(scope="module")
def long_prompt(smollm2) -> torch.Tensor:
    _, tokenizer = smollm2
    question = "Which Python function is described first above? Answer with its name only."
    return real_prompt(tokenizer, 2048, question)


@pytest.fixture(scope="module")
def prefilled(smollm2, long_prompt):
    """The adapter and its state of the long prompt, in chunks that do not divide it."""
    model, _ = smollm2
    adapter = ls.adapt(model)
    return adapter, adapter.prefill(long_prompt, chunk_size=700)


def test_the_model_and_prompt_are_the_real_ones(smollm2, long_prompt):
    model, tokenizer = smollm2
    config = model.config
    assert (config.model_type, config.num_hidden_layers) == ("llama", LAYERS)
    assert (config.hidden_size, config.intermediate_size) == (576, INTERMEDIATE)
    assert (config.vocab_size, config.max_position_embeddings) == (49152, 8192)
    assert config.tie_word_embeddings and config.eos_token_id == EOS
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == EOS
    text = tokenizer.decode(long_prompt)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    assert 2048 <= len(long_prompt) <= 2800


def test_score_equals_the_models_forward(smollm2, long_prompt, prefilled):
    """``score`` of an answer after the ~2.4K-token prompt (prefilled in 4 chunks) equals the
    log-probs of transformers' forward over prompt + answer."""
    model, tokenizer = smollm2
    adapter, state = prefilled
    answer = "textwrap.wrap: it wraps a paragraph into lines of at most 70 characters."
    response = torch.tensor(tokenizer(answer, add_special_tokens=False)["input_ids"] + [EOS])
    with torch.no_grad():
        ours = adapter.score(state, response)
        expected = full_sequence_logps(model, long_prompt, response)
    error = float((ours - expected).abs().max())
    assert error <= LOGP_ATOL, f"max |d logp| {error:.3e} > {LOGP_ATOL:.1e}"
    assert float(expected.abs().max()) > 1.0  # a response the model does not simply predict


def test_greedy_rollout_equals_generate(smollm2, long_prompt, prefilled):
    """Three greedy branches from the prefilled ~2.4K-token prompt are transformers'
    ``generate(do_sample=False)`` with the model's generation config, token for token:
    they stop where it does, at ``<|im_end|>`` (kept), and their log-probs are its logits'.
    Without an EOS the branches go on past it, the same tokens first."""
    model, tokenizer = smollm2
    adapter, state = prefilled
    with torch.no_grad():
        generated = model.generate(
            long_prompt[None], attention_mask=torch.ones_like(long_prompt)[None],
            max_new_tokens=32, do_sample=False, output_logits=True, return_dict_in_generate=True,
        )  # fmt: skip
    tokens = generated.sequences[0, len(long_prompt) :]
    assert int(tokens[-1]) == EOS and len(tokens) < 32, tokenizer.decode(tokens)

    out = ls.rollout(
        adapter, state, num_generations=3, max_new_tokens=32, temperature=0, eos_token_ids=[EOS],
        stop_check_every=1,  # checked every step: it stops where generate does
    )  # fmt: skip
    assert all(torch.equal(response, tokens) for response in out.responses)
    assert out.truncated == [False] * 3 and out.stats["steps"] == len(tokens)
    logits = torch.cat(generated.logits)  # generate's own, before its processors
    expected = torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, None])[:, 0]
    for logps in out.logps:  # measured 8.6e-6
        assert float((logps - expected).abs().max()) <= LOGP_ATOL

    free = ls.rollout(
        adapter, state, num_generations=2, max_new_tokens=len(tokens) + 4, temperature=0
    )
    assert free.truncated == [True] * 2
    for response in free.responses:
        assert torch.equal(response[: len(tokens)], tokens) and len(response) == len(tokens) + 4


# --- gradients: TRL's _compute_loss, LoRA r=16 -------------------------------------------

G = 3
MAX_NEW_TOKENS = 16
REWARDS = [1.0, -0.5, 0.25]
CHUNK = 300  # prefill and sweep chunks: the ~1.1K-token prompt in 4


@dataclasses.dataclass
class LoraGroup:
    """One group on the LoRA policy and what the references make of it."""

    model: torch.nn.Module
    adapter: ls.ModelAdapter
    prompt: torch.Tensor
    state: ls.PrefixState
    responses: list[torch.Tensor]
    old_logps: list[torch.Tensor]
    args: dict
    trl_loss: float
    trl_grads: dict[str, torch.Tensor]
    detached_loss: float
    detached_grads: dict[str, torch.Tensor]


@pytest.fixture(scope="module")
def lora_group(smollm2, tmp_path_factory) -> LoraGroup:
    """A copy of the model with LoRA r=16 on every linear of its layers (B drawn off zero);
    a group sampled from it by ``ls.rollout`` (temperature 1, the real EOS); and, at the
    suite's one thread, the references' loss and gradients for that group: TRL's own
    ``_compute_loss`` (the full graph) and the detached-cache reference."""
    base, tokenizer = smollm2
    with torch.random.fork_rng():  # peft draws A from the global generator
        torch.manual_seed(0)
        model = with_lora(
            copy.deepcopy(base), registry.default_lora_targets()["llama"], r=16,
            lora_alpha=32, std=0.01, seed=1,
        )  # fmt: skip
    question = "Name one Python function described above, in one word."
    prompt = real_prompt(tokenizer, 1024, question)
    adapter = ls.adapt(model)
    state = adapter.prefill(prompt, chunk_size=CHUNK)
    out = ls.rollout(
        adapter, state, num_generations=G, max_new_tokens=MAX_NEW_TOKENS, eos_token_ids=[EOS],
        seed=3,
    )  # fmt: skip
    # Behaviour log-probs off the policy (a drift per branch, noise per token), so that the
    # importance ratios are not 1, some clip, and the loss is not the on-policy one (0 here,
    # where the responses' lengths are equal and the advantages sum to 0).
    noise = torch.Generator().manual_seed(4)
    old = [
        logps + drift + 0.3 * torch.randn(logps.shape, generator=noise)
        for logps, drift in zip(out.logps, [0.1, -0.2, 0.15], strict=True)
    ]
    args = grpo_args("dapo", max_completion_length=MAX_NEW_TOKENS)
    config = ls.GRPOConfig(**args, num_generations=G)

    # Before TRL's trainer patches the model (its fused LM head, gradient checkpointing).
    detached_loss, detached_grads = group_reference(
        model, detached_reference_logps, prompt, out.responses, REWARDS, config, old=old
    )

    def no_reward(completions, **_):  # never called: the advantages are given below
        return [0.0] * len(completions)

    trainer = grpo_trainer(
        model, tokenizer, tmp_path_factory.mktemp("trl"), no_reward, [tokenizer.decode(prompt)],
        num_generations=G, per_device_train_batch_size=G, **args,
    )  # fmt: skip
    width = max(len(r) for r in out.responses)

    def padded(rows):
        return torch.stack([torch.cat([r, r.new_full((width - len(r),), EOS)]) for r in rows])

    completion_mask = torch.tensor([[int(t < len(r)) for t in range(width)] for r in out.responses])
    inputs = {
        "prompt_ids": prompt.expand(G, -1),
        "prompt_mask": torch.ones(G, len(prompt), dtype=torch.long),
        "completion_ids": padded(out.responses),
        "old_per_token_logps": padded(old),
        "completion_mask": completion_mask,
        "advantages": group_advantages(torch.tensor(REWARDS)).float(),
        "num_items_in_batch": completion_mask.sum(),
    }
    trl_loss = trainer._compute_loss(trainer.model, inputs)
    trl_loss.backward()
    trl_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    return LoraGroup(
        model, adapter, prompt, state, out.responses, old, args, trl_loss.item(), trl_grads,
        detached_loss.item(), detached_grads,
    )  # fmt: skip


@pytest.mark.threads
@pytest.mark.parametrize("gradient", ["exact", "detached"])
def test_lora_gradients_equal_trls(lora_group, gradient):
    """``grpo_step`` from the rollout's state, at 1 and 2 threads (the references ran at 1).

    Exact mode's gradient is TRL's ``_compute_loss`` backpropagated through the whole
    sequence. Detached mode leaves out the paths through the prompt's keys and values by
    design: its gradient is the detached-cache reference's (the transformers cache of the
    prompt under ``no_grad``, TRL's loss: ``reference.group_reference``), and on the real
    model it is far from TRL's; its loss is TRL's all the same."""
    group = lora_group
    assert 1024 <= len(group.prompt) <= 1400  # the length the tolerance below is for
    config = ls.GRPOConfig(**group.args, num_generations=G, gradient=gradient)
    metrics, grads = step_grads(
        group.model, group.adapter, group.prompt, group.responses, REWARDS, config,
        old_logps=group.old_logps, state=group.state, chunk_size=CHUNK,
    )  # fmt: skip
    assert grads and all(".lora_" in name for name in grads)
    assert metrics.branch_stats["clip_ratio/region_mean"] > 0  # some ratios clipped
    # layers_rtol of the ~1.1K-token context: 1.4e-4 of the largest gradient entry (measured
    # at 1 and 2 threads: 1.5e-5 against TRL, 1.4e-5 against the detached reference; 3.4e-5
    # against TRL on a 1.5K-token prompt). The losses: 1.6e-7 and 2.1e-5 relative (the
    # reference's log-probs read a prompt cache transformers computes on its own).
    rtol = layers_rtol(len(group.prompt) + MAX_NEW_TOKENS)
    assert metrics.loss == pytest.approx(group.trl_loss, rel=rtol)
    if gradient == "exact":
        assert_grads_close(grads, group.trl_grads, rtol=rtol)
        return
    assert metrics.loss == pytest.approx(group.detached_loss, rel=rtol)
    assert_grads_close(grads, group.detached_grads, rtol=rtol)
    largest = max(float(g.abs().max()) for g in group.trl_grads.values())
    missed = max(float((grads[n] - g).abs().max()) for n, g in group.trl_grads.items())
    assert missed > 100 * rtol * largest  # measured: the size of the largest entry itself
