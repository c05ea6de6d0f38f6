"""Pipeline stages (``longstraw_core.pipeline``) against one process on the whole model.

- ``multiprocess``: torchrun starts CPU ranks (gloo) on ``pipeline_worker.py`` as S=2 stages
  (2 ranks), S=4 stages (4 ranks) and S=2 stages x 2 replicas (4 ranks). For qwen3,
  qwen3_5_text and glm_moe_dsa, detached and exact, full and LoRA: no-grad log-probs are
  bit-equal to one process, the losses equal, and parameters and AdamW state after two steps
  equal one process training every replica's groups on the whole model (within 1e-6
  relative in float64; float32 routing in GLM's MoE is the loosest). Each stage holds only
  its layers' prefix state. Some cases train at a temperature (0.7, 1.6): the last stage's
  head scores the policy and the LoRA reference at it. Greedy rollout equals one process and transformers' ``generate``;
  sampled rollout equals one process for the same seed. With FSDP2 sharding each stage over
  the replicas (S=2 x D=2, ``*-fsdp`` cases), where the replicas' prompts, branches and
  response lengths differ and the shorter ones pad with idle passes, the same holds.
- Sliding-window layers (``kinds.window``, width 6 under chunks of 8): a tiny qwen3 with full
  attention between window layers (exact) and a qwen2 whose first layer is full (LoRA,
  detached) on S=2 train like one process (``qwen3-sliding-exact``, ``qwen2-sliding-*``).
- In-process: the layout's balance and its checks, and the refusals of ``stage_model``.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pipeline_worker as worker
import pytest
import torch
from launch import SUPPORT, torchrun_ok

import longstraw_core as ls
from longstraw_core import checkpoint
from longstraw_core.adapters.matrix import probe_of
from longstraw_core.adapters.stage_cut import stage_model
from longstraw_core.models.tiny import tiny_model
from longstraw_core.parallel.fsdp import shard_model
from longstraw_core.parallel.mesh import pipeline_mesh, stage_link
from longstraw_core.pipeline import (
    StageLayout,
    StageLayoutError,
    balanced_boundaries,
    check_stage_count,
)

# (stages, ranks) -> the cases that run there
TOPOLOGIES = {
    (2, 2): list(worker.CASES),
    (4, 4): ["qwen3-exact", "qwen3_5_text-lora-exact", "glm_moe_dsa-exact-4"],
    (2, 4): ["qwen3-exact", "qwen3-lora-kl-detached", "qwen3_5_text-lora-exact",
             "glm_moe_dsa-exact-4", "qwen3-exact-fsdp", "qwen3_5_text-lora-exact-fsdp",
             "glm_moe_dsa-lora-kl-detached-fsdp"],
}  # fmt: skip
RUNS = [(stages, ranks, name) for (stages, ranks), names in TOPOLOGIES.items() for name in names]
ROLLOUTS = {(2, 2): "rollout", (4, 4): "rollout", (2, 4): "rollout-fsdp"}


@pytest.fixture(scope="module")
def staged_runs(tmp_path_factory) -> Path:
    """Every topology's cases, one launch each; the directory of their results."""
    out = tmp_path_factory.mktemp("pipeline")
    for (stages, ranks), names in TOPOLOGIES.items():
        rollout = [ROLLOUTS[stages, ranks]] if (stages, ranks) in ROLLOUTS else []
        torchrun_ok(
            SUPPORT / "pipeline_worker.py", str(out), str(stages), *names, *rollout,
            ranks=ranks,
        )  # fmt: skip
    return out


@functools.cache
def reference(name: str, replicas: int) -> dict:
    return worker.train_reference(worker.CASES[name], replicas)


def _tolerances(case: worker.Case) -> tuple[float, float]:
    """``(loss, AdamW state)`` relative tolerances. Replay in pieces runs the same sums in
    other groupings: float64 rounding, within 1e-12 and 1e-6; but where a model computes in
    float32 inside, the pieces' rounding is float32's. The gradients stay within 1e-6 (checked
    for every case); AdamW then divides each entry by its own gradient's size, so an entry
    whose gradient is near zero moves by a visible part of its step (2e-4 of the largest)."""
    # Families that compute part of a layer in float32 whatever the model's dtype (the Gated
    # DeltaNet rule in transformers' torch kernel, GLM's MoE router) declare it.
    if case.pieces != 1 and probe_of(case.model_type).float32_inside:
        return 1e-7, 2e-4
    return 1e-12, 1e-6


def _relative(got: torch.Tensor, expected: torch.Tensor) -> float:
    scale = expected.abs().max().clamp(min=1e-12)
    return float((got - expected).abs().max() / scale)


