"""The run config's schema: every setting a recipe reads, with its type and default.

A recipe reads ``cfg.<section>.<field>``, never ``cfg.get(key, default)``, so a typo cannot
silently fall back to a default. ``ConfigError``, raised for every config problem, is here too.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING

from longstraw_core.offload.policy import placement_fields
from longstraw_core.schema.grpo import GRPOConfig

DTYPES = ("float32", "bfloat16", "float16", "float64")
ATTN_IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2", "flash_attention_3")
SCHEDULERS = ("constant", "cosine", "linear")
TRACKING_MODES = ("online", "offline", "disabled")
MIXED_PRECISION = ("bf16", "fp32")
ROLLOUT_GATHER = ("auto", "once", "per_step")


class ConfigError(ValueError):
    """A configuration problem; ``key`` is the full dotted path of the offending setting."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}")
        self.key = key


@dataclass
class ModelSection:
    """Which model: a local checkpoint (``path``) or a random-init toy (``tiny``)."""

    # a local directory with config.json and safetensors weights, or a Hugging Face Hub id
    # (Qwen/Qwen3-0.6B: its snapshot in the HF cache, downloaded online; longstraw_core.config.hub)
    path: str | None = None
    tiny: str | None = None  # a model type of a family's tiny_configs (registry.tiny_configs)
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
    target_modules: list[str] | None = None  # null: the family's default for model_type
    # peft's target_parameters: nn.Parameters LoRA adapts in place, such as the fused 3-D
    # expert weights of gpt-oss ([mlp.experts.gate_up_proj, mlp.experts.down_proj]); null: none
    target_parameters: list[str] | None = None


@dataclass
class TokenizerSection:
    # A tokenizer directory or Hub id; "builtin:bytes": the built-in byte-level tokenizer
    # (ChatML template); null: the model's own, i.e. model.path's tokenizer (refused when
    # model.path has none), or the byte tokenizer for a model.tiny toy.
    path: str | None = None


@dataclass
class DataSection:
    """Prompts: a synthetic long-context task generated on the fly, or a local dataset.

    ``prompt_tokens`` is the length a task generates (within its 1% tolerance); with ``path``
    it is the longest prompt accepted, so the position-limit check below covers both. The
    whole of ``path`` is scanned and measured before the model loads (``data.sample_source``).
    """

    task: str | None = None  # a name of longstraw_core.data.tasks.TASKS
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
class EvalDataSection:
    """The eval prompts: each field ``data``'s own unless set here (``eval.data.split: test``
    evaluates the training dataset's test split; ``eval.data.seed: 1`` a task's other
    prompts). Setting ``path`` replaces an inherited ``task`` and the other way round (a new
    task starts from no ``task_kwargs``). Prompts are templated with
    ``data.chat_template_kwargs``, as the training prompts are."""

    task: str | None = None
    path: str | None = None
    split: str | None = None  # TRL scripts' dataset_test_split is "test"
    shuffle: bool | None = None  # the order eval.samples takes its first prompts from
    prompt_tokens: int | None = None
    on_overlong: str | None = None
    depth: float | None = None
    seed: int | None = None
    task_kwargs: dict[str, Any] | None = None


@dataclass
class EvalSection:
    """Evaluation during training (``longstraw_core.training.evaluation``): greedy accuracy and pass@k
    under the training's reward functions, logged as ``eval/...``."""

    # Every N optimizer steps (and after the last), like TRL's eval_steps; 0: never. Each
    # eval costs a prefill and two rollouts per eval prompt, with no training in between.
    every: int = 0
    # Also before the first step (TRL's eval_on_start), logged at step 0: where the held-out
    # curve starts, so a run shows what training changed.
    on_start: bool = False
    data: EvalDataSection = field(default_factory=EvalDataSection)
    # Prompts per eval: the first N of eval.data (every eval the same ones). null: the whole
    # dataset (TRL evaluates all of eval_dataset); a task needs a number.
    samples: int | None = None
    # k completions sampled per prompt with the rollout's settings, for pass@k and TRL's
    # eval/reward...; null: rollout.num_generations (TRL's num_generations_eval); 0: greedy only.
    num_generations: int | None = None
    max_new_tokens: int | None = None  # null: rollout.max_new_tokens
    # A completion is correct when its weighted reward (the rewards' weighted sum) is at least
    # this; with partial-credit rewards choose what counts as solved.
    correct_reward: float = 1.0


