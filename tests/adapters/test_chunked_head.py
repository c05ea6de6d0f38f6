"""``score``'s LM head in row chunks (``longstraw_core.adapters.lm_head.HEAD_CHUNK_ELEMENTS``).

- Equivalence: with the budget shrunk so that a branch's head runs in several checkpointed
  chunks, ``score``'s log-probs and entropy and every parameter gradient (LM head, final
  norm, a LoRA'd LM head, the layers) equal the one-chunk computation, with and without
  per-layer activation checkpointing, with the state offloaded, and on an FSDP2-sharded
  model (a world of one rank in this process).
- Memory: ``LiveTensorMemory`` shows score + backward's peak dropping with a 32K vocabulary.
"""

from __future__ import annotations

import pytest
import torch
from reference import detached_reference_logps, with_lora

import longstraw_core as ls
import longstraw_core.adapters.lm_head as lm_head
from longstraw_core.models.tiny import tiny_model
from longstraw_core.offload import OffloadPolicy
from longstraw_core.tensors.memory import LiveTensorMemory

VOCAB = 512
ONE_CHUNK = 1 << 40
SMALL = 3 * VOCAB  # three rows a chunk: a 10-token branch runs in four chunks
LORA_TARGETS = {
    "qwen3": ["q_proj", "v_proj", "down_proj", "lm_head"],
    "qwen3_5_text": ["q_proj", "in_proj_qkv", "out_proj", "lm_head"],
}


def _ids(length: int, seed: int, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(seed))


def _model(model_type: str, lora: bool = False, **overrides) -> torch.nn.Module:
    model = tiny_model(model_type, dtype=torch.float64, seed=3, **overrides)
    return with_lora(model, LORA_TARGETS[model_type], seed=1) if lora else model


def _score_and_grads(model, adapter, state, response, weights):
    """``score``'s log-probs and entropy, and the gradients of a weighted sum of the first."""
    model.zero_grad(set_to_none=True)
    logps, entropy = adapter.score(state, response, return_entropy=True)
    assert not entropy.requires_grad
    (logps * weights).sum().backward()
    grads = {
        name: p.grad.detach().clone()
        for name, p in model.named_parameters()
        if p.requires_grad and p.grad is not None
    }
    return logps.detach(), entropy, grads


def _assert_same(chunked, whole, names_required=()) -> None:
    (logps, entropy, grads), (want_logps, want_entropy, want_grads) = chunked, whole
    torch.testing.assert_close(logps, want_logps, rtol=0, atol=1e-12)
    torch.testing.assert_close(entropy, want_entropy, rtol=0, atol=1e-12)
    assert grads.keys() == want_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, want_grads[name], rtol=1e-12, atol=1e-12, msg=name)
    for required in names_required:
        assert any(required in name for name in grads), (required, sorted(grads))


def _counting_chunks(monkeypatch) -> dict[str, int]:
    """Count the head chunks run, and those backward recomputed."""
    counts = {"chunks": 0, "recomputed": 0}
    run = lm_head.head_chunk

    def counted(head, with_entropy, hidden, targets, temperature):
        counts["chunks"] += 1
        counts["recomputed"] += torch.is_grad_enabled() and not with_entropy
        return run(head, with_entropy, hidden, targets, temperature)

    monkeypatch.setattr(lm_head, "head_chunk", counted)
    return counts


