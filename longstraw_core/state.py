"""The prefix state: what later tokens read of a prompt that was run once without autograd.

Each layer keeps a record of its own kind: ``AttentionKV`` (full-attention keys/values),
``RecurrentState`` (Gated DeltaNet conv and recurrent state) or ``LatentKV`` (MLA latent and
DSA indexer keys), all defined here; each adapter's ``new_layer_states`` picks them
(``docs/design.md``, "Prefix state per layer kind"). Records are preallocated to the prompt
length when prefill starts and filled chunk by chunk in place, so a long prompt never
triggers the quadratic copying of a growing cache.

Rollout adds a ``BranchCache``: per layer, what each of ``B`` branches decoded from the
prefix holds of its own (``BranchKV``, ``BranchRecurrent``, ``BranchLatent``), made by the
prefix record's ``new_branch``. The prefix itself is shared by the branches, never copied.

Records of the layer types an ``OffloadPolicy`` sends to the CPU live there (pinned with
CUDA); passes read them through ``longstraw_core.offload.stream_layers``, which copies each
record's ``window`` (what the pass reads) to the device one layer at a time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Protocol

import torch

from longstraw_core.attention import AttentionOutput
from longstraw_core.offload import OffloadPolicy, Residency, copy_rows


class LayerState(Protocol):
    """One layer's share of the prefix state."""

    kind: ClassVar[str]
    grows_with_prompt: ClassVar[bool]

    def nbytes(self) -> int: ...

    def window(self, position: int | None) -> LayerState: ...

    def to(self, device: torch.device | str, non_blocking: bool = False) -> LayerState: ...


