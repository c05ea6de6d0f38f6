"""A model family that exists only in the tests: ``THROWAWAY``, registered by ``register()``
(or by loading this module as a pytest plugin: ``-p throwaway_family``), so a test can check
that the cross-cutting tests pick up a family nobody typed into them."""

from __future__ import annotations

from longstraw_core.adapters import registry
from longstraw_core.adapters.family import ModelFamily
from longstraw_core.adapters.probe import GPU_CHECK, TEST_CAPABILITIES, FamilyProbe, GpuShapes
from longstraw_core.kinds.attention import AttentionKV

MODEL_TYPE = "throwaway_decoder"
# It leaves QLoRA out: a declared capability, not a name check in the QLoRA tests.
CAPABILITIES = (TEST_CAPABILITIES - {"qlora"}) | {GPU_CHECK}

THROWAWAY = ModelFamily(
    name="throwaway",
    model_types=(MODEL_TYPE,),
    layer_kinds=(AttentionKV.kind,),
    lora_targets={MODEL_TYPE: ["q_proj", "v_proj", "down_proj"]},
    tiny_configs={MODEL_TYPE: {"num_hidden_layers": 2}},
    probe=FamilyProbe(
        capabilities=frozenset(CAPABILITIES),
        gpu=GpuShapes(recipe=("recipes/grpo_qwen36.py", "configs/qwen36/tiny_grpo_cpu.yaml")),
    ),
)


class ThrowawayAdapter:
    """Stands in for an adapter class: the registry reads only its ``family``."""

    family = THROWAWAY


def register() -> None:
    registry.register_adapter(ThrowawayAdapter)


def unregister() -> None:
    registry.unregister_adapter(ThrowawayAdapter)


def pytest_configure(config: object) -> None:
    """As a plugin: registered before any test module is collected."""
    register()
