"""Loading that scales: each rank builds only its share of a checkpoint.

``models.build_model`` reads the whole checkpoint into every rank, which then moves it to
its device and cuts it to its pipeline stage: every rank briefly holds the whole model (a
27B model in float32 is ~108 GB per rank; GLM-5.2 cannot load at all). Here the model is
built on the ``meta`` device (parameters only: buffers such as rotary ``inv_freq``, which
no checkpoint holds, are computed for real on the CPU as ``from_pretrained`` computes them),
LoRA is added and the model is cut to the rank's stage while it has no storage, and only
then are the parameters the rank still holds allocated on its device and read, tensor by
tensor, straight from the safetensors files into them. A rank's host memory while loading
is one tensor (none on CPU when the file's dtype is the model's: the bytes are read into
the parameter itself); its device memory is its own share.

QLoRA bases (``model.quantization=nf4``) take the same path: the 4-bit linears are built on
``meta`` with placeholder weights, and each one the rank holds is quantized on the CPU as
soon as its weight is read (``quantization.fill_nf4_``), then moved to the device: host
memory is one weight in the model dtype and its quantization's scratch, the device holds
the rank's 4-bit share.

Checkpoint names are the model's after transformers' own renamings for its class
(``checkpoint_renamings``), as ``from_pretrained`` applies them: Qwen3.5/3.6 checkpoints are
multimodal and store the text decoder under ``model.language_model.``.

``load_policy`` / ``load_reference`` are what the recipes call; tiny random-init models
(``model.tiny``) keep the old path (they are built from a seed, and small).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import json
import math
import struct
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from accelerate import init_empty_weights
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig, PreTrainedModel
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import WeightRenaming, apply_renamings

import longstraw_core as ls
from longstraw_core.adapters.stage_cut import move_stage
from longstraw_core.config import hub
from longstraw_core.models import build as models
from longstraw_core.models.tiny import reference_attention
from longstraw_core.tensors import quantization

if TYPE_CHECKING:
    from longstraw_core.adapters.base import ModelAdapter
    from longstraw_core.config import ModelSection, RunConfig
    from longstraw_core.parallel.topology import RunTopology

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}  # fmt: skip


class CheckpointTensorError(ValueError):
    """A tensor this rank owns is missing from the checkpoint, or has another shape."""


# --- what the recipes call ------------------------------------------------------------------


def load_policy(cfg: RunConfig, topology: RunTopology, device: torch.device) -> ModelAdapter:
    """The policy (LoRA added, train mode) on this rank's stage and device, FSDP-sharded when
    ``distributed.fsdp``; build the optimizer afterwards. ``adapter.model`` is the model."""
    device = _as_tensors_report(device)
    whole = builds_whole(cfg)
    if whole:
        model = models.build_model(cfg.model, seed=cfg.train.seed)
        model = models.add_lora(model, cfg.lora).to(device).train()
    else:
        with keep_lora_init() as lora_init:
            model = models.add_lora(build_on_meta(cfg.model), cfg.lora).train()
    adapter = topology.place(ls.adapt(model))  # meta: cut while the model has no storage
    topology.shard(adapter, cfg.distributed, device)  # FSDP2 (with stages: per stage)
    if not whole:  # only now allocated: the stage's tensors, or its shards of them
        materialize(adapter, cfg.model.path, device, lora_init)
    return adapter


def load_reference(cfg: RunConfig, topology: RunTopology, device: torch.device) -> ModelAdapter:
    """A frozen copy of the base model (full fine-tuning with ``beta > 0``), placed and
    sharded like the policy."""
    device = _as_tensors_report(device)
    whole = builds_whole(cfg)
    if whole:
        model = models.build_model(cfg.model, cfg.train.seed).to(device)
    else:
        model = build_on_meta(cfg.model)
    model.eval().requires_grad_(False)  # before sharding: FSDP reads it from the shards
    adapter = topology.shard(topology.place(ls.adapt(model)), cfg.distributed, device)
    if not whole:
        materialize(adapter, cfg.model.path, device)
    return adapter


def builds_whole(cfg: RunConfig) -> bool:
    """Whether every rank builds the whole model (``models.build_model``), as before: tiny
    random-init models (drawn from a seed over the whole model, and small)."""
    return cfg.model.tiny is not None


# --- the mechanics --------------------------------------------------------------------------


def _as_tensors_report(device: torch.device) -> torch.device:
    """``device`` as its tensors name it (Accelerate's ``cpu:0`` is ``cpu``): the adapters
    compare a state's device with the one their stage records."""
    return torch.empty(0, device=device).device


def build_on_meta(section: ModelSection) -> PreTrainedModel:
    """``section.path``'s architecture with its parameters on ``meta`` (no storage) and its
    buffers computed on the CPU; the rest as ``models.build_model`` (dtype, attention, the
    4-bit linears of ``model.quantization=nf4``, here with placeholder weights)."""
    path = Path(section.path)
    hub.fetch_weights(path)  # a Hub id's snapshot: its weights now, at the same commit
    config = AutoConfig.from_pretrained(
        path, trust_remote_code=section.trust_remote_code, local_files_only=True
    )
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(
            config,
            dtype=getattr(torch, section.dtype),
            attn_implementation=reference_attention(config, section.attn_implementation),
            trust_remote_code=section.trust_remote_code,
        )
    if (path / "generation_config.json").exists():
        model.generation_config = GenerationConfig.from_pretrained(path)
    if section.quantization == "nf4":
        quantization.quantize_nf4(model, compute_dtype=getattr(torch, section.dtype))
    return model


def materialize(
    adapter: ModelAdapter,
    directory: str | Path,
    device: torch.device,
    lora_init: dict[nn.Module, dict[str, torch.Tensor]] | None = None,
) -> None:
    """Allocate the parameters ``adapter``'s model still holds on ``device`` and fill them:
    the base weights from the checkpoint in ``directory`` (a 4-bit linear's quantized as it
    is read), LoRA's from ``lora_init`` (``keep_lora_init``). Buffers move to ``device``
    with their computed values."""
    model = adapter.model
    buffers = {name: b for name, b in model.named_buffers() if b.device.type != "meta"}
    _allocate(model, device)
    if adapter.stage is None:  # to_empty gives tied parameters their own storage
        adapter.causal_lm.tie_weights()
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name in buffers:
                buffer.copy_(buffers[name])
        checkpoint = SafetensorsCheckpoint(directory, checkpoint_renamings(adapter.causal_lm))
        for name, module, tensor in _base_tensors(adapter.causal_lm):
            if quantization.is_nf4_placeholder(module) and tensor is module.weight:
                # A 4-bit weight: read in the model's dtype, quantized, moved to the device.
                values = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")
                checkpoint.read_into(name, values)
                quantization.fill_nf4_(module, values, device)
                del values
                _return_freed_host_memory()
                continue
            local, first = _local_rows(tensor)
            for part in _checkpoint_parts(name, local, first, tuple(tensor.shape), checkpoint):
                checkpoint.read_into(*part)
        held = set(model.modules())  # the adapters of other stages' layers are gone
        filled: set[int] = set()
        for module, tensors in (lora_init or {}).items():
            for name, value in tensors.items():
                if module in held:
                    parameter = module.get_parameter(name)
                    local, first = _local_rows(parameter)
                    local.copy_(value[first : first + len(local)] if local.dim() else value)
                    filled.add(id(parameter))
    unset = [n for n, p in model.named_parameters() if ".lora_" in n and id(p) not in filled]
    if unset:  # PEFT no longer initialises adapters the way keep_lora_init expects
        raise RuntimeError(f"LoRA adapters left uninitialised after loading: {unset[:3]}")
    if adapter.stage is not None:
        move_stage(adapter, device)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim`` (None where the C library has none, e.g. macOS or musl)."""
    return getattr(ctypes.CDLL(None), "malloc_trim", None)


def _return_freed_host_memory() -> None:
    """Give the free pages of the C heap back to the OS, after a weight is quantized.

    Quantizing a weight on the CPU allocates and frees scratch several times its size while
    its small 4-bit results stay allocated. glibc keeps freed chunks under its mmap threshold
    (which grows up to 32 MiB) in its heap, where the 4-bit results allocated between them
    pin them: without a trim a rank's resident memory keeps about two weights' scratch beyond
    its share (measured: a 538 MiB qwen3 as NF4 on 4 CPU stages, stage 0 grew by 224-268
    MiB instead of 181-186)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def _allocate(model: nn.Module, device: torch.device) -> None:
    """``model.to_empty(device=device)``, except the placeholder weights of 4-bit linears
    (``quantization.is_nf4_placeholder``): ``to_empty`` would allocate them whole in their
    unquantized dtype. They are taken off their modules meanwhile and stay on ``meta``
    until ``fill_nf4_`` replaces them with their quantized values."""
    placeholders = {}
    for module in model.modules():
        if quantization.is_nf4_placeholder(module):
            placeholders[module] = module.weight
            del module.weight
    model.to_empty(device=device)
    for module, weight in placeholders.items():
        module.weight = weight


def _base_tensors(causal_lm: nn.Module) -> Iterator[tuple[str, nn.Module, torch.Tensor]]:
    """The base model's parameters and persistent buffers this rank holds, under their
    checkpoint names (PEFT's ``.base_layer`` dropped; LoRA's own tensors left out), each
    with the module that holds it."""
    seen: set[int] = set()
    for module_name, module in causal_lm.named_modules():
        tensors = [*module._parameters.items()] + [
            (n, b)
            for n, b in module._buffers.items()
            if n not in module._non_persistent_buffers_set
        ]
        for name, tensor in tensors:
            if tensor is None or id(tensor) in seen:
                continue
            seen.add(id(tensor))
            qualified = f"{module_name}.{name}" if module_name else name
            if ".lora_" in f".{qualified}":
                continue
            yield qualified.replace(".base_layer", ""), module, tensor


def _local_rows(tensor: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The part of ``tensor`` this rank stores, and the first row of the whole it starts at
    (FSDP2 shards each parameter by rows over its mesh; anything else is stored whole)."""
    if not isinstance(tensor, DTensor):
        return tensor, 0
    if any(not isinstance(p, (Shard, Replicate)) for p in tensor.placements) or any(
        isinstance(p, Shard) and p.dim != 0 for p in tensor.placements
    ):
        raise NotImplementedError(f"loading a DTensor placed as {tensor.placements}")
    _, offset = compute_local_shape_and_global_offset(
        tensor.shape, tensor.device_mesh, tensor.placements
    )
    return tensor.to_local(), offset[0] if offset else 0


_Part = tuple[str, torch.Tensor, tuple[int, ...], int]  # name, view to fill, whole shape, row


def _checkpoint_parts(
    name: str,
    local: torch.Tensor,
    first: int,
    shape: tuple[int, ...],
    checkpoint: SafetensorsCheckpoint,
) -> list[_Part]:
    """The checkpoint tensors that make ``local`` (rows ``first...`` of a ``shape`` tensor),
    each with the view of ``local`` it fills, its own whole shape and first row.

    transformers v5 fuses a MoE layer's experts into 3-D parameters (``experts.gate_up_proj``
    ``[E, 2I, H]``, ``experts.down_proj`` ``[E, H, I]``) that checkpoints, its own
    ``save_pretrained`` included, store per expert (``experts.{e}.gate_proj.weight``, ...)."""
    prefix, _, last = name.rpartition(".experts.")
    if not prefix or last not in ("gate_up_proj", "down_proj") or name in checkpoint.entries:
        return [(name, local, shape, first)]
    parts = []
    for row, expert in enumerate(range(first, first + len(local))):
        stem, matrix = f"{prefix}.experts.{expert}", local[row]
        if last == "down_proj":
            parts.append((f"{stem}.down_proj.weight", matrix, tuple(matrix.shape), 0))
        else:
            gate, up = matrix.chunk(2, dim=0)
            whole = tuple(gate.shape)
            parts += [(f"{stem}.gate_proj.weight", gate, whole, 0)]
            parts += [(f"{stem}.up_proj.weight", up, whole, 0)]
    return parts


def checkpoint_renamings(causal_lm: PreTrainedModel) -> list[WeightRenaming]:
    """transformers' key renamings for ``causal_lm``'s class, the ones ``from_pretrained``
    applies to a checkpoint's names (``Qwen3_5ForCausalLM``: ``model.language_model.X`` ->
    ``model.X``). Its converters (per-expert tensors fused into 3-D parameters) are left
    out: ``_checkpoint_parts`` reads the experts one by one instead. ``causal_lm``: the
    adapter's, already unwrapped from PEFT."""
    mapping = get_model_conversion_mapping(causal_lm)
    return [t for t in mapping if isinstance(t, WeightRenaming)]


