"""The planner on pipeline stages: layouts, per-stage memory, the paper verdicts, time, CLI.

One prompt over S stages: each rank holds its stage's layers (weights, prefix state, dS),
the embeddings on stage 0, the head on the last, and what the schedules keep in flight
(replay's pieces, the exact sweep's prompt chunks).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from longstraw_core.config import load_config
from longstraw_core.offload import OffloadPolicy
from longstraw_core.pipeline import StageLayoutError
from longstraw_core.pipeline.schedule import replay_orders
from longstraw_core.pipeline.simulate import replay_pieces
from longstraw_core.plan import (
    Hardware,
    ModelSpec,
    Scenario,
    Workload,
    compute_plan,
    estimate_time,
    pipeline_plan,
    plan_for_config,
    scenario_workload,
    spec_for_preset,
    stage_layout,
)
from longstraw_core.plan.advice import fixes_for, largest_chunk
from longstraw_core.plan.cli import main
from longstraw_core.plan.core import PHASES
from longstraw_core.plan.pieces import most_held, pieces_of
from longstraw_core.plan.sources import PRESET_LORA_TARGETS
from longstraw_core.plan.stages import full_attention_counts, layer_costs, stage_spec
from longstraw_core.plan.units import GIB
from longstraw_core.tensors.quantization import nf4_bytes

ROOT = Path(__file__).resolve().parents[2]
_QWEN = PRESET_LORA_TARGETS["Qwen3.6-27B"]
_GLM = PRESET_LORA_TARGETS["GLM-5.2"]
QWEN_21 = Scenario("Qwen3.6-27B", 2_100_000, 8, "96GiB", 32, _QWEN, stages=8)
QWEN_446 = Scenario("Qwen3.6-27B", 4_460_000, 8, "96GiB", 32, _QWEN, stages=8)
GLM_21 = Scenario("GLM-5.2", 2_100_000, 32, "96GiB", 32, _GLM, stages=32)


@pytest.fixture(scope="module")
def qwen() -> ModelSpec:
    return spec_for_preset("Qwen3.6-27B")


@pytest.fixture(scope="module")
def glm() -> ModelSpec:
    return spec_for_preset("GLM-5.2")


def _work(scenario: Scenario, group: int, gradient: str, **changes: object) -> Workload:
    return dataclasses.replace(scenario_workload(scenario, group, gradient), **changes)


# --- stage layouts ---------------------------------------------------------------------------


@pytest.mark.parametrize("stages", [2, 4, 8, 16])
def test_qwen36_full_attention_layers_spread_evenly(qwen: ModelSpec, stages: int) -> None:
    """64 layers, one in four full attention: an even split, 16 / S full-attention layers
    on every stage, in both gradient modes."""
    for gradient in ("detached", "exact"):
        layout = stage_layout(qwen, stages, gradient=gradient)
        size = 64 // stages
        assert layout.boundaries == tuple(range(0, 65, size))
        assert full_attention_counts(qwen, layout) == [16 // stages] * stages


def test_qwen36_on_8_stages_has_two_full_attention_layers_each(qwen: ModelSpec) -> None:
    layout = stage_layout(qwen, 8)
    assert layout.describe() == "0-7 | 8-15 | 16-23 | 24-31 | 32-39 | 40-47 | 48-55 | 56-63"
    assert full_attention_counts(qwen, layout) == [2] * 8


@pytest.mark.parametrize("stages", [1, 3, 5, 7, 31, 64])
def test_every_stage_owns_layers(qwen: ModelSpec, stages: int) -> None:
    layout = stage_layout(qwen, stages)
    assert layout.stages == stages and layout.num_layers == 64
    assert all(len(layout.layers_of(s)) >= 1 for s in range(stages))
    counts = full_attention_counts(qwen, layout)
    assert max(counts) - min(counts) <= 1 + (stages > 16)  # as even as 16 layers allow


def test_glm52_on_32_stages_is_balanced(glm: ModelSpec) -> None:
    """78 layers (3 dense, 75 MoE) on 32 stages: no stage has more than three MoE layers
    (the fewest possible), none is empty, and the stages below the largest are even too."""
    layout = stage_layout(glm, 32)
    moe = [sum(glm.layers[i].mlp == "moe" for i in layout.layers_of(s)) for s in range(32)]
    assert max(moe) == 3 and sum(moe) == 75
    assert all(len(layout.layers_of(s)) >= 1 for s in range(32))
    assert sorted(set(moe[1:])) == [2, 3] and moe[0] == 0  # the dense layers together
    assert all(len(layout.layers_of(s)) in (2, 3) for s in range(32))


def test_glm52_on_every_layer_and_on_8_stages(glm: ModelSpec) -> None:
    assert stage_layout(glm, 78).boundaries == tuple(range(79))
    layout = stage_layout(glm, 8)
    sizes = [len(layout.layers_of(s)) for s in range(8)]
    assert sum(sizes) == 78 and max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize(("name", "stages"), [("Qwen3.6-27B", 65), ("GLM-5.2", 79)])
def test_more_stages_than_layers_is_refused_naming_the_key(name: str, stages: int) -> None:
    spec = spec_for_preset(name)
    with pytest.raises(StageLayoutError, match=r"distributed\.pipeline_stages"):
        stage_layout(spec, stages)
    work = _work(QWEN_21, 8, "detached", stages=stages, gpus=stages)
    with pytest.raises(ValueError, match=r"distributed\.pipeline_stages"):
        compute_plan(spec, work)


def test_stages_must_divide_the_gpus(qwen: ModelSpec) -> None:
    with pytest.raises(ValueError, match=r"pipeline_stages=3 does not divide the 8"):
        compute_plan(qwen, _work(QWEN_21, 8, "detached", stages=3))


def test_stage_starts_override_the_layout(qwen: ModelSpec) -> None:
    plan = compute_plan(qwen, _work(QWEN_21, 8, "detached", stages=2, stage_starts=(0, 40)))
    assert plan.layout is not None and plan.layout.boundaries == (0, 40, 64)
    with pytest.raises(ValueError, match=r"distributed\.stage_starts"):
        compute_plan(qwen, _work(QWEN_21, 8, "detached", stages=4, stage_starts=(0, 40)))


def test_layer_costs_carry_state_params_and_both_kinds_of_compute(qwen: ModelSpec) -> None:
    costs = layer_costs(qwen)
    full = [c for c, layer in zip(costs, qwen.layers, strict=True) if layer.mixer != "deltanet"]
    linear = [c for c, layer in zip(costs, qwen.layers, strict=True) if layer.mixer == "deltanet"]
    assert all(c[0] > 0 and c[3] > 0 for c in full)  # K/V per position, quadratic compute
    assert all(c[0] == 0 and c[3] == 0 for c in linear)  # fixed-size state, linear compute
    assert all(c[1] > 0 and c[2] > 0 for c in costs)
    exact = layer_costs(qwen, "exact")
    assert all(e[0] == 3 * d[0] for e, d in zip(exact, costs, strict=True))  # + fp32 dS


# --- per-stage memory ------------------------------------------------------------------------


@pytest.mark.parametrize("gradient", ["detached", "exact"])
def test_one_stage_equals_todays_plan(qwen: ModelSpec, gradient: str) -> None:
    """The per-stage machinery with one stage (the whole model as its slice, nothing in
    flight, no neighbours) gives today's rows and peaks exactly."""
    for changes in (
        {},
        {"offload": OffloadPolicy.parse({"attention": "cpu"})},
        {"activation_checkpointing": False, "chunk_size": 2048, "keep_attention_outputs": True},
    ):
        scenario = dataclasses.replace(QWEN_21, stages=1)
        work = _work(scenario, 8, gradient, **changes)
        if work.keep_attention_outputs and gradient != "exact":
            continue
        today, staged = compute_plan(qwen, work), pipeline_plan(qwen, work)
        assert staged.lines == today.lines and staged.phases == today.phases
        assert staged.stage_plans[0].lines == today.lines


