"""``make gpu-check``'s plan: its phases, each step's time limit and the outer limit, in one
place, with the standard library alone.

Why alone: on a machine without a GPU (no NVIDIA device) ``gpu_check.sh`` runs this file,
which prints what a GPU run would do (every phase, its steps and their limits, what one GPU
skips) and exits 0 in well under a second, with no torch needed. ``gpu_check.py`` reads the
same figures, so the plan printed is the plan run.

The budget: the device tool gives a command at most 600 s; the shell's ``timeout`` of
``OUTER_LIMIT_S`` leaves the rest to the wheels' install and the transfers. Inside it,
``START_AND_WRITE_S`` for Python's start, the probe of the environment and the JSON writes,
and every step's own limit (``LIMITS_S``), which add up to the remainder: no step can take
another's time, and a step that hangs costs only its own limit.
"""

from __future__ import annotations

import sys

OUTER_LIMIT_S = 560
START_AND_WRITE_S = 30
# In the order they run. ``warmup`` first: it compiles the Triton kernels the later steps
# use into a persistent cache (``TRITON_CACHE_DIR``), so a compile never eats their limits.
PHASES = (
    "warmup", "tests", "collectives", "fsdp", "host_syncs", "profile", "pinned", "fla",
    "layers", "recipes", "benchmark", "multi_gpu",
)  # fmt: skip
LIMITS_S: dict[str, dict[str, int]] = {
    "warmup": {"triton": 55},
    "tests": {"pytest": 60},
    "collectives": {"nccl_one_rank": 20},
    "fsdp": {"lora_bf16_gathers": 20},
    "host_syncs": {"rollout": 20},
    "profile": {"decode": 15},
    "pinned": {"probe": 15},
    "fla": {"head_dim_128": 15},
    "layers": {"qwen3": 25, "qwen3_5_text": 25},
    "recipes": {"qwen3": 30, "qwen3_5_text": 40, "glm_moe_dsa": 40},
    "benchmark": {"peaks": 15, "qwen3": 20, "qwen3_5_text": 20},
    "multi_gpu": {"qwen36": 30, "glm52": 30, "qwen36_s3": 35},
}
# What each phase answers (printed by the plan; docs/gpu_check.md says more).
PURPOSE = {
    "warmup": "Triton kernels (fla, at the head dims the steps use) compiled into the cache",
    "tests": "the suite's gpu-marked tests (fused attention, fla, offload streams)",
    "collectives": "a one-rank NCCL group through every collective helper: no CPU tensor",
    "fsdp": "a one-rank FSDP LoRA rollout, bf16 base, float32 LoRA: all-gathers per token",
    "host_syncs": "torch.cuda.set_sync_debug_mode('warn') over a rollout: syncs per token",
    "profile": "torch.profiler over 20 decode steps: kernels, launches, host time a step",
    "pinned": "pinned host memory: how fast it pins, and its copies against pageable ones",
    "fla": "fla's chunked and recurrent Gated DeltaNet kernels at head dim 128, timed",
    "layers": "real-width layers (hidden 5120; head dims 128, 256), chunk 8192 over "
    "prefixes of 128K and 512K, timed against the planner's figures",
    "recipes": "one bf16 GRPO step of each family's recipe, offloaded state, a checkpoint",
    "benchmark": "the GPU's matmul and copy peaks, each family's prefill (calibration)",
    "multi_gpu": "the recipes on pipeline stages over NCCL: S=2 (2+ GPUs), S=3 with G=2 < S "
    "(3+ GPUs)",
}
# GPUs a multi_gpu step needs (torchrun's --nproc_per_node: one stage per GPU).
STEP_GPUS = {"qwen36": 2, "glm52": 2, "qwen36_s3": 3}


def inner_total_s() -> int:
    """Every step's limit added up: with ``START_AND_WRITE_S``, within ``OUTER_LIMIT_S``."""
    return sum(sum(steps.values()) for steps in LIMITS_S.values())


def one_gpu_total_s() -> int:
    """The limits a one-GPU machine runs (the multi-GPU steps skipped)."""
    return inner_total_s() - sum(LIMITS_S["multi_gpu"].values())


def plan_text() -> str:
    """What a GPU run would do, one line a phase and its steps' limits."""
    lines = [
        f"gpu-check plan: {len(PHASES)} phases, outer limit {OUTER_LIMIT_S} s = start-up and "
        f"writes {START_AND_WRITE_S} s + steps {inner_total_s()} s (one GPU runs "
        f"{one_gpu_total_s()} s of them)"
    ]
    for phase in PHASES:
        steps = ", ".join(f"{step} {limit} s" for step, limit in LIMITS_S[phase].items())
        total = sum(LIMITS_S[phase].values())
        lines.append(f"  {phase:<12} {total:>4} s  [{steps}]  {PURPOSE[phase]}")
    return "\n".join(lines)


def main() -> int:
    print(plan_text())
    print(
        "gpu-check: no NVIDIA GPU on this machine, so nothing ran (the plan above is what a "
        'GPU run does; `make gpu-check ARGS="--device cpu --quick"` self-tests on CPU)'
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
