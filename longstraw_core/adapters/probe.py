"""What the cross-cutting tests and benchmarks need of a model family: ``FamilyProbe``.

Why here: offload, QLoRA, loading, mixed precision, pipeline, the TRL losses, the demo and
the GPU check each run "every family". A family says once, at its registration
(``ModelFamily.probe``), which tiny model stands for it, what it can run (``capabilities``),
its GPU shapes and the kernels its runs must record; the tests and benchmarks ask
``longstraw_core.adapters.matrix.families_for`` instead of typing the families again, so a
family registered anywhere (a package of one's own, a test) gets their coverage.

This module imports nothing of LongStraw (``family`` imports it, and anything imports that).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

# --- capabilities: what a family's probe model can be run through -----------------------------
# CPU tests: every family gets them unless it declares otherwise.
OFFLOAD = "offload"  # prefix state in CPU memory equals a device-resident run
QLORA = "qlora"  # an NF4 base under LoRA
LOADING = "loading"  # one-process load from a checkpoint equals the old path
MIXED_PRECISION = "mixed_precision"  # bf16 working weights equal FSDP2's policy
PIPELINE = "pipeline"  # pipeline stages train like one process
TOOL_MASK = "tool_mask"  # grpo_step with loss masks equals TRL's loss
DEMO = "demo"  # ``python -m longstraw_core.training.state_demo --model-type`` checks itself
PREFILL_OPTIONS = "prefill_options"  # a state prefilled with exact mode's options serves it
TEST_CAPABILITIES: frozenset[str] = frozenset(
    {OFFLOAD, QLORA, LOADING, MIXED_PRECISION, PIPELINE, TOOL_MASK, DEMO, PREFILL_OPTIONS}
)
# Benchmarks: a family opts in, with the shapes they need.
GPU_CHECK = "gpu_check"  # one bf16 recipe step on a GPU (needs ``GpuShapes.recipe``)
PREFILL_BENCHMARK = "prefill_benchmark"  # gpu_check's prefill timing (``GpuShapes.bench_dims``)
PREFIX_MEMORY = "prefix_memory"  # benchmarks/prefix_memory.py in benchmarks/report.py
BENCHMARK_CAPABILITIES: frozenset[str] = frozenset({GPU_CHECK, PREFILL_BENCHMARK, PREFIX_MEMORY})
CAPABILITIES: frozenset[str] = TEST_CAPABILITIES | BENCHMARK_CAPABILITIES

# Kernel calls a run can be expected to record (``benchmarks/kernel_trace.py``'s counters).
KERNEL_CALLS = ("attention", "deltanet")


@dataclass(frozen=True)
class GpuShapes:
    """What ``make gpu-check`` builds for a family on a GPU.

    - ``recipe``: ``(script, config)`` of the recipe its ``recipes`` step runs (on the probe
      model: ``model.tiny`` is overridden).
    - ``recipe_dims``: tiny-config overrides giving head dims the GPU kernels take (flash /
      SDPA want multiples of 8, fla's Gated DeltaNet 64 and up).
    - ``bench_dims``: tiny-config overrides of the prefill benchmark (wide enough to keep
      the GPU busy); None: the family is not in the benchmark.
    """

    recipe: tuple[str, str]
    recipe_dims: Mapping[str, int] = field(default_factory=dict)
    bench_dims: Mapping[str, int] | None = None


@dataclass(frozen=True)
class FamilyProbe:
    """The tiny model the cross-cutting tests and benchmarks build for a family.

    - ``model_type``: which of the family's ``tiny_configs`` (``tiny_models.tiny_model``)
      stands for it; "" (the default): the first one.
    - ``capabilities``: what it can be run through (this module's names); by default every
      CPU test, no benchmark. A family that cannot run a test leaves its capability out.
    - ``gpu``: its GPU shapes (``GpuShapes``), needed for ``gpu_check`` and
      ``prefill_benchmark``.
    - ``expected_kernels``: the kernel calls (``KERNEL_CALLS``) every run of it records
      (``kernel_trace.failures``: a run recording none of one was not traced).
    - ``float32_inside``: part of a layer computes in float32 whatever the model's dtype
      (pipeline pieces round as float32 does).
    """

    model_type: str = ""
    capabilities: frozenset[str] = TEST_CAPABILITIES
    gpu: GpuShapes | None = None
    expected_kernels: tuple[str, ...] = ()
    float32_inside: bool = False

    def can(self, capability: str) -> bool:
        """Whether the probe runs through ``capability`` (a name of this module)."""
        if capability not in CAPABILITIES:
            raise ValueError(f"unknown capability {capability!r}; known: {sorted(CAPABILITIES)}")
        return capability in self.capabilities

    def problems(self, tiny_types: Mapping[str, object]) -> list[str]:
        """What is wrong with this probe of a family whose tiny configs are ``tiny_types``."""
        found = []
        if self.model_type not in tiny_types:
            found.append(f"probe model type {self.model_type!r} has no tiny config")
        unknown = sorted(set(self.capabilities) - CAPABILITIES)
        if unknown:
            found.append(f"unknown capabilities {unknown}; known: {sorted(CAPABILITIES)}")
        if GPU_CHECK in self.capabilities and self.gpu is None:
            found.append("capability 'gpu_check' needs GPU shapes (probe.gpu)")
        if PREFILL_BENCHMARK in self.capabilities and (self.gpu is None or not self.gpu.bench_dims):
            found.append("capability 'prefill_benchmark' needs probe.gpu.bench_dims")
        bad = sorted(set(self.expected_kernels) - set(KERNEL_CALLS))
        if bad:
            found.append(f"expected kernels {bad}; kernel calls are {list(KERNEL_CALLS)}")
        return found
