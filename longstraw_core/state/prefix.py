"""The prefix state: what later tokens read of a prompt that was run once without autograd.

Each layer keeps a record of its own kind: ``AttentionKV`` (full-attention keys/values),
``WindowKV`` (a sliding window's last keys/values), ``RecurrentState`` (Gated DeltaNet conv
and recurrent state) or ``LatentKV`` (MLA latent and DSA indexer keys). Each kind lives in
one module of ``longstraw_core.kinds`` (``attention``, ``window``, ``recurrent``,
``latent``) with its branch record, exact-mode gradient buffer and view, behind
the protocols of ``longstraw_core.kinds.base`` (import them from there). This module holds
what spans the layers: ``PrefixState`` and ``BranchCache``. Each adapter's
``new_layer_states`` picks the records
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

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from longstraw_core.kinds.base import BranchState, LayerState, Pieces, Produced
from longstraw_core.kinds.rows import Rows
from longstraw_core.offload import OffloadPolicy, Residency
from longstraw_core.tensors.fake import is_fake

__all__ = [
    "BranchCache",
    "BranchRecord",
    "PieceCache",
    "PrefixState",
    "format_bytes",
]


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
        """Bytes of the chunk-start checkpoints (recurrent states, sliding windows; exact mode)."""
        return sum(layer.checkpoint_nbytes() for layer in self.layers)

    def output_nbytes(self) -> int:
        """Bytes of attention outputs kept for exact mode's sweep (``keep_attention_outputs``)."""
        return sum(layer.output_nbytes() for layer in self.layers)

    def keeps_attention_outputs(self) -> bool:
        """Whether every full-attention layer that attends during prefill (all but the last
        layer, which only writes its state) keeps its outputs."""
        return all(layer.keeps_outputs for layer in self.layers[:-1] if layer.can_keep_outputs)

    def keep_attention_outputs(self) -> None:
        """Make full-attention records keep each prefill chunk's attention output, which
        exact mode's sweep then reuses instead of recomputing it. An offloaded record keeps
        them beside its keys and values, in CPU memory."""
        for layer in self.layers:
            if layer.can_keep_outputs:
                layer.keeps_outputs = True

    def offloaded(self, layer: LayerState) -> bool:
        """Whether ``layer``'s record lives in CPU memory and is streamed to the device."""
        return self.offload is not None and self.offload.offloads(layer.kind)

    def keep_checkpoints(self, device: torch.device | str) -> None:
        """Make the records of kinds that need it (recurrent states, sliding windows) keep
        their state at every chunk start, on ``device``
        (offloaded records: in CPU memory, whatever ``device`` says)."""
        for layer in self.layers:
            home = torch.device("cpu") if self.offloaded(layer) else torch.device(device)
            layer.keep_checkpoints(home)  # a no-op for kinds without checkpoints

    def needs_checkpoints(self) -> bool:
        """Whether exact mode needs checkpoints this state lacks (``lacking_checkpoints``)."""
        return bool(self.lacking_checkpoints())

    def lacking_checkpoints(self) -> list[str]:
        """The kinds of the records that need chunk-start checkpoints for exact mode and were
        prefilled without them (each record says, ``LayerState.needs_checkpoints``), each
        once, in layer order: recurrent states, sliding windows."""
        lacking = (layer.kind for layer in self.layers if layer.needs_checkpoints())
        return list(dict.fromkeys(lacking))

    def holds_prompt(self, prompt_ids: torch.Tensor) -> bool:
        """Whether this state was prefilled from exactly ``prompt_ids``."""
        prompt_ids = torch.as_tensor(prompt_ids).to(self.prompt_ids.device)
        if prompt_ids.shape != self.prompt_ids.shape:
            return False
        if is_fake(prompt_ids) or is_fake(self.prompt_ids):  # a dry run: shapes only
            return True
        return bool(torch.equal(prompt_ids, self.prompt_ids))

    def summary(self) -> dict[str, dict[str, float | int | bool]]:
        """Bytes by layer type: how many layers, total bytes, bytes per stored prompt token.

        Each record adds its kind's own figures (``LayerState.summary_bytes``): latent
        attention rows carry ``expanded_bytes`` and ``expanded_bytes_per_token``, the same
        figures for the per-head K/V a naive cache would hold; recurrent rows
        ``checkpoint_bytes``; records that keep attention outputs for exact mode's sweep
        ``kept_output_bytes`` (neither part of ``bytes``). ``device_bytes`` + ``cpu_bytes``
        == ``bytes``, split by where the offload policy keeps the records: on the compute
        device, or in CPU memory, streamed in layer by layer.
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
            # Each kind's own figures: recurrent checkpoints, kept attention outputs, and
            # what a naive cache would hold of a compressed (latent) record.
            for name, count in layer.summary_bytes().items():
                row[name] = row.get(name, 0) + count
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


def format_bytes(num_bytes: float) -> str:
    """Human-readable binary size: ``format_bytes(3 * 2**20) == '3.00 MiB'``."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


