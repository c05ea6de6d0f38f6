"""LoRA through ``models.add_lora``: the modules the targets name get adapters, no others.

peft (0.19 to at least 0.21, on transformers v5) rewrites ``gate_proj``/``up_proj``/
``down_proj`` targets of MoE models onto the routed experts' fused parameters
(huggingface/peft#3711): plain ``get_peft_model`` adapts 26 of the 32 modules named here on
tiny glm_moe_dsa and deepseek_v32, 14 of 22 on qwen3_next. ``add_lora`` and ``load_lora``
keep the targets as written.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from longstraw_core.adapters import registry
from longstraw_core.config import LoraSection
from longstraw_core.models import build as models
from longstraw_core.models.tiny import tiny_model
from longstraw_core.plan import ModelSpec, Workload
from longstraw_core.plan.core import MemoryParts

MODEL_TYPES = sorted(set(registry.default_lora_targets()) & set(registry.tiny_configs()))


def _named_linear_modules(model: nn.Module, targets: list[str]) -> set[str]:
    return {
        name
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in targets
    }


def _adapted(peft_model: nn.Module) -> set[str]:
    """Names (in the base model) of everything that holds a LoRA A matrix."""
    return {
        name.removeprefix("base_model.model.").rsplit(".lora_A", 1)[0]
        for name, _ in peft_model.named_parameters()
        if ".lora_A" in name
    }


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_lora_adapts_exactly_the_named_linear_modules(model_type: str) -> None:
    model = tiny_model(model_type)
    wanted = _named_linear_modules(model, registry.default_lora_targets()[model_type])
    peft_model = models.add_lora(model, LoraSection(enabled=True, r=4, alpha=8))
    assert _adapted(peft_model) == wanted
    trainable = {n for n, p in peft_model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in name for name in trainable)


@pytest.mark.parametrize("model_type", ["glm_moe_dsa", "qwen3_next", "qwen3"])
def test_saved_adapters_load_back_onto_the_same_modules(model_type: str, tmp_path: Path) -> None:
    torch.manual_seed(0)
    lora = LoraSection(enabled=True, r=4, alpha=8)
    trained = models.add_lora(tiny_model(model_type), lora)
    with torch.no_grad():
        for name, parameter in trained.named_parameters():
            if ".lora_" in name:
                parameter.normal_()
    trained.save_pretrained(tmp_path)
    loaded = models.load_lora(tiny_model(model_type), tmp_path)
    saved = {k: v for k, v in trained.state_dict().items() if ".lora_" in k}
    restored = {k: v for k, v in loaded.state_dict().items() if ".lora_" in k}
    assert saved.keys() == restored.keys()
    for key, value in saved.items():
        assert torch.equal(restored[key], value), key


@pytest.mark.parametrize("model_type", ["glm_moe_dsa", "qwen3_next", "qwen3_5_text"])
def test_planner_counts_the_adapters_peft_trains(model_type: str) -> None:
    model = tiny_model(model_type)
    spec = ModelSpec.from_model(model, model_type)
    targets = tuple(registry.default_lora_targets()[model_type])
    work = Workload(
        prompt_tokens=64, group=2, response_tokens=8, chunk_size=32, lora_rank=4,
        lora_targets=targets,
    )  # fmt: skip
    peft_model = models.add_lora(model, LoraSection(enabled=True, r=4, alpha=8))
    trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    assert MemoryParts(spec, work).lora_params() == trainable
