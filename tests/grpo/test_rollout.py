"""Rollout against transformers' own ``generate`` and the model's own forward.

References are the transformers models themselves: greedy ``generate`` (``do_sample=False``)
on the full prompt for the tokens, the full-sequence forward for the log-probs at a
temperature, and ``adapter.score`` (itself tested against the full-sequence forward) for the
on-policy log-probs of sampled responses.
"""

from __future__ import annotations

import functools

import pytest
import torch
from dispatch_probes import RecordIndexScores, RecordLargestOutput, assert_no_ties_at_k
from reference import assert_grads_close, full_sequence_logps, step_grads

import longstraw_core as ls
from longstraw_core.data.tokenizer import load_tokenizer
from longstraw_core.models.tiny import tiny_model
from model_adapters import glm52

VOCAB = 512
PROMPT_LENGTH = 45  # 44 stored positions; prefilled in chunks of 16 (which do not divide it)
SPARSE_TOPK = 6  # far fewer than the ~50 positions the decoded queries see
CASES = {
    "qwen3": ("qwen3", {}),
    "llama": ("llama", {}),
    "qwen3_5_text": ("qwen3_5_text", {}),
    "glm_dense": ("glm_moe_dsa", {"index_topk": 4096}),
    "glm_sparse": ("glm_moe_dsa", {"index_topk": SPARSE_TOPK}),
}
# transformers computes the gated delta rule in float32 with other kernels for a whole span
# (score) than for single tokens (decoding): the log-probs agree to ~1e-5, as score does with
# the full-sequence forward (tests/families/test_qwen36_adapter.py).
LOGP_ATOL = {"qwen3_5_text": 2e-5}

_MODELS: dict[str, torch.nn.Module] = {}


def _model(case: str) -> torch.nn.Module:
    if case not in _MODELS:
        model_type, overrides = CASES[case]
        _MODELS[case] = tiny_model(model_type, **overrides)
    return _MODELS[case]


def _ids(length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(seed))


def _generate(model: torch.nn.Module, prompt: torch.Tensor, max_new_tokens: int, eos: int | None):
    """transformers' greedy decoding on the full prompt: the generated tokens, EOS included."""
    with torch.no_grad():
        output = model.generate(
            prompt[None],
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=0 if eos is None else eos,
        )
    return output[0, len(prompt) :]


def _state_tensors(state: ls.PrefixState) -> list[torch.Tensor]:
    tensors = [state.prompt_ids]
    for record in state.layers:
        tensors += [v for v in vars(record).values() if isinstance(v, torch.Tensor)]
    return tensors


def _first_new_token(tokens: torch.Tensor, start: int) -> int:
    """The first position at or after ``start`` whose token did not occur before it."""
    for position in range(start, len(tokens)):
        if int(tokens[position]) not in tokens[:position].tolist():
            return position
    raise AssertionError("greedy output repeats itself: pick another prompt")


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_rollout_equals_transformers_generate(case: str) -> None:
    model = _model(case)
    adapter = ls.adapt(model)
    prompt = _ids(PROMPT_LENGTH, 8)  # a prompt the tiny models do not answer with a loop
    recorder = RecordIndexScores(SPARSE_TOPK)
    with recorder:
        free = _generate(model, prompt, 12, eos=None)
    if case == "glm_sparse":
        assert_no_ties_at_k(recorder)
    stop = _first_new_token(free, 6)
    eos = int(free[stop])
    stopped = _generate(model, prompt, 12, eos=eos)
    assert torch.equal(stopped, free[: stop + 1])  # transformers stops at its EOS

    state = adapter.prefill(prompt, chunk_size=16)
    before = [t.clone() for t in _state_tensors(state)]
    out = ls.rollout(adapter, state, num_generations=3, max_new_tokens=12, temperature=0)
    assert all(torch.equal(response, free) for response in out.responses)
    assert out.truncated == [True] * 3
    out = ls.rollout(
        adapter, state, num_generations=3, max_new_tokens=12, temperature=0, eos_token_ids=[eos],
        stop_check_every=1,  # checked every step: it stops where generate does
    )  # fmt: skip
    assert all(torch.equal(response, stopped) for response in out.responses)
    assert out.truncated == [False] * 3
    assert out.stats["steps"] == stop + 1
    for response, logps in zip(out.responses, out.logps, strict=True):
        with torch.no_grad():
            expected = full_sequence_logps(model, prompt, response)
        assert (logps - expected).abs().max() <= LOGP_ATOL.get(case, 1e-5)
    after = _state_tensors(state)
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert state.length == PROMPT_LENGTH - 1


