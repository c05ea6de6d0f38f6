"""What the memory planner asks a layer kind (``longstraw_core.plan``): ``KindPlan``.

Each kind module defines a ``KindPlan`` subclass next to its record and registers it
(``kinds.registry.LayerKind.plan``). The planner never names a kind: for every decoder layer
it asks the layer's kind (``LayerSpec.kind``) for its token mixer's shapes, saved bytes,
working sets, FLOPs and decode reads.

The formulas follow the code the kind's layers run. They import nothing of the planner: the
planner hands them ``act`` (its ``plan.activations.Activations``: the compute dtype's bytes
``b``, the spec and workload, the building blocks ``linear_input`` and ``norm``, and the
attention kernels' scratch formulas as ``act.kernels``, ``plan.kernels``) and ``layer``
(its ``plan.model.LayerSpec``: ``mixer``, ``dims``, the record's byte counts).
"""

from __future__ import annotations

import math
from typing import Any

FP32 = 4  # bytes of a float32 (as ``plan.units``)
INT64 = 8  # bytes of an int64


class KindPlan:
    """A kind's planner formulas; the defaults are those of a kind without the feature."""

    # The kernels ``make gpu-check`` times for this kind's layers on CUDA, in words
    # (``plan.output.time_kernels``).
    cuda_kernels: str = ""
    # How the memory advice names offloading this kind's state (``plan.advice``); None: the
    # advice never offloads it alone (fixed-size state).
    offload_label: str | None = None
    # Whether every query attends over every stored position, dense (the per-stage table's
    # "full attn" count, ``plan.stages.full_attention_counts``).
    full_attention: bool = False
    # Whether a recomputed chunk's last layer, which only writes its state, has a backward
    # with weight gradients (its key/value or latent projections) or runs whole (False).
    state_only_backward: bool = True
    # Whether exact mode's kept attention outputs (``keep_attention_outputs``) spare the
    # sweep's recompute this kind's mixing FLOPs.
    reuses_kept_outputs: bool = False

    # --- the model -----------------------------------------------------------------------------

    def mixer_dims(self, layer: Any) -> tuple[str, dict[str, int]]:
        """The token mixer of decoder layer ``layer`` (an ``nn.Module``) and the widths its
        activations have (``LayerSpec.mixer``, ``LayerSpec.dims``)."""
        raise NotImplementedError

    def checkpoint_bytes(self, state_fixed: int) -> int:
        """Bytes of one chunk-start checkpoint exact mode keeps (``state_fixed``: the
        record's bytes at capacity 0); 0 for kinds that keep none."""
        return 0

    def checkpoints_bytes(self, layer: Any, stored: int, chunk: int) -> int:
        """Bytes of all the chunk-start checkpoints exact mode keeps of ``layer``'s record
        over a prompt of ``stored`` positions prefilled in chunks of ``chunk``: one
        ``LayerSpec.checkpoint`` per chunk start (a kind whose checkpoints grow with the
        position says so)."""
        return math.ceil(stored / chunk) * layer.checkpoint if stored > 0 else 0

    def branch_bytes(self, layer: Any, positions: float) -> float:
        """Bytes of one rollout branch's own record after ``positions`` decoded tokens (its
        preallocated K/V, or a copy of a fixed-size state)."""
        if layer.state_per_token:
            return layer.state_per_token * positions
        return layer.state_fixed

    def branch_read_bytes(self, layer: Any, positions: float) -> float:
        """Bytes of its own record one branch's decode step reads (and writes) after
        ``positions`` decoded tokens: its K/V so far, or its fixed-size state read and
        written."""
        if layer.state_per_token:
            return layer.state_per_token * positions
        return 2 * layer.state_fixed

    def kept_positions(self, layer: Any, positions: float) -> float:
        """How many of ``positions`` prompt positions ``layer``'s record keeps
        (``LayerSpec.state_at``): all of them for a kind whose state grows with the prompt or
        has a fixed size; a bounded window keeps at most its window (``layer.dims``)."""
        return positions

    # --- what autograd saves ---------------------------------------------------------------

    def saved(self, act: Any, layer: Any, tokens: int, prefix: int) -> int:
        """Bytes the mixer saves for backward over ``tokens`` tokens after ``prefix``."""
        raise NotImplementedError

    def state_only_saved(self, act: Any, layer: Any, tokens: int) -> int:
        """What a recomputed chunk's last layer keeps when it only writes its state (besides
        its input norm)."""
        raise NotImplementedError

    def kept_beside_input(self, act: Any, layer: Any, tokens: int, prefix: int) -> int:
        """What a checkpointed layer keeps besides its input (the DSA selection)."""
        return 0

    def written(self, act: Any, layer: Any, tokens: int) -> int:
        """What a recomputed chunk's layer hands the sweep, alive until the chunk's
        backward ends."""
        raise NotImplementedError

    def piece_rows(self, act: Any, layer: Any, tokens: int) -> int:
        """What a replay piece of ``tokens`` tokens writes and the later pieces read."""
        return self.written(act, layer, tokens)

    def kept_output_bytes(self, act: Any, layer: Any, lse: int) -> int:
        """Bytes per stored position of the attention outputs prefill keeps for the sweep
        (``keep_attention_outputs``); ``lse``: the log-sum-exp's bytes."""
        return 0

    # --- working sets --------------------------------------------------------------------------

    def width(self, act: Any, layer: Any) -> int:
        """The mixer's widest per-token activation (elements)."""
        raise NotImplementedError

    def working(self, act: Any, layer: Any, tokens: int, prefix: int) -> int:
        """The mixer without autograd: its projections (and their roped / convolved copies)
        and its kernel's scratch."""
        raise NotImplementedError

    def state_only_working(self, act: Any, layer: Any, tokens: int, prefix: int) -> int:
        """A writing span's last layer: only the keys/values (or latent) it stores."""
        return tokens * act.b * (act.spec.hidden + act.widest(layer))

    def forward_scratch(self, act: Any, layer: Any, tokens: int, prefix: int) -> int:
        """The mixer's kernels in a pass with autograd, beyond what the graph saves."""
        return 0

    def prefix_backward_scratch(self, act: Any, layer: Any, tokens: int, prefix: int) -> int:
        """The mixer's backward over ``prefix > 0`` stored positions, per block of keys."""
        return 0

    def decode_scratch(self, act: Any, layer: Any, group: int, prefix: int) -> int:
        """One decoding step of ``group`` branches over ``prefix`` positions."""
        return 0

    # --- FLOPs and reads ---------------------------------------------------------------------

    def pair_flops(self, layer: Any) -> float:
        """Forward FLOPs per query-key pair of the part that grows with the context."""
        return 0.0

    def token_flops(self, layer: Any) -> float:
        """Forward mixing FLOPs per token that do not grow with a long context."""
        return 0.0

    def mixing_flops(self, layer: Any, tokens: float, prefix: float) -> tuple[float, float]:
        """(mixing, indexer) forward FLOPs over ``tokens`` tokens after ``prefix``: what
        backpropagates, and the DSA indexer's scores (which do not)."""
        raise NotImplementedError

    def decode_read_bytes(self, layer: Any, context: float, group: int, cb: int) -> float:
        """Bytes of prefix state one decode step of ``group`` branches reads at ``context``
        positions (``cb``: the compute dtype's bytes): growing state whole, shared by the
        branches; a fixed-size state is counted with the branches' own."""
        return layer.state_at(context) if layer.state_per_token else 0.0


def causal_pairs(tokens: float, prefix: float, window: float | None = None) -> float:
    """Query-key pairs of ``tokens`` queries after ``prefix`` stored positions, each query
    seeing every earlier position and itself, or at most ``window`` of them."""
    if tokens <= 0:
        return 0.0
    first, last = prefix + 1, prefix + tokens  # keys the first and the last query see
    if window is None or last <= window:
        return (first + last) * tokens / 2
    if first >= window:
        return window * tokens
    return (first + window) * (window - first + 1) / 2 + (last - window) * window
