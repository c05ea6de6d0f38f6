"""NF4 (QLoRA) bases: which linear layers hold 4-bit weights, quantizing them, reading them back.

One module because the model builder, the adapters' absorbed weights, the planner and the
tests must agree on which linears are quantized and on what weight a quantized linear
applies. bitsandbytes is imported only here, and only when a quantized model is asked for.

- **Which**: every ``nn.Linear`` of the decoder layers (``...layers.<i>...``) except
  ``KEPT_LINEARS``; embeddings, the LM head, norms, routers (GLM's is a plain parameter, not
  a linear), convolutions and the fused routed experts (3-D parameters) keep the model dtype.
- **How**: ``bitsandbytes.nn.Linear4bit`` with NF4 codes in blocks of 64 and double
  quantization (each block's absmax in 8 bits, one float32 scale per 256 blocks), as QLoRA
  does. A pass dequantizes the weight (to the compute dtype) and multiplies; backward uses
  the same dequantized weight, so gradients flow through the quantized weights' values.
- **Same for checkpoints and toys**: every weight is quantized here from its values in the
  model dtype, so ``model.path`` and ``model.tiny`` get the same modules; transformers'
  ``BitsAndBytesConfig`` loading is not used for that reason. A toy is built whole and
  quantized (``quantize_nf4``); a checkpoint is built on ``meta`` with placeholder weights
  and each weight a rank holds is quantized as ``longstraw_core.models.sharded_loading`` reads it
  (``fill_nf4_``), by the same steps: the same codes, bit for bit.
"""

from __future__ import annotations

import logging
import math
import re
import sys
from types import ModuleType

import torch
from torch import nn

QUANTIZATIONS = ("nf4",)
NF4_BLOCKSIZE = 64  # bitsandbytes' 4-bit block: one absmax per 64 weights
NESTED_BLOCKSIZE = 256  # double quantization: one float32 scale per 256 absmax values
# Host bytes per weight bitsandbytes' CPU quantization (0.50, torch ops) holds besides its
# float32 input: the scaled weights (float32), their int32 code indices, the 8-bit codes and
# the packed halves (measured: 10.45 on a 4096 x 8192 weight).
QUANTIZE_SCRATCH_BYTES = 10.5
# Decoder linears kept in the model dtype: the DSA indexer's head weights, which transformers
# keeps in float32 (``_keep_in_fp32_modules``) and feeds ``x.to(weights_proj.weight.dtype)``.
KEPT_LINEARS = ("weights_proj",)
# The 16/32-bit floats bitsandbytes' 4-bit kernels compute in (float64 is not one: its CPU
# dequantization returns an unfilled tensor for it).
COMPUTE_DTYPES = ("float32", "bfloat16", "float16")
INSTALL_HINT = 'pip install "bitsandbytes>=0.50" (or pip install -e ".[qlora]")'
_DECODER_LAYER = re.compile(r"(^|\.)layers\.\d+\.")


class _KernelNotice(logging.Filter):
    """Drops bitsandbytes' import-time notice that its fused AVX512-BF16 CPU kernel needs the
    ``kernels`` package: ``quantize_nf4`` switches that path off (see there), and peft
    imports bitsandbytes whenever it is installed, so every run would print the notice."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "gemm_4bit_forward" not in record.getMessage()


def quiet_cpu_kernel_notice() -> None:
    """Install ``_KernelNotice`` on bitsandbytes' CPU backend logger (before it imports)."""
    logger = logging.getLogger("bitsandbytes.backends.cpu.ops")
    if not any(isinstance(f, _KernelNotice) for f in logger.filters):
        logger.addFilter(_KernelNotice())


quiet_cpu_kernel_notice()  # at import: ``longstraw_core`` imports this module before peft


def require_bitsandbytes() -> ModuleType:
    """``bitsandbytes``, or an ``ImportError`` naming the install command."""
    try:
        import bitsandbytes
    except ImportError as exc:
        raise ImportError(f"model.quantization=nf4 needs bitsandbytes: {INSTALL_HINT}") from exc
    return bitsandbytes