@pytest.mark.parametrize("case", ["qwen3", "qwen3_5_text", "glm_sparse"])
def test_sampled_logps_equal_score_and_the_seed_reproduces(case: str) -> None:
    model = _model(case)
    adapter = ls.adapt(model)
    prompt = _ids(PROMPT_LENGTH, 2)
    state = adapter.prefill(prompt, chunk_size=16)
    eos = list(range(40))  # ~8% of the vocabulary: some branches end early, some do not
    options = {"num_generations": 6, "max_new_tokens": 14, "eos_token_ids": eos}
    out = ls.rollout(adapter, state, seed=5, **options)

    assert any(out.truncated) and not all(out.truncated)
    for response, logps, truncated in zip(out.responses, out.logps, out.truncated, strict=True):
        assert response.dtype == torch.long and len(response) == len(logps)
        ends = torch.isin(response, torch.tensor(eos))
        assert not ends[:-1].any()  # trimmed after the first EOS, which is kept
        assert bool(ends[-1]) != truncated
        assert len(response) == 14 or not truncated
        with torch.no_grad():
            scored = adapter.score(state, response)
        assert (logps - scored).abs().max() <= LOGP_ATOL.get(case, 1e-5)

    again = ls.rollout(adapter, state, seed=5, **options)
    other = ls.rollout(adapter, state, seed=6, **options)
    for a, b in zip(out.responses + out.logps, again.responses + again.logps, strict=True):
        assert torch.equal(a, b)
    assert any(not torch.equal(a, b) for a, b in zip(out.responses, other.responses, strict=True))
    assert len({tuple(r.tolist()) for r in out.responses}) > 1  # branches differ


def test_logps_at_a_temperature_and_top_k_top_p_limits() -> None:
    model = _model("qwen3")
    adapter = ls.adapt(model)
    prompt = _ids(PROMPT_LENGTH, 3)
    state = adapter.prefill(prompt, chunk_size=16)
    out = ls.rollout(adapter, state, num_generations=4, max_new_tokens=10, temperature=0.7)
    for response, logps in zip(out.responses, out.logps, strict=True):
        with torch.no_grad():
            logits = model(input_ids=torch.cat([prompt, response])[None]).logits[0]
        scaled = torch.log_softmax(logits[PROMPT_LENGTH - 1 : -1] / 0.7, -1)
        assert (logps - scaled.gather(-1, response[:, None])[:, 0]).abs().max() <= 1e-5

    greedy = _generate(model, prompt, 10, eos=None)
    # top_k=1 and a tiny top_p keep only the most likely token: sampling is greedy.
    for limits in ({"top_k": 1}, {"top_p": 1e-6}, {"top_k": 3, "top_p": 1e-6}):
        sampled = ls.rollout(adapter, state, num_generations=2, max_new_tokens=10, **limits)
        assert all(torch.equal(response, greedy) for response in sampled.responses)
    top2 = ls.rollout(adapter, state, num_generations=4, max_new_tokens=10, top_k=2, seed=1)
    for response in top2.responses:
        with torch.no_grad():
            logits = model(input_ids=torch.cat([prompt, response])[None]).logits[0]
        allowed = logits[PROMPT_LENGTH - 1 : -1].topk(2, dim=-1).indices
        assert (allowed == response[:, None]).any(-1).all()


