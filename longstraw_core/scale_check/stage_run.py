"""One pipeline stage's GRPO step at real dimensions on fake tensors, with its peak.

Why: a configuration that does not fit is found after its weights load and its million-token
prefill ran. Here the stage's model is built on ``meta``, cut to its stage
(``stage_model``), its parameters made fake (``FakeTensorMode``: shapes, no memory), and
the recipe's step runs through the real code: ``prefill``, ``rollout`` (a few tokens),
``grpo_step`` (replay, exact sweep), clip and AdamW. ``LiveTensorMemory`` counts the live
storages op by op, as ``max_memory_allocated`` would on the GPU; the neighbours are a
``FakeStageLink``.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

import longstraw_core as ls
from longstraw_core.adapters.stage_cut import stage_model
from longstraw_core.config import grpo_config, offload_policy
from longstraw_core.models import build as models
from longstraw_core.pipeline import StageLayout
from longstraw_core.scale_check.link import FakeStageLink
from longstraw_core.tensors import gpu_emulation, quantization
from longstraw_core.tensors.fake import real_values
from longstraw_core.tensors.memory import LiveTensorMemory

DEVICE = torch.device("cpu")  # fake tensors on CPU: the CPU kernels' code paths run


@dataclass
class StageResult:
    """What one stage's dry run measured: peak bytes per phase and overall, and seconds."""

    stage: int
    layers: list[int]
    phases: dict[str, int]
    peak: int
    params_bytes: int
    seconds: float


def build_stage(
    cfg: Any, config: Any, layout: StageLayout, stage: int, mode: FakeTensorMode
) -> tuple[ls.ModelAdapter, FakeStageLink]:
    """``config``'s model (with ``cfg``'s LoRA) cut down to ``stage``, parameters fake."""
    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, cfg.model.dtype)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if cfg.model.quantization == "nf4":  # 4-bit placeholders, as loading builds them
        quantization.quantize_nf4(model, compute_dtype=dtype)
    model = models.add_lora(model, cfg.lora).train()
    adapter = ls.adapt(model)
    adapter.activation_checkpointing = bool(cfg.train.activation_checkpointing)
    link = FakeStageLink(ranks=list(range(layout.stages)), stage=stage, group=None, device=DEVICE)
    stage_model(adapter, layout, link, cfg.distributed.replay_pieces)
    adapter.stage = _on_device(adapter.stage)
    with mode:
        _materialize(model)
    return adapter, link


def _on_device(stage: Any) -> Any:
    import dataclasses

    return dataclasses.replace(stage, device=DEVICE)


def _materialize(model: nn.Module) -> None:
    """Replace every ``meta`` parameter and buffer with a fake one on ``DEVICE``; quantize
    each 4-bit placeholder from fake values (bitsandbytes' ops have fake kernels)."""
    for module in model.modules():
        if quantization.is_nf4_placeholder(module):
            _fake_nf4_(module)
            continue
        for name, param in list(module._parameters.items()):
            if param is not None and param.is_meta:
                fake = torch.empty(param.shape, dtype=param.dtype, device=DEVICE)
                module._parameters[name] = nn.Parameter(fake, requires_grad=param.requires_grad)
        for name, buffer in list(module._buffers.items()):
            if buffer is not None and buffer.is_meta:
                module._buffers[name] = torch.empty(buffer.shape, dtype=buffer.dtype, device=DEVICE)


def _fake_nf4_(linear: nn.Module) -> None:
    """Quantize a 4-bit placeholder from fake values as ``quantization.fill_nf4_`` does (NF4
    from the float32 values, blocks of 64, double quantization), through bitsandbytes'
    functional API: its ``Params4bit`` cannot wrap a FakeTensor, so the packed codes stay a
    plain parameter carrying the state where ``Linear4bit.forward`` reads it."""
    from bitsandbytes.functional import quantize_4bit

    with real_values():  # bitsandbytes builds (and caches) its 8-bit code map on first use
        quantize_4bit(torch.zeros(256), compress_statistics=True, quant_type="nf4")
    values = torch.empty(linear.weight.shape, dtype=torch.float32, device=DEVICE)
    packed, state = quantize_4bit(
        values, blocksize=quantization.NF4_BLOCKSIZE, compress_statistics=True, quant_type="nf4"
    )
    linear.weight = nn.Parameter(packed, requires_grad=False)
    linear.weight.quant_state = state


def run_stage(
    cfg: Any,
    config: Any,
    layout: StageLayout,
    stage: int,
    *,
    rollout_tokens: int,
    say: Callable[[str], object] | None = None,
) -> StageResult:
    """Stage ``stage``'s step of ``cfg`` (prompt ``cfg.data.prompt_tokens``, G responses of
    ``cfg.rollout.max_new_tokens`` replayed), measured (see the module). ``say`` gets a line
    as each phase ends (a full-size stage runs for many minutes)."""
    started = time.perf_counter()
    mode = FakeTensorMode(allow_non_fake_inputs=True)  # rewards, advantages: real
    adapter, _ = build_stage(cfg, config, layout, stage, mode)
    model = adapter.model
    trainable = [p for p in model.parameters() if p.requires_grad]
    grpo = grpo_config(cfg)
    offload = offload_policy(cfg)
    chunk, group = cfg.train.chunk_size, cfg.rollout.num_generations
    tracked = [*model.parameters(), *model.buffers(), *quantization.quantized_tensors(model)]
    with mode, gpu_emulation.gpu_kernels(), LiveTensorMemory(tracked) as memory:
        params_bytes = memory.current

        @contextmanager
        def phase(name: str) -> Iterator[None]:
            begun = time.perf_counter()
            with memory.phase(name):
                yield
            if say is not None:
                took, peak = time.perf_counter() - begun, memory.phases[name] / 2**30
                say(f"stage {stage}: {name} done in {took:.0f} s, peak {peak:.2f} GiB")

        optimizer = models.build_optimizer(model, cfg.optim)
        vocab = adapter.vocab_size
        prompt = torch.randint(vocab, (cfg.data.prompt_tokens,), device=DEVICE)
        with phase("prefill"):
            state = adapter.prefill(
                prompt, chunk_size=chunk, offload=offload, **grpo.prefill_options()
            )
        with phase("rollout"):
            out = ls.rollout(adapter, state, group, rollout_tokens, eos_token_ids=[0], seed=0)
            del out
        responses = [
            torch.randint(vocab, (cfg.rollout.max_new_tokens,), device=DEVICE) for _ in range(group)
        ]
        rewards = [float(i % 2) for i in range(group)]  # half right: every branch replays
        sweep = adapter.backprop_prompt  # exact mode's sweep, inside grpo_step: its own phase

        def backprop_prompt(*args: Any, **kwargs: Any) -> None:
            with phase("sweep"):
                sweep(*args, **kwargs)

        adapter.backprop_prompt = backprop_prompt
        with phase("replay"):  # grpo_step: the replay (the sweep is its own phase)
            ls.grpo_step(
                adapter, prompt, responses, rewards, config=grpo, state=state,
                chunk_size=chunk, offload=offload,
            )  # fmt: skip
        del state
        gc.collect()
        with phase("optimizer"):
            torch.nn.utils.clip_grad_norm_(trainable, cfg.optim.max_grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return StageResult(
        stage=stage,
        layers=list(layout.layers_of(stage)),
        phases=dict(memory.phases),
        peak=memory.peak,
        params_bytes=params_bytes,
        seconds=time.perf_counter() - started,
    )