def test_one_stage_equals_todays_plan_for_tiny_models() -> None:
    for name in ("qwen36/tiny_grpo_cpu.yaml", "glm52/tiny_grpo_cpu.yaml"):
        cfg = load_config(ROOT / "configs" / name, [], check_paths=False)
        spec, work = plan_for_config(cfg)
        assert work.stages == 1
        today, staged = compute_plan(spec, work), pipeline_plan(spec, work)
        assert (staged.lines, staged.phases) == (today.lines, today.phases)


@pytest.mark.parametrize("stages", [2, 4, 8])
def test_each_stage_holds_its_share_of_the_state(qwen: ModelSpec, stages: int) -> None:
    """Prefix state and dS per stage ~ total / S; the stages' parameters add up to the
    model's (embeddings on the first, the head on the last)."""
    work = _work(QWEN_21, 8, "exact", stages=stages, gpus=stages)
    whole = compute_plan(qwen, dataclasses.replace(work, stages=1, gpus=1, fsdp=False))
    plan = compute_plan(qwen, work)

    def total(p: object, prefix: str) -> int:
        return sum(line.device for line in p.lines if line.name.startswith(prefix))

    for name in ("prefix state", "dS"):
        share = total(whole, name) / stages
        for stage in plan.stage_plans:
            assert abs(total(stage, name) - share) <= 0.01 * share, (name, stage.stage)
    assert sum(stage.spec.params for stage in plan.stage_plans) == qwen.params
    params = [stage.line("parameters").device for stage in plan.stage_plans]
    assert params[0] == pytest.approx(params[-1], rel=0.01)  # embeddings / norm + head
    if stages > 2:
        assert params[0] > params[1] * 1.2
    assert plan.peak == max(stage.peak for stage in plan.stage_plans)
    assert plan.stage == max(plan.stage_plans, key=lambda s: s.peak).stage


