"""The planner's formulas for sliding-window layers (``kinds.window.WindowPlan``).

A tiny Qwen3 of four layers, the second full attention and the others sliding windows of
width 6, read on ``meta`` (``ModelSpec.from_config``) as the planner reads a model, at two
prompt lengths: the window layers' state, ``dS`` and working sets stay the same, and their
FLOPs per token are bounded by ``W`` keys a query, while the full-attention layer's grow.
The state and exact mode's chunk-start checkpoints are then compared to the byte with
those of a real prefill of the same model.
"""

from __future__ import annotations

import pytest
import torch

import longstraw_core as ls
from longstraw_core.kinds import registry
from longstraw_core.models.tiny import tiny_model
from longstraw_core.plan import ModelSpec, Workload, compute_plan
from longstraw_core.plan.activations import Activations
from longstraw_core.plan.flops import layer_flops, pair_flops, token_flops
from longstraw_core.state.exact import new_state_grad

WINDOW = 6
LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]
SLIDING = {
    "use_sliding_window": True,
    "sliding_window": WINDOW,
    "num_hidden_layers": 4,
    "layer_types": LAYER_TYPES,
}
SHORT, LONG = 65, 4097  # prompt tokens: 64 and 4096 stored positions


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return tiny_model("qwen3", seed=2, **SLIDING)


@pytest.fixture(scope="module")
def spec(model) -> ModelSpec:
    return ModelSpec.from_config(model.config, "qwen3-sliding", torch.float32)


def _work(prompt: int, chunk: int = 16, **changes: object) -> Workload:
    settings: dict = {"gradient": "exact", "device": "cpu"} | changes
    return Workload(prompt_tokens=prompt, group=2, response_tokens=24, chunk_size=chunk, **settings)


def _line(plan, name: str) -> int:
    return next((line.device for line in plan.lines if line.name == name), 0)


def test_the_window_layers_are_read_as_their_kind(spec) -> None:
    assert [layer.record for layer in spec.layers] == [
        "sliding_attention", "full_attention", "sliding_attention", "sliding_attention"
    ]  # fmt: skip
    window = spec.layers[0]
    assert window.dims["window"] == WINDOW
    assert window.state_per_token == window.grad_per_token == 0
    assert window.state_fixed == 2 * 2 * (WINDOW - 1) * 16 * 4  # K and V, [2, W - 1, 16] fp32
    assert not window.kind.plan.full_attention and spec.layers[1].kind.plan.full_attention


def test_window_state_and_working_sets_do_not_grow_with_the_prompt(spec) -> None:
    short, long = compute_plan(spec, _work(SHORT)), compute_plan(spec, _work(LONG))
    assert _line(short, "prefix state: sliding_attention") == _line(
        long, "prefix state: sliding_attention"
    )
    assert _line(short, "prefix state: full_attention") < _line(
        long, "prefix state: full_attention"
    )
    window = spec.layers[0]
    for kernels in ({"device": "cpu"}, {"device": "cuda", "compute_dtype": torch.bfloat16}):
        act = Activations(spec, _work(LONG, **kernels))
        # prefill without autograd, a replayed branch's graph and backward, the sweep's
        phases = (act.forward_working, act.layer, act.backward_working, act.kernel_forward_scratch)
        for phase in phases:
            assert phase(window, 16, WINDOW - 1) == phase(window, 16, 100_000), phase
            assert phase(window, 16, 0) <= phase(window, 16, WINDOW - 1), phase
        assert act.decode_scratch(window, 2, 100) == act.decode_scratch(window, 2, 100_000)
    plan = window.kind.plan
    assert plan.branch_bytes(window, 24) == 24 * window.state_fixed / (WINDOW - 1)  # own K/V
    assert plan.branch_read_bytes(window, 24) == window.state_fixed  # at most W - 1 of them
    assert plan.decode_read_bytes(window, 10**6, 2, 4) == window.state_fixed


def test_window_flops_per_token_are_bounded_by_the_window(spec) -> None:
    window, full = spec.layers[0], spec.layers[1]
    per_pair = registry.kind("full_attention").plan.pair_flops(window)
    for tokens, prefix in [(16, 0), (3, 2), (16, 64), (16, 4096), (1, 10**6)]:
        mixing = layer_flops(spec, window, tokens, prefix).mixing
        seen = [min(prefix + i + 1, WINDOW) for i in range(tokens)]  # keys query i sees
        assert mixing == per_pair * sum(seen) <= per_pair * WINDOW * tokens
    assert (
        layer_flops(spec, full, 16, 4096).mixing > 100 * layer_flops(spec, window, 16, 4096).mixing
    )
    # Stages balance it as a cost per token (W keys a query), not per query-key pair.
    assert pair_flops(window) == 0 and pair_flops(full) == per_pair
    assert token_flops(spec, window) == token_flops(spec, full) + per_pair * WINDOW


@pytest.mark.parametrize("chunk", [4, 16])
def test_planned_state_and_checkpoints_are_the_prefills_to_the_byte(model, spec, chunk) -> None:
    """Chunks shorter than the window (the first checkpoints hold fewer rows than ``W - 1``)
    and longer; the measured bytes of a real prefill at both prompt lengths."""
    adapter = ls.adapt(model)
    planned_window = []
    for prompt in (SHORT, 201):
        ids = torch.randint(0, 512, (prompt,), generator=torch.Generator().manual_seed(prompt))
        with torch.no_grad():
            state = adapter.prefill(ids, chunk_size=chunk, checkpoints="device")
        plan = compute_plan(spec, _work(prompt, chunk))
        summary = state.summary()
        for kind in ("sliding_attention", "full_attention"):
            assert _line(plan, f"prefix state: {kind}") == summary[kind]["bytes"], kind
        windows = [layer for layer in state.layers if layer.kind == "sliding_attention"]
        assert _line(plan, "recurrent checkpoints") == sum(w.checkpoint_nbytes() for w in windows)
        grad = new_state_grad(state)
        assert _line(plan, "dS (exact)") == grad.nbytes()
        planned_window.append(_line(plan, "prefix state: sliding_attention"))
    assert planned_window[0] == planned_window[1]
