"""The run config's schema: every setting a recipe reads, with its type and default.

A recipe reads ``cfg.<section>.<field>``, never ``cfg.get(key, default)``, so a typo cannot
silently fall back to a default. ``ConfigError``, raised for every config problem, is here too.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING

from longstraw_core.grpo_config import GRPOConfig
from longstraw_core.tokenizer import BUILTIN_SPECIAL_TOKENS

DTYPES = ("float32", "bfloat16", "float16", "float64")
ATTN_IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2", "flash_attention_3")
SCHEDULERS = ("constant", "cosine", "linear")
TRACKING_MODES = ("online", "offline", "disabled")
MIXED_PRECISION = ("bf16", "fp32")
ROLLOUT_GATHER = ("auto", "once", "per_step")
BUILTIN_TOKENIZER_SIZE = 256 + len(BUILTIN_SPECIAL_TOKENS)


class ConfigError(ValueError):
    """A configuration problem; ``key`` is the full dotted path of the offending setting."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}")
        self.key = key


@dataclass
class ModelSection:
    """Which model: a local checkpoint (``path``) or a random-init toy (``tiny``)."""

    path: str | None = None  # a local directory with config.json and weights
    tiny: str | None = None  # a model type of longstraw_core.tiny_models.TINY_CONFIGS
    tiny_overrides: dict[str, Any] = field(default_factory=dict)  # transformers config fields
    dtype: str = "float32"  # one of DTYPES; the dtype of the parameters (and master weights)
    attn_implementation: str = "sdpa"  # used by the reference forward; adapters attend themselves
    trust_remote_code: bool = False  # only for checkpoints whose code is not in transformers
    # nf4: the decoder's linear layers in 4-bit NF4 (QLoRA; needs lora.enabled and
    # bitsandbytes); model.dtype is then their compute dtype. null: no quantization.
    quantization: str | None = None


@dataclass
class LoraSection:
    """PEFT LoRA on the policy; the KL reference is then the same weights, adapters off."""

    enabled: bool = False
    r: int = 16
    alpha: float = 32.0
    dropout: float = 0.0  # must be 0 with grpo.gradient=exact or on kv_b_proj (see validate)
    target_modules: list[str] | None = None  # null: DEFAULT_LORA_TARGETS[model_type]


@dataclass
class TokenizerSection:
    path: str | None = None  # null: the built-in byte-level tokenizer (ChatML template)


@dataclass
class DataSection:
    """Prompts: a synthetic long-context task generated on the fly, or a local dataset.

    ``prompt_tokens`` is the length a task generates (within its 1% tolerance); with ``path``
    it is the longest prompt accepted, so the position-limit check below covers both. The
    whole of ``path`` is scanned and measured before the model loads (``data.sample_source``).
    """

    task: str | None = None  # a name of longstraw_core.tasks.TASKS
    # A .json/.jsonl/.parquet/.csv/.arrow file (read by `datasets.load_dataset`), a directory
    # written by `save_to_disk`, or a directory of data files (a dataset repo on local disk).
    path: str | None = None
    split: str = "train"  # with path: the split to train on (TRL scripts' dataset_train_split)
    # With path: each pass over the data in a new random order seeded by data.seed (TRL's
    # shuffle_dataset); false: in file order (a curriculum, or to compare runs row by row).
    shuffle: bool = True
    prompt_tokens: int = 16384
    # With path: prompts longer than prompt_tokens are "error" (refuse the data before the
    # model loads, naming them) or "skip" (leave them out of the run, counted and reported).
    on_overlong: str = "error"
    depth: float | None = None  # needle depth in [0, 1]; null: uniform random per sample
    seed: int = 0  # a task's generation; with path, the shuffled order
    task_kwargs: dict[str, Any] = field(default_factory=dict)  # extra task arguments (hops=4)
    # Passed to the tokenizer's chat template for message prompts, as TRL's
    # chat_template_kwargs (e.g. {enable_thinking: false} for Qwen3.6); plain-text prompts
    # are never templated.
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class RolloutSection:
    """Sampling of the group; ``num_generations`` and ``max_new_tokens`` are also GRPO's
    ``num_generations`` and ``max_completion_length`` (one setting, not two that must agree)."""

    num_generations: int = 8
    max_new_tokens: int = 512
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0  # drop tokens below min_p x the top token's probability; 0: off
    # > 1 makes tokens already in the prompt or the response less likely (transformers' and
    # vLLM's semantics: the whole prompt counts); 1: off
    repetition_penalty: float = 1.0
    # A response ends at the token that completes one of these strings (kept, like an EOS);
    # e.g. ["</answer>"] stops a branch once it has answered. []: only EOS ends a response.
    stop: list[str] = field(default_factory=list)


def _grpo_section() -> type:
    """``GRPOConfig``'s fields and defaults as a plain schema dataclass.

    Built from the dataclass itself so the two cannot drift; its ``__post_init__`` checks
    are not copied but run by ``grpo_config``. ``num_generations`` and
    ``max_completion_length`` live in ``rollout``. ``scale_rewards`` is typed ``Any`` because
    TRL also accepts True/False there (OmegaConf would turn a bool into the string "True").
    """
    spec = []
    for f in dataclasses.fields(GRPOConfig):
        if f.name in GRPO_FROM_ROLLOUT:
            continue
        kind = Any if f.name == "scale_rewards" else f.type
        spec.append((f.name, kind, field(default=f.default)))
    return dataclasses.make_dataclass("GRPOSection", spec)