def test_stages_keep_replay_pieces_and_sweep_chunks_in_flight(qwen: ModelSpec) -> None:
    """Replay on S=8 stages, G=8: branches of 5 pieces (``simulate.replay_pieces``), stage s
    holding up to 5 + 3 (7 - s) piece graphs; a step replaying fewer branches cuts them in
    more pieces (one branch: 32), which the last stages hold whole. The exact sweep is 1F1B
    over prompt chunks (S - s in flight)."""
    plan = compute_plan(qwen, _work(QWEN_21, 8, "exact"))
    first, last = plan.stage_plans[0], plan.stage_plans[-1]
    pieces = "in-flight replay piece graphs"
    assert "25 more pieces of 8 branch(es) x P=5" in first.line(pieces).note
    assert "31 more pieces of 1 branch(es) x P=32" in last.line(pieces).note
    assert "the worst count of the G=8 branches" in last.line(pieces).note
    assert "410 of a branch's 2048 tokens (P=5)" in first.line("one replay piece (transient)").note
    assert first.line("replay piece leaves").device > 0
    every = compute_plan(qwen, _work(QWEN_21, 8, "exact", replay_branches=8)).stage_plans[-1]
    assert "4 more pieces of 8 branch(es) x P=5" in every.line(pieces).note
    assert every.phases["replay"] < last.phases["replay"]
    assert last.line("in-flight sweep chunk graphs (1F1B)").device == 0
    assert first.line("in-flight sweep chunk graphs (1F1B)").device > 0
    small = compute_plan(qwen, _work(QWEN_21, 2, "detached"))  # G=2: 20 pieces, all held
    assert "39 more pieces of 2 branch(es) x P=20" in small.stage_plans[0].line(pieces).note
    # one piece a branch (distributed.replay_pieces=1) is 1F1B over the branches
    whole = compute_plan(qwen, _work(QWEN_21, 8, "exact", replay_pieces=1))
    assert "7 more pieces of 8 branch(es) x P=1" in whole.stage_plans[0].line(pieces).note
    assert whole.stage_plans[-1].line(pieces).device == 0
    assert whole.stage_plans[0].phases["replay"] > first.phases["replay"]
    # only the last stage has the LM head: its logits in rollout and in the branch graph
    rollout = [p.line("rollout caches + step (transient)").device for p in plan.stage_plans]
    assert rollout[-1] - rollout[1] == 3 * 8 * qwen.vocab * 4  # [G, vocab] fp32 logits
    assert plan.stage_plans[0].phases["rollout"] > 0
    # the first and last stages have one neighbour, the others two
    notes = [p.line("stage hidden-state buffers").note for p in plan.stage_plans]
    assert [int(note.split("to/from ")[1][0]) for note in notes] == [1, 2, 2, 2, 2, 2, 2, 1]
    buffers = [p.line("stage hidden-state buffers").device for p in plan.stage_plans]
    assert buffers[1] == 2 * (8 - 1 + 1) * 8192 * qwen.hidden * 2  # sweep: 7 + 1 chunks