# --- branch caches: what each branch adds to the prefix while it is decoded -----------------
#
# Rollout decodes ``B`` branches of one prompt in a batch. They share the prefix state (read,
# never copied or written) and each keeps its own positions in a branch record per layer,
# made by the prefix record's ``new_branch(batch, capacity)``. Records that grow are
# preallocated to ``capacity`` positions and filled step by step; recurrent records start
# from per-branch copies of the (small) prefix state and are replaced at each step.


BranchRecord = BranchState  # one layer's branch record, of the layer's kind


@dataclass
class BranchCache:
    """``batch`` branches decoded from one ``PrefixState``: one branch record per layer.

    ``length`` branch positions have been run (position 0 is the prompt's last token, at
    prompt position ``prefix_length``); ``capacity`` is the most any growing record holds.
    Made by ``ModelAdapter.new_branch_cache``; the prefix state it belongs to is only read.

    Decoded in ragged steps (``decode(..., counts=)``), each branch is at its own position:
    ``lengths`` (per branch; ``length`` is then the furthest). A cache is decoded in lock
    step or ragged from its first step on, not both.
    """

    layers: list[BranchRecord]
    batch: int
    capacity: int
    prefix_length: int
    length: int = 0
    lengths: list[int] | None = None
    # A narrowed cache (``narrow``): the whole and the first branch's index there.
    whole: tuple[BranchCache, int] | None = field(default=None, repr=False)

    def ragged_rows(self, counts: Sequence[int], length: int, device: torch.device) -> Rows:
        """The next ragged step's ``Rows``: each branch takes ``counts`` of ``length`` inputs
        from where it is."""
        lengths = self._ragged_lengths()
        return Rows.build(lengths, counts, length, self.capacity, self.prefix_length, device)

    def narrow(self, start: int, stop: int) -> BranchCache:
        """Branches ``start..stop`` as a cache of their own, ragged, whose steps land in this
        one's records and lengths: a long answer is prefilled for its branch alone, not
        padded across the batch."""
        lengths = self._ragged_lengths()
        return BranchCache(
            layers=[layer.narrow(start, stop) for layer in self.layers],
            batch=stop - start,
            capacity=self.capacity,
            prefix_length=self.prefix_length,
            length=max(lengths[start:stop], default=0),
            lengths=lengths[start:stop],
            whole=(self, start),
        )

    def _ragged_lengths(self) -> list[int]:
        if self.lengths is None:
            if self.length:
                raise RuntimeError(
                    "this branch cache was decoded in lock step: it cannot go ragged"
                )
            self.lengths = [0] * self.batch
        return self.lengths

    def advance(self, counts: Sequence[int]) -> None:
        """After a ragged step: each branch has run ``counts`` more positions."""
        self.lengths = [have + more for have, more in zip(self.lengths, counts, strict=True)]
        self.length = max(self.lengths)
        if self.whole is not None:
            whole, start = self.whole
            every = [0] * whole.batch
            every[start : start + len(counts)] = counts
            whole.advance(every)

    def nbytes(self) -> int:
        """Bytes allocated by the branch records (preallocated to ``capacity``)."""
        return sum(layer.nbytes() for layer in self.layers)


@dataclass
class PieceCache:
    """One branch replayed in pieces with autograd (pipeline replay): per layer, what the
    pieces keep between them (``LayerState.new_pieces``). ``piece(produced)`` gives the
    records of the next piece, which ``run_owned_layers`` takes as a branch cache; what the
    piece writes goes into ``produced``, seeded for its backward."""

    chains: list[Pieces]

    def piece(self, produced: Produced) -> PieceStep:
        return PieceStep([chain.piece(produced) for chain in self.chains])


@dataclass
class PieceStep:
    """The branch records of one piece (``layers``, as ``BranchCache.layers``)."""

    layers: list[Any]
