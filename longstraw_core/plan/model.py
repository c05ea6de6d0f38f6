"""The model and the workload the planner reasons about: presets, layer specs read from the
adapter's own state records, and the step's settings."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from longstraw_core.kinds import registry as kinds
from longstraw_core.offload import OffloadPolicy
from longstraw_core.rollout.decode import STOP_CHECK_EVERY
from longstraw_core.tensors.quantization import is_quantized, quantizable_in_layer

PHASES = ("prefill", "rollout", "replay", "sweep", "optimizer")  # a step's, in recipe order
LOAD = "load"  # the phase before the first step: loading the weights (``plan.phases`` first)


@dataclass(frozen=True)
class LayerSpec:
    """One decoder layer: its mixer, MLP and state record, with the shapes the planner uses.

    The planner asks the layer's ``kind`` (its record's, ``kinds.registry.LayerKind``) for
    everything that depends on it: ``kind.plan`` holds the kind's formulas."""

    mixer: str  # the token mixer, as its kind names it (``KindPlan.mixer_dims``)
    record: str  # the record's kind (``LayerState.kind``)
    dims: dict[str, int]  # the mixer's widths (``KindPlan.mixer_dims``)
    mlp: str  # "dense" | "moe"
    mlp_dims: dict[str, int]
    params: int
    state_fixed: int  # bytes at capacity 0
    state_per_token: int  # bytes per stored position
    grad_fixed: int  # dS bytes at length 0
    grad_per_token: int
    checkpoint: int  # bytes of one chunk-start checkpoint (recurrent records)
    linear_shapes: dict[str, tuple[int, int]]  # linear name -> (in, out), for LoRA
    # Weights of the linears model.quantization=nf4 stores in 4 bits (``quantization``),
    # and the largest of them (the one weight a pass dequantizes at a time).
    quantizable: int = 0
    largest_quantizable: int = 0

    @property
    def kind(self) -> kinds.LayerKind:
        """The layer kind of its record."""
        return kinds.kind(self.record)

    def state_at(self, positions: float) -> float:
        """Bytes of its record holding ``positions`` prompt positions (as many as its kind
        keeps of them, ``KindPlan.kept_positions``)."""
        return self.state_fixed + self.state_per_token * self.kind.plan.kept_positions(
            self, positions
        )

    def grad_at(self, positions: float) -> float:
        """Bytes of exact mode's ``dS`` of its record holding ``positions`` positions."""
        return self.grad_fixed + self.grad_per_token * self.kind.plan.kept_positions(
            self, positions
        )


@dataclass(frozen=True)
class ModelSpec:
    """What the planner knows of a model: layers, parameters, dtypes. Built on ``meta``."""

    name: str
    model_type: str
    hidden: int
    vocab: int
    layers: tuple[LayerSpec, ...]
    params: int
    root_params: int  # outside the decoder layers: embeddings, final norm, head
    largest_param: int  # numel of the largest parameter tensor (CPU optimizer scratch)
    rotary_dim: int
    llama_norm: bool  # x.to(fp32) ... weight * x.to(dtype) (Qwen3, GLM); else Qwen3.5's
    state_dtype: torch.dtype
    # False for a pipeline stage's slice that ends before the model does: its last layer runs
    # whole (only the model's last layer merely writes its state) and it has no LM head.
    has_head: bool = True

    @classmethod
    def from_config(cls, config: Any, name: str, state_dtype: torch.dtype) -> ModelSpec:
        """Build ``config``'s causal LM on ``meta`` (no memory) and read it."""
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=state_dtype)
        return cls.from_model(model, name)

    @classmethod
    def from_model(cls, model: nn.Module, name: str) -> ModelSpec:
        """Read a (meta or real) model through its LongStraw adapter (pass the model before
        any PEFT wrapping: LoRA is the workload's, not the spec's)."""
        from longstraw_core.adapters.lookup import adapt

        adapter = adapt(model)
        with torch.device("meta"):
            empty = adapter.new_layer_states(0)
            one = adapter.new_layer_states(1)
        layers = tuple(
            _layer_spec(layer, empty_record, one_record)
            for layer, empty_record, one_record in zip(
                adapter.decoder.layers, empty, one, strict=True
            )
        )
        params = _numel(model.parameters())
        text = getattr(adapter, "text_config", adapter.config)
        return cls(
            name=name,
            model_type=adapter.config.model_type,
            hidden=text.hidden_size,
            vocab=adapter.vocab_size,
            layers=layers,
            params=params,
            root_params=params - sum(layer.params for layer in layers),
            largest_param=max(_weights_of(p) for p in model.parameters()),
            rotary_dim=_rotary_dim(adapter),
            llama_norm=type(adapter).llama_norm,
            state_dtype=adapter.dtype,
        )


