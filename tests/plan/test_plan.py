"""The memory planner against measured peaks, its CLI, ``check_fits`` and ``memory`` config.

Accuracy: each case runs one real step on a tiny model (prefill, rollout, ``grpo_step``, an
AdamW step) under ``LiveTensorMemory``, which sums the live tensor storages (parameters,
gradients, optimizer moments, state, activations; not Python objects nor kernels' internal
scratch), and compares its peak with the planner's prediction, made from the config alone.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import longstraw_core as ls
import longstraw_core.adapters.lm_head as lm_head
from longstraw_core.config import ConfigError, load_config
from longstraw_core.models.mixed_precision import FullPrecision, WorkingWeights
from longstraw_core.models.tiny import tiny_model
from longstraw_core.plan import (
    MemoryPlanError,
    ModelSpec,
    Scenario,
    Workload,
    check_fits,
    compute_plan,
    plan_for_config,
    plan_memory,
)
from longstraw_core.plan.sources import PRESET_LORA_TARGETS
from longstraw_core.state.prefix import format_bytes
from longstraw_core.tensors.memory import LiveTensorMemory, parse_bytes

ROOT = Path(__file__).resolve().parents[2]
TOLERANCE = 0.15
# The paper tables' first scenario (docs/tools/paper_tables.py): Qwen3.6-27B, LoRA r=32,
# 2.1M positions, 8 x 96GiB.
QWEN_LORA = Scenario("Qwen3.6-27B", 2_100_000, 8, "96GiB", 32, PRESET_LORA_TARGETS["Qwen3.6-27B"])


@dataclasses.dataclass(frozen=True)
class Case:
    model_type: str
    gradient: str
    prompt: int
    group: int
    response: int
    chunk: int
    checkpointing: bool = False  # adapter.activation_checkpointing
    vocab: int = 512  # the tiny models' own
    head_chunk: int = (
        0  # longstraw_core.adapters.lm_head.HEAD_CHUNK_ELEMENTS for the case (0: as it is)
    )
    keep_outputs: bool = False  # GRPOConfig.keep_attention_outputs
    bf16: bool = False  # bf16 working weights over float32 masters (models/mixed_precision.py)
    config: tuple[tuple[str, object], ...] = ()  # the tiny config's overrides


SLIDING = (
    ("use_sliding_window", True),
    ("sliding_window", 64),
    ("num_hidden_layers", 4),
    (
        "layer_types",
        ("sliding_attention", "full_attention", "sliding_attention", "sliding_attention"),
    ),
)
CASES = [
    Case("qwen3", "detached", 4096, 4, 48, 1024),
    Case("qwen3", "exact", 4096, 2, 64, 512),
    Case("qwen3_5_text", "detached", 3072, 3, 32, 512),
    Case("qwen3_5_text", "exact", 3072, 2, 48, 512),
    Case("glm_moe_dsa", "detached", 2048, 2, 32, 512),
    Case("glm_moe_dsa", "exact", 2048, 2, 32, 256),
    Case("qwen3", "exact", 4096, 2, 64, 512, keep_outputs=True),
    # Activation checkpointing, with responses and chunks long enough for the step to be the
    # peak: the head's logits (qwen3), a layer recomputed in the sweep (qwen3_5_text).
    Case("qwen3", "detached", 1024, 2, 512, 256, checkpointing=True),
    Case("qwen3_5_text", "exact", 2048, 2, 256, 1024, checkpointing=True),
    Case("glm_moe_dsa", "exact", 1024, 2, 256, 512, checkpointing=True),
    # The LM head in chunks of 64 rows (eight a branch) with a vocabulary large enough for
    # the head to be the step's peak.
    Case("qwen3", "detached", 1024, 2, 512, 256, vocab=8192, head_chunk=64 * 8192),
    Case("qwen3_5_text", "exact", 1024, 2, 512, 256, True, vocab=8192, head_chunk=64 * 8192),
    # bf16 working weights: a bf16 state, the bf16 copy and one backward's bf16 gradients.
    Case("qwen3", "exact", 4096, 2, 64, 512, bf16=True),
    Case("qwen3_5_text", "detached", 3072, 3, 32, 512, bf16=True),
    # Sliding-window layers (width 64) around a full-attention one: a fixed window per layer.
    Case("qwen3", "exact", 1024, 2, 64, 256, config=SLIDING),
    Case("qwen3", "detached", 1024, 3, 48, 256, config=SLIDING),
    # gpt-oss: sliding (width 8) and full layers in turn, attention sinks (on a CPU the torch
    # backend, each segment through PyTorch's fused kernel), a top-2 mixture of 4 experts.
    Case("gpt_oss", "exact", 1024, 2, 64, 256),
    Case("gpt_oss", "detached", 1024, 3, 48, 256),
]


def measure_step(model: torch.nn.Module, case: Case) -> tuple[LiveTensorMemory, dict]:
    """One recipe-shaped step in steady state (AdamW moments already exist), measured."""
    adapter = ls.adapt(model)
    adapter.activation_checkpointing = case.checkpointing
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    for p in params:  # a first step creates the moments: later steps start with them
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, adapter.vocab_size, (case.prompt,), generator=generator)
    config = ls.GRPOConfig(
        num_generations=case.group, gradient=case.gradient, keep_attention_outputs=case.keep_outputs
    )
    checkpoints = "device" if case.gradient == "exact" else None
    tracked = [*model.parameters(), *model.buffers(), optimizer.state_dict()["state"], prompt]
    weights = WorkingWeights(model) if case.bf16 else FullPrecision()
    with LiveTensorMemory(tracked) as memory, weights.step():
        with memory.phase("prefill"):
            state = adapter.prefill(
                prompt, chunk_size=case.chunk, checkpoints=checkpoints,
                keep_attention_outputs=case.keep_outputs,
            )  # fmt: skip
        with memory.phase("rollout"):
            out = ls.rollout(adapter, state, case.group, case.response, seed=0)
        with memory.phase("step"):
            rewards = [float(i) for i in range(case.group)]
            result = ls.grpo_step(
                adapter, prompt, out.responses, rewards, config=config, state=state,
                chunk_size=case.chunk,
            )  # fmt: skip
        with memory.phase("optimizer"):
            weights.to_masters()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return memory, result.metrics() | {"checkpoint_bytes": state.checkpoint_nbytes()}


def _case_id(case: Case) -> str:
    name = f"{case.model_type}-{case.gradient}" + ("-checkpointed" if case.checkpointing else "")
    name += "-kept-outputs" if case.keep_outputs else ""
    name += "-bf16" if case.bf16 else ""
    name += "-sliding" if case.config else ""
    return name + ("-head-chunks" if case.head_chunk else "")


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_prediction_within_15_percent_of_measured_peak(case: Case, monkeypatch) -> None:
    torch.set_num_threads(1)
    if case.head_chunk:  # the adapter's and the planner's budget
        monkeypatch.setattr(lm_head, "HEAD_CHUNK_ELEMENTS", case.head_chunk)
    positions = case.prompt + case.response + 8
    overrides = {"vocab_size": case.vocab} if case.vocab != 512 else {}
    overrides |= {k: list(v) if isinstance(v, tuple) else v for k, v in case.config}
    model = tiny_model(case.model_type, max_position_embeddings=positions, **overrides).train()
    memory, metrics = measure_step(model, case)
    # The planner reads the state's records from a model in the compute dtype (as
    # plan_for_config builds it).
    spec_model = copy.deepcopy(model).to(torch.bfloat16) if case.bf16 else model
    spec = ModelSpec.from_model(spec_model, case.model_type)
    work = Workload(
        prompt_tokens=case.prompt,
        group=case.group,
        response_tokens=case.response,
        chunk_size=case.chunk,
        gradient=case.gradient,
        device="cpu",
        activation_checkpointing=case.checkpointing,
        keep_attention_outputs=case.keep_outputs,
        compute_dtype=torch.bfloat16 if case.bf16 else torch.float32,
    )
    plan = plan_memory(spec, work)
    error = (plan.peak - memory.peak) / memory.peak
    phases = {
        "prefill": plan.phases["prefill"],
        "rollout": plan.phases["rollout"],
        "step": max(plan.phases["replay"], plan.phases.get("sweep", 0)),
        "optimizer": plan.phases["optimizer"],
    }
    report = {name: (memory.phases[name], phases[name]) for name in phases}
    assert abs(error) <= TOLERANCE, f"peak {memory.peak} vs {plan.peak} ({error:+.1%}): {report}"
    # The exact parts come from the adapter's own records: they must match to the byte.
    state = sum(line.device for line in plan.lines if line.name.startswith("prefix state"))
    assert state == metrics["state_bytes"]
    if case.gradient == "exact":
        assert plan.line("dS (exact)").device == metrics["state_grad_bytes"]
        checkpoints = next((x for x in plan.lines if x.name == "recurrent checkpoints"), None)
        assert (checkpoints.device if checkpoints else 0) == metrics["checkpoint_bytes"]
        kept = next((x for x in plan.lines if x.name == "kept attention outputs"), None)
        assert (kept.device if kept else 0) == metrics["attention_output_bytes"]
        assert bool(kept) == case.keep_outputs


def test_checkpointing_shrinks_the_branch_and_sweep_at_paper_scale() -> None:
    """Qwen3.6-27B, a 2048-token branch and an 8192-token chunk: checkpointed, each keeps
    one ``[T, hidden]`` input per layer instead of every activation; the rest of the step
    (parameters, state, dS) is the same."""
    from longstraw_core.plan import scenario_workload, spec_for_preset

    spec = spec_for_preset("Qwen3.6-27B")
    work = scenario_workload(QWEN_LORA, 8, "exact")  # the shipped configs checkpoint
    work = dataclasses.replace(work, activation_checkpointing=False)
    plain = plan_memory(spec, work)
    checkpointed = plan_memory(spec, dataclasses.replace(work, activation_checkpointing=True))
    branch, sweep = "one branch graph (transient)", "sweep chunk graph (transient)"
    assert checkpointed.line(branch).device < 0.2 * plain.line(branch).device
    assert checkpointed.line(sweep).device < 0.2 * plain.line(sweep).device
    for name in ("parameters", "prefix state: full_attention", "dS (exact)"):
        assert checkpointed.line(name) == plain.line(name)
    assert checkpointed.phases["prefill"] == plain.phases["prefill"]


def test_chunked_head_shrinks_the_branch_at_paper_scale(monkeypatch) -> None:
    """Qwen3.6-27B, a 2048-token branch over a 248K vocabulary, layers checkpointed: the head
    in chunks of 256 rows keeps no ``[T, vocab]`` log-probs and builds one chunk's logits
    at a time, a fraction of the whole branch's."""
    from longstraw_core.plan import scenario_workload, spec_for_preset

    spec = spec_for_preset("Qwen3.6-27B")
    work = scenario_workload(QWEN_LORA, 8, "exact")
    work = dataclasses.replace(work, activation_checkpointing=True)
    branch = "one branch graph (transient)"
    chunked = plan_memory(spec, work)
    assert "logits [256, 248320]" in chunked.line(branch).note
    monkeypatch.setattr(lm_head, "HEAD_CHUNK_ELEMENTS", 1 << 40)  # the whole branch: one chunk
    whole = plan_memory(spec, work)
    assert chunked.line(branch).device < 0.4 * whole.line(branch).device
    tokens, vocab = work.response_tokens, spec.vocab
    assert whole.line(branch).device - chunked.line(branch).device > 2 * 4 * tokens * vocab


