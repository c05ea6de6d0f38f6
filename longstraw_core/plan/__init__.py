"""Memory planner: the peak per GPU of one LongStraw GRPO step, before anything is loaded.

A long-prompt run fails late and expensively when it does not fit: after the weights load,
after a prefill of millions of tokens. The planner predicts the peak from the config alone
and names what to change (chunk size, offload, GPUs) when it does not fit::

    python -m longstraw_core.plan --config configs/qwen36/27b_lora_grpo_8xgpu.yaml \\
        --prompt-tokens 2100000 --group 8 --gpus 8 --gpu-mem 96GiB
    python -m longstraw_core.plan --preset Qwen3.6-27B --prompt-tokens 2100000 --group 8 \\
        --gpus 8 --gpu-mem 96GiB --offload attention=cpu --resident-layers 2
    python -m longstraw_core.plan --preset Qwen3.6-27B --prompt-tokens 2100000 --group 8 \\
        --gpu-mem 96GiB --stages 8          # one prompt over 8 pipeline stages, with times
    python docs/tools/paper_tables.py   # the tables at paper scale: docs/memory_plans.md

Where the numbers come from (so the plan cannot drift from the code):

- **Model.** The model is built from its transformers config on the ``meta`` device (no
  weights, no memory): a tiny model from ``longstraw_core.models.tiny``, a checkpoint's
  ``config.json`` through ``AutoConfig``, or a named paper-scale preset (a family's ``presets``).
  Parameter counts are read from its modules; LoRA counts ``r x (in + out)`` per targeted
  ``nn.Linear``.
- **State.** The adapter's own ``new_layer_states`` builds the records (on ``meta``) at
  capacity 0 and 1: their tensors give the fixed and per-position bytes of every layer, in
  the dtype the layers compute in. ``dS`` comes from each record's ``new_grad`` the same way,
  chunk-start checkpoints are one copy of the record per prefill chunk (a sliding window's
  holds the ``min(start, W - 1)`` rows it has there: ``KindPlan.checkpoints_bytes``).
- **Transients.** Activation memory is derived from tensor shapes, module by module, following
  the code that runs (``Activations``): what autograd saves in one branch (or one recomputed
  chunk), the LM head's float32 logits and ``log_softmax`` in row chunks
  (``longstraw_core.adapters.lm_head.HEAD_CHUNK_ELEMENTS``), the kernels' blocks
  (``attention.kernel_budgets()``, ``glm52.work_elements()``), the optimizer's scratch.

What the peak counts: tensor memory (what ``torch.cuda.max_memory_allocated`` reports, or
``memory.LiveTensorMemory`` on CPU) of parameters, gradients, AdamW moments, prefix state,
``dS``, checkpoints and every transient, per rank. Not counted: the CUDA context and
NCCL buffers (~1-3 GiB, covered by ``memory.headroom``), allocator fragmentation, the
kernels' internal scratch.

Loading (phase ``load``, before the first step): the rank's own share of the parameters
on the device (NF4: its 4-bit share) and one tensor of it on the host
(``MemoryPlan.load_host``; NF4: the largest 4-bit weight as read, with its quantization's
scratch), as ``longstraw_core.models.sharded_loading`` reads a checkpoint; never the whole model.

The chunk (``train.chunk_size: null``, the default): the largest power of two from 256 to
8192 (no larger than the prompt needs) whose planned peak is within 25% of the leanest
chunk's, so that exact mode's sweep graph does not set the step's peak
(``chunking.auto_chunk``; the run prints the choice and why).

Pipeline stages (``Workload.stages``, ``--stages``): each rank of a stage group holds only
its stage's layers (weights, prefix state, dS, checkpoints), the embeddings on stage 0, the
head on the last, and what the schedules keep in flight (replay's branches cut into
``Workload.replay_pieces`` pieces, ``pieces``; the exact sweep's chunks, 1F1B); the plan is
the worst stage's, every stage's in ``MemoryPlan.per_stage``. ``stage_layout`` picks the
boundaries (the runtime calls it too), ``estimate_time`` the seconds per phase on a stated
GPU.

What depends on a layer's kind (its token mixer's widths, saved bytes, working sets, FLOPs,
decode reads, a rollout branch's own record) is the kind's own: ``LayerSpec.kind.plan``, defined in the kind's module of
``longstraw_core.kinds`` (``kinds.planning.KindPlan``); no module here names a kind.

Modules, each importing only those before it: ``units`` (byte sizes, number formats),
``model`` (presets, the model's layer specs, the workload), ``kernels`` (the attention
kernels' scratch from their block budgets), ``activations`` (transients from tensor
shapes), ``flops`` (forward FLOPs from shapes), ``pieces`` (replay in pieces on a stage),
``stages`` (stage layouts, a stage's slice of the model, what is in flight), ``weights``
(parameters, gradients, optimizer, FSDP), ``core`` (the pure plan: lines and phase peaks),
``chunking`` (the chunk ``train.chunk_size: null`` leaves to the planner), ``roofline``
(one stage's work and its cost on a GPU), ``timing`` (seconds per phase, the
stages combined by the schedules), ``calibration`` (the time
estimate's GPU figures from flags, defaults or ``make gpu-check``'s measurements),
``sources`` (specs and workloads from presets, checkpoints and run configs), ``advice``
(fixes, ``plan_memory`` with advice, ``check_fits``),
``output`` (tables), ``cli``. The paper-scale tables are docs tooling,
``docs/tools/paper_tables.py``.
"""

from longstraw_core.adapters.family import Preset
from longstraw_core.plan.advice import (
    MemoryPlanError,
    check_fits,
    fixes_for,
    plan_memory,
    rollout_gathers_once,
)
from longstraw_core.plan.chunking import ChunkChoice, auto_chunk, resolve_chunk
from longstraw_core.plan.core import Line, MemoryPlan, compute_plan, pipeline_plan
from longstraw_core.plan.model import LayerSpec, ModelSpec, Workload
from longstraw_core.plan.output import print_plan, render_markdown, render_text
from longstraw_core.plan.roofline import Hardware
from longstraw_core.plan.sources import (
    Scenario,
    chunk_for_config,
    plan_for_config,
    scenario_workload,
    spec_for_config,
    spec_for_preset,
    workload_from_config,
)
from longstraw_core.plan.stages import layer_costs, stage_layout, stage_spec
from longstraw_core.plan.timing import PhaseTime, TimeEstimate, estimate_time

__all__ = [
    "ChunkChoice",
    "Hardware",
    "LayerSpec",
    "Line",
    "MemoryPlan",
    "MemoryPlanError",
    "ModelSpec",
    "PhaseTime",
    "Preset",
    "Scenario",
    "TimeEstimate",
    "Workload",
    "auto_chunk",
    "check_fits",
    "chunk_for_config",
    "compute_plan",
    "estimate_time",
    "fixes_for",
    "layer_costs",
    "pipeline_plan",
    "plan_for_config",
    "plan_memory",
    "print_plan",
    "render_markdown",
    "render_text",
    "resolve_chunk",
    "rollout_gathers_once",
    "scenario_workload",
    "spec_for_config",
    "spec_for_preset",
    "stage_layout",
    "stage_spec",
    "workload_from_config",
]