def _numel(params: Iterable[torch.Tensor]) -> int:
    """Elements of ``params``; a 4-bit parameter counts the weights it packs, not its bytes."""
    return sum(_weights_of(p) for p in params)


def _weights_of(param: torch.Tensor) -> int:
    state = getattr(param, "quant_state", None)  # bitsandbytes Params4bit
    return math.prod(state.shape) if state is not None else param.numel()


def _record_bytes(record: Any) -> int:
    """Bytes of every tensor a record holds (preallocated capacity, not just valid rows)."""
    return sum(
        value.numel() * value.element_size()
        for value in vars(record).values()
        if isinstance(value, torch.Tensor)
    )


def _grad_bytes(record: Any, length: int) -> int:
    """Bytes of the exact-mode buffer ``record.new_grad`` makes, holding ``length`` rows."""
    from longstraw_core.state.exact import gradient_dtype

    if record.grows_with_prompt:
        record = dataclasses.replace(record, length=length)
    with torch.device("meta"):
        grad = record.new_grad(gradient_dtype(record))
    return _record_bytes(grad)


def _layer_spec(layer: nn.Module, empty: Any, one: Any) -> LayerSpec:
    """A decoder layer's shapes, read from its modules, and its record's bytes."""
    kind = kinds.kind(empty.kind)
    mixer, dims = kind.plan.mixer_dims(layer)
    mlp, mlp_dims = _mlp_dims(layer.mlp)
    fixed = _record_bytes(empty)
    linears = {
        name.rsplit(".", 1)[-1]: (module.in_features, module.out_features)
        for name, module in layer.named_modules()
        if isinstance(module, nn.Linear)
    }
    quantizable = [
        module.in_features * module.out_features
        for name, module in layer.named_modules()
        if quantizable_in_layer(name, module) or is_quantized(module)
    ]
    return LayerSpec(
        mixer=mixer,
        record=empty.kind,
        dims=dims,
        mlp=mlp,
        mlp_dims=mlp_dims,
        params=_numel(layer.parameters()),
        state_fixed=fixed,
        state_per_token=_record_bytes(one) - fixed,
        grad_fixed=_grad_bytes(empty, 0),
        grad_per_token=_grad_bytes(one, 1) - _grad_bytes(empty, 0),
        checkpoint=kind.plan.checkpoint_bytes(fixed),
        linear_shapes=linears,
        quantizable=sum(quantizable),
        largest_quantizable=max(quantizable, default=0),
    )


def _mlp_dims(mlp: nn.Module) -> tuple[str, dict[str, int]]:
    if hasattr(mlp, "experts"):
        experts = mlp.experts
        shared = getattr(mlp, "shared_experts", None) or getattr(mlp, "shared_expert", None)
        router = getattr(mlp, "gate", None) or mlp.router  # gpt-oss: ``router``
        top_k = getattr(router, "top_k", None) or mlp.config.num_experts_per_tok
        expert_dim = getattr(experts, "intermediate_dim", None) or experts.intermediate_size
        return "moe", {
            "experts": experts.num_experts,
            "top_k": top_k,
            "expert_dim": expert_dim,
            "shared_dim": shared.down_proj.in_features if shared is not None else 0,
        }
    return "dense", {"intermediate": mlp.down_proj.in_features}