def test_live_tensor_memory_counts_views_once_and_frees() -> None:
    with LiveTensorMemory() as memory:
        x = torch.zeros(1000)
        views = [x[:10], x[10:], x.view(10, 100)]
        assert memory.current == 4000
        y = x * 2
        assert memory.current == 8000
        del x, views, y
        assert memory.current == 0
    assert memory.peak == 8000


# --- check_fits, the CLI ----------------------------------------------------------------------

TINY_QWEN36 = ROOT / "configs/qwen36/tiny_grpo_cpu.yaml"


def _config(*overrides: str):
    return load_config(TINY_QWEN36, list(overrides), check_paths=False)


def test_check_fits_without_a_budget_returns_the_plan_unchecked() -> None:
    plan = check_fits(_config())
    assert plan.fits is None and plan.peak > 0
    assert plan.work.device == "cpu"


def test_check_fits_names_a_smaller_chunk_when_that_is_enough() -> None:
    cfg = _config("memory.headroom=0")
    big = check_fits(cfg, gpu_mem="1TiB")
    small = check_fits(_config("memory.headroom=0", "train.chunk_size=256"), gpu_mem="1TiB")
    budget = (big.peak + small.peak) // 2
    with pytest.raises(MemoryPlanError) as caught:
        check_fits(cfg, gpu_mem=budget)
    message = str(caught.value)
    assert "per GPU" in message and "train.chunk_size=" in message
    assert caught.value.plan.peak == big.peak
    relaxed = check_fits(_config("memory.headroom=0", "memory.check=false"), gpu_mem=budget)
    assert relaxed.fits is False  # memory.check=false: the plan, no error