@dataclass
class RolloutSection:
    """Sampling of the group; ``num_generations``, ``max_new_tokens`` and ``temperature`` are
    also GRPO's ``num_generations``, ``max_completion_length`` and ``temperature`` (one
    setting, not two that must agree)."""

    num_generations: int = 8
    max_new_tokens: int = 512
    # Also the loss's: its log-probs are log_softmax(logits / temperature), as TRL's; > 0
    # (greedy decoding has no distribution to train on).
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
    # Decode steps between two stop checks (every branch ended? non-finite logits?), the
    # decode loop's only host reads: the same responses for any value; larger reads less
    # often and may decode up to k - 1 steps of padding at the end (rollout.STOP_CHECK_EVERY).
    stop_check_every: int = 8
    # Agents (longstraw_core.tools), TRL's tools and environment_factory: functions the model
    # may call, as module:function (type hints and a Google-style docstring: their schema);
    # an environment class (module:Class) built once per branch, whose public methods are
    # tools, reset(**row) is called with the sample's columns and get_reward() is an extra
    # reward; tool rounds per branch (TRL's max_tool_calling_iterations; null: no limit); and
    # how long a tool call may run before it fails with {"error": ...} (null: no limit); how
    # many branches' tool rounds may run at once (null: every branch's, each in its own
    # thread; 1: one after another, TRL's order, for tools that are not thread-safe). The
    # other branches go on decoding while a branch's tools run either way.
    tools: list[str] = field(default_factory=list)
    environment: str | None = None
    max_tool_calling_iterations: int | None = None
    tool_timeout_seconds: float | None = 60.0  # tools.DEFAULT_TIMEOUT_SECONDS
    tool_threads: int | None = None
    # How long building a group's environments, and their reset(**row), may each take before
    # the run stops with one line (a reset that hangs would stall it forever); null: no limit.
    environment_timeout_seconds: float | None = 600.0  # tools.DEFAULT_ENVIRONMENT_TIMEOUT_SECONDS