@dataclass
class AttentionKV:
    """Keys (after any q/k norm and RoPE) and values of one full-attention layer.

    Shapes are ``[kv_heads, capacity, head_dim]``; the first ``length`` positions are valid.

    With ``keeps_outputs`` (exact mode's ``keep_attention_outputs``), prefill also keeps each
    chunk's attention output ``[heads, capacity, value_dim]`` and log-sum-exp
    ``[heads, capacity]``, so the sweep's recompute of that chunk skips the attention
    forward (``output_for``).
    """

    kind: ClassVar[str] = "full_attention"
    grows_with_prompt: ClassVar[bool] = True

    keys: torch.Tensor
    values: torch.Tensor
    length: int = 0
    keeps_outputs: bool = False
    outputs: torch.Tensor | None = None
    output_lse: torch.Tensor | None = None
    outputs_length: int = 0

    @classmethod
    def empty(
        cls,
        kv_heads: int,
        capacity: int,
        head_dim: int,
        *,
        dtype: torch.dtype,
        device: torch.device,
        value_dim: int | None = None,
        pin_memory: bool = False,
    ) -> AttentionKV:
        options = {"dtype": dtype, "device": device, "pin_memory": pin_memory}
        keys = torch.empty(kv_heads, capacity, head_dim, **options)
        values = torch.empty(kv_heads, capacity, value_dim or head_dim, **options)
        return cls(keys, values, 0)

    @property
    def capacity(self) -> int:
        return self.keys.shape[1]

    def write(self, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store one prefill chunk's ``[kv_heads, T, head_dim]`` keys/values at ``start``."""
        end = start + keys.shape[1]
        if start != self.length or end > self.capacity:
            raise RuntimeError(
                f"prefill wrote positions {start}..{end} into a state holding {self.length} "
                f"of {self.capacity} positions; chunks must be written in order"
            )
        _store(self.keys[:, start:end], keys)
        _store(self.values[:, start:end], values)
        self.length = end

    def segments(self, end: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Views (never copies) of the valid prefix, as segments for ``segmented_attention``."""
        end = self.length if end is None else end
        if end == 0:
            return []
        return [(self.keys[:, :end], self.values[:, :end])]

    def write_output(self, start: int, output: AttentionOutput) -> None:
        """Keep one prefill chunk's attention output (``B = 1``) at ``start``, beside the
        keys and values (in CPU memory for an offloaded record)."""
        out, lse = output.out[0], output.lse[0]  # [heads, T, value_dim], [heads, T]
        if self.outputs is None:
            home = {"device": self.keys.device, "pin_memory": self.keys.is_pinned()}
            heads, capacity = out.shape[0], self.capacity
            self.outputs = torch.empty(heads, capacity, out.shape[-1], dtype=out.dtype, **home)
            self.output_lse = torch.empty(heads, capacity, dtype=lse.dtype, **home)
        end = start + out.shape[1]
        if start != self.outputs_length:
            raise RuntimeError(f"attention outputs written at {start}, after {self.outputs_length}")
        _store(self.outputs[:, start:end], out)
        _store(self.output_lse[:, start:end], lse)
        self.outputs_length = end

    def output_for(
        self, start: int, length: int, device: torch.device | None = None
    ) -> AttentionOutput | None:
        """The kept attention output of positions ``[start, start + length)``, as a batch of
        one, copied to ``device`` (default: the record's); None when prefill kept none."""
        if self.outputs is None or start + length > self.outputs_length:
            return None
        end = start + length
        return AttentionOutput(
            *(
                t[None, :, start:end].to(device or t.device, copy=True)
                for t in (self.outputs, self.output_lse)
            )
        )

    def output_nbytes(self) -> int:
        """Bytes of the kept attention outputs (0 unless ``keeps_outputs``)."""
        if self.outputs is None:
            return 0
        end = self.outputs_length
        return _nbytes(self.outputs[:, :end]) + _nbytes(self.output_lse[:, :end])

    def window(self, position: int | None) -> AttentionKV:
        """What a pass starting at ``position`` (``None``: after the prompt) reads: views of
        the valid keys/values before it (``longstraw_core.offload`` copies them)."""
        end = self.length if position is None else position
        return AttentionKV(self.keys[:, :end], self.values[:, :end], end, self.keeps_outputs)

    def grad_segments(self, end: int | None = None) -> None:
        """Gradient buffers for the segments: none here (exact mode's views provide them)."""
        return None

    def nbytes(self) -> int:
        return _nbytes(self.keys[:, : self.length]) + _nbytes(self.values[:, : self.length])

    def new_branch(self, batch: int, capacity: int, device: torch.device | None = None) -> BranchKV:
        """Empty per-branch keys/values for ``batch`` branches of up to ``capacity`` positions,
        on ``device`` (default: the record's; an offloaded record's branches compute on the
        device)."""
        kv_heads, _, head_dim = self.keys.shape
        options = {"dtype": self.keys.dtype, "device": device or self.keys.device}
        return BranchKV(
            torch.empty(batch, kv_heads, capacity, head_dim, **options),
            torch.empty(batch, kv_heads, capacity, self.values.shape[-1], **options),
        )

    def to(self, device: torch.device | str, non_blocking: bool = False) -> AttentionKV:
        moved = [
            None if t is None else t.to(device, non_blocking=non_blocking)
            for t in (self.keys, self.values, self.outputs, self.output_lse)
        ]
        return AttentionKV(
            moved[0], moved[1], self.length, self.keeps_outputs, *moved[2:], self.outputs_length
        )


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _store(target: torch.Tensor, source: torch.Tensor) -> None:
    """``target[...] = source``. Into pinned CPU memory from CUDA (an offloaded record's
    prefill) the copy is asynchronous, row by row, on the compute stream: later kernels on
    that stream may reuse ``source`` safely, and prefill synchronises before it returns."""
    if target.device == source.device:
        target.copy_(source)
        return
    copy_rows(target, source, non_blocking=source.is_cuda and target.is_pinned())


@dataclass
class PrefixState:
    """The prompt as later tokens see it: one record per decoder layer.

    ``length`` prompt positions are stored: all prompt tokens but the last. The last prompt
    token (``last_token``) is replayed at the head of every branch, because its logits score
    the branch's first token and must be computed with autograd. ``prompt_ids`` are kept
    (8 bytes a token) so exact mode can recompute chunks and a step can check its prompt.

    ``offload``: the policy prefill placed the records by (``None``: all on the device);
    passes stream offloaded layers to the device and account for it in ``residency``.
    """

    layers: list[LayerState]
    prompt_ids: torch.Tensor
    owner: str
    length: int = 0
    meta: dict[str, object] = field(default_factory=dict)
    offload: OffloadPolicy | None = None
    residency: Residency = field(default_factory=Residency, repr=False, compare=False)

    @property
    def last_token(self) -> torch.Tensor:
        return self.prompt_ids[-1:]

    @property
    def prompt_length(self) -> int:
        return self.length + 1

    @property
    def device(self) -> torch.device:
        return self.prompt_ids.device

    def nbytes(self) -> int:
        """Bytes of the per-layer records (prompt ids and checkpoints not counted)."""
        return sum(layer.nbytes() for layer in self.layers)

    def checkpoint_nbytes(self) -> int:
        """Bytes of recurrent-state checkpoints at chunk boundaries (exact mode)."""
        return sum(getattr(layer, "checkpoint_nbytes", lambda: 0)() for layer in self.layers)

    def output_nbytes(self) -> int:
        """Bytes of attention outputs kept for exact mode's sweep (``keep_attention_outputs``)."""
        return sum(getattr(layer, "output_nbytes", lambda: 0)() for layer in self.layers)

    def keeps_attention_outputs(self) -> bool:
        """Whether every full-attention layer that attends during prefill (all but the last
        layer, which only writes its state) keeps its outputs."""
        return all(
            layer.keeps_outputs for layer in self.layers[:-1] if isinstance(layer, AttentionKV)
        )

    def keep_attention_outputs(self) -> None:
        """Make full-attention records keep each prefill chunk's attention output, which
        exact mode's sweep then reuses instead of recomputing it. An offloaded record keeps
        them beside its keys and values, in CPU memory."""
        for layer in self.layers:
            if isinstance(layer, AttentionKV):
                layer.keeps_outputs = True

    def offloaded(self, layer: LayerState) -> bool:
        """Whether ``layer``'s record lives in CPU memory and is streamed to the device."""
        return self.offload is not None and self.offload.offloads(layer.kind)

    def keep_checkpoints(self, device: torch.device | str) -> None:
        """Make recurrent records keep their state at every chunk start, on ``device``
        (offloaded records: in CPU memory, whatever ``device`` says)."""
        for layer in self.layers:
            if hasattr(layer, "checkpoint_device"):
                home = torch.device("cpu") if self.offloaded(layer) else torch.device(device)
                layer.checkpoint_device = home

    def needs_checkpoints(self) -> bool:
        """Whether exact mode needs checkpoints this state lacks (recurrent layers only)."""
        return any(
            hasattr(layer, "checkpoints") and layer.length and not layer.checkpoints
            for layer in self.layers
        )

    def holds_prompt(self, prompt_ids: torch.Tensor) -> bool:
        """Whether this state was prefilled from exactly ``prompt_ids``."""
        prompt_ids = torch.as_tensor(prompt_ids).to(self.prompt_ids.device)
        return prompt_ids.shape == self.prompt_ids.shape and bool(
            torch.equal(prompt_ids, self.prompt_ids)
        )

    def summary(self) -> dict[str, dict[str, float | int | bool]]:
        """Bytes by layer type: how many layers, total bytes, bytes per stored prompt token.

        Rows of records that offer ``expanded_nbytes()`` (latent attention) also carry
        ``expanded_bytes`` and ``expanded_bytes_per_token``: the same figures for the
        per-head K/V a naive cache would hold. ``device_bytes`` + ``cpu_bytes`` ==
        ``bytes``, split by where the offload policy keeps the records: on the compute
        device, or in CPU memory, streamed in layer by layer. Records that keep attention
        outputs for exact mode's sweep add ``kept_output_bytes`` (not part of ``bytes``).
        """
        table: dict[str, dict[str, float | int | bool]] = {}
        for layer in self.layers:
            row = table.setdefault(
                layer.kind,
                {
                    "layers": 0,
                    "bytes": 0,
                    "grows_with_prompt": layer.grows_with_prompt,
                    "device_bytes": 0,
                    "cpu_bytes": 0,
                },
            )
            row["layers"] += 1
            row["bytes"] += layer.nbytes()
            row["cpu_bytes" if self.offloaded(layer) else "device_bytes"] += layer.nbytes()
            if hasattr(layer, "checkpoint_nbytes"):
                row["checkpoint_bytes"] = row.get("checkpoint_bytes", 0) + layer.checkpoint_nbytes()
            if getattr(layer, "keeps_outputs", False):
                row["kept_output_bytes"] = row.get("kept_output_bytes", 0) + layer.output_nbytes()
            # Compressed records (latent attention) also report what a naive cache would hold.
            expanded_nbytes = getattr(layer, "expanded_nbytes", None)
            if expanded_nbytes is not None:
                row["expanded_bytes"] = row.get("expanded_bytes", 0) + expanded_nbytes()
        for row in table.values():
            row["bytes_per_token"] = row["bytes"] / max(self.length, 1)
            if "expanded_bytes" in row:
                row["expanded_bytes_per_token"] = row["expanded_bytes"] / max(self.length, 1)
        return table

    def to(self, device: torch.device | str, non_blocking: bool = False) -> PrefixState:
        """The state on ``device``; tensors already there are shared, not copied. Offloaded
        records stay in CPU memory (the policy goes with the state)."""
        return PrefixState(
            layers=[
                layer if self.offloaded(layer) else layer.to(device, non_blocking=non_blocking)
                for layer in self.layers
            ],
            prompt_ids=self.prompt_ids.to(device),
            owner=self.owner,
            length=self.length,
            meta=dict(self.meta),
            offload=self.offload,
        )

    def __repr__(self) -> str:
        kinds = ", ".join(
            f"{kind}: {row['layers']} layers, {format_bytes(row['bytes'])}"
            for kind, row in self.summary().items()
        )
        where = f"on {self.device}"
        if self.offload is not None and self.offload.active:
            offloaded = sum(row["cpu_bytes"] for row in self.summary().values())
            where += (
                f" ({format_bytes(offloaded)} in CPU memory, streamed with "
                f"resident_layers={self.offload.resident_layers})"
            )
        return (
            f"PrefixState(prompt_length={self.prompt_length}, "
            f"{format_bytes(self.nbytes())} {where}; {kinds})"
        )


@dataclass
class RecurrentState:
    """One linear-attention (Gated DeltaNet) layer's prefix state: a fixed size at any length.

    ``conv``: the last ``kernel - 1`` inputs of the causal conv, ``[conv_dim, kernel - 1]`` in
    the model's dtype (zeros before the prompt, as the conv's own zero padding).
    ``recurrent``: the delta-rule state ``[v_heads, d_k, d_v]`` in float32 (zeros at start).
    ``length``: prompt positions folded in so far.
    ``checkpoints``: with ``checkpoint_device`` set, the state at the start of every prefill
    chunk (by position), which exact mode's reverse sweep restarts chunks from.
    """

    kind: ClassVar[str] = "linear_attention"
    grows_with_prompt: ClassVar[bool] = False

    conv: torch.Tensor
    recurrent: torch.Tensor
    length: int = 0
    checkpoint_device: torch.device | None = None
    checkpoints: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @classmethod
    def empty(
        cls,
        conv_dim: int,
        conv_kernel: int,
        value_heads: int,
        key_dim: int,
        value_dim: int,
        *,
        dtype: torch.dtype,
        device: torch.device,
        pin_memory: bool = False,
    ) -> RecurrentState:
        options = {"device": device, "pin_memory": pin_memory}
        conv = torch.zeros(conv_dim, conv_kernel - 1, dtype=dtype, **options)
        recurrent = torch.zeros(value_heads, key_dim, value_dim, dtype=torch.float32, **options)
        return cls(conv, recurrent, 0)

    def read(self, start: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(conv, recurrent)`` at position ``start``; ``None``: after the whole prompt."""
        if start is None or start == self.length:
            return self.conv, self.recurrent
        if start in self.checkpoints:
            conv, recurrent = self.checkpoints[start]
            return conv.to(self.conv.device), recurrent.to(self.recurrent.device)
        raise RuntimeError(
            f"no recurrent state at position {start} (state holds {self.length} positions and "
            f"checkpoints at {sorted(self.checkpoints)}); prefill with checkpoints for exact mode"
        )

    def window(self, position: int | None) -> RecurrentState:
        """What a pass starting at ``position`` (``None``: after the prompt) reads: the state
        there (``longstraw_core.offload`` copies it)."""
        conv, recurrent = self.read(position)
        return RecurrentState(conv, recurrent, self.length if position is None else position)

    def update(self, start: int, length: int, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
        """Fold one prefill chunk of ``length`` positions at ``start`` into the state."""
        if start != self.length:
            raise RuntimeError(
                f"prefill wrote positions {start}..{start + length} into a recurrent state "
                f"holding {self.length} positions; chunks must be written in order"
            )
        if self.checkpoint_device is not None:
            self.checkpoints[start] = (
                _copy_to(self.conv, self.checkpoint_device),
                _copy_to(self.recurrent, self.checkpoint_device),
            )
        self.conv.copy_(conv)
        self.recurrent.copy_(recurrent)
        self.length = start + length

    def nbytes(self) -> int:
        return _nbytes(self.conv) + _nbytes(self.recurrent)

    def checkpoint_nbytes(self) -> int:
        return sum(_nbytes(c) + _nbytes(r) for c, r in self.checkpoints.values())

    def new_branch(
        self, batch: int, capacity: int, device: torch.device | None = None
    ) -> BranchRecurrent:
        """Per-branch copies of the state after the whole prompt (small: a fixed size), on
        ``device`` (default: the record's)."""
        conv, recurrent = self.conv, self.recurrent
        if device is not None:
            conv, recurrent = conv.to(device), recurrent.to(device)
        return BranchRecurrent(
            conv.expand(batch, *conv.shape).clone(),
            recurrent.expand(batch, *recurrent.shape).clone(),
        )

    def to(self, device: torch.device | str, non_blocking: bool = False) -> RecurrentState:
        return RecurrentState(
            self.conv.to(device, non_blocking=non_blocking),
            self.recurrent.to(device, non_blocking=non_blocking),
            self.length,
            self.checkpoint_device,
            dict(self.checkpoints),
        )


def _copy_to(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A copy of ``tensor`` on ``device``; pinned when it goes from pinned memory to the CPU
    (offloaded checkpoints stream to the device like the state)."""
    if device.type == "cpu" and tensor.device.type == "cpu" and tensor.is_pinned():
        return torch.empty_like(tensor, pin_memory=True).copy_(tensor)
    return tensor.to(device, copy=True)


def format_bytes(num_bytes: float) -> str:
    """Human-readable binary size: ``format_bytes(3 * 2**20) == '3.00 MiB'``."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


@dataclass
class LatentKV:
    """One multi-head latent attention (MLA) layer, kept compressed (GLM-5.x, DeepSeek-V3.2).

    ``latent`` is ``[capacity, kv_lora_rank + rope_dim]``: per position the normalised latent
    ``c_kv`` followed by the roped shared key ``k_pe`` (one buffer, so attention reads it as a
    single-head key without concatenating anything). ``index_keys`` ``[capacity,
    index_head_dim]`` holds the DSA indexer's keys on layers that run their own indexer
    (``None`` on layers that reuse another layer's selection). ``expanded_width`` is the number
    of elements per position a naive cache would hold: per-head keys and values.
    """

    kind: ClassVar[str] = "mla_dsa"
    grows_with_prompt: ClassVar[bool] = True

    latent: torch.Tensor
    index_keys: torch.Tensor | None
    kv_lora_rank: int
    expanded_width: int
    length: int = 0

    @classmethod
    def empty(
        cls,
        capacity: int,
        kv_lora_rank: int,
        rope_dim: int,
        index_dim: int | None,
        expanded_width: int,
        *,
        dtype: torch.dtype,
        device: torch.device,
        pin_memory: bool = False,
    ) -> LatentKV:
        options = {"dtype": dtype, "device": device, "pin_memory": pin_memory}
        latent = torch.empty(capacity, kv_lora_rank + rope_dim, **options)
        index_keys = None
        if index_dim is not None:
            index_keys = torch.empty(capacity, index_dim, **options)
        return cls(latent, index_keys, kv_lora_rank, expanded_width, 0)

    @property
    def capacity(self) -> int:
        return self.latent.shape[0]

    @property
    def c_kv(self) -> torch.Tensor:
        """The normalised latent of the valid positions, ``[length, kv_lora_rank]`` (a view)."""
        return self.latent[: self.length, : self.kv_lora_rank]

    @property
    def k_pe(self) -> torch.Tensor:
        """The roped shared key of the valid positions, ``[length, rope_dim]`` (a view)."""
        return self.latent[: self.length, self.kv_lora_rank :]

    def write(self, start: int, latent: torch.Tensor, index_keys: torch.Tensor | None) -> None:
        """Store one prefill chunk's ``[T, kv_lora_rank + rope_dim]`` latent (and index keys)."""
        end = start + latent.shape[0]
        if start != self.length or end > self.capacity:
            raise RuntimeError(
                f"prefill wrote positions {start}..{end} into a state holding {self.length} "
                f"of {self.capacity} positions; chunks must be written in order"
            )
        if (index_keys is None) != (self.index_keys is None):
            raise RuntimeError("index keys must be written exactly on layers that keep them")
        _store(self.latent[start:end], latent)
        if index_keys is not None:
            _store(self.index_keys[start:end], index_keys)
        self.length = end

    def latent_prefix(self, end: int) -> torch.Tensor:
        """The latent of positions ``[0, end)``, ``[end, kv_lora_rank + rope_dim]`` (a view)."""
        return self.latent[:end]

    def index_key_prefix(self, end: int) -> torch.Tensor | None:
        """The indexer keys of positions ``[0, end)`` (a view), ``None`` on shared layers."""
        return None if self.index_keys is None else self.index_keys[:end]

    def window(self, position: int | None) -> LatentKV:
        """What a pass starting at ``position`` (``None``: after the prompt) reads: views of
        the valid latent and index keys before it (``longstraw_core.offload`` copies them)."""
        end = self.length if position is None else position
        index_keys = None if self.index_keys is None else self.index_keys[:end]
        return LatentKV(self.latent[:end], index_keys, self.kv_lora_rank, self.expanded_width, end)

    def latent_grad(self, end: int) -> None:
        """Gradient buffer for ``latent_prefix(end)``: none here (exact mode's views give one)."""
        return None

    def nbytes(self) -> int:
        total = _nbytes(self.latent[: self.length])
        if self.index_keys is not None:
            total += _nbytes(self.index_keys[: self.length])
        return total

    def expanded_nbytes(self) -> int:
        """Bytes of the per-head K/V a naive cache would hold for the same positions."""
        return self.length * self.expanded_width * self.latent.element_size()

    def new_branch(
        self, batch: int, capacity: int, device: torch.device | None = None
    ) -> BranchLatent:
        """Empty per-branch latent (and index keys) for ``batch`` branches of ``capacity``,
        on ``device`` (default: the record's)."""
        options = {"dtype": self.latent.dtype, "device": device or self.latent.device}
        index_keys = None
        if self.index_keys is not None:
            index_keys = torch.empty(batch, capacity, self.index_keys.shape[-1], **options)
        latent = torch.empty(batch, capacity, self.latent.shape[-1], **options)
        return BranchLatent(latent, index_keys)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> LatentKV:
        index_keys = self.index_keys
        if index_keys is not None:
            index_keys = index_keys.to(device, non_blocking=non_blocking)
        return LatentKV(
            self.latent.to(device, non_blocking=non_blocking),
            index_keys,
            self.kv_lora_rank,
            self.expanded_width,
            self.length,
        )


# --- branch caches: what each branch adds to the prefix while it is decoded -----------------
#
# Rollout decodes ``B`` branches of one prompt in a batch. They share the prefix state (read,
# never copied or written) and each keeps its own positions in a branch record per layer,
# made by the prefix record's ``new_branch(batch, capacity)``. Records that grow are
# preallocated to ``capacity`` positions and filled step by step; recurrent records start
# from per-branch copies of the (small) prefix state and are replaced at each step.


@dataclass
class BranchKV:
    """The branches' own keys and values of one full-attention layer.

    ``[batch, kv_heads, capacity, head_dim]``; the first ``length`` positions are valid.
    """

    kind: ClassVar[str] = "full_attention"

    keys: torch.Tensor
    values: torch.Tensor
    length: int = 0

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``[batch, kv_heads, T, dim]`` after the valid positions; return views of all."""
        end = _check_append(self.length, keys.shape[2], self.keys.shape[2])
        self.keys[:, :, self.length : end] = keys
        self.values[:, :, self.length : end] = values
        self.length = end
        return self.keys[:, :, :end], self.values[:, :, :end]

    def nbytes(self) -> int:
        return _nbytes(self.keys) + _nbytes(self.values)


@dataclass
class BranchRecurrent:
    """Each branch's Gated DeltaNet state: conv ``[batch, conv_dim, kernel - 1]`` and
    recurrent ``[batch, v_heads, d_k, d_v]`` (float32), after the positions run so far."""

    kind: ClassVar[str] = "linear_attention"

    conv: torch.Tensor
    recurrent: torch.Tensor

    def update(self, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
        self.conv, self.recurrent = conv, recurrent

    def nbytes(self) -> int:
        return _nbytes(self.conv) + _nbytes(self.recurrent)


@dataclass
class BranchLatent:
    """The branches' own MLA latent ``[batch, capacity, kv_lora_rank + rope_dim]`` and DSA
    indexer keys ``[batch, capacity, index_head_dim]`` (``None`` on layers that reuse another
    layer's selection); the first ``length`` positions are valid."""

    kind: ClassVar[str] = "mla_dsa"

    latent: torch.Tensor
    index_keys: torch.Tensor | None
    length: int = 0

    def append(
        self, latent: torch.Tensor, index_keys: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Store ``[batch, T, ...]`` rows after the valid positions; return views of all."""
        end = _check_append(self.length, latent.shape[1], self.latent.shape[1])
        if (index_keys is None) != (self.index_keys is None):
            raise RuntimeError("index keys must be appended exactly on layers that keep them")
        self.latent[:, self.length : end] = latent
        if index_keys is not None:
            self.index_keys[:, self.length : end] = index_keys
        self.length = end
        index_view = None if self.index_keys is None else self.index_keys[:, :end]
        return self.latent[:, :end], index_view

    def nbytes(self) -> int:
        total = _nbytes(self.latent)
        return total if self.index_keys is None else total + _nbytes(self.index_keys)


BranchRecord = BranchKV | BranchRecurrent | BranchLatent


@dataclass
class BranchCache:
    """``batch`` branches decoded from one ``PrefixState``: one branch record per layer.

    ``length`` branch positions have been run (position 0 is the prompt's last token, at
    prompt position ``prefix_length``); ``capacity`` is the most any growing record holds.
    Made by
    ``ModelAdapter.new_branch_cache``; the prefix state it belongs to is only read.
    """

    layers: list[BranchRecord]
    batch: int
    capacity: int
    prefix_length: int
    length: int = 0

    def nbytes(self) -> int:
        """Bytes allocated by the branch records (preallocated to ``capacity``)."""
        return sum(layer.nbytes() for layer in self.layers)


def _check_append(length: int, count: int, capacity: int) -> int:
    end = length + count
    if end > capacity:
        raise RuntimeError(
            f"branch cache holds {length} of {capacity} positions and cannot take {count} more"
        )
    return end
