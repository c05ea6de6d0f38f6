"""Dry runs at real dimensions (``longstraw_core.scale_check``), reduced to run in the suite.

The paper's models at their real widths, with few layers on 2 pipeline stages and a 4K
prompt: a whole GRPO step per stage on fake tensors, through the real staged passes and the
GPU's kernels (``gpu_emulation``). Each stage's tracked peak must be within 10% of the
planner's for that stage and within the 96 GiB budget. ``make scale-check`` runs the
paper's sizes.

- Qwen3.6-27B (hidden 5120, 248K vocabulary, DeltaNet 48 x 128 heads, gated attention 24 q
  / 4 kv heads of 256): 4 layers (three Gated DeltaNet, one full attention), LoRA, and the
  same with an NF4 base (QLoRA);
- GLM-5.2 (hidden 6144, MLA with a 512 + 64 latent over 64 heads, DSA top-2048, 256
  experts): 2 layers (one dense MLP, one MoE), the prompt long enough that the second chunk
  takes the sparse (top-k) path.

Those replay whole branches (S=2, G=8: one piece each, 1F1B); a Qwen3.6-27B run on 4 stages
with G=4 replays each branch in 5 pieces, and is checked phase by phase.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from longstraw_core.plan import pipeline_plan
from longstraw_core.plan.pieces import pieces_of
from longstraw_core.scale_check.runs import (
    GLM,
    PAPER,
    QWEN,
    TOLERANCE,
    DryRun,
    _prepare,
    run_config,
    table,
    worst_stages,
)
from longstraw_core.tensors.fake import is_fake, known_bool, known_float, known_list
from longstraw_core.tensors.quantization import nf4_bytes

REDUCED = DryRun(
    "qwen36-27b-widths-4-layers",
    QWEN,
    "Qwen3.6-27B",
    (
        "data.prompt_tokens=4097",
        "train.chunk_size=2048",
        "rollout.max_new_tokens=32",
        "distributed.pipeline_stages=2",
    ),
    (("num_hidden_layers", 4),),
    rollout_tokens=2,
)


REDUCED_RUNS = {
    "qwen36-lora": REDUCED,
    "qwen36-qlora": dataclasses.replace(
        REDUCED, overrides=(*REDUCED.overrides, "model.quantization=nf4")
    ),
    "glm52-lora": DryRun(
        "glm52-widths-2-layers",
        GLM,
        "GLM-5.2",
        REDUCED.overrides,
        (("num_hidden_layers", 2), ("first_k_dense_replace", 1)),
        rollout_tokens=2,
    ),
}


# Replay in pieces: S=4, G=4 cuts each 1024-token branch into 5 pieces (the schedule's
# choice) and stage s holds up to 5 + 3 (3 - s) of them. One layer a stage, no activation
# checkpointing and no sweep, so the piece graphs are much of each stage's peak.
PIECES = DryRun(
    "qwen36-27b-widths-4-stages-in-pieces",
    QWEN,
    "Qwen3.6-27B",
    (
        "data.prompt_tokens=4097",
        "train.chunk_size=2048",
        "rollout.max_new_tokens=1024",
        "rollout.num_generations=4",
        "distributed.pipeline_stages=4",
        "train.activation_checkpointing=false",
        "grpo.gradient=detached",
    ),
    (("num_hidden_layers", 4),),
    rollout_tokens=2,
)


_RESULTS: dict[str, dict] = {}


def _result(name: str) -> dict:
    """Each reduced run once per session, whichever test asks first."""
    if name not in _RESULTS:
        _RESULTS[name] = run_config(REDUCED_RUNS[name])
    return _RESULTS[name]


@pytest.fixture(scope="module", params=sorted(REDUCED_RUNS))
def reduced(request) -> dict:
    return _result(request.param)


def test_every_stage_runs_a_whole_step(reduced):
    print(table(reduced))
    assert [row["stage"] for row in reduced["rows"]] == [0, 1]
    for row in reduced["rows"]:
        assert set(row["tracked_phases"]) == {"prefill", "rollout", "replay", "sweep", "optimizer"}
        # the weights alone: a real-width stage holds gigabytes, none of it allocated here
        assert row["tracked"] > 2**30


def test_tracked_peaks_match_the_planner_and_fit(reduced):
    for row in reduced["rows"]:
        assert abs(row["error"]) <= TOLERANCE, table(reduced)
    assert reduced["within_plan"] and reduced["within_budget"]


def test_replay_in_pieces_matches_the_planner():
    """Each kind's first stage (0; 1, like 2; 3, with the head) replays its pieces as the
    schedule orders them; its tracked replay peak, the stage's peak, is within 10% of the
    planner's (``plan.pieces``; 1F1B over whole branches was 11-19% off)."""
    work = _prepare(PIECES)[3]
    assert pieces_of(work) == 5
    result = run_config(PIECES, worst_stages(PIECES))
    print(table(result))
    assert [row["stage"] for row in result["rows"]] == [0, 1, 3]
    for row in result["rows"]:
        tracked, planned = row["tracked_phases"]["replay"], row["planned_phases"]["replay"]
        assert row["tracked"] == tracked and row["planned"] == planned, table(result)
        assert abs(tracked - planned) <= TOLERANCE * planned, table(result)
    assert result["within_plan"] and result["within_budget"]


