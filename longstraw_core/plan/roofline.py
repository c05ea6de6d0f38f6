"""One pipeline stage's work in a phase, and what it costs on a stated GPU: the roofline.

``timing`` combines the stages' costs with the phases' schedules; this module holds what one
stage does: its FLOPs (``plan.flops``, the kinds' own counts), the weights and prefix state it
reads (HBM, or PCIe for offloaded records; each kind's decode reads,
``KindPlan.decode_read_bytes``), a 4-bit base's dequantization, and ``Work.seconds``, the
slowest of its FLOPs over ``flops x mfu``, its HBM bytes and its host traffic.
"""

from __future__ import annotations

from dataclasses import dataclass

from longstraw_core.pipeline.layout import StageLayout
from longstraw_core.plan.flops import (
    Flops,
    active_params,
    expert_params,
    head_flops,
    layer_flops,
)
from longstraw_core.plan.model import LayerSpec, ModelSpec, Workload
from longstraw_core.plan.stages import root_split
from longstraw_core.plan.units import FP32, dtype_bytes
from longstraw_core.tensors.quantization import nf4_bytes

# flash-attn's backward: five matmuls (scores recomputed, dP, dV, dQ, dK) to the forward's two.
ATTENTION_BACKWARD = 2.5
# bitsandbytes (>= 0.50, CUDA) multiplies by a 4-bit weight in its fused kernel, reading the
# codes alone, up to this many rows (``_GEMM_4BIT_CUSTOM_FLOOR_M``; up to 1536 on some GPUs
# and shapes: not counted); with more rows, and in every backward, it dequantizes the weight
# to the compute dtype first (``_dequant_linear_fallback``, ``MatMul4Bit.backward``).
NF4_FUSED_ROWS = 4


@dataclass(frozen=True)
class Hardware:
    """A GPU and its links (defaults: an NVIDIA H20, 8 to a node on NVLink, PCIe 5 x16)."""

    name: str = "H20"
    tflops: float = 148.0  # dense bf16 tensor-core peak, TFLOP/s
    hbm_tbps: float = 4.0  # HBM bandwidth, TB/s
    link_gbps: float = 900.0  # between stages (NVLink), GB/s
    pcie_gbps: float = 64.0  # host <-> device, GB/s
    mfu: float = 0.4  # fraction of the FLOP peak the kernels reach (GEMMs and attention alike)
    bandwidth_efficiency: float = 0.8  # fraction of the HBM, link and PCIe peaks reached
    latency_us: float = 10.0  # one point-to-point message between stages
    # (field, where its value came from: a flag, a calibration file) for values not defaulted
    sources: tuple[tuple[str, str], ...] = ()

    @property
    def flop_rate(self) -> float:
        return self.tflops * 1e12 * self.mfu

    @property
    def hbm_rate(self) -> float:
        return self.hbm_tbps * 1e12 * self.bandwidth_efficiency

    @property
    def link_rate(self) -> float:
        return self.link_gbps * 1e9 * self.bandwidth_efficiency

    @property
    def pcie_rate(self) -> float:
        return self.pcie_gbps * 1e9 * self.bandwidth_efficiency

    def hop(self, size: float) -> float:
        """Seconds to send ``size`` bytes from one stage to the next."""
        return self.latency_us * 1e-6 + size / self.link_rate

    def describe(self) -> str:
        return (
            f"{self.name}: {self.tflops:g} TFLOP/s dense bf16 x MFU {self.mfu:g}, HBM "
            f"{self.hbm_tbps:g} TB/s, stage links {self.link_gbps:g} GB/s, PCIe "
            f"{self.pcie_gbps:g} GB/s (bandwidths x {self.bandwidth_efficiency:g}), "
            f"{self.latency_us:g} us a message"
        )


@dataclass(frozen=True)
class Work:
    """One stage's work in one phase (or one microbatch or step of it)."""

    flops: float = 0.0
    hbm: float = 0.0  # bytes
    pcie: float = 0.0  # bytes
    dequant: float = 0.0  # HBM bytes of NF4 dequantization: kernels of their own, not overlapped

    def seconds(self, hw: Hardware) -> tuple[float, str]:
        """The roofline: the slowest resource, and its name; plus the dequantization (it
        runs before the matmuls it feeds, so it adds), named when it is the largest part."""
        times = {
            "compute": self.flops / hw.flop_rate,
            "HBM": self.hbm / hw.hbm_rate,
            "PCIe": self.pcie / hw.pcie_rate,
        }
        bound = max(times, key=times.__getitem__)
        dequant = self.dequant / hw.hbm_rate
        return times[bound] + dequant, "dequant" if dequant > times[bound] else bound


