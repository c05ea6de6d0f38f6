"""The weights' share of a rank's memory: parameters (4-bit ones, LoRA adapters), gradients,
AdamW's moments and step, the frozen reference model, working weights, FSDP's gathered and
unsharded tensors, and the host while loading (``core.MemoryParts`` mixes ``WeightParts`` in).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

from longstraw_core.plan.model import LayerSpec, ModelSpec, Workload
from longstraw_core.plan.units import FP32, dtype_name, human_count
from longstraw_core.tensors.quantization import nf4_bytes, nf4_load_bytes


class WeightParts:
    """What the weights take on one rank (``spec``: the rank's stage of the model)."""

    spec: ModelSpec
    work: Workload
    cb: int  # bytes of the compute dtype
    pb: int  # bytes of the parameters' dtype

    def lora_params(self, layer: LayerSpec | None = None) -> int:
        """Adapter parameters (all layers, or one): ``r x (in + out)`` per adapted linear."""
        return self._all_lora_params if layer is None else self._lora_params((layer,))

    @functools.cached_property
    def _all_lora_params(self) -> int:
        """Every layer's adapters, counted once: the lines that scale with the trainable
        parameters ask for them in each of the planner's searches."""
        return self._lora_params(self.spec.layers)

    def _lora_params(self, layers: Sequence[LayerSpec]) -> int:
        work = self.work
        if not work.lora_rank:
            return 0
        return sum(
            work.lora_rank * (inp + out)
            for item in layers
            for name, (inp, out) in item.linear_shapes.items()
            if name in work.lora_targets
        )

    @property
    def trainable(self) -> int:
        return self.lora_params() if self.work.lora_rank else self.spec.params

    @property
    def state_bytes(self) -> int:
        """Bytes per element of gradients and AdamW moments: the trainable parameters'
        dtype (PEFT keeps adapters in float32 over a 16-bit base)."""
        return FP32 if self.work.lora_rank else self.pb

    def quantized_params(self) -> int:
        """Weights stored in 4 bits (``model.quantization=nf4``): the decoder linears."""
        if self.work.quantization is None:
            return 0
        return sum(layer.quantizable for layer in self.spec.layers)

    @property
    def working_weights(self) -> bool:
        """bf16 compute over float32 masters without FSDP (``longstraw_core.models.mixed_precision``):
        frozen weights are cast to the compute dtype once, trained ones copied per step."""
        return not self.work.fsdp and self.cb < self.pb

    def parameters(self) -> int:
        """The weights (4-bit ones at ``nf4_bytes``: ~0.516 byte each) and the adapters."""
        quantized = self.quantized_params()
        frozen_base = self.working_weights and self.work.lora_rank
        base_bytes = self.cb if frozen_base else self.pb
        total = (self.spec.params - quantized) * base_bytes + self.lora_params() * FP32
        total += math.ceil(nf4_bytes(quantized))
        return total // self.work.shards

    def reference(self) -> int:
        """The frozen reference model of full fine-tuning with ``beta > 0``: the policy's
        base weights, sharded like the policy (LoRA's reference is its own base)."""
        if not self.work.reference_model or self.work.lora_rank:
            return 0
        frozen_bytes = self.cb if self.working_weights else self.pb
        return self.spec.params * frozen_bytes // self.work.shards

    def working_copy(self) -> int:
        """Working weights: the compute-dtype copy of every trained parameter, from prefill
        to the optimizer step (the float32 masters stay where they are)."""
        return self.trainable * self.cb if self.working_weights else 0

    def working_grads(self) -> int:
        """Working weights: one backward's gradients in the compute dtype, each added into
        its float32 sum (``gradients``) as soon as autograd has accumulated it."""
        return self.trainable * self.cb if self.working_weights else 0

    def dequantized(self) -> int:
        """A 4-bit linear's weight, dequantized to the compute dtype for its matmul (forward
        and backward alike): one at a time, the largest."""
        if self.work.quantization is None:
            return 0
        return max((layer.largest_quantizable for layer in self.spec.layers), default=0) * self.cb

    def gradients(self) -> int:
        return self.trainable * self.state_bytes // self.work.shards

    def optimizer(self) -> int:
        return 2 * self.trainable * self.state_bytes // self.work.shards

    def gathered(self) -> int:
        """Parameters FSDP holds unsharded during a pass: the root (embeddings, head), the
        last layer (kept gathered), the layer computing and the one prefetched."""
        if not self.work.fsdp:
            return 0
        if not self.work.reshard_after_forward:
            return self.spec.params * self.cb
        biggest = max(layer.params for layer in self.spec.layers)
        return (self.spec.root_params + self.spec.layers[-1].params + 2 * biggest) * self.cb

    def gathered_in_rollout(self, once: bool) -> int:
        """What FSDP holds unsharded while decoding: every layer when gathered ``once`` for
        the rollout, else what any other pass holds."""
        return self.spec.params * self.cb if once else self.gathered()

    def unsharded_grads(self) -> int:
        """Backward of a sharded layer: its unsharded gradients in the compute dtype and
        their copy in the reduce dtype (float32), until reduce-scatter; the root's are held
        to the end of backward."""
        if not self.work.fsdp:
            return 0
        reduce = self.cb + (FP32 if self.cb < FP32 else 0)
        if self.work.lora_rank:
            per_layer = [self.lora_params(layer) for layer in self.spec.layers]
            root = 0
        else:
            per_layer = [layer.params for layer in self.spec.layers]
            root = self.spec.root_params * self.cb
        return max(per_layer) * reduce + root

    def optimizer_transient(self) -> int:
        """AdamW's step: foreach on CUDA (one temporary per moment, the whole shard);
        one tensor at a time on CPU (sqrt and quotient of the largest parameter)."""
        if self.work.device == "cuda":
            return self.trainable * self.state_bytes // self.work.shards
        largest = self.spec.largest_param if not self.work.lora_rank else self.lora_largest()
        return 2 * largest * self.state_bytes // self.work.shards

    def lora_largest(self) -> int:
        shapes = [
            self.work.lora_rank * max(inp, out)
            for layer in self.spec.layers
            for name, (inp, out) in layer.linear_shapes.items()
            if name in self.work.lora_targets
        ]
        return max(shapes, default=0)

    def load_host(self) -> int:
        """Host bytes while loading: one tensor (of the rank's shard) at a time, read there
        before it is cast or copied to the device (none on a CPU rank whose checkpoint has
        the model's dtype: read in place), or a 4-bit weight being quantized
        (``load_quantizing``), whichever is larger; never the whole model."""
        read = math.ceil(self.spec.largest_param / self.work.shards) * self.pb
        return max(read, self.load_quantizing())

    def load_quantizing(self) -> int:
        """Host bytes while the rank's largest 4-bit weight is read and quantized
        (``model.quantization=nf4``: on the host, one weight at a time, then moved to the
        device; ``quantization.nf4_load_bytes``)."""
        if self.work.quantization is None:
            return 0
        largest = max((layer.largest_quantizable for layer in self.spec.layers), default=0)
        return nf4_load_bytes(largest, self.pb)

    def _param_note(self) -> str:
        work = self.work
        quantized = self.quantized_params()
        note = f"{human_count(self.spec.params - quantized)} x {dtype_name(self.pb)}"
        if quantized:
            note += f" + {human_count(quantized)} x NF4 (0.516 B)"
        if work.lora_rank:
            note += f" + LoRA {human_count(self.lora_params())} x fp32"
        if work.shards > 1:
            note += f", sharded /{work.shards}"
        return note