def test_value_helpers_read_real_tensors_and_stand_in_for_fake_ones():

    real = torch.tensor([1, 0])
    assert not is_fake(real)
    assert known_list(real, fake=7) == [1, 0]
    assert known_bool(real[0], fake=False) is True
    assert known_float(real.float().sum()) == 1.0
    with FakeTensorMode():
        fake = torch.zeros(3)
        assert is_fake(fake)
        assert known_list(fake, fake=7) == [7, 7, 7]
        assert known_bool(fake.any(), fake=True) is True
        assert known_float(fake.sum(), 2.0) == 2.0


def test_the_qlora_run_holds_4bit_weights():
    """The NF4 base's stages hold their decoder linears in ~0.52 byte a weight instead of 2
    (the embeddings and head stay bf16): the dry run quantized exactly those weights."""
    lora, qlora = _result("qwen36-lora"), _result("qwen36-qlora")
    spec = _prepare(REDUCED_RUNS["qwen36-qlora"])[2]
    for bf16, nf4 in zip(lora["rows"], qlora["rows"], strict=True):
        weights = sum(spec.layers[i].quantizable for i in nf4["layers"])
        saved = 2 * weights - nf4_bytes(weights)
        assert weights > 0 and bf16["params"] - nf4["params"] == pytest.approx(saved, rel=0.01)


def test_each_kind_of_stage_is_worst_first_in_the_pipeline():
    """Qwen3.6-27B's 8 stages are 3 kinds (the embeddings', 6 alike, the head's) and
    GLM-5.2's 32 are 4 (the dense layers', two-layer and three-layer MoE stages, the
    head's): each kind's first stage is its worst (most microbatches in flight), and the
    planner agrees; gpt-oss-20b's 2 stages are 2 kinds (embeddings, head)."""
    worst = {run.name: worst_stages(run) for run in PAPER}
    assert worst == {
        "qwen36-27b-lora-2.1M": [0, 1, 7],
        "qwen36-27b-lora-4.46M": [0, 1, 7],
        "qwen36-27b-qlora-2.1M": [0, 1, 7],
        "glm52-lora-2.1M": [0, 1, 19, 31],
        "gpt-oss-20b-lora-128K": [0, 1],
    }
    _, _, spec, work, _ = _prepare(PAPER[0])
    planned = [stage.peak for stage in pipeline_plan(spec, work).stage_plans]
    assert planned[1:7] == sorted(planned[1:7], reverse=True)


@pytest.mark.parametrize("backward", [False, True])
@pytest.mark.parametrize("blocks", [1, 3])
def test_the_planners_sparse_attention_scratch_is_what_the_kernel_holds(
    monkeypatch: pytest.MonkeyPatch, blocks: int, backward: bool
):
    """``glm52.mla._SparseLatentAttention`` at GLM-5.2's widths (64 heads, a 576-wide latent,
    top-2048) on fake tensors, its tracked scratch against ``plan.kernels``' formula, in
    blocks of 16 queries: one block, and several (the previous block's tensors bound while
    the next gathers)."""
    from longstraw_core.plan.kernels import sparse_attention_scratch
    from longstraw_core.tensors import gpu_emulation
    from longstraw_core.tensors.memory import LiveTensorMemory
    from model_adapters import glm52

    heads, dim, value, topk, step = 64, 576, 512, 2048, 16
    tokens, prefix = step * blocks, 4096
    d = {"index_topk": topk, "heads": heads, "kv_rank": value, "rope_dim": dim - value}
    monkeypatch.setattr(glm52.family, "_GPU_WORK_ELEMENTS", step * topk * 3 * (dim + heads))
    with FakeTensorMode(), gpu_emulation.gpu_kernels(), LiveTensorMemory() as memory:
        bf16 = torch.bfloat16
        queries = torch.empty(1, tokens, heads, dim, dtype=bf16, requires_grad=True)
        span = torch.empty(1, tokens, dim, dtype=bf16, requires_grad=True)
        latent = torch.empty(prefix, dim, dtype=bf16)
        positions = torch.empty(1, tokens, topk, dtype=torch.long)
        sink = torch.empty(prefix, dim)
        apply = glm52.mla._SparseLatentAttention.apply
        before = memory.current
        with memory.phase("forward"):
            out = apply(queries, span, latent, positions, value, 0.1, sink)
        scratch = memory.phases["forward"] - memory.current  # the output and lse are kept
        if backward:
            d_out = torch.empty_like(out)
            before = memory.current
            with memory.phase("backward"):
                out.backward(d_out)
            grads = 4 * tokens * dim * (heads + 1)  # float32 dq and d_span, filled block by block
            scratch = memory.phases["backward"] - before - grads
    assert before > 0
    planned = sparse_attention_scratch(d, tokens, 1, "cuda", 2, backward)
    assert planned == pytest.approx(scratch, rel=0.05)