def _grpo_section() -> type:
    """``GRPOConfig``'s fields and defaults as a plain schema dataclass.

    Built from the dataclass itself so the two cannot drift; its ``__post_init__`` checks
    are not copied but run by ``grpo_config``. ``num_generations``,
    ``max_completion_length`` and ``temperature`` live in ``rollout`` (``GRPO_FROM_ROLLOUT``). ``scale_rewards`` is typed ``Any`` because
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
    "temperature": "rollout.temperature",
}
GRPOSection = _grpo_section()


@dataclass
class RewardSpec:
    """One reward function. ``name``: a built-in, or ``module:function`` (imported from the
    import path, else the config file's directory, else the working directory). With
    ``args`` or ``kwargs`` the named object is a factory (TRL's
    ``get_soft_overlong_punishment``, a class): ``name(*args, **kwargs)`` is the function.
    Or a reward model, as TRL's ``reward_funcs`` strings: a sequence classifier's directory
    or Hub id (``rewards.models``); its ``kwargs`` are ``from_pretrained``'s, and it runs on
    ``device`` in batches of ``batch_size``."""

    name: str = MISSING
    weight: float = 1.0
    # A call (one group's completions) longer than this counts as failed (NaN), so a hung
    # judge cannot stall the run; null: no limit (called in the main thread, as TRL does).
    timeout_seconds: float | None = 600.0  # rewards.DEFAULT_TIMEOUT_SECONDS
    args: list[Any] = field(default_factory=list)  # positional arguments of the factory
    kwargs: dict[str, Any] = field(default_factory=dict)  # its keyword arguments
    # A reward model only: where it runs (null: the run's device, a rank's GPU or the CPU)
    # and how many texts per forward (null: a call's every completion at once, as TRL).
    device: str | None = None
    batch_size: int | None = None


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
    steps: int = 100  # optimizer steps (TRL's max_steps); grpo.num_iterations per rollout
    # Prompt tokens a prefill chunk holds, also the exact sweep's recompute unit (its graph
    # grows with it). null: the planner's choice, the largest chunk (256 .. 8192) whose step
    # peak stays within 25% of the leanest chunk's (longstraw_core.plan.chunking; the run
    # prints it and why); an int: that chunk.
    chunk_size: int | None = None
    # Prompts (groups) each replica rolls out and accumulates into one optimizer step, the
    # loss normalised as TRL's over all of them: a larger batch per step for one more
    # rollout + replay each (one prefix state at a time, so no more memory).
    prompts_per_step: int = 1
    activation_checkpointing: bool = (
        False  # recompute layers in backward: less memory, ~1 more forward
    )
    seed: int = 0
    log_every: int = 1  # print a summary line every N steps (metrics go to W&B every step)
    # Progress inside a step (prefill and sweep tokens, decode steps, branches replayed) when
    # stderr is not a terminal (a log, CI): a plain line at most every N seconds; a terminal
    # shows live bars instead. null: no lines (the step lines only).
    progress_every_seconds: float | None = 30.0
    completions_every: int = 10  # log a table of sample completions every N steps; 0: never
    save_every: int = 0  # checkpoint every N steps and at the last step; 0: never
    output_dir: str = "outputs/longstraw"
    resume_from: str | None = None  # null, "latest" (newest in output_dir if any) or a path
    keep_last: int = 0  # keep the newest N complete checkpoints; 0: keep every one
    max_skipped_steps: int = 3  # stop after N steps in a row skipped for inf/NaN (process/guard.py)
    raise_reward_errors: bool = False  # a failing reward function stops the run (else NaN)
    # Keep the last finished step's checkpoint in rank 0's host memory (one gather per step)
    # so that a stop signal writes it at once: launchers kill the ranks 5-30 s after their
    # SIGTERM, long before a step ends. Costs a host copy of the trainable state and its
    # AdamW state (LoRA: small; a full fine-tune: 12 bytes a parameter); false: a signal
    # waits for the step's end (checkpoint.kept).
    save_on_signal: bool = True


@dataclass
class TrackingSection:
    wandb: bool = True
    project: str = "longstraw"
    run_name: str | None = None
    mode: str = "offline"  # one of TRACKING_MODES
    # metrics.csv is always written beside the run (output_dir) when it ends; true: also the
    # learning curves as curves.png (training reward, eval accuracy), logged to W&B as an
    # image. Needs matplotlib; costs a few seconds at the end of the run.
    curves_png: bool = False
    # W&B names as a TRL run has them (transformers' WandbCallback): train/<name> for a
    # training metric, eval/<name> for an evaluation one, with train/global_step, so a TRL
    # run's W&B panels show a LongStraw run. false: the bare names (reward, loss, eval/...),
    # as the console and metrics.csv show them.
    trl_names: bool = True


@dataclass
class DistributedSection:
    fsdp: bool = False  # fully_shard per decoder layer (FSDP2)
    # bf16: compute in bf16 over float32 master weights (model.dtype=float32): with fsdp,
    # FSDP2's policy over the fp32 shards; without, bf16 working weights per step
    # (longstraw_core/models/mixed_precision.py): half the matmul time and prefix-state memory, for
    # bf16 rounding in every pass. fp32: everything in model.dtype.
    mixed_precision: str = "fp32"
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
    # Replay on stages cuts each branch into this many pieces, which follow each other
    # through the stages (more pieces: busier stages, more, shorter kernel calls); null: the
    # fewest that keep the schedule's idle time at 15% (S=8, G=8: 5; G=2: 20).
    replay_pieces: int | None = None
    # collectives' timeout (NCCL/gloo), and how long ranks wait while rank 0 writes a
    # checkpoint: 60 minutes, long on purpose (settings that differ between ranks are refused
    # at start, rewards have their own timeout; a stuck rank ends at a second SIGTERM)
    timeout_minutes: float = 60.0


def _offload_section() -> type:
    """Where the prefix state lives, per layer type (``longstraw_core.offload.OffloadPolicy``).

    One key per placement the layer kinds declare (``kinds.registry.placements``: ``attention``
    for full-attention and sliding-window K/V, ``recurrent`` for Gated DeltaNet states,
    ``latent`` for the MLA latent and DSA index keys), each ``device`` (the default) or
    ``cpu``: that layer type's state (and exact mode's gradient buffer for it) in host memory,
    streamed to the GPU layer by layer (less GPU memory, more host-device traffic).
    ``resident_layers``: offloaded layers on the GPU at once (2 overlaps copy and compute);
    ``pin_memory``: pinned host memory on CUDA (asynchronous copies).
    Built from the registered kinds, so a placement is named once, where its kind registers.
    """
    spec: list[tuple[str, Any, Any]] = [
        (name, str, field(default="device")) for name in placement_fields()
    ]
    spec += [("resident_layers", int, field(default=2)), ("pin_memory", bool, field(default=True))]
    section = dataclasses.make_dataclass("OffloadSection", spec)
    section.__doc__ = _offload_section.__doc__
    section.__module__ = __name__
    return section


OffloadSection = _offload_section()


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
    eval: EvalSection = field(default_factory=EvalSection)
    grpo: GRPOSection = field(default_factory=GRPOSection)  # type: ignore[valid-type]
    rewards: list[RewardSpec] = field(default_factory=lambda: [RewardSpec(name="exact_match")])
    optim: OptimSection = field(default_factory=OptimSection)
    train: TrainSection = field(default_factory=TrainSection)
    tracking: TrackingSection = field(default_factory=TrackingSection)
    distributed: DistributedSection = field(default_factory=DistributedSection)
    memory: MemorySection = field(default_factory=MemorySection)
    offload: OffloadSection = field(default_factory=OffloadSection)