@contextlib.contextmanager
def keep_lora_init() -> Iterator[dict[nn.Module, dict[str, torch.Tensor]]]:
    """While PEFT adds adapters to a meta model, keep each adapter's initial values.

    PEFT creates and initialises the adapters on the CPU, drawing from the global RNG
    exactly as it does for a loaded model, then moves them to the base layer's device (here
    ``meta``, which drops the values) and dtype (a 16-bit base's, or a 4-bit layer's compute
    dtype; ``get_peft_model`` then casts them back to float32). The values are copied just
    before that move and rounded to the dtype it gives, so the adapters after
    ``materialize`` equal those of the old path for the same seed."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    kept: dict[nn.Module, dict[str, torch.Tensor]] = {}
    move = BaseTunerLayer._move_adapter_to_device_of_base_layer

    def keep_then_move(self: nn.Module, adapter_name: str, *args: object, **kwargs: object):
        values = {
            name: p.detach().clone()
            for name, p in self.named_parameters()
            if ".lora_" in f".{name}" and p.device.type != "meta"
        }
        moved = move(self, adapter_name, *args, **kwargs)
        kept[self] = {
            name: value.to(self.get_parameter(name).dtype) for name, value in values.items()
        }
        return moved

    BaseTunerLayer._move_adapter_to_device_of_base_layer = keep_then_move
    try:
        yield kept
    finally:
        BaseTunerLayer._move_adapter_to_device_of_base_layer = move


@dataclasses.dataclass(frozen=True)
class _Entry:
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    end: int


class SafetensorsCheckpoint:
    """A checkpoint directory's safetensors files, read tensor by tensor without ``mmap``
    (mapped pages a rank touches would count in its memory) into tensors it is given, each
    under its name after ``renamings`` (``checkpoint_renamings``)."""

    def __init__(self, directory: str | Path, renamings: Sequence[WeightRenaming] = ()) -> None:
        self.directory = Path(directory)
        index = self.directory / INDEX
        if index.exists():
            self.weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
            files = sorted(set(self.weight_map.values()))
        elif (self.directory / SINGLE).exists():
            self.weight_map, files = {}, [SINGLE]
        else:
            raise FileNotFoundError(f"no {INDEX} or {SINGLE} in {self.directory}")
        self.entries: dict[str, _Entry] = {}
        for file in files:
            self.entries |= _header(self.directory / file)
        if renamings:
            renamings = list(renamings)
            self.entries = {apply_renamings(n, renamings): e for n, e in self.entries.items()}
            self.weight_map = {apply_renamings(n, renamings): f for n, f in self.weight_map.items()}

    def read_into(
        self,
        name: str,
        tensor: torch.Tensor,
        shape: tuple[int, ...] | None = None,
        first: int = 0,
    ) -> None:
        """Fill ``tensor`` (cast to its dtype) with checkpoint tensor ``name``, or with its
        rows ``first...`` when ``tensor`` is a shard of the ``shape`` tensor ``name``."""
        entry = self._entry(name, tuple(tensor.shape) if shape is None else shape)
        row_bytes = entry.dtype.itemsize * math.prod(entry.shape[1:])
        with open(entry.file, "rb") as file:
            file.seek(entry.start + first * row_bytes)
            if (
                tensor.device.type == "cpu"
                and tensor.dtype == entry.dtype
                and tensor.is_contiguous()
            ):
                target = tensor
            else:  # one tensor's worth of host memory, then cast and/or copied to the device
                target = torch.empty(tensor.shape, dtype=entry.dtype)
            if target.numel():
                file.readinto(target.reshape(-1).view(torch.uint8).numpy())
        if target is not tensor:
            tensor.copy_(target)

    def _entry(self, name: str, shape: tuple[int, ...]) -> _Entry:
        entry = self.entries.get(name)
        if entry is None:
            files = ", ".join(sorted({str(e.file.name) for e in self.entries.values()}))
            where = f"files read: {files}"
            if name in self.weight_map:
                where = f"{INDEX} puts it in {self.weight_map[name]}, which lacks it"
            raise CheckpointTensorError(
                f"the checkpoint in {self.directory} has no tensor {name!r}, which this rank "
                f"holds ({where})"
            )
        if entry.shape != shape:
            raise CheckpointTensorError(
                f"{name!r} in {entry.file} has shape {list(entry.shape)}, the model's is "
                f"{list(shape)}"
            )
        return entry


def _header(file: Path) -> dict[str, _Entry]:
    """The tensors of one safetensors file: 8 bytes of header length, a JSON header, data."""
    with open(file, "rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(length))
    header.pop("__metadata__", None)
    base = 8 + length
    return {
        name: _Entry(
            file=file,
            dtype=_DTYPES[info["dtype"]],
            shape=tuple(info["shape"]),
            start=base + info["data_offsets"][0],
            end=base + info["data_offsets"][1],
        )
        for name, info in header.items()
    }