def test_check_fits_offloads_attention_when_the_state_does_not_fit() -> None:
    cfg = _config(
        "model.tiny=qwen3",
        "model.tiny_overrides={max_position_embeddings: 300000}",
        "grpo.gradient=detached",
        "data.prompt_tokens=262144",
        "memory.headroom=0",
    )
    plan = check_fits(cfg, gpu_mem="1TiB")
    state = plan.line("prefix state: full_attention").device
    with pytest.raises(MemoryPlanError, match=r"offload\.attention=cpu") as caught:
        check_fits(cfg, gpu_mem=plan.peak - state // 2)
    assert "saves" in str(caught.value)


def test_cpu_offload_moves_state_and_ds_off_the_device() -> None:
    cfg = _config(
        "data.prompt_tokens=65536", "model.tiny_overrides={max_position_embeddings: 70000}"
    )
    spec, work = plan_for_config(cfg)
    resident = plan_memory(spec, work)
    offloaded = plan_memory(
        spec, dataclasses.replace(work, offload=ls.OffloadPolicy(attention="cpu"))
    )
    line = offloaded.line("prefix state: full_attention")
    assert line.device == 0 and line.cpu == resident.line("prefix state: full_attention").device
    assert offloaded.line("dS (exact)").cpu > 0
    assert offloaded.peak < resident.peak


def _cli(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "longstraw_core.plan", *args]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_cli_prints_a_table_and_exits_zero_when_it_fits(tmp_path: Path) -> None:
    markdown = tmp_path / "plan.md"
    result = _cli(
        "--config", str(TINY_QWEN36), "--prompt-tokens", "8192", "--group", "8",
        "--gpu-mem", "8GiB", "--markdown", str(markdown),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    for row in ("parameters", "prefix state: full_attention", "dS (exact)", "predicted peak"):
        assert row in result.stdout
    assert "fits" in result.stdout
    assert "| predicted peak per GPU" in markdown.read_text()


def test_check_fits_names_activation_checkpointing_when_that_is_enough() -> None:
    cfg = _config("memory.headroom=0", "train.chunk_size=256", "grpo.gradient=detached")
    spec, work = plan_for_config(cfg, gpu_mem="1TiB")
    plain = plan_memory(spec, dataclasses.replace(work, response_tokens=2048))
    checkpointed = plan_memory(spec, dataclasses.replace(plain.work, activation_checkpointing=True))
    assert checkpointed.peak < plain.peak
    budget = (plain.peak + checkpointed.peak) // 2
    tight = plan_memory(spec, dataclasses.replace(plain.work, budget=budget))
    assert tight.fits is False
    assert any("train.activation_checkpointing=true" in line for line in tight.advice)


def test_cli_activation_checkpointing_flag(tmp_path: Path) -> None:
    markdown = tmp_path / "plan.md"
    result = _cli(
        "--preset", "Qwen3.6-27B", "--prompt-tokens", "65536", "--gpus", "8",
        "--activation-checkpointing", "--markdown", str(markdown),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    text = markdown.read_text()
    assert "exact, activation checkpointing, 8 GPU(s)" in text
    assert "layers checkpointed" in text


def test_cli_exits_nonzero_and_names_the_fix_when_it_does_not_fit() -> None:
    result = _cli(
        "--config", str(TINY_QWEN36), "--prompt-tokens", "16384", "--gpu-mem", "100MiB",
        "--offload", "attention=cpu", "--resident-layers", "1",
    )  # fmt: skip
    assert result.returncode == 1
    assert "error: predicted" in result.stderr and "train.chunk_size=" in result.stderr


# --- the memory section ---------------------------------------------------------------------


def test_memory_section_validates() -> None:
    cfg = _config("memory.gpu_mem=80GB", "memory.gpus=8")
    assert parse_bytes(cfg.memory.gpu_mem) == 80 * 10**9 and cfg.memory.gpus == 8
    assert parse_bytes("96GiB") == 96 * 2**30
    for override, key in (
        ("memory.gpu_mem=96 gigabytes", "memory.gpu_mem"),
        ("memory.gpu_mem=-1GB", "memory.gpu_mem"),
        ("memory.gpus=0", "memory.gpus"),
        ("memory.headroom=1.0", "memory.headroom"),
    ):
        with pytest.raises(ConfigError) as caught:
            _config(override)
        assert caught.value.key == key
    with pytest.raises(ConfigError, match=r"did you mean 'memory\.gpu_mem'"):
        _config("memory.gpu_memory=80GB")


@pytest.mark.slow
def test_paper_tables_render(tmp_path: Path) -> None:
    path = tmp_path / "tables.md"
    command = [sys.executable, str(ROOT / "docs/tools/paper_tables.py"), str(path)]
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    text = path.read_text()
    assert "Qwen3.6-27B, LoRA r=32, 2.10M positions" in text and "GLM-5.2" in text
    assert "### Assumptions" in text


def test_kept_attention_outputs_at_paper_scale_and_the_fix_that_drops_them() -> None:
    """Qwen3.6-27B at 256K tokens: the kept outputs are heads x (head_dim + fp32 lse) per
    token for 15 of its 16 full-attention layers (the last only writes its state), about 3x
    their K/V; when they are what does not fit, the first fix is to stop keeping them."""
    from longstraw_core.plan import fixes_for, scenario_workload, spec_for_preset

    spec = spec_for_preset("Qwen3.6-27B")
    work = scenario_workload(QWEN_LORA, 8, "exact")
    work = dataclasses.replace(
        work, prompt_tokens=262144, activation_checkpointing=True, keep_attention_outputs=True,
        rollout_gather="per_step",  # the same rollout either way: only the outputs differ
    )  # fmt: skip
    plan = plan_memory(spec, work)
    kept = plan.line("kept attention outputs").device
    assert kept == 15 * 24 * (256 * 2 + 4) * (262144 - 1)
    assert 2.5 < kept / plan.line("prefix state: full_attention").device < 3.2
    without = plan_memory(spec, dataclasses.replace(work, keep_attention_outputs=False))
    assert plan.peak - without.peak == kept
    assert not plan.fits and without.fits
    assert fixes_for(plan)[0].keys == "grpo.keep_attention_outputs=false"


def test_fsdp_rollout_gathers_the_model_once_when_that_fits() -> None:
    """``rollout_gather="auto"`` holds the unsharded model through the rollout when the plan
    still fits (Qwen3.6-27B LoRA detached on 8 GPUs), and gathers per step when it would
    not (exact); ``once`` forces it, and the advice then names ``per_step``."""
    from longstraw_core.offload import OffloadPolicy
    from longstraw_core.plan import scenario_workload, spec_for_preset

    spec = spec_for_preset("Qwen3.6-27B")
    paper = {  # docs/memory_plans.md's settings for this run
        "offload": OffloadPolicy.parse({"attention": "cpu"}),
        "activation_checkpointing": True,
        "chunk_size": 8192,
    }
    detached = dataclasses.replace(scenario_workload(QWEN_LORA, 2, "detached"), **paper)
    once, per_step = (
        plan_memory(spec, dataclasses.replace(detached, rollout_gather=setting))
        for setting in ("auto", "per_step")
    )
    assert once.rollout_gathered and not per_step.rollout_gathered
    whole = spec.params * 2  # the bf16 base, gathered in its compute dtype
    assert once.line("FSDP parameters gathered for rollout").device == whole
    gathered = per_step.line("FSDP gathered parameters").device
    assert once.phases["rollout"] - per_step.phases["rollout"] == whole - gathered
    assert once.phases["replay"] == per_step.phases["replay"]  # only the rollout changes
    exact = dataclasses.replace(scenario_workload(QWEN_LORA, 2, "exact"), **paper)
    auto = plan_memory(spec, exact)
    assert auto.fits and not auto.rollout_gathered  # once would not fit: per step
    forced = plan_memory(spec, dataclasses.replace(exact, rollout_gather="once"))
    assert forced.rollout_gathered and not forced.fits
    assert any("distributed.rollout_gather=per_step" in line for line in forced.advice)


def test_a_full_fine_tuning_reference_model_is_counted_sharded() -> None:
    """``beta > 0`` without LoRA keeps a frozen copy of the model, sharded like the policy:
    its bytes are in every phase."""
    from longstraw_core.plan import scenario_workload, spec_for_preset

    spec = spec_for_preset("Qwen3.6-27B")
    work = dataclasses.replace(
        scenario_workload(QWEN_LORA, 2, "detached"), lora_rank=0, lora_targets=()
    )
    without = compute_plan(spec, work)
    with_reference = compute_plan(spec, dataclasses.replace(work, reference_model=True))
    reference = with_reference.line("reference model").device
    assert reference == spec.params * 2 // 8  # bf16 weights over 8 FSDP ranks
    for phase, peak in without.phases.items():
        assert with_reference.phases[phase] - peak == reference, phase


def test_the_recipe_hears_why_a_rollout_gathers_per_step() -> None:
    """``plan.rollout_gathers_once``: with no budget, once; with one too small for the
    gathered model, per step and a message naming the key; settings other than auto win."""
    from longstraw_core.plan import rollout_gathers_once

    assert rollout_gathers_once(_config("distributed.fsdp=true")) == (True, None)
    once, why = rollout_gathers_once(_config("distributed.fsdp=true", "memory.gpu_mem=3MiB",
                                             "memory.check=false"))  # fmt: skip
    assert not once and "distributed.rollout_gather=once" in why
    forced = _config(
        "distributed.fsdp=true", "memory.gpu_mem=3MiB", "distributed.rollout_gather=once"
    )
    assert rollout_gathers_once(forced) == (True, None)
    with pytest.raises(ConfigError, match=r"distributed\.rollout_gather"):
        _config("distributed.rollout_gather=sometimes")


def test_exact_mode_with_room_to_spare_hears_that_kept_outputs_fit() -> None:
    from longstraw_core.plan import scenario_workload, spec_for_preset

    spec = spec_for_preset("Qwen3.6-27B")
    work = scenario_workload(QWEN_LORA, 8, "exact")
    work = dataclasses.replace(work, prompt_tokens=131072, activation_checkpointing=True)
    plan = plan_memory(spec, work)
    kept = plan_memory(spec, dataclasses.replace(work, keep_attention_outputs=True))
    assert plan.fits and kept.fits
    assert any("grpo.keep_attention_outputs=true also fits" in line for line in plan.advice)
    assert not any("keep_attention_outputs" in line for line in kept.advice)
    detached = plan_memory(spec, dataclasses.replace(work, gradient="detached"))
    assert not any("keep_attention_outputs" in line for line in detached.advice)


def test_offloaded_state_says_what_each_decode_step_streams() -> None:
    """Rollout reads the whole prefix every new token: offloaded, that is the whole
    offloaded state copied to the GPU per step, which the advice spells out."""
    from longstraw_core.offload import OffloadPolicy
    from longstraw_core.plan import scenario_workload, spec_for_preset

    spec = spec_for_preset("Qwen3.6-27B")
    work = scenario_workload(QWEN_LORA, 8, "detached")
    work = dataclasses.replace(
        work, prompt_tokens=131072, offload=OffloadPolicy(attention="cpu"), rollout=True
    )
    plan = plan_memory(spec, work)
    offloaded = plan.line("prefix state: full_attention").cpu
    (line,) = [text for text in plan.advice if text.startswith("rollout: every decode step")]
    assert f"{format_bytes(offloaded)} a step" in line
    assert f"{format_bytes(offloaded * work.response_tokens)} for" in line
    resident = plan_memory(spec, dataclasses.replace(work, offload=None))
    assert not any(text.startswith("rollout:") for text in resident.advice)


# --- the package's shape: no import cycle, no private names across modules -------------------

PLAN_DIR = ROOT / "longstraw_core" / "plan"


def _imported_modules(path: Path, package: str) -> set[str]:
    """Every module ``path`` imports, at its top or inside a function, as dotted names (for
    ``from a import b``: ``a`` and ``a.b``, since ``b`` may be a module)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package (level 1) or above
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def plan_import_graph(directory: Path = PLAN_DIR) -> dict[str, set[str]]:
    """Each module of ``longstraw_core.plan`` -> the package's modules it imports. Importing
    the package itself (``longstraw_core.plan``, which imports them all) counts as ``__init__``."""
    package = "longstraw_core.plan"
    modules = {path.stem: path for path in directory.glob("*.py")}
    graph = {}
    for name, path in modules.items():
        targets = set()
        for dotted in _imported_modules(path, package):
            if dotted == package:
                targets.add("__init__")
            elif dotted.startswith(package + "."):
                targets.add(dotted.split(".")[2])
        graph[name] = (targets & set(modules)) - {name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (its modules in order), or None."""
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> list[str] | None:
        if node in path:
            return [*path[path.index(node) :], node]
        if node in done:
            return None
        for target in sorted(graph.get(node, ())):
            cycle = visit(target, [*path, node])
            if cycle:
                return cycle
        done.add(node)
        return None

    for start in sorted(graph):
        cycle = visit(start, [])
        if cycle:
            return cycle
    return None


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for target in graph[todo.pop()] - seen:
            seen.add(target)
            todo.append(target)
    return seen


def test_find_cycle_finds_one() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


# The package's layers, lowest first (its docstring's order): a module imports only earlier ones.
PLAN_LAYERS = (
    "units", "model", "kernels", "activations", "flops", "pieces", "stages", "weights", "core",
    "chunking", "roofline", "timing", "calibration", "sources", "advice", "output", "cli", "__main__",
)  # fmt: skip


def test_planner_modules_import_no_cycle_and_the_core_stays_pure() -> None:
    """Lazy imports (inside functions) count: a cycle through one is still a cycle."""
    graph = plan_import_graph()
    submodules = {name: targets - {"__init__"} for name, targets in graph.items()}
    assert find_cycle(submodules) is None
    for name, targets in graph.items():  # the facade imports them all: none may import it
        assert name == "__main__" or "__init__" not in targets, name
    assert not _reachable(graph, "core") & {"sources", "advice", "output", "cli"}
    assert set(graph) == {*PLAN_LAYERS, "__init__"}, "a new module: place it in PLAN_LAYERS"
    for index, name in enumerate(PLAN_LAYERS):
        assert submodules[name] <= set(PLAN_LAYERS[:index]), (name, submodules[name])


def test_planner_modules_import_no_private_names() -> None:
    """What one module uses of another is public: no ``from x import _name``."""
    private = []
    for path in [*sorted(PLAN_DIR.glob("*.py")), ROOT / "docs/tools/paper_tables.py"]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                names = [a.name for a in node.names if a.name.startswith("_")]
                private += [f"{path.name}: from {node.module} import {n}" for n in names]
    assert private == []
