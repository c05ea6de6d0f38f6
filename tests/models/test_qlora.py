"""QLoRA: an NF4 base (bitsandbytes ``Linear4bit``) under peft LoRA adapters.

The reference is the same model with every NF4 weight dequantized to float32 and put in a
plain ``nn.Linear``, under plain peft LoRA holding the same adapter values, run through
transformers' own forward (``reference.py``). LongStraw's passes over the 4-bit model must
give its log-probs and its LoRA gradients, detached and exact, for every adapter family;
the reference policy (adapters off) must be the dequantized base's.

Everything runs in float32 (bitsandbytes' 4-bit kernels compute in 16/32-bit floats), so
the tolerances are float32 round-off between two orderings of the same sums.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from recipe_runs import assert_resumed_like_straight, run_recipe, weights
from reference import (
    assert_grads_close,
    detached_reference_logps,
    full_sequence_logps,
    group_reference,
    step_grads,
)
from safetensors.torch import load_file
from torch import nn

import longstraw_core as ls
from longstraw_core.adapters.matrix import probe_types
from longstraw_core.adapters.probe import QLORA
from longstraw_core.config import (
    ConfigError,
    LoraSection,
    ModelSection,
    load_config,
    lora_targets,
)
from longstraw_core.models import build as models
from longstraw_core.models.tiny import tiny_model
from longstraw_core.plan import ModelSpec, Workload, compute_plan
from longstraw_core.plan.core import MemoryParts
from longstraw_core.tensors import quantization

MODEL_TYPES = probe_types(QLORA)
VOCAB = 200
LENGTHS = [5, 3, 7]
REWARDS = [1.0, -0.5, 0.1]  # none at the mean: every branch replays
# GLM: a DSA top-k below the positions the last queries see, so the indexer selects.
OVERRIDES = {"glm_moe_dsa": {"index_topk": 12}}
LOGP_ATOL = 1e-5  # float32 log-probs (observed <= 3.4e-6, Qwen3.6)
# Relative to the model's largest gradient entry (``assert_grads_close``). Measured against
# each parameter's own largest entry, which is stricter: <= 2.8e-6 (qwen3, GLM); Qwen3.5 up
# to 3.8e-5 on an AMD EPYC host (2.3e-6 on another): its Gated DeltaNet runs in float32 as
# transformers' chunked kernel on one side and our prefill's own chunking on the other, so
# its float32 round-off depends on the CPU's matmul kernels.
GRAD_RTOL = {"qwen3_5_text": 1e-4}


def _ids(length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(seed))


def _base(model_type: str, quantized: bool) -> nn.Module:
    """The tiny model with its NF4 base, or that base dequantized into plain linears."""
    model = models.build_model(
        ModelSection(
            tiny=model_type,
            tiny_overrides=OVERRIDES.get(model_type, {}),
            quantization="nf4",
        ),
        seed=3,
    )
    return model if quantized else quantization.dequantize_(model)


def _pair(model_type: str) -> tuple[nn.Module, nn.Module]:
    """(QLoRA model, its dequantized reference), the same adapters, B drawn off zero."""
    lora = LoraSection(enabled=True, r=4, alpha=8)
    policy = models.add_lora(_base(model_type, quantized=True), lora)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, parameter in policy.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0.0, 0.1, generator=generator)
    reference = models.add_lora(_base(model_type, quantized=False), lora)
    adapters = {k: v for k, v in policy.state_dict().items() if ".lora_" in k}
    missing = reference.load_state_dict(adapters, strict=False)
    assert not missing.unexpected_keys
    return policy, reference


@pytest.fixture(scope="module", params=MODEL_TYPES)
def pair(request: pytest.FixtureRequest) -> tuple[str, nn.Module, nn.Module]:
    return (request.param, *_pair(request.param))


def test_the_decoder_linears_are_4bit_and_nothing_else(pair) -> None:
    """Every ``nn.Linear`` of the decoder layers but DSA's ``weights_proj``; never the head,
    embeddings, norms or router; only the adapters train."""
    model_type, policy, reference = pair
    plain = _base(model_type, quantized=False)
    expected = {
        name
        for name, module in plain.named_modules()
        if type(module) is nn.Linear and ".layers." in name and "weights_proj" not in name
    }
    quantized = {
        name.removeprefix("base_model.model.").removesuffix(".base_layer")
        for name, module in policy.named_modules()
        if quantization.is_quantized(module)
    }
    assert expected and quantized == expected
    kept = ("lm_head", "embed_tokens", "norm", "gate", "weights_proj")
    assert not any(
        quantization.is_quantized(module)
        for name, module in policy.named_modules()
        if name.endswith(kept)
    )
    assert all(not p.requires_grad for n, p in policy.named_parameters() if ".lora_" not in n)
    assert not any(quantization.is_quantized(m) for m in reference.modules())


def _assert_logps_match(
    adapter: ls.ModelAdapter, reference: nn.Module, prompt: torch.Tensor, response: torch.Tensor
) -> torch.Tensor:
    """The adapter's no-grad log-probs of ``response`` equal transformers' full-sequence ones
    of ``reference`` (the dequantized model) within ``LOGP_ATOL``; returns the adapter's."""
    with torch.no_grad():
        ours = adapter.score(adapter.prefill(prompt, chunk_size=10), response)
        theirs = full_sequence_logps(reference, prompt, response)
    assert (ours - theirs).abs().max() <= LOGP_ATOL
    return ours