@pytest.mark.multiprocess
@pytest.mark.parametrize(("stages", "ranks", "name"), RUNS)
def test_stages_train_like_one_process(staged_runs, stages, ranks, name):
    got = torch.load(staged_runs / f"{name}-S{stages}-W{ranks}.pt", weights_only=False)
    replicas = ranks // stages
    expected = reference(name, replicas)
    loss_rtol, state_rtol = _tolerances(worker.CASES[name])
    for logps in got["logps"]:  # every rank receives the last stage's log-probs
        assert torch.equal(logps, expected["logps"])
    for replica, step, loss in got["losses"]:  # the reference runs the groups step by step
        assert loss == pytest.approx(expected["losses"][step * replicas + replica], rel=loss_rtol)
    assert sorted(got["grads"]) == sorted(expected["grads"])
    # Of the model's largest gradient entry: round-off reaches a parameter whose gradient
    # cancels (a norm's weight) at the size of the others' (issue 38)
    largest = max(float(grad.abs().max()) for grad in expected["grads"].values())
    for key, grad in expected["grads"].items():
        assert float((got["grads"][key] - grad).abs().max()) < 1e-6 * largest, key
    initial = dict(worker.build(worker.CASES[name])[0].named_parameters())
    for key, entry in expected["state"].items():
        saved = got["state"][key]
        assert sorted(saved) == sorted(entry), key
        for field in ("value", "exp_avg", "exp_avg_sq"):
            if field in entry:
                assert _relative(saved[field], entry[field]) < state_rtol, (key, field)
        moved = (entry["value"] - initial[key].detach()).abs().max()
        assert (moved > 0) == (key in expected["grads"]), key  # trained moved, frozen did not
    for replica_state in got["replica_states"][1:]:  # replicas agree after the average
        for key, entry in replica_state.items():
            assert torch.equal(entry["value"], got["replica_states"][0][key]["value"]), key
    layers = got["layers"][:stages]
    assert [index for block in layers for index in block] == list(range(4))


CHECKPOINT_RUNS = [run for run in RUNS if worker.CASES[run[2]].checkpoint]


@pytest.mark.multiprocess
@pytest.mark.parametrize(("stages", "ranks", "name"), CHECKPOINT_RUNS)
def test_stage_checkpoints_load_into_any_stage_count(staged_runs, stages, ranks, name):
    """The stages' checkpoint reloads into each stage bit for bit, and into one process on
    the whole model: the same parameters and AdamW state as the stages held."""
    got = torch.load(staged_runs / f"{name}-S{stages}-W{ranks}.pt", weights_only=False)
    assert got["reloaded"] == [True] * ranks
    case = worker.CASES[name]
    model, _ = worker.build(case)
    optimizer = worker.optimizer_for(model)
    directory = staged_runs / f"checkpoint-{name}-S{stages}-W{ranks}"
    info = checkpoint.load_checkpoint(directory, model, optimizer, output_dir=directory,
                                      restore_rng=False)  # fmt: skip
    assert (info.step, info.data_position) == (worker.STEPS, worker.STEPS)
    whole = worker.by_name(model, optimizer)
    trained = [key for key, entry in got["state"].items() if "exp_avg" in entry]
    assert trained and sorted(trained) == sorted(k for k, e in whole.items() if "exp_avg" in e)
    for key in trained:
        for field in ("value", "exp_avg", "exp_avg_sq"):
            assert torch.equal(whole[key][field], got["state"][key][field]), (key, field)


@pytest.mark.multiprocess
@pytest.mark.parametrize(("stages", "ranks"), [(2, 2), (4, 4)])
def test_each_stage_holds_only_its_share_of_the_state(staged_runs, stages, ranks):
    """qwen3's layers are alike: each stage's state is total / S (within 10%)."""
    got = torch.load(staged_runs / f"qwen3-exact-S{stages}-W{ranks}.pt", weights_only=False)
    _, adapter = worker.build(worker.CASES["qwen3-exact"])
    longest = worker.step_groups(1, 1)[0].prompt  # the larger of replica 0's two prompts
    with torch.no_grad():
        total = adapter.prefill(longest, chunk_size=worker.CHUNK_SIZE).nbytes()
    for state_bytes in got["state_bytes"]:
        assert abs(state_bytes - total / stages) <= 0.1 * total / stages


@pytest.mark.multiprocess
@pytest.mark.parametrize(("stages", "ranks"), list(ROLLOUTS))
def test_staged_rollout_equals_one_process_and_generate(staged_runs, stages, ranks):
    """Every replica's rollouts (with FSDP across the replicas: each its own prompt) equal
    one process's on its prompt; greedy equals transformers' ``generate``."""
    name = ROLLOUTS[stages, ranks]
    got = torch.load(staged_runs / f"{name}-S{stages}-W{ranks}.pt", weights_only=False)
    model, adapter = worker.build(worker.Case("qwen3", "detached"))
    replicas = ranks // stages
    assert len(got["replicas"]) == replicas
    for replica, rollouts in enumerate(got["replicas"]):
        prompt = worker.step_groups(0, replicas)[replica].prompt
        expected = worker.rollouts(adapter, prompt)
        # The same tokens; log-probs within float64 rounding (the stages decode the group in
        # micro-groups, smaller batches than one process's).
        for key, values in expected.items():
            if key.endswith("logps"):
                for got_row, row in zip(rollouts[key], values, strict=True):
                    assert got_row == pytest.approx(row, rel=1e-12), key
            else:
                assert rollouts[key] == values, key
        with torch.no_grad():
            generated = model.generate(
                prompt[None], max_new_tokens=10, do_sample=False, pad_token_id=0
            )[0, len(prompt) :]
        assert rollouts["greedy"][0] == generated.tolist()
    truncated = [t for rollouts in got["replicas"] for t in rollouts["options_truncated"]]
    assert 0 < sum(truncated) < len(truncated)  # some branches ended at a stop string