def test_most_held_is_what_the_replay_orders_hold() -> None:
    """The planner's count of replay piece graphs on a stage (``pieces.most_held``) is the
    most the schedule's orders hold, walked for every stage of many shapes and the paper's
    (8 stages: 5 pieces for G=8, 20 for G=2)."""
    shapes = [(s, g, p) for s in range(1, 6) for g in range(1, 5) for p in range(1, 6)]
    for stages, branches, pieces in [*shapes, (8, 8, 5), (8, 2, 20)]:
        for stage, order in enumerate(replay_orders(stages, [pieces] * branches)):
            held = most = 0
            for compute in order:
                held += 1 if compute.kind == "F" else -1
                most = max(most, held)
            assert most == most_held(stages, stage, pieces, branches), (stages, branches, stage)


def test_replay_pieces_come_from_the_config_or_the_schedule(capsys) -> None:
    """``distributed.replay_pieces`` (and ``--replay-pieces``) set P; unset, the planner
    takes the schedule's choice, as ``Stage.pieces_for`` does; one stage replays whole."""
    config = ROOT / "configs/qwen36/tiny_grpo_cpu.yaml"
    stages = ["distributed.pipeline_stages=2", "memory.gpus=2"]
    cfg = load_config(config, [*stages, "distributed.replay_pieces=3"], check_paths=False)
    _, work = plan_for_config(cfg)
    assert work.replay_pieces == 3 and pieces_of(work) == 3
    _, work = plan_for_config(load_config(config, stages, check_paths=False))
    assert work.replay_pieces is None and pieces_of(work) == replay_pieces(2, work.group)
    assert pieces_of(dataclasses.replace(work, stages=1, gpus=1, replay_pieces=3)) == 1
    assert main([*_QWEN_ARGS, "--group", "8", "--stages", "8", "--replay-pieces", "1"]) == 0
    assert "7 more pieces of 8 branch(es) x P=1" in capsys.readouterr().out


def test_a_stage_slice_that_ends_before_the_model_runs_its_last_layer_whole(
    qwen: ModelSpec,
) -> None:
    layout = stage_layout(qwen, 2)
    first, last = stage_spec(qwen, layout, 0), stage_spec(qwen, layout, 1)
    assert not first.has_head and last.has_head
    assert first.root_params + last.root_params == qwen.root_params
    assert len(first.layers) + len(last.layers) == len(qwen.layers)


def test_fsdp_shards_a_stage_over_its_replicas(qwen: ModelSpec) -> None:
    """8 GPUs as 4 stages x 2 replicas: FSDP shards a stage's parameters in two; as 8 x 1
    there is nothing to shard, and no FSDP lines."""
    two = compute_plan(qwen, _work(QWEN_21, 8, "detached", stages=4))
    one = compute_plan(qwen, _work(QWEN_21, 8, "detached", stages=8))
    assert two.work.replicas == 2 and one.work.replicas == 1
    assert "sharded /2" in two.line("parameters").note
    assert "FSDP gathered parameters" in {line.name for line in two.lines}
    assert "FSDP gathered parameters" not in {line.name for line in one.lines}