def test_logprobs_equal_the_dequantized_model(pair) -> None:
    """The adapters' passes over ``Linear4bit`` give transformers' log-probs of the
    dequantized model, with adapters on and off (off: the reference policy)."""
    _, policy, reference = pair
    adapter = ls.adapt(policy)
    prompt, response = _ids(33, 1), _ids(7, 2)
    ours = _assert_logps_match(adapter, reference, prompt, response)
    with torch.no_grad():
        base = ls.lora_reference(adapter)
        ours_off = base.score(base.prefill(prompt, chunk_size=10), response)
        with reference.disable_adapter():
            theirs_off = full_sequence_logps(reference, prompt, response)
        assert (ours_off - theirs_off).abs().max() <= LOGP_ATOL
    assert (ours - ours_off).abs().max() > 1e-3  # the adapters change the policy


@pytest.mark.parametrize("gradient", ["detached", "exact"])
def test_lora_gradients_equal_the_dequantized_models(pair, gradient: str) -> None:
    model_type, policy, reference = pair
    adapter = ls.adapt(policy)
    prompt, responses = _ids(30, 3), [_ids(n, 40 + n) for n in LENGTHS]
    config = ls.GRPOConfig(gradient=gradient, beta=0.04)
    ref_adapter = ls.lora_reference(adapter)
    metrics, grads = step_grads(
        policy, adapter, prompt, responses, REWARDS, config, chunk_size=7,
        ref_adapter=ref_adapter,
    )  # fmt: skip
    with torch.no_grad(), reference.disable_adapter():
        ref_logps = [full_sequence_logps(reference, prompt, r) for r in responses]
    logps_fn = full_sequence_logps if gradient == "exact" else detached_reference_logps
    loss, expected = group_reference(
        reference, logps_fn, prompt, responses, REWARDS, config, ref=ref_logps
    )
    assert metrics.loss == pytest.approx(loss.item(), rel=1e-4, abs=1e-6)
    assert grads.keys() == expected.keys() and all(".lora_" in name for name in grads)
    assert sum(g.abs().sum() for g in expected.values()) > 0
    assert_grads_close(grads, expected, rtol=GRAD_RTOL.get(model_type, 2e-5))