def nf4_bytes(numel: int) -> float:
    """Bytes of ``numel`` weights in NF4 with double quantization: 4-bit codes, an 8-bit
    absmax per 64-weight block, a float32 scale per 256 blocks (~0.516 byte per weight)."""
    blocks = numel / NF4_BLOCKSIZE
    return numel / 2 + blocks + 4 * blocks / NESTED_BLOCKSIZE


def nf4_load_bytes(numel: int, dtype_bytes: int) -> int:
    """Host bytes while one weight of ``numel`` is quantized as it loads (``fill_nf4_``):
    the weight as read in the model dtype (``dtype_bytes`` each), its float32 copy (the
    same tensor for float32), and the quantization's scratch (``QUANTIZE_SCRATCH_BYTES``)."""
    copy = 0 if dtype_bytes == 4 else 4
    return math.ceil(numel * (dtype_bytes + copy + QUANTIZE_SCRATCH_BYTES))


def is_quantizable(name: str, module: nn.Module) -> bool:
    """Whether NF4 quantizes the module at ``name``: a decoder layer's linear, not kept."""
    return _DECODER_LAYER.search(name) is not None and quantizable_in_layer(name, module)


def quantizable_in_layer(name: str, module: nn.Module) -> bool:
    """``is_quantizable`` for ``name`` inside a decoder layer (the planner reads layers)."""
    return type(module) is nn.Linear and name.rsplit(".", 1)[-1] not in KEPT_LINEARS


def is_quantized(module: nn.Module) -> bool:
    """Whether ``module`` is a bitsandbytes 4-bit linear (False when bitsandbytes is absent)."""
    bnb = sys.modules.get("bitsandbytes")
    return bnb is not None and isinstance(module, bnb.nn.Linear4bit)


def quantize_nf4(model: nn.Module, compute_dtype: torch.dtype) -> nn.Module:
    """Replace every quantizable linear of ``model`` by an NF4 ``Linear4bit``, in place.

    Each weight is quantized where it lies (CPU or GPU) from its float32 values and freed
    as soon as its 4-bit copy exists. On a ``meta`` model (``longstraw_core.models.sharded_loading``) each
    4-bit linear gets a placeholder weight of the linear's shape and dtype instead, which
    ``fill_nf4_`` quantizes once its values are read. The model is marked
    ``is_loaded_in_4bit`` so peft wraps these layers with its 4-bit LoRA layer.
    """
    if compute_dtype not in {getattr(torch, name) for name in COMPUTE_DTYPES}:
        raise ValueError(f"NF4 computes in one of {', '.join(COMPUTE_DTYPES)}, not {compute_dtype}")
    bnb = require_bitsandbytes()
    names = [name for name, module in model.named_modules() if is_quantizable(name, module)]
    for name in names:
        linear = model.get_submodule(name)
        quantized = bnb.nn.Linear4bit(
            linear.in_features,
            linear.out_features,
            bias=linear.bias is not None,
            compute_dtype=compute_dtype,
            compress_statistics=True,
            quant_type="nf4",
            device="meta",
        )
        quantized.weight = _nf4_weight(linear.weight.data, quantized)
        if linear.bias is not None:
            quantized.bias = nn.Parameter(linear.bias.data, requires_grad=False)
        # bitsandbytes repacks a CPU layer's weight in eval mode without autograd (AVX512-BF16
        # CPUs) and then computes in bfloat16: no-grad passes (prefill, rollout) would differ
        # from autograd ones (replay, sweep), and the packed weight is no longer NF4's layout.
        quantized.support_avx512bf16_for_cpu = False
        quantized.train(linear.training)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, quantized)
    model.is_loaded_in_4bit = True  # what peft reads to pick its 4-bit LoRA layer
    return model