# GRPOConfig fields that are rollout settings: the rollout key each comes from.
GRPO_FROM_ROLLOUT = {
    "num_generations": "rollout.num_generations",
    "max_completion_length": "rollout.max_new_tokens",
}
GRPOSection = _grpo_section()


@dataclass
class RewardSpec:
    name: str = MISSING  # a built-in name or a dotted path 'package.module:function'
    weight: float = 1.0


@dataclass
class OptimSection:
    """AdamW and its learning-rate schedule."""

    lr: float = 1e-6
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    max_grad_norm: float | None = 1.0  # null: no clipping
    scheduler: str = "constant"  # one of SCHEDULERS, after the warmup
    warmup_steps: int = 0


@dataclass
class TrainSection:
    steps: int = 100
    chunk_size: int = 4096  # prefill chunk; also the exact sweep's recompute unit
    activation_checkpointing: bool = (
        False  # recompute layers in backward: less memory, ~1 more forward
    )
    seed: int = 0
    log_every: int = 1  # print a summary line every N steps (metrics go to W&B every step)
    completions_every: int = 10  # log a table of sample completions every N steps; 0: never
    save_every: int = 0  # checkpoint every N steps and at the last step; 0: never
    output_dir: str = "outputs/longstraw"
    resume_from: str | None = None  # null, "latest" (newest in output_dir if any) or a path
    keep_last: int = 0  # keep the newest N complete checkpoints; 0: keep every one
    max_skipped_steps: int = 3  # stop after N steps in a row skipped for inf/NaN (guard.py)
    raise_reward_errors: bool = False  # a failing reward function stops the run (else NaN)


@dataclass
class TrackingSection:
    wandb: bool = True
    project: str = "longstraw"
    run_name: str | None = None
    mode: str = "offline"  # one of TRACKING_MODES


@dataclass
class DistributedSection:
    fsdp: bool = False  # fully_shard per decoder layer (FSDP2)
    mixed_precision: str = "fp32"  # bf16: FSDP2 computes in bf16 over fp32 sharded params
    reshard_after_forward: bool = True  # False keeps gathered params: faster, more memory
    # FSDP in rollout: "once" gathers each layer once for the whole rollout and keeps it (the
    # unsharded model's memory, or a stage's, while decoding); "per_step" gathers at every
    # decode step (a gather of the model per token); "auto": "once" if the plan fits, else
    # "per_step" (the run says so).
    rollout_gather: str = "auto"
    # S: each of a prompt's S ranks owns 1/S of the layers, their weights and prefix state;
    # the world is S stages x (world / S) replicas, each replica training its own prompt.
    pipeline_stages: int = 1
    stage_starts: list[int] | None = None  # each stage's first layer; null: balanced
    # collectives' timeout (NCCL/gloo), and how long ranks wait while rank 0 writes a checkpoint
    timeout_minutes: float = 60.0


@dataclass
class OffloadSection:
    """Where the prefix state lives, per layer type (``longstraw_core.offload.OffloadPolicy``).

    ``cpu`` keeps that layer type's state (and exact mode's gradient buffer for it) in host
    memory and streams it to the GPU layer by layer: less GPU memory, more host-device traffic.
    """

    attention: str = "device"  # full-attention K/V: the state that grows with the prompt
    recurrent: str = "device"  # Gated DeltaNet conv + recurrent states (constant per layer)
    latent: str = "device"  # MLA latent + index keys (GLM-5.2)
    resident_layers: int = 2  # offloaded layers on the GPU at once: 2 overlaps copy and compute
    pin_memory: bool = True  # pinned host memory on CUDA: asynchronous copies


@dataclass
class MemorySection:
    """The per-GPU memory budget ``longstraw_core.plan.check_fits`` checks a run against
    before any weight is loaded (``python -m longstraw_core.plan`` prints the plan)."""

    gpu_mem: str | None = None  # memory per GPU: "96GiB", "80GB"; null: no check (CPU runs)
    gpus: int | None = None  # ranks the step runs on (FSDP shards over them); null: 1
    headroom: float = 0.05  # fraction of gpu_mem kept free: CUDA context, NCCL, fragmentation
    check: bool = True  # false: print the plan but start even when it predicts no fit


@dataclass
class RunConfig:
    """Everything one GRPO run reads. Build it with ``load_config``."""

    model: ModelSection = field(default_factory=ModelSection)
    lora: LoraSection = field(default_factory=LoraSection)
    tokenizer: TokenizerSection = field(default_factory=TokenizerSection)
    data: DataSection = field(default_factory=DataSection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    grpo: GRPOSection = field(default_factory=GRPOSection)  # type: ignore[valid-type]
    rewards: list[RewardSpec] = field(default_factory=lambda: [RewardSpec(name="exact_match")])
    optim: OptimSection = field(default_factory=OptimSection)
    train: TrainSection = field(default_factory=TrainSection)
    tracking: TrackingSection = field(default_factory=TrackingSection)
    distributed: DistributedSection = field(default_factory=DistributedSection)
    memory: MemorySection = field(default_factory=MemorySection)
    offload: OffloadSection = field(default_factory=OffloadSection)