def test_absorbed_kv_b_proj_without_an_adapter_reads_its_dequantized_weight() -> None:
    """GLM's MLA absorbs ``kv_b_proj``'s weight; a bare 4-bit one gives its dequantized
    weight (``effective_weight``), here with adapters on other linears only."""
    lora = LoraSection(enabled=True, r=4, alpha=8, target_modules=["q_b_proj", "o_proj"])
    policy = models.add_lora(_base("glm_moe_dsa", quantized=True), lora)
    assert quantization.is_quantized(policy.get_submodule(
        "base_model.model.model.layers.0.self_attn.kv_b_proj"
    ))  # fmt: skip
    reference = models.add_lora(_base("glm_moe_dsa", quantized=False), lora)
    _assert_logps_match(ls.adapt(policy), reference, _ids(33, 1), _ids(7, 2))


def test_activation_checkpointing_recomputes_through_the_4bit_layers() -> None:
    """Exact mode with each layer recomputed in backward: the same gradients."""
    policy, _ = _pair("qwen3_5_text")
    adapter = ls.adapt(policy)
    prompt, responses = _ids(30, 3), [_ids(n, 40 + n) for n in LENGTHS]
    config = ls.GRPOConfig(gradient="exact")
    _, plain = step_grads(policy, adapter, prompt, responses, REWARDS, config, chunk_size=7)
    adapter.activation_checkpointing = True
    _, recomputed = step_grads(policy, adapter, prompt, responses, REWARDS, config, chunk_size=7)
    assert_grads_close(recomputed, plain, rtol=1e-6)


def test_exact_mode_differs_from_detached_through_the_4bit_base() -> None:
    """Exact mode's extra gradient flows back through the prompt's 4-bit layers."""
    policy, _ = _pair("qwen3")
    adapter = ls.adapt(policy)
    prompt, responses = _ids(30, 3), [_ids(n, 40 + n) for n in LENGTHS]
    _, exact = step_grads(
        policy, adapter, prompt, responses, REWARDS, ls.GRPOConfig(gradient="exact")
    )
    _, detached = step_grads(policy, adapter, prompt, responses, REWARDS, ls.GRPOConfig())
    name = next(n for n in exact if "layers.0.self_attn.k_proj.lora_B" in n)
    assert (exact[name] - detached[name]).abs().max() > 0.1 * exact[name].abs().max()


def test_a_checkpoint_directory_loads_into_the_same_4bit_model(tmp_path: Path) -> None:
    """``model.path`` is quantized by the same code as ``model.tiny``: the same codes."""
    section = ModelSection(tiny="glm_moe_dsa", quantization="nf4")
    tiny_model("glm_moe_dsa", seed=3).save_pretrained(tmp_path)
    from_tiny = models.build_model(section, seed=3)
    from_path = models.build_model(ModelSection(path=str(tmp_path), quantization="nf4"), seed=0)
    tiny_modules = dict(from_tiny.named_modules())
    count = 0
    for name, module in from_path.named_modules():
        assert quantization.is_quantized(module) == quantization.is_quantized(tiny_modules[name])
        if quantization.is_quantized(module):
            count += 1
            assert torch.equal(module.weight.data, tiny_modules[name].weight.data), name
            dequantized = quantization.dequantized_weight(module)
            assert torch.equal(dequantized, quantization.dequantized_weight(tiny_modules[name]))
    assert count > 0