# --- the paper configurations, state on the GPUs ---------------------------------------------


@pytest.mark.parametrize("gradient", ["detached", "exact"])
@pytest.mark.parametrize("group", [2, 8])
def test_qwen36_lora_at_2_1m_fits_8_x_96gb_on_8_stages_without_offload(
    qwen: ModelSpec, group: int, gradient: str
) -> None:
    plan = compute_plan(qwen, _work(QWEN_21, group, gradient))
    assert plan.work.offload is None and plan.cpu_bytes == 0
    # detached G=2: the last stage is the worst, for a step that replays one branch, in 32
    # pieces too short for the head's chunks: it holds them all, each with its float32
    # log-probs [64, vocab] (G=8: as much, and stage 0's 26 pieces of 410 tokens 2 MB more)
    assert plan.fits and plan.stage == (7 if (group, gradient) == (2, "detached") else 0)
    assert plan.peak < (30 if gradient == "detached" else 75) * GIB
    today = compute_plan(qwen, _work(QWEN_21, group, gradient, stages=1))
    assert not today.fits  # one stage needs the K/V offloaded


def test_qwen36_lora_at_4_46m_on_8_x_96gb_which_mode_fits(qwen: ModelSpec) -> None:
    """Detached with activation checkpointing fits (any chunk up to 65536); without
    checkpointing it fits only in replay pieces (5 a branch: stage 0 holds 26 pieces of 410
    tokens; one piece a branch, 1F1B, holds 8 whole branches); exact does not in any mode
    (dS alone is 64 GiB a stage), but does on 16 stages."""
    detached = _work(QWEN_446, 8, "detached")
    assert compute_plan(qwen, detached).fits
    assert largest_chunk(qwen, detached) == 65536
    plain = dataclasses.replace(detached, activation_checkpointing=False)
    assert compute_plan(qwen, plain).fits
    assert not compute_plan(qwen, dataclasses.replace(plain, replay_pieces=1)).fits
    for checkpointing in (True, False):
        for keep in (False, True):
            work = _work(
                QWEN_446,
                8,
                "exact",
                activation_checkpointing=checkpointing,
                keep_attention_outputs=keep,
            )
            assert not compute_plan(qwen, work).fits
            assert largest_chunk(qwen, work) is None
    exact = compute_plan(qwen, _work(QWEN_446, 8, "exact"))
    assert exact.line("dS (exact)").device > 60 * GIB
    wider = [fix for fix in fixes_for(exact) if "pipeline_stages" in fix.keys]
    assert wider[0].keys == "distributed.pipeline_stages=16" and wider[0].plan.fits


@pytest.mark.parametrize("group", [2, 8])
def test_glm52_lora_at_2_1m_on_32_x_96gb_on_32_stages(glm: ModelSpec, group: int) -> None:
    """The paper's configuration, which one stage per GPU cannot fit at all: detached fits
    as configured; exact fits with 2048-token chunks (the 1F1B sweep keeps up to 32 chunk
    graphs in flight on the first stages, and the DSA's GPU block scratch is 1 GiB)."""
    detached = compute_plan(glm, _work(GLM_21, group, "detached"))
    assert detached.fits and detached.cpu_bytes == 0
    exact = _work(GLM_21, group, "exact")
    assert not compute_plan(glm, exact).fits
    assert largest_chunk(glm, exact) == 2048
    assert compute_plan(glm, dataclasses.replace(exact, chunk_size=2048)).fits
    assert not compute_plan(glm, _work(GLM_21, group, "detached", stages=1)).fits


# --- the time model --------------------------------------------------------------------------


def test_prefill_pipelines_over_stages(qwen: ModelSpec) -> None:
    """Prefill: (K + S - 1) / K x the slowest stage; with 257 chunks two stages take about
    half of one stage's time, eight about an eighth."""
    times = {}
    for stages in (1, 2, 8):
        work = _work(QWEN_21, 8, "detached", stages=stages, gpus=stages)
        times[stages] = estimate_time(qwen, work).phase("prefill").seconds
    chunks = 257
    assert times[2] / times[1] == pytest.approx((chunks + 1) / chunks / 2, rel=0.01)
    assert times[8] / times[1] == pytest.approx((chunks + 7) / chunks / 8, rel=0.02)