@pytest.mark.parametrize(
    ("model_type", "gradient"), [("qwen3", "detached"), ("qwen3_5_text", "exact")]
)
def test_behaviour_logps_are_the_replays_at_a_temperature(model_type: str, gradient: str) -> None:
    """Sampled at 0.7, the rollout's behaviour log-probs are ``grpo_step``'s current log-probs
    at ``GRPOConfig.temperature=0.7`` for the same weights: passed as ``old_logps`` every
    ratio is 1 (to round-off), so the loss and the gradient are the on-policy step's (old
    log-probs ``None``), and nothing clips even at ``epsilon=1e-4``. At temperature 1 the
    replay's log-probs would differ by ~10%."""
    model = tiny_model(model_type, dtype=torch.float64, seed=7)
    adapter = ls.adapt(model)
    prompt = _ids(PROMPT_LENGTH, 4)
    config = ls.GRPOConfig(
        temperature=0.7, num_generations=4, gradient=gradient, loss_type="dapo", epsilon=1e-4
    )
    state = adapter.prefill(prompt, chunk_size=16, **config.prefill_options())
    out = ls.rollout(adapter, state, 4, 8, temperature=config.temperature, seed=1)
    rewards = [1.0, 0.0, 0.5, -1.0]
    on_policy, on_grads = step_grads(model, adapter, prompt, out.responses, rewards, config,
                                     state=state, chunk_size=16)  # fmt: skip
    off_policy, off_grads = step_grads(model, adapter, prompt, out.responses, rewards, config,
                                       state=state, chunk_size=16, old_logps=out.logps)  # fmt: skip
    # transformers' gated delta rule runs in float32 (kernels differ for a token and a span)
    atol = 1e-12 if model_type == "qwen3" else LOGP_ATOL[model_type]
    for replayed, behaviour in zip(on_policy.logps, out.logps, strict=True):
        torch.testing.assert_close(replayed, behaviour, rtol=0, atol=atol)
    with torch.no_grad():
        plain = [adapter.score(state, response) for response in out.responses]
    assert max((p - b).abs().max() for p, b in zip(plain, out.logps, strict=True)) > 1e-2
    assert off_policy.branch_stats["clip_ratio/region_mean"] == 0.0
    assert off_policy.loss == pytest.approx(on_policy.loss, rel=atol, abs=atol)
    assert_grads_close(off_grads, on_grads, rtol=max(atol, 1e-10))


# --------------------------------------------------------------------------- generation options
# A qwen3 toy over exactly the built-in byte tokenizer's 260 tokens, so that stop strings can be
# read off its output and transformers' StopStringCriteria sees every token it can emit.
BYTES_PAD = 257  # <|pad|>: what generate writes after a branch has stopped
# <|im_end|>: with an EOS, generate pads every finished branch (stopped by a string too)
BYTES_EOS = 259
NEW_TOKENS = 16
# Each of these changes the sampled tokens here (checked below): none is a no-op.
OPTIONS = {"temperature": 0.8, "top_k": 40, "top_p": 0.7, "min_p": 0.15, "repetition_penalty": 1.3}


@functools.cache
def _bytes_model() -> torch.nn.Module:
    return tiny_model("qwen3", vocab_size=260)


def _bytes_prompt() -> torch.Tensor:
    return torch.randint(0, 256, (PROMPT_LENGTH,), generator=torch.Generator().manual_seed(8))


def _generate_with(model, prompt, group: int, seed: int, **options) -> torch.Tensor:
    """transformers' ``generate`` on ``group`` copies of the prompt: the new tokens, padded."""
    torch.manual_seed(seed)  # sampling draws from the global generator, ours from one seeded so
    with torch.no_grad():
        out = model.generate(
            prompt.expand(group, -1),
            max_new_tokens=NEW_TOKENS,
            do_sample=options.get("temperature", 1.0) > 0,
            eos_token_id=BYTES_EOS,
            pad_token_id=BYTES_PAD,
            **{k: v for k, v in options.items() if not (k == "temperature" and v == 0)},
        )
    return out[:, len(prompt) :]


def _padded(responses: list[torch.Tensor], length: int) -> torch.Tensor:
    return torch.stack(
        [
            torch.cat([r, torch.full((length - len(r),), BYTES_PAD, dtype=torch.long)])
            for r in responses
        ]
    )


def _ascii_stop(tokens: list[int], start: int, width: int) -> tuple[str, int]:
    """A stop string of ``width`` printable ASCII tokens first completed at position >= start,
    and the position of its last token."""
    text = "".join(chr(t) if 33 <= t <= 126 else "\ufffd" for t in tokens)
    for end in range(start, len(tokens)):
        candidate = text[end - width + 1 : end + 1]
        if "\ufffd" not in candidate and len(candidate) == width and candidate not in text[:end]:
            return candidate, end
    raise AssertionError("no printable stop string in the output: pick another prompt")


