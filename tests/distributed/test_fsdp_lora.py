"""FSDP2 over LoRA on a bfloat16 base (``shard_model``, ``FSDPRun.kept_gathered``).

peft keeps LoRA weights float32 over a bfloat16 base (``model.dtype: bfloat16``). Two CPU
ranks (gloo, torchrun under the NCCL-rules harness) run ``fsdp_lora_worker.py``: each
samples a group from its own prompt with LoRA on the recipes' default targets, for the
``bf16`` and ``fp32`` mixed-precision policies, on Qwen3.6's toy (Gated DeltaNet and full
attention layers) and GLM-5.x's (a float32 MoE router in the bfloat16 model).

- Gathering once per rollout means once: the first pass gathers every FSDP2 unit, each
  later decode pass gathers nothing (counted as the all-gathers run).
- Each decoder layer is one unit with its LoRA weights (only GLM's routers, which keep
  float32, are units of their own), and LoRA computes in one dtype in every layer: the
  policy's (bfloat16) under ``bf16``, its own (float32, as peft computes it) under ``fp32``.
- The sharded rollouts sample what one process samples from the same model: under ``fp32``
  the model as it is (what one process runs with ``model.dtype: bfloat16``), under ``bf16``
  the model with its LoRA weights cast to bfloat16 (the routers stay float32).
- A sharded exact-mode step backpropagates through those units: its LoRA gradients equal one
  process's (``bf16``: on working weights).
"""

from __future__ import annotations

import fsdp_lora_worker as worker
import pytest
import torch
from launch import SUPPORT, torchrun_ok
from reference import assert_grads_close

import longstraw_core as ls
from longstraw_core.grpo.groups import group_loss_scales
from longstraw_core.models.mixed_precision import FullPrecision, WorkingWeights

CASES = [(family, policy) for family in worker.FAMILIES for policy in worker.POLICIES]
IDS = [f"{family}-{policy}" for family, policy in CASES]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    """Every rank's results (``fsdp_lora_worker.run``) per (family, policy)."""
    out = tmp_path_factory.mktemp("fsdp-lora")
    torchrun_ok(SUPPORT / "fsdp_lora_worker.py", str(out))
    return torch.load(out / "fsdp-lora.pt")


def _layers(family: str) -> tuple[int, set[str]]:
    """The toy's number of decoder layers and their kinds."""
    config = worker.tiny_model(family).config
    return config.num_hidden_layers, set(getattr(config, "layer_types", None) or ["attention"])


@pytest.mark.multiprocess
@pytest.mark.parametrize(("family", "policy"), CASES, ids=IDS)
def test_a_lora_rollout_on_a_bf16_base_gathers_once(ranks, family, policy):
    """After the first pass, no decode step all-gathers anything."""
    layers, _ = _layers(family)
    apart = 0 if family == "qwen3_5_text" else 3  # GLM's toy: a router in layers 1..3
    for rank in ranks:
        result = rank[family, policy]
        first, *later = result["passes"]
        assert len(later) == worker.NEW_TOKENS - 1
        assert later == [0] * len(later), result["passes"]
        assert result["apart"] == apart  # the base weights are not units of their own
        assert first == 1 + layers + apart  # the root, each layer, each router
        # what FSDP2 packed is what the process group gathered
        assert result["ops"]["c10d._allgather_base_"] == first


@pytest.mark.multiprocess
@pytest.mark.parametrize(("family", "policy"), CASES, ids=IDS)
def test_lora_computes_in_one_dtype_in_every_layer(ranks, family, policy):
    """DeltaNet and attention layers alike (GLM's dense and MoE layers alike)."""
    layers, kinds = _layers(family)
    if family == "qwen3_5_text":
        assert kinds == {"linear_attention", "full_attention"}
    dtype = str(torch.bfloat16 if policy == "bf16" else torch.float32)
    for rank in ranks:
        assert rank[family, policy]["lora_dtypes"] == {i: [(dtype, dtype)] for i in range(layers)}


@pytest.mark.multiprocess
@pytest.mark.parametrize(("family", "policy"), CASES, ids=IDS)
def test_the_sharded_rollout_samples_what_one_process_samples(ranks, family, policy):
    for index, rank in enumerate(ranks):
        model, adapter = worker.build(family)
        if policy == "bf16":  # what FSDP2's policy gathers: the trained weights in bfloat16
            for parameter in model.parameters():
                if parameter.requires_grad:
                    parameter.data = parameter.data.to(torch.bfloat16)
        with torch.no_grad():
            state = adapter.prefill(worker.prompt(index), chunk_size=worker.CHUNK_SIZE)
            out = ls.rollout(
                adapter, state, num_generations=2, max_new_tokens=worker.NEW_TOKENS, seed=index
            )
        sharded = rank[family, policy]
        assert sharded["responses"] == [r.tolist() for r in out.responses]
        for got, want in zip(sharded["logps"], out.logps, strict=True):
            # The gathered shards are the whole weights (cast elementwise under bf16), and
            # each rank runs the one-process kernels on them: the same values.
            assert torch.equal(got, want)


@pytest.mark.multiprocess
@pytest.mark.parametrize("policy", worker.POLICIES)
def test_a_sharded_lora_step_on_a_bf16_base_equals_one_process(ranks, policy):
    """Each rank's exact-mode step backpropagates through its layer's one unit (frozen
    bfloat16 base, float32 LoRA): the averaged LoRA gradients are one process's over both
    groups, under ``bf16`` on bfloat16 working weights (``WorkingWeights``: the same bfloat16
    gradients, summed in float32)."""
    case = worker.STEP_CASE
    model, adapter = worker.build(case.model_type)
    config = worker.grpo_config(case)
    groups = worker.step_groups(0)
    scales = group_loss_scales([[len(r) for r in g.responses] for g in groups], config)
    weights = WorkingWeights(model) if policy == "bf16" else FullPrecision()
    with weights.step():
        for group, scale in zip(groups, scales, strict=True):
            ls.grpo_step(
                adapter, group.prompt, group.responses, group.rewards, config=config,
                chunk_size=worker.CHUNK_SIZE, loss_scale=scale,
            )  # fmt: skip
    expected = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert expected and all("lora_" in name for name in expected)
    # Both sum the same per-branch gradients in float32, in another order (and FSDP halves
    # a sum of doubled ones: exact): a few float32 roundings (2^-24 each) of the largest.
    assert_grads_close(ranks[0]["step", policy], expected, rtol=1e-6)