def test_the_time_follows_the_schedules(qwen: ModelSpec) -> None:
    """Each phase's seconds are its schedule's, played under NCCL's rules with each compute at
    its stage's roofline: replay is 1F1B over all G P pieces, ``(G P + S - 1)`` pieces' time
    on a stage (compute-bound at 2.1M positions, so a piece costs its share of the branch);
    the sweep 1F1B over the chunks; prefill the chunks forward; rollout's micro-groups keep
    the stages busy together, but one micro-group (G=1) passes them in turn. One piece per
    branch (the old 1F1B over branches) idles more."""
    one = estimate_time(qwen, _work(QWEN_21, 8, "exact", stages=1, gpus=1))
    eight = estimate_time(qwen, _work(QWEN_21, 8, "exact"))
    pieces = replay_pieces(8, 8)
    assert pieces == 5
    replay = one.phase("replay").seconds * (8 * pieces + 8 - 1) / (8 * 8 * pieces)
    # each piece also reads its stage's weights and prefix state, and the stages are not
    # exactly alike (the head on the last): within 8% of the balanced compute-bound figure
    assert replay < eight.phase("replay").seconds < 1.08 * replay
    whole = dataclasses.replace(_work(QWEN_21, 8, "exact"), replay_pieces=1)
    assert estimate_time(qwen, whole).phase("replay").seconds > 1.3 * eight.phase("replay").seconds
    sweep = one.phase("sweep").seconds * (257 + 7) / 257 / 8
    assert eight.phase("sweep").seconds == pytest.approx(sweep, rel=0.05)
    assert eight.phase("rollout").seconds < 0.7 * one.phase("rollout").seconds
    alone = [
        estimate_time(qwen, _work(QWEN_21, 1, "exact", stages=stages, gpus=stages))
        for stages in (1, 8)
    ]
    rollouts = [estimate.phase("rollout").seconds for estimate in alone]
    assert rollouts[1] == pytest.approx(rollouts[0], rel=0.01)
    assert rollouts[1] > rollouts[0]  # + the hops
    assert eight.phase("prefill").link_bytes == 7 * 2_099_999 * 5120 * 2


def test_the_time_model_follows_its_inputs(qwen: ModelSpec) -> None:
    work = _work(QWEN_21, 8, "detached")
    base = estimate_time(qwen, work)
    faster = estimate_time(qwen, work, Hardware(tflops=296.0))
    # twice the FLOPs: half the seconds but for the hops between stages
    assert faster.phase("prefill").seconds == pytest.approx(
        base.phase("prefill").seconds / 2, rel=1e-4
    )
    offloaded = dataclasses.replace(
        work, stages=1, gpus=1, offload=OffloadPolicy.parse({"attention": "cpu"})
    )
    slow = estimate_time(qwen, offloaded)
    assert slow.phase("rollout").bound == "PCIe"  # the K/V over PCIe for every token
    assert slow.phase("rollout").pcie_bytes > 2048 * 128 * GIB
    assert base.total < 0.5 * 6785  # well under the paper's measured step
    assert base.phase("prefill").seconds / base.total > 0.7  # still mostly prefill