def test_the_planner_counts_4bit_weights() -> None:
    """NF4 with double quantization: 0.5 byte + an 8-bit absmax per 64 weights + a float32
    per 256 blocks; the plan's parameters are the model's bytes (adapters in float32)."""
    bnb = quantization.require_bitsandbytes()
    big = nn.Linear(1024, 1024, bias=False)
    wrapped = nn.Module()
    wrapped.layers = nn.ModuleList([nn.Module()])
    wrapped.layers[0].proj = big
    quantization.quantize_nf4(wrapped, torch.float32)
    assert isinstance(wrapped.layers[0].proj, bnb.nn.Linear4bit)
    # and one float32 offset per tensor (the nested absmax are stored minus their mean)
    assert quantization.quantized_bytes(wrapped) == quantization.nf4_bytes(1024 * 1024) + 4
    for model_type in MODEL_TYPES:
        plain = _base(model_type, quantized=False)
        spec = ModelSpec.from_model(plain, model_type)
        work = Workload(
            prompt_tokens=64, group=2, response_tokens=8, chunk_size=32, lora_rank=4,
            lora_targets=tuple(lora_targets(LoraSection(enabled=True), model_type)),
            quantization="nf4",
        )  # fmt: skip
        policy = models.add_lora(_base(model_type, quantized=True), LoraSection(enabled=True, r=4))
        held = sum(
            p.numel() * p.element_size()
            for p in policy.parameters()
            if not isinstance(p, bnb.nn.Params4bit)
        )
        held += quantization.quantized_bytes(policy)
        planned = MemoryParts(spec, work).parameters()
        # Tiny tensors round their nested blocks up (one float32 scale for < 256 blocks).
        assert abs(planned - held) <= 0.01 * held, (model_type, planned, held)
        full = MemoryParts(spec, dataclasses.replace(work, quantization=None))
        assert planned < full.parameters()
        # A spec read off the 4-bit model counts the weights, not the packed bytes.
        assert ModelSpec.from_model(_base(model_type, quantized=True), model_type) == spec
        plan = compute_plan(spec, work)
        assert "NF4" in plan.line("parameters").note
        assert plan.line("NF4 dequantized weight (transient)").device > 0


def _config(*overrides: str):
    return load_config(
        Path(__file__).resolve().parents[2] / "configs/qwen36/tiny_qlora_grpo_cpu.yaml",
        list(overrides),
    )


@pytest.mark.parametrize(
    ("overrides", "key", "words"),
    [
        (["model.quantization=int3"], "model.quantization", "allowed: nf4"),
        (["lora.enabled=false"], "model.quantization", "lora.enabled=true"),
        (["model.dtype=float64"], "model.dtype", "float32, bfloat16, float16"),
        (["distributed.fsdp=true"], "model.quantization", "distributed.fsdp=false"),
    ],
)
def test_bad_qlora_configs_name_the_key(overrides: list[str], key: str, words: str) -> None:
    with pytest.raises(ConfigError) as caught:
        _config(*overrides)
    assert caught.value.key == key and words in str(caught.value)


def test_missing_bitsandbytes_names_the_install_command(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # import bitsandbytes fails
    with pytest.raises(ConfigError) as caught:
        _config()
    assert caught.value.key == "model.quantization" and "pip install" in str(caught.value)
    assert _config("model.quantization=null").model.quantization is None


def test_qlora_recipe_saves_and_resumes_adapters_only(tmp_path: Path) -> None:
    """A tiny QLoRA run (exact mode, KL to the 4-bit base with adapters off) checkpoints the
    adapters only; resuming step 1 gives step 2's adapters bit for bit."""
    config = "configs/qwen36/tiny_qlora_grpo_cpu.yaml"
    common = ["train.save_every=1", "grpo.gradient=exact", "grpo.beta=0.04",
              "tracking.wandb=false"]  # fmt: skip
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run_recipe("grpo_qwen36.py", config, straight, "train.steps=2", *common)
    files = {p.name for p in (straight / "step-000002" / "model").iterdir()}
    assert files - {"README.md"} == {"adapter_config.json", "adapter_model.safetensors"}
    saved = load_file(straight / "step-000002" / "model" / "adapter_model.safetensors")
    assert saved and all(".lora_" in k and v.dtype == torch.float32 for k, v in saved.items())
    adapter_config = json.loads((straight / "step-000002/model/adapter_config.json").read_text())
    assert adapter_config["r"] == 8
    shutil.copytree(straight / "step-000001", resumed / "step-000001")
    (resumed / "latest").write_text("step-000001\n")
    run_recipe("grpo_qwen36.py", config, resumed, "train.steps=2", "train.resume_from=latest",
               *common)  # fmt: skip
    assert_resumed_like_straight(
        weights(straight / "step-000002"),
        weights(resumed / "step-000002"),
        weights(straight / "step-000001"),
    )