def test_greedy_repetition_penalty_and_stop_strings_equal_generate() -> None:
    """Greedy decoding with ``repetition_penalty`` (which counts the prompt's tokens) and a
    two-token stop string equals ``generate`` with the same settings; the stop string is kept."""
    model, tok, prompt = _bytes_model(), load_tokenizer(None), _bytes_prompt()
    adapter = ls.adapt(model)
    state = adapter.prefill(prompt, chunk_size=16)
    plain = _generate_with(model, prompt, 1, 0, temperature=0)[0]
    penalised = _generate_with(model, prompt, 1, 0, temperature=0, repetition_penalty=1.5)[0]
    assert not torch.equal(plain, penalised)  # the penalty changes what greedy picks
    out = ls.rollout(
        adapter,
        state,
        eos_token_ids=[BYTES_EOS],
        num_generations=2,
        max_new_tokens=NEW_TOKENS,
        temperature=0,
        repetition_penalty=1.5,
    )
    assert all(torch.equal(r, penalised) for r in out.responses)

    stop, end = _ascii_stop(plain.tolist(), 3, width=2)
    assert end + 1 < NEW_TOKENS  # it ends the response early
    expected = _generate_with(
        model, prompt, 1, 0, temperature=0, stop_strings=[stop], tokenizer=tok
    )[0]
    assert torch.equal(expected[: end + 1], plain[: end + 1])
    assert (expected[end + 1 :] == BYTES_PAD).all()  # generate stopped there too
    out = ls.rollout(
        adapter,
        state,
        eos_token_ids=[BYTES_EOS],
        num_generations=2,
        max_new_tokens=NEW_TOKENS,
        temperature=0,
        stop_strings=[stop],
        tokenizer=tok,
        stop_check_every=1,  # checked every step: it stops where generate does
    )
    assert all(torch.equal(r, plain[: end + 1]) for r in out.responses)
    assert tok.decode(out.responses[0]).endswith(stop)
    assert out.truncated == [False, False] and out.stats["steps"] == end + 1


def test_sampling_options_and_stop_strings_equal_seeded_generate() -> None:
    """temperature, top-k, top-p, min-p and the repetition penalty together, seeded alike, draw
    the tokens ``generate`` draws; a stop string ends some branches and not others."""
    model, tok, prompt = _bytes_model(), load_tokenizer(None), _bytes_prompt()
    adapter = ls.adapt(model)
    state = adapter.prefill(prompt, chunk_size=16)
    group, seed = 4, 3
    free = _generate_with(model, prompt, group, seed, **OPTIONS)
    out = ls.rollout(
        adapter,
        state,
        eos_token_ids=[BYTES_EOS],
        num_generations=group,
        max_new_tokens=NEW_TOKENS,
        seed=seed,
        **OPTIONS,
    )
    assert torch.equal(_padded(out.responses, NEW_TOKENS), free)
    assert len({tuple(r.tolist()) for r in out.responses}) == group  # branches differ
    for name in OPTIONS:  # every option takes part in the draw
        fewer = {k: v for k, v in OPTIONS.items() if k != name}
        other = ls.rollout(adapter, state, group, NEW_TOKENS, seed=seed, **fewer)
        pairs = zip(other.responses, out.responses, strict=True)
        assert any(not torch.equal(a, b) for a, b in pairs), name

    stop, end = _ascii_stop(free[0].tolist(), 2, width=1)
    expected = _generate_with(
        model, prompt, group, seed, **OPTIONS, stop_strings=[stop], tokenizer=tok
    )
    out = ls.rollout(
        adapter,
        state,
        eos_token_ids=[BYTES_EOS],
        num_generations=group,
        max_new_tokens=NEW_TOKENS,
        seed=seed,
        stop_strings=[stop],
        tokenizer=tok,
        **OPTIONS,
    )
    assert torch.equal(_padded(out.responses, NEW_TOKENS), expected)
    assert len(out.responses[0]) == end + 1 and not out.truncated[0]
    assert any(out.truncated)  # another branch never wrote the stop string
    for response, logps in zip(out.responses, out.logps, strict=True):
        with torch.no_grad():  # the behaviour log-probs are the policy's, before any processor
            logits = model(input_ids=torch.cat([prompt, response])[None]).logits[0]
        scaled = torch.log_softmax(logits[PROMPT_LENGTH - 1 : -1] / OPTIONS["temperature"], -1)
        assert (logps - scaled.gather(-1, response[:, None])[:, 0]).abs().max() <= 1e-5