def test_a_4_bit_base_pays_its_dequantization(qwen: ModelSpec) -> None:
    """QLoRA: every pass over more than NF4_FUSED_ROWS rows, and every backward, reads the
    NF4 codes and writes the bf16 copy of each 4-bit weight before its matmul (bitsandbytes),
    added to the roofline; decoding up to that many rows reads the codes instead of bf16."""
    base = _work(QWEN_21, 8, "exact", stages=1, gpus=1)
    nf4 = dataclasses.replace(base, quantization="nf4")
    plain, quantized = estimate_time(qwen, base), estimate_time(qwen, nf4)
    weights = sum(layer.quantizable for layer in qwen.layers)
    per_pass = (nf4_bytes(weights) + 2 * weights) / Hardware().hbm_rate
    assert 2 < per_pass * Hardware().hbm_rate / weights < 2.6
    chunks, passes = 257, 3  # forward, the checkpointed recompute, backward
    added = {name: quantized.phase(name).seconds - plain.phase(name).seconds for name in PHASES}
    assert added["prefill"] == pytest.approx(chunks * per_pass, rel=1e-6)
    assert added["replay"] == pytest.approx(8 * passes * per_pass, rel=1e-6)
    assert added["sweep"] == pytest.approx(chunks * passes * per_pass, rel=1e-6)
    assert added["rollout"] == pytest.approx(2048 * per_pass, rel=0.01)  # G=8 rows: dequantized
    assert added["optimizer"] == 0
    # G=2: bitsandbytes' fused kernel reads the 4-bit codes, less than the bf16 weights
    two = [estimate_time(qwen, dataclasses.replace(w, group=2)) for w in (base, nf4)]
    assert two[1].phase("rollout").seconds < two[0].phase("rollout").seconds
    assert two[1].phase("prefill").seconds == pytest.approx(quantized.phase("prefill").seconds)


# --- the CLI ---------------------------------------------------------------------------------


_QWEN_ARGS = ["--preset", "Qwen3.6-27B", "--prompt-tokens", "2100000", "--gpu-mem", "96GiB"]


def test_cli_stages_prints_the_worst_stage_every_stage_and_the_time(capsys) -> None:
    assert main([*_QWEN_ARGS, "--group", "8", "--stages", "8"]) == 0
    out = capsys.readouterr().out
    assert "8 stages x 1 replica(s); worst stage 0 (layers 0-7)" in out
    assert "per stage" in out and "56-63" in out
    assert "in-flight sweep chunk graphs (1F1B)" in out
    assert "time per step (H20, 8 stage(s))" in out and "prefill" in out
    assert "fits" in out


def test_cli_time_flags_and_stage_starts(capsys) -> None:
    args = [*_QWEN_ARGS, "--stages", "2", "--gpus", "2", "--stage-starts", "0,40"]
    args += ["--gradient", "detached", "--tflops", "989", "--gpu-name", "H100"]
    main(args)
    out = capsys.readouterr().out
    assert "(layers 0-39)" in out and "time per step (H100, 2 stage(s))" in out
    assert main([*_QWEN_ARGS, "--time"]) in (0, 1)  # one stage: the time only with --time
    assert "time per step (H20, 1 stage(s))" in capsys.readouterr().out


def test_cli_refuses_bad_stage_counts_naming_the_key(capsys) -> None:
    assert main([*_QWEN_ARGS, "--stages", "65"]) == 2
    assert "distributed.pipeline_stages=65" in capsys.readouterr().err
    assert main([*_QWEN_ARGS, "--stages", "3", "--gpus", "8"]) == 2
    assert "does not divide" in capsys.readouterr().err


def test_cli_stages_over_a_run_config(capsys) -> None:
    config = str(ROOT / "configs/qwen36/tiny_grpo_cpu.yaml")
    assert main(["--config", config, "--stages", "2", "--gpus", "2"]) == 0
    out = capsys.readouterr().out
    assert "2 stages x 1 replica(s)" in out and "time per step" in out


@pytest.mark.slow
def test_docs_pipeline_tables_are_current() -> None:
    """docs/pipeline_plans.md's generated block is what the generator writes today."""
    import importlib.util

    path = ROOT / "docs/tools/paper_tables.py"
    module_spec = importlib.util.spec_from_file_location("paper_tables", path)
    assert module_spec is not None and module_spec.loader is not None
    tables = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(tables)
    block = tables.pipeline_tables()
    assert block in (ROOT / "docs/pipeline_plans.md").read_text()
    assert "| Qwen3.6-27B LoRA, 4.46M, 8 x 96GiB | 8 x 1 | detached, checkpointed" in block
