"""``Float64Internals``: a float64 model with its float32 islands computed in float64 too.

Models keep float32 islands even in float64 (every RMSNorm computes in float32; GLM's MoE
router casts its input and weight to float32). They bound a comparison with the model's own
forward at ~1e-7 relative whatever the mechanism does; under this mode (on both sides alike)
the comparison shows float64 round-off.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode


class Float64Internals(TorchFunctionMode):
    """``.to(float32)`` / ``.type(float32)`` of a float64 tensor returns it in float64."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.Tensor.to, torch.Tensor.type) and args[0].dtype == torch.float64:
            args = tuple(torch.float64 if a is torch.float32 else a for a in args)
            if kwargs.get("dtype") is torch.float32:
                kwargs = {**kwargs, "dtype": torch.float64}
        return func(*args, **kwargs)