@pytest.mark.parametrize("case", ["qwen3", "qwen3_5_text", "glm_sparse", "glm_dense"])
def test_the_prefix_is_never_copied(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """No op during rollout makes a tensor as large as one layer's prefix keys (or latent):
    every branch reads the prefix in place, never copied, expanded or joined with the branch.
    """
    monkeypatch.setattr(glm52.family, "_WORK_ELEMENTS", 4096)  # indexer scratch below the latent
    model = _model(case)
    adapter = ls.adapt(model)
    state = adapter.prefill(_ids(400, 4), chunk_size=128)
    smallest = min(
        (record.keys if hasattr(record, "keys") else record.latent)[..., : state.length, :].numel()
        for record in state.layers
        if record.grows_with_prompt
    )
    recorder = RecordLargestOutput(views=False)
    with recorder:
        out = ls.rollout(adapter, state, num_generations=4, max_new_tokens=8)
    assert 0 < recorder.largest < smallest
    cache = adapter.new_branch_cache(state, batch=4, capacity=8)
    assert out.stats["branch_cache_bytes"] == cache.nbytes()
    assert out.stats["prefix_state_bytes"] == state.nbytes()
    assert out.stats["generated_tokens"] == sum(len(r) for r in out.responses)


def test_rollout_feeds_grpo_step_on_policy() -> None:
    """The state and behaviour log-probs go straight into ``grpo_step``: importance ratio 1."""
    model = _model("qwen3")
    adapter = ls.adapt(model)
    prompt = _ids(PROMPT_LENGTH, 5)
    state = adapter.prefill(prompt, chunk_size=16)
    out = ls.rollout(adapter, state, num_generations=4, max_new_tokens=6, seed=2)
    rewards = [1.0, 0.0, 0.5, -1.0]
    model.zero_grad(set_to_none=True)
    metrics = ls.grpo_step(
        adapter,
        prompt,
        out.responses,
        rewards,
        state=state,
        old_logps=out.logps,
        truncated=out.truncated,
        config=ls.GRPOConfig(loss_type="grpo", epsilon=1e-4),
    )
    model.zero_grad(set_to_none=True)
    # With a tiny clipping range, any ratio off 1 by more than float noise would be clipped.
    assert metrics.branch_stats["clip_ratio/region_mean"] == 0.0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_generations": 0}, "num_generations must be a positive integer"),
        ({"max_new_tokens": 0}, "max_new_tokens must be a positive integer"),
        ({"temperature": -1.0}, "temperature must be >= 0"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_k": -1}, "top_k must be a non-negative integer"),
        ({"eos_token_ids": [3, 512]}, "eos_token_ids holds 512"),
        ({"min_p": 1.5}, r"min_p must be in \[0, 1\]"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be > 0"),
        ({"stop_strings": ["x"]}, "stop_strings need the tokenizer"),
        ({"stop_strings": "x"}, "must be a list of strings"),
        ({"max_new_tokens": 30}, r"prompt \(40 tokens\) \+ response \(30 tokens\) = 70"),
    ],
)
def test_rollout_rejects_bad_input(kwargs: dict, message: str) -> None:
    adapter = ls.adapt(tiny_model("qwen3", max_position_embeddings=64))
    state = adapter.prefill(_ids(40, 6))
    with pytest.raises(ValueError, match=message):
        ls.rollout(adapter, state, **{"max_new_tokens": 4, **kwargs})


def test_rollout_refuses_a_state_from_another_model() -> None:
    state = ls.adapt(_model("qwen3")).prefill(_ids(10, 7))
    with pytest.raises(ValueError, match="prefilled by another model"):
        ls.rollout(ls.adapt(_model("llama")), state, max_new_tokens=2)


def test_decode_checks_its_branch_cache() -> None:
    adapter = ls.adapt(_model("qwen3"))
    state, other = adapter.prefill(_ids(10, 8)), adapter.prefill(_ids(12, 9))
    cache = adapter.new_branch_cache(state, batch=2, capacity=3)
    with pytest.raises(ValueError, match="made for a prefix of 9 positions, not this state's 11"):
        adapter.decode(other, cache, torch.zeros(2, 1, dtype=torch.long))
    with pytest.raises(ValueError, match=r"input_ids must be \[2, T\]"):
        adapter.decode(state, cache, torch.zeros(3, 1, dtype=torch.long))
    response = _ids(3, 10)
    inputs = torch.cat([state.last_token, response[:-1]]).expand(2, -1)
    with torch.no_grad():  # a whole span in one call: per branch, what score computes
        logits = adapter.decode(state, cache, inputs)
        logps = torch.log_softmax(logits, -1).gather(-1, response.expand(2, -1)[..., None])
        assert (logps[..., 0] - adapter.score(state, response)).abs().max() <= 1e-5
        with pytest.raises(RuntimeError, match="holds 3 of 3 positions and cannot take 1 more"):
            adapter.decode(state, cache, torch.zeros(2, 1, dtype=torch.long))


class _ScriptedTurns:
    """A turn handler that answers the first ``turns`` ended turns of every branch with fixed
    tokens (an environment's reply and the next turn's header), as an agent's tools would."""

    def __init__(self, reply: list[int], turns: int = 1) -> None:
        self.reply, self.turns = reply, turns
        self.seen: list[dict[int, list[int]]] = []
        self.answered: dict[int, int] = {}
        self.ready: dict[int, list[int]] = {}

    def begin_turns(self, turns: dict[int, list[int]]) -> None:
        self.seen.append({row: list(tokens) for row, tokens in turns.items()})
        for row in turns:
            self.ready[row] = []
            if self.answered.get(row, 0) < self.turns:
                self.answered[row] = self.answered.get(row, 0) + 1
                self.ready[row] = self.reply

    def ended_turns(self, wait: bool) -> dict[int, list[int]]:
        ready, self.ready = self.ready, {}
        return ready


@pytest.mark.parametrize("case", ["qwen3", "qwen3_5_text", "glm_sparse"])
def test_turns_append_the_environments_tokens_and_mask_them_out(case: str) -> None:
    """A branch whose turn ends goes on with the handler's tokens, fed one a step: the
    response holds them right after the turn's end token, ``loss_masks`` is 0 exactly there,
    and every log-prob (the policy's after the reply too) equals ``score`` of the whole
    response: the fed tokens extended the branch's own state as a prefill of them would."""
    model = _model(case)
    adapter = ls.adapt(model)
    prompt = _ids(PROMPT_LENGTH, 2)
    state = adapter.prefill(prompt, chunk_size=16)
    before = [t.clone() for t in _state_tensors(state)]
    eos = list(range(40))
    reply = [300, 301, 302, 5]  # 5 is an EOS id: fed, it ends nothing
    handler = _ScriptedTurns(reply, turns=2)
    options = {"num_generations": 6, "max_new_tokens": 24, "eos_token_ids": eos}
    out = ls.rollout(adapter, state, seed=5, turns=handler, **options)

    assert handler.seen and all(
        torch.equal(a, b) for a, b in zip(before, _state_tensors(state), strict=True)
    )
    fed_any = False
    for row, (response, logps, mask) in enumerate(
        zip(out.responses, out.logps, out.loss_masks, strict=True)
    ):
        assert mask.shape == response.shape and set(mask.tolist()) <= {0, 1}
        expected = torch.ones_like(mask)
        tokens = response.tolist()
        # Walk the response: each policy turn ends at an EOS; the first two are followed by
        # the reply (cut where the budget ends), the third ends the branch.
        i, answered = 0, 0
        while i < len(tokens):
            if tokens[i] in eos and expected[i] == 1:
                if answered == 2:
                    assert i == len(tokens) - 1 and not out.truncated[row]
                    break
                answered += 1
                fed = tokens[i + 1 : i + 1 + len(reply)]
                assert fed == reply[: len(fed)]
                expected[i + 1 : i + 1 + len(fed)] = 0
                fed_any = fed_any or bool(fed)
                i += len(fed)
            i += 1
        assert torch.equal(mask, expected)
        with torch.no_grad():
            scored = adapter.score(state, response)
        assert (logps - scored).abs().max() <= LOGP_ATOL.get(case, 1e-5)
    assert fed_any
    # The handler saw each branch's tokens up to its ended turn, reply included later on.
    assert all(tokens[-1] in eos for turns in handler.seen for tokens in turns.values())
    # Without a handler: all-ones masks, and the same draws up to each branch's first end.
    plain = ls.rollout(adapter, state, seed=5, **options)
    for mask, response, first in zip(plain.loss_masks, plain.responses, out.responses, strict=True):
        assert bool(mask.all()) and len(mask) == len(response)
        assert torch.equal(first[: len(response)], response)
