"""Functions of the transformers module that defines a model's class (its own RoPE, its
pure-torch kernels), so the adapters compute exactly what that model does."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

import torch
from torch import nn

RotaryFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]


@functools.cache
def model_function(model_class: type, name: str, pure: bool = False) -> Callable:
    """The function ``name`` of the module that defines ``model_class``.

    ``pure``: the pure-torch function itself. transformers wraps some functions so that they
    call flash-linear-attention or causal-conv1d whenever the package is importable, even for
    CPU tensors, and otherwise warn, on every run, that they fall back to "much slower" torch;
    unwrapping gives back the reference function, and the caller chooses the kernel instead
    (``model_adapters/qwen36/kernels.py``), so that warning never applies.
    """
    module = inspect.getmodule(model_class)
    function = getattr(module, name, None)
    if function is None:
        raise TypeError(f"{model_class.__name__}'s module has no {name}")
    if pure:
        function = _unwrapped(function)
        if not inspect.isfunction(function) or function.__module__ != module.__name__:
            raise TypeError(f"could not find the pure-torch {name} of {module.__name__}")
    return function


def _unwrapped(function: Callable) -> Callable:
    """``function`` without its wrappers: ``functools.wraps`` layers (transformers' fallback
    wrapper) and, with the ``kernels`` package installed, the ``nn.Module`` that its
    ``use_kernel_forward_from_hub`` makes of a function (whose ``forward`` calls it)."""
    function = inspect.unwrap(function)
    if isinstance(function, nn.Module):
        inner = inspect.getclosurevars(type(function).forward).nonlocals.get("func")
        if callable(inner):
            function = inspect.unwrap(inner)
    return function


def model_rotary_function(attention: nn.Module) -> RotaryFn:
    """The ``apply_rotary_pos_emb`` of the module that defines ``attention``'s class.

    Using the model's own function keeps its RoPE variant (partial, interleaved, ...) exact.
    """
    return model_function(type(attention), "apply_rotary_pos_emb")