def _nf4_weight(values: torch.Tensor, module: nn.Module) -> torch.nn.Parameter:
    """``values`` as a bitsandbytes ``Params4bit`` of ``module``: quantized (NF4, double
    quantization) from their float32 copy on the device they lie on; on ``meta``, an
    unquantized placeholder keeping their shape and dtype (what ``fill_nf4_`` reads)."""
    bnb = require_bitsandbytes()
    meta = values.device.type == "meta"
    weight = bnb.nn.Params4bit(
        values if meta else values.float(),
        requires_grad=False,
        compress_statistics=True,
        quant_type="nf4",
        blocksize=NF4_BLOCKSIZE,
        module=module,
    )
    return weight if meta else weight.to(values.device)


def is_nf4_placeholder(module: nn.Module) -> bool:
    """Whether ``module`` is a 4-bit linear built on ``meta`` whose weight awaits
    ``fill_nf4_``."""
    return is_quantized(module) and module.weight.device.type == "meta"


def fill_nf4_(linear: nn.Module, values: torch.Tensor, device: torch.device) -> None:
    """Quantize ``values`` (its weight in the model's dtype, on the CPU) into a 4-bit linear
    built on ``meta``, then move it to ``device``: the same steps, in the same order, as
    ``quantize_nf4`` on a built model followed by ``model.to(device)``, so the same codes,
    absmax and nested scales."""
    placeholder = linear.weight
    if not is_nf4_placeholder(linear):
        raise ValueError("fill_nf4_ fills a 4-bit linear built on meta (quantize_nf4)")
    if values.shape != placeholder.shape or values.dtype != placeholder.dtype:
        raise ValueError(
            f"values {list(values.shape)} {values.dtype} for a 4-bit weight of "
            f"{list(placeholder.shape)} {placeholder.dtype}"
        )
    linear.weight = _nf4_weight(values, linear)
    linear.to(device)


def dequantized_weight(linear: nn.Module) -> torch.Tensor:
    """The ``[out, in]`` weight a plain or 4-bit linear applies (4-bit: its dequantized
    values in float32, the dtype they are stored from)."""
    if not is_quantized(linear):
        return linear.weight
    from bitsandbytes.functional import dequantize_4bit

    return dequantize_4bit(linear.weight.data, linear.weight.quant_state).float()


def weight_dtype(linear: nn.Module) -> torch.dtype:
    """The dtype ``linear`` computes in: a 4-bit layer's compute dtype, else its weight's."""
    if is_quantized(linear):
        return linear.compute_dtype
    return linear.weight.dtype


def dequantize_(model: nn.Module, dtype: torch.dtype = torch.float32) -> nn.Module:
    """Replace every 4-bit linear (peft's base layers included) by a plain ``nn.Linear``
    holding its dequantized weight in ``dtype``, in place: the reference a quantized model
    must equal, and a way to export one."""
    names = [name for name, module in model.named_modules() if is_quantized(module)]
    for name in names:
        quantized = model.get_submodule(name)
        weight = dequantized_weight(quantized)
        linear = nn.Linear(
            quantized.in_features,
            quantized.out_features,
            bias=quantized.bias is not None,
            device=weight.device,
            dtype=dtype,
        )
        with torch.no_grad():
            linear.weight.copy_(weight)
            if quantized.bias is not None:
                linear.bias.copy_(quantized.bias)
        linear.requires_grad_(False)
        linear.train(quantized.training)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, linear)
    if getattr(model, "is_loaded_in_4bit", False):
        model.is_loaded_in_4bit = False
    return model


def quantized_tensors(model: nn.Module) -> list[torch.Tensor]:
    """What the 4-bit layers of ``model`` hold: packed codes, absmax and nested scales (the
    quantization state's tensors are neither parameters nor buffers)."""
    tensors = []
    for module in model.modules():
        if not is_quantized(module) or is_nf4_placeholder(module):
            continue
        state = module.weight.quant_state
        tensors += [module.weight.data, state.absmax]
        if state.nested:
            tensors += [state.state2.absmax, state.offset]
    return tensors


def quantized_bytes(model: nn.Module) -> int:
    """Bytes the 4-bit layers of ``model`` hold: packed codes, absmax and nested scales."""
    return sum(t.numel() * t.element_size() for t in quantized_tensors(model))