# --- in one process -----------------------------------------------------------------------


def test_balanced_layout_spreads_full_attention_evenly():
    """Qwen3.6-27B's pattern: three Gated DeltaNet layers, then one full-attention layer."""
    costs = [(1.0 if i % 4 == 3 else 0.0, 1.0) for i in range(64)]
    layout = balanced_boundaries(costs, 8)
    assert layout.boundaries == (0, 8, 16, 24, 32, 40, 48, 56, 64)
    for stage in range(8):
        assert sum(costs[i][0] for i in layout.layers_of(stage)) == 2
    assert layout.stage_of(63) == 7 and layout.stage_of(8) == 1
    assert balanced_boundaries([(1.0,)] * 4, 3).boundaries == (0, 2, 3, 4)  # the last: fewest
    heavy_middle = balanced_boundaries([(1.0,), (1.0,), (6.0,), (1.0,), (1.0,)], 3)
    assert heavy_middle.layers_of(1) == range(2, 3)


def test_layout_refuses_what_cannot_run():
    with pytest.raises(StageLayoutError, match=r"distributed\.pipeline_stages=5 is more than"):
        check_stage_count(5, 4)
    with pytest.raises(StageLayoutError, match="does not divide the 6 processes"):
        check_stage_count(4, 8, world_size=6)
    with pytest.raises(StageLayoutError, match="positive integer"):
        check_stage_count(0, 8)
    with pytest.raises(StageLayoutError, match="name layer 9"):
        StageLayout.from_starts([0, 9], 4)
    with pytest.raises(StageLayoutError, match="increase strictly"):
        StageLayout.from_starts([0, 2, 2], 4)
    assert StageLayout.from_starts([0, 3], 4).describe() == "0-2 | 3-3"


def test_one_stage_changes_nothing(world_of_one):
    """S=1 on a world of one: staging keeps every module, and the step is the same."""
    model = tiny_model("qwen3", dtype=torch.float64).train()
    plain = ls.adapt(tiny_model("qwen3", dtype=torch.float64).train())
    adapter = ls.adapt(model)
    mesh = pipeline_mesh(1)
    stage_model(adapter, StageLayout((0, 2)), stage_link(mesh, adapter.device))
    prompt, responses = torch.arange(20), [torch.arange(5), torch.arange(3, 9)]
    config = ls.GRPOConfig(gradient="exact")
    for each in (adapter, plain):
        ls.grpo_step(each, prompt, responses, [1.0, 0.0], config=config, chunk_size=8)
    for (name, got), (_, expected) in zip(
        model.named_parameters(), plain.model.named_parameters(), strict=True
    ):
        assert torch.equal(got.grad, expected.grad), name


def test_stage_model_refuses_misuse(world_of_one):
    mesh = pipeline_mesh(1)
    tied = ls.adapt(tiny_model("qwen3", tie_word_embeddings=True))
    link = stage_link(mesh, tied.device)
    with pytest.raises(StageLayoutError, match="covers 4 layers, the model has 2"):
        stage_model(tied, StageLayout((0, 2, 4)), link)
    with pytest.raises(StageLayoutError, match="2 stages, the pipeline 1 ranks"):
        stage_model(tied, StageLayout((0, 1, 2)), link)
    with pytest.raises(ValueError, match="must divide the 1 processes"):
        pipeline_mesh(2)


def test_a_stage_sharded_with_bf16_keeps_its_state_in_bf16(world_of_one):
    """Stages are made before FSDP shards them, so the stage records the float32 masters'
    dtype; with bf16 mixed precision the layers compute in bf16 and the prefix state must
    be kept in it (as unstaged FSDP keeps it), not in float32 at twice the memory."""
    adapter = ls.adapt(tiny_model("qwen3").train())
    mesh = pipeline_mesh(1)
    stage_model(adapter, StageLayout((0, 2)), stage_link(mesh, adapter.device))
    shard_model(adapter, mixed_precision="bf16", mesh=mesh["replica"])
    assert adapter.dtype == torch.bfloat16
    state = adapter.prefill(torch.arange(40), chunk_size=16)
    stored = {t.dtype for layer in state.layers for t in (layer.keys, layer.values)}
    assert stored == {torch.bfloat16}
