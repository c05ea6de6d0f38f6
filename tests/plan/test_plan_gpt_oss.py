"""The planner on gpt-oss-20b and gpt-oss-120b (the ``gpt_oss`` family's presets).

What the planner must get right of them: the experts' fused 3-D weights in the parameter
count (the published 21B and 117B), the sliding layers' state fixed at ``W - 1`` positions
while the full layers' grows with the prompt, and plans that fit at the longest context (the
tiny model's plan against a measured step: ``test_plan.py``'s gpt_oss cases).
"""

from __future__ import annotations

import pytest
import torch

from longstraw_core.plan import ModelSpec, Workload, compute_plan, spec_for_preset
from longstraw_core.plan.activations import Activations

LONGEST = 131072  # gpt-oss' max_position_embeddings


@pytest.fixture(scope="module")
def specs() -> dict[str, ModelSpec]:
    return {name: spec_for_preset(name) for name in ("gpt-oss-20b", "gpt-oss-120b")}


def _work(prompt: int, **changes: object) -> Workload:
    settings: dict = {
        "gradient": "exact",
        "device": "cuda",
        "param_dtype": torch.bfloat16,
        "compute_dtype": torch.bfloat16,
    } | changes
    return Workload(
        prompt_tokens=prompt, group=8, response_tokens=2048, chunk_size=8192, **settings
    )


def _line(plan, name: str) -> int:
    return next((line.device for line in plan.lines if line.name == name), 0)


def test_parameters_count_every_expert(specs) -> None:
    small, large = specs["gpt-oss-20b"], specs["gpt-oss-120b"]
    assert 20.8e9 < small.params < 21.0e9 and 116.7e9 < large.params < 116.9e9
    assert (len(small.layers), len(large.layers)) == (24, 36)
    experts = {layer.mlp_dims["experts"] for layer in small.layers}
    assert experts == {32} and {layer.mlp_dims["experts"] for layer in large.layers} == {128}
    # one layer: attention (with biases and 64 sinks), router, and E experts' gate_up/down
    # with their biases, two norms
    h, e = 2880, 32
    attention = h * 4096 + 4096 + 2 * (h * 512 + 512) + 4096 * h + h + 64
    experts_params = e * (h * 2 * h + 2 * h + h * h + h) + e * h + e
    assert small.layers[0].params == attention + experts_params + 2 * h


def test_sliding_state_is_constant_and_full_state_grows(specs) -> None:
    spec = specs["gpt-oss-20b"]
    kinds = [layer.record for layer in spec.layers]
    assert kinds == ["sliding_attention", "full_attention"] * 12
    short, long = compute_plan(spec, _work(8192)), compute_plan(spec, _work(LONGEST))
    sliding = _line(long, "prefix state: sliding_attention")
    assert sliding == _line(short, "prefix state: sliding_attention") == 12 * 2 * 127 * 8 * 64 * 2
    full = _line(long, "prefix state: full_attention")
    assert full == 12 * 2 * (LONGEST - 1) * 8 * 64 * 2  # K and V, bf16, every stored position
    assert _line(short, "prefix state: full_attention") == 12 * 2 * 8191 * 8 * 64 * 2


def test_sinks_take_the_same_kernels(specs) -> None:
    """The fused backends fold a sink in after their kernels (``attention.fused``), so a
    layer with sinks plans flash-attn's scratch on CUDA, as one without would."""
    from longstraw_core.kinds.attention import AttentionPlan

    spec = specs["gpt-oss-20b"]
    act = Activations(spec, _work(LONGEST))
    assert AttentionPlan.path(act, 64, 64) == "flash"
    assert "sink" not in spec.layers[1].dims


def test_plans_at_the_longest_context(specs) -> None:
    """131072 tokens, LoRA on the attention projections, FSDP over 8 GPUs of 96 GiB."""
    from longstraw_core.plan import plan_memory
    from longstraw_core.plan.sources import PRESET_LORA_TARGETS, Scenario, scenario_workload

    for name, spec in specs.items():
        scenario = Scenario(name, LONGEST, 8, "96GiB", 32, PRESET_LORA_TARGETS[name])
        plan = plan_memory(spec, scenario_workload(scenario, 8, "exact"))
        assert plan.fits, (name, plan.advice)
        assert _line(plan, "dS (exact)") == 2 * _line(plan, "prefix state: full_attention") + 2 * (
            _line(plan, "prefix state: sliding_attention")
        )