class StageCosts:
    """Each stage's work: its layers' FLOPs, the bytes it reads, its trainable parameters."""

    def __init__(self, spec: ModelSpec, work: Workload, hw: Hardware, layout: StageLayout):
        self.spec, self.work, self.hw, self.layout = spec, work, hw, layout
        self.cb = dtype_bytes(work.compute_dtype)
        self.stages = layout.stages
        self.full = not work.lora_rank  # the base's weights train: backward also computes dW
        self.embedding, self.head = root_split(spec)

    # --- per stage ----------------------------------------------------------------------------

    def layers(self, stage: int) -> list[LayerSpec]:
        return [self.spec.layers[i] for i in self.layout.layers_of(stage)]

    def last(self, stage: int) -> bool:
        return stage == self.stages - 1

    def forward(self, stage: int, tokens: float, prefix: float, head: bool) -> Flops:
        total = Flops()
        for layer in self.layers(stage):
            total = total + layer_flops(self.spec, layer, tokens, prefix)
        if head and self.last(stage):
            total = total + head_flops(self.spec, tokens)
        return total

    def backward(self, forward: Flops) -> float:
        """A backward's FLOPs: input gradients through every matmul (and weight gradients
        when the base trains; LoRA's own are noise), the attention's ``ATTENTION_BACKWARD``;
        the DSA indexer has no gradient."""
        return forward.matmul * (2 if self.full else 1) + forward.mixing * ATTENTION_BACKWARD

    def without_attention(self, stage: int, tokens: float, prefix: float) -> Flops:
        """A forward that reuses the kept full-attention outputs (``keep_attention_outputs``):
        full attention's scores and values skipped; MLA and DeltaNet unaffected."""
        total = Flops()
        for layer in self.layers(stage):
            flops = layer_flops(self.spec, layer, tokens, prefix)
            if layer.kind.plan.reuses_kept_outputs:
                flops = Flops(flops.matmul, 0.0, flops.indexer)
            total = total + flops
        return total

    def weight_bytes(self, stage: int, group: int | None = None) -> float:
        """Weights a pass reads (compute dtype; LoRA adapters fp32): every expert, or for a
        decode step of ``group`` tokens only the experts they can reach (``group x top_k``)."""
        size = 0.0
        for layer in self.layers(stage):
            params = layer.params
            if group is not None and layer.mlp == "moe":
                m = layer.mlp_dims
                reached = min(m["experts"], group * m["top_k"])
                params = active_params(self.spec, layer) - m["top_k"] * expert_params(
                    self.spec, layer
                )
                params += reached * expert_params(self.spec, layer)
            size += params
        # the embedding is read by rows (a chunk's tokens): noise next to the layers
        size += self.head * self.last(stage) + self.lora_params(stage) * FP32 / self.cb
        return size * self.cb

    def quantized(self, stage: int) -> float:
        """The stage's weights stored in 4 bits (``model.quantization=nf4``)."""
        if self.work.quantization is None:
            return 0.0
        return sum(layer.quantizable for layer in self.layers(stage))

    def dequant(self, stage: int, passes: float, rows: float) -> float:
        """HBM bytes ``passes`` passes of ``rows`` rows move dequantizing the stage's 4-bit
        weights: each reads the NF4 codes and scales and writes the compute-dtype copy (that
        the matmul then reads, as ``weight_bytes`` counts); none when the fused kernel takes
        the rows (``NF4_FUSED_ROWS``)."""
        quantized = self.quantized(stage)
        if not quantized or rows <= NF4_FUSED_ROWS:
            return 0.0
        return passes * (nf4_bytes(quantized) + quantized * self.cb)

    def lora_params(self, stage: int) -> float:
        if not self.work.lora_rank:
            return 0.0
        return sum(
            self.work.lora_rank * (inp + out)
            for layer in self.layers(stage)
            for name, (inp, out) in layer.linear_shapes.items()
            if name in self.work.lora_targets
        )

    def trainable(self, stage: int) -> float:
        if self.work.lora_rank:
            return self.lora_params(stage)
        root = self.embedding * (stage == 0) + self.head * self.last(stage)
        if self.stages == 1:
            root = self.spec.root_params
        return sum(layer.params for layer in self.layers(stage)) + root

    def state_bytes(self, stage: int, positions: float, offloaded: bool | None = None) -> float:
        """The stage's prefix state at ``positions`` (only its offloaded, or only its
        resident, records when ``offloaded`` is given)."""
        return sum(
            layer.state_at(positions)
            for layer in self.layers(stage)
            if offloaded is None or self.work.offloads(layer.record) == offloaded
        )

    def grad_bytes(self, stage: int, positions: float, offloaded: bool) -> float:
        """Exact mode's dS of the stage's offloaded (or resident) records."""
        return sum(
            layer.grad_at(positions)
            for layer in self.layers(stage)
            if self.work.offloads(layer.record) == offloaded
        )

    def decode_reads(
        self, stage: int, context: float, group: int | None = None
    ) -> tuple[float, float]:
        """(HBM, PCIe) bytes one decode step of ``group`` branches (default: G) reads of the
        prefix state: all K/V (the branches share it: their queries are rows of one batch),
        the DSA indexer's keys and the selected latents, each branch's recurrent state (read
        and written) and its own cache."""
        group = self.work.group if group is None else group
        hbm, pcie = 0.0, 0.0
        mean_new = self.work.response_tokens / 2
        for layer in self.layers(stage):
            size = layer.kind.plan.decode_read_bytes(layer, context, group, self.cb)
            if self.work.offloads(layer.record):
                pcie += size
            else:
                hbm += size
            hbm += group * layer.kind.plan.branch_read_bytes(layer, mean_new)
        return hbm, pcie