@pytest.mark.parametrize("offloaded", [False, True], ids=["device", "offload"])
@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_5_text"])
def test_chunked_head_equals_one_chunk(monkeypatch, model_type, lora, checkpointing, offloaded):
    model = _model(model_type, lora)
    adapter = ls.adapt(model)
    adapter.activation_checkpointing = checkpointing
    offload = OffloadPolicy.cpu() if offloaded else None
    prompt, response = _ids(23, 0), _ids(10, 1)
    weights = torch.randn(10, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    state = adapter.prefill(prompt, chunk_size=6, offload=offload)

    monkeypatch.setattr(lm_head, "HEAD_CHUNK_ELEMENTS", ONE_CHUNK)
    whole = _score_and_grads(model, adapter, state, response, weights)
    monkeypatch.setattr(lm_head, "HEAD_CHUNK_ELEMENTS", SMALL)
    counts = _counting_chunks(monkeypatch)
    chunked = _score_and_grads(model, adapter, state, response, weights)
    assert counts == {"chunks": 8, "recomputed": 4}  # 4 chunks forward, 4 in backward

    required = ["lora_A", "lora_B"] if lora else ["lm_head.weight", "norm.weight"]
    _assert_same(chunked, whole, required)
    # And the one-chunk path is the transformers model's own (a detached-cache reference;
    # the hybrid's reference runs transformers' own chunked delta rule, hence the tolerance).
    reference = detached_reference_logps(model, prompt, response)
    torch.testing.assert_close(whole[0], reference.detach(), rtol=0, atol=1e-5)


def test_head_rows() -> None:
    assert lm_head.HEAD_CHUNK_ELEMENTS == 1 << 26
    assert lm_head.head_rows(2048, 248320) == 256  # 8 equal chunks of at most 270 rows
    assert lm_head.head_rows(10, 1 << 30) == 1  # a row at least
    assert lm_head.head_rows(100, 512) == 100  # a tiny vocabulary: one chunk


def test_no_grad_chunks_are_not_checkpointed(monkeypatch) -> None:
    model = _model("qwen3")
    adapter = ls.adapt(model)
    state = adapter.prefill(_ids(15, 0), chunk_size=8)
    response = _ids(7, 1)
    with torch.no_grad():
        whole = adapter.score(state, response, return_entropy=True)
        monkeypatch.setattr(lm_head, "HEAD_CHUNK_ELEMENTS", 2 * VOCAB)
        monkeypatch.setattr(lm_head, "checkpoint", None)  # would fail if called
        chunked = adapter.score(state, response, return_entropy=True)
    for got, want in zip(chunked, whole, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_exact_mode_grpo_step_is_unchanged(monkeypatch) -> None:
    """A whole exact-mode step (``dS`` through the chunked head's gradient) is unchanged."""
    from reference import step_grads

    prompt, responses = _ids(19, 3), [_ids(n, 4 + n) for n in (5, 8, 3)]
    config = ls.GRPOConfig(gradient="exact")
    results = []
    for budget in (ONE_CHUNK, 2 * VOCAB):
        monkeypatch.setattr(lm_head, "HEAD_CHUNK_ELEMENTS", budget)
        model = _model("qwen3_5_text")
        adapter = ls.adapt(model)
        state = adapter.prefill(prompt, chunk_size=6, checkpoints="device")
        results.append(step_grads(model, adapter, prompt, responses, [1.0, -0.5, 0.2], config,
                                  state=state, chunk_size=6))  # fmt: skip
    (metrics, grads), (want_metrics, want_grads) = results[1], results[0]
    assert metrics.loss == pytest.approx(want_metrics.loss, abs=1e-12)
    assert metrics.entropy == pytest.approx(want_metrics.entropy, abs=1e-12)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, want_grads[name], rtol=1e-12, atol=1e-12, msg=name)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_sharded_chunked_head_equals_one_chunk(world_of_one, monkeypatch, lora) -> None:
    """The chunks run inside the root's FSDP forward method; backward recomputes them with
    the root's parameters still gathered, and the gradients are the unsharded model's."""
    from longstraw_core.parallel.fsdp import shard_model

    prompt, response = _ids(23, 0), _ids(10, 1)
    weights = torch.randn(10, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    model = _model("qwen3", lora)
    adapter = ls.adapt(model)
    monkeypatch.setattr(lm_head, "HEAD_CHUNK_ELEMENTS", ONE_CHUNK)
    whole = _score_and_grads(model, adapter, adapter.prefill(prompt, chunk_size=6), response,
                             weights)  # fmt: skip

    model = _model("qwen3", lora)
    adapter = shard_model(ls.adapt(model))
    adapter.activation_checkpointing = True
    monkeypatch.setattr(lm_head, "HEAD_CHUNK_ELEMENTS", SMALL)
    counts = _counting_chunks(monkeypatch)
    state = adapter.prefill(prompt, chunk_size=6)
    logps, entropy, grads = _score_and_grads(model, adapter, state, response, weights)
    assert counts["recomputed"] == 4
    grads = {name: grad.full_tensor() for name, grad in grads.items()}
    _assert_same((logps, entropy, grads), whole)


def test_chunked_head_lowers_the_peak(monkeypatch) -> None:
    """A 32K vocabulary and a 256-token branch (score + backward, 115 MB in one chunk): the
    one-chunk head keeps the branch's float32 log-probs ``[T, vocab]`` for backward and
    builds two more such tensors in it; in chunks of 32 rows only one chunk's logits are
    alive at a time (37 MB, mostly the embeddings' and the head's gradients)."""
    vocab, tokens = 32768, 256
    model = tiny_model("qwen3", vocab_size=vocab, seed=3)
    adapter = ls.adapt(model)
    prompt, response = _ids(64, 0, vocab), _ids(tokens, 1, vocab)
    state = adapter.prefill(prompt, chunk_size=64)
    peaks, results = [], []
    for budget in (ONE_CHUNK, 32 * vocab):
        monkeypatch.setattr(lm_head, "HEAD_CHUNK_ELEMENTS", budget)
        model.zero_grad(set_to_none=True)
        with LiveTensorMemory() as memory:
            logps, entropy = adapter.score(state, response, return_entropy=True)
            logps.sum().backward()
            del logps
        peaks.append(memory.peak)
        results.append((entropy, model.lm_head.weight.grad.clone()))
        model.zero_grad(set_to_none=True)
    one, chunked = peaks
    logits = 4 * tokens * vocab  # one float32 [T, vocab]
    assert one > 3 * logits  # the saved log-probs, and two more [T, vocab] in backward
    # What is left: the embeddings' and the head's gradients ([vocab, 64] each), one chunk.
    assert one - chunked > 2 * logits and chunked < 0.4 * one, (chunked, one)
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(results[1][1], results[0][1], rtol=1e-5, atol=1e-6)