def _rotary_dim(adapter: Any) -> int:
    """Width of the cos/sin tables a pass builds once and every layer reads."""
    rotary = adapter.decoder.rotary_emb
    inv_freq = getattr(rotary, "inv_freq", None)
    return 2 * inv_freq.numel() if inv_freq is not None else 0


@dataclass(frozen=True)
class Workload:
    """One GRPO step as the planner sees it (from a ``RunConfig`` or the CLI).

    ``stages > 1``: each group's prompt is spread over ``stages`` pipeline stages (rank ``s``
    of a stage group owns a contiguous block of layers, their weights and their prefix
    state); the plan is then the worst stage's (``core.compute_plan``).

    ``device``: which kernels to model: ``"cuda"`` (flash-attn, flash-linear-attention) or
    ``"cpu"`` (the pure-torch paths the CPU runs). ``param_dtype``: the parameters' dtype
    (``model.dtype``); the layers compute, and keep their state, in ``compute_dtype``.
    """

    prompt_tokens: int
    group: int
    response_tokens: int
    chunk_size: int | None  # None: not chosen yet (``chunk_auto``: ``chunking.resolve_chunk``)
    gradient: str = "detached"
    checkpoints: str = "device"
    gpus: int = 1
    fsdp: bool = False
    reshard_after_forward: bool = True
    # FSDP in rollout (distributed.rollout_gather): "once" holds the unsharded model while
    # decoding, "per_step" gathers as any pass does; "auto" is resolved by plan_memory.
    rollout_gather: str = "auto"
    reference_model: bool = False  # beta > 0 in full fine-tuning: a frozen copy of the model
    param_dtype: torch.dtype = torch.float32
    compute_dtype: torch.dtype = torch.float32
    lora_rank: int = 0  # 0: full fine-tuning
    lora_targets: tuple[str, ...] = ()
    offload: OffloadPolicy | None = None
    device: str = "cuda"
    budget: int | None = None
    headroom: float = 0.0
    rollout: bool = True
    activation_checkpointing: bool = False  # ModelAdapter.activation_checkpointing
    keep_attention_outputs: bool = False  # GRPOConfig.keep_attention_outputs (exact mode)
    stages: int = 1  # distributed.pipeline_stages: gpus = stages x data-parallel replicas
    stage_starts: tuple[int, ...] | None = None  # distributed.stage_starts (None: balanced)
    # distributed.replay_pieces: pieces a replayed branch is cut into on S > 1 stages (None:
    # the schedule's choice, ``simulate.replay_pieces``)
    replay_pieces: int | None = None
    # branches a step replays (those with a non-zero advantage or weight; None: plan for
    # the worst count from 1 to group: fewer branches get more pieces)
    replay_branches: int | None = None
    quantization: str | None = None  # model.quantization: "nf4" stores decoder linears in 4 bits
    # rollout.stop_check_every: decode steps between the ring's stop collectives
    stop_check_every: int = STOP_CHECK_EVERY
    # train.chunk_size: null: the planner chooses chunk_size (``chunking.auto_chunk``), and
    # chooses it again after a change to the workload (``chunking.resolve_chunk``)
    chunk_auto: bool = False

    @property
    def stored(self) -> int:
        """Prompt positions the state stores: all but the last (replayed with each branch)."""
        return max(self.prompt_tokens - 1, 0)

    @property
    def replicas(self) -> int:
        """Data-parallel replicas: groups of ``stages`` ranks, each training its own prompt."""
        return max(self.gpus // self.stages, 1)

    @property
    def shards(self) -> int:
        """Ranks FSDP shards a stage's parameters over: its replicas (all GPUs at S=1)."""
        return self.replicas if self.fsdp else 1

    @property
    def usable(self) -> int | None:
        """The budget after headroom, or None when no budget is known."""
        return None if self.budget is None else int(self.budget * (1 - self.headroom))

    def offloads(self, record_kind: str) -> bool:
        return self.offload is not None and self.offload.offloads(record_kind)
