"""Model families: each adapter module's ``FAMILY`` is the one place its knowledge lives, and
the tables other modules read come from the registry."""

from __future__ import annotations

import pytest
from transformers import AutoConfig

from longstraw_core.adapters import registry
from longstraw_core.adapters.base import ModelAdapter
from longstraw_core.adapters.family import ModelFamily, Preset
from longstraw_core.kinds import registry as kinds
from model_adapters import dense, glm52, gpt_oss, qwen36


def test_each_shipped_family_is_declared_by_its_adapter_module() -> None:
    families = registry.families()
    assert [f.name for f in families] == ["dense", "qwen36", "glm52", "gpt_oss"]
    for module, adapter in [
        (dense, dense.DenseAdapter),
        (qwen36, qwen36.Qwen36Adapter),
        (glm52, glm52.GlmMoeDsaAdapter),
        (gpt_oss, gpt_oss.GptOssAdapter),
    ]:
        assert adapter.family is module.FAMILY
        assert adapter.model_types == module.FAMILY.model_types
    served = [t for f in families for t in f.model_types]
    assert sorted(served) == registry.supported_model_types()
    assert all(registry.family_of(t) is f for f in families for t in f.model_types)
    assert registry.family_of("gpt2") is None


def test_the_tables_hold_every_familys_declarations() -> None:
    families = registry.families()
    assert registry.default_lora_targets() == {
        t: v for f in families for t, v in f.lora_targets.items()
    }
    assert registry.tiny_configs() == {t: v for f in families for t, v in f.tiny_configs.items()}
    assert list(registry.presets()) == ["Qwen3.6-27B", "GLM-5.2", "gpt-oss-20b", "gpt-oss-120b"]
    assert kinds.offload_fields() == {
        "full_attention": "attention",
        "linear_attention": "recurrent",
        "mla_dsa": "latent",
        "sliding_attention": "attention",
    }
    assert all(isinstance(p, Preset) for p in registry.presets().values())


@pytest.mark.parametrize("model_type", sorted(registry.tiny_configs()))
def test_every_tiny_config_builds_its_config_class(model_type: str) -> None:
    config = AutoConfig.for_model(model_type, **registry.tiny_configs()[model_type])
    assert config.model_type == model_type


def test_a_family_cannot_claim_what_another_declares() -> None:
    def adapter_of(family: ModelFamily) -> type[ModelAdapter]:
        return type("Clash", (), {"family": family, "model_types": family.model_types})

    before = (registry.version(), dict(registry._ADAPTERS), list(registry._FAMILIES))
    taken_type = ModelFamily("x", ("qwen3",), {}, {}, {})
    taken_preset = ModelFamily(
        "y", ("new_type",), {}, {}, {}, {"GLM-5.2": Preset("new_type", {}, "")}
    )
    with pytest.raises(ValueError, match="declares its own placement"):
        ModelFamily("z", ("new_type",), {"mla_dsa": "attention"}, {}, {})
    for family in (taken_type, taken_preset):
        with pytest.raises(ValueError):
            registry.register_adapter(adapter_of(family))
    assert (registry.version(), dict(registry._ADAPTERS), list(registry._FAMILIES)) == before


def test_a_family_declares_only_its_own_model_types() -> None:
    with pytest.raises(ValueError, match="does not serve"):
        ModelFamily("x", ("a",), {}, {"b": []}, {})
    with pytest.raises(ValueError, match="declares its own placement"):
        ModelFamily("x", ("a",), {"k": "elsewhere"}, {}, {})
