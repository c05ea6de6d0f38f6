"""NCCL's point-to-point rules, enforced over gloo: the CPU multi-rank tests hang where NCCL
would, and fail fast with every rank's pending ops printed.

Why. gloo pairs a receive with a send by (source, tag) and buffers sends, so any order of
point-to-point ops completes on the CPU ranks CI runs. NCCL does neither, so code that passes
there can hang on its first multi-GPU run (two pipeline stages that both ``isend`` to each
other and then ``recv``: the sends face each other and wait forever). ``install()`` wraps
``torch.distributed``'s point-to-point API in this process so that it behaves as NCCL does;
the data still moves through real gloo.

The emulated rules (ProcessGroupNCCL's, with its default lazy communicators):

- Streams. Each rank has in-order streams, one per NCCL communicator the op would run on:
  an unbatched op (``isend``, ``irecv``, ``send``, ``recv``) runs on the two-rank
  communicator of its rank pair (ProcessGroupNCCL keys it ``"rankA:rankB"``), so ONE stream
  per (process group, rank pair), for both directions. A ``batch_isend_irecv`` batch is
  coalesced onto the group's device communicator, whose stream also carries the group's
  collectives: ONE stream per (process group, rank) for all of a rank's batches on that
  group, whatever their peers, and its collectives, in issue order. Each call issues one
  entry into one stream: a single op, a whole batch, or a collective. Different groups
  (``dist.new_group``, ``new_subgroups_by_enumeration``) have different streams.
- Matching is by order only. The n-th send from A to B (counted per process group and
  ordered pair, over unbatched and batched ops alike, in issue order) meets the n-th receive
  posted on B for A. Tags are ignored. A met send/receive whose dtype or element count
  differ is an error naming both ranks, the sequence number and both tensors (what code
  that relied on tags to pair its messages now hits). Equal counts of different shapes
  pass, as on NCCL, which moves ``count x dtype``. A met pair of which one is batched and
  the other not is an error too, naming both: on NCCL the two sit on different
  communicators and never meet (the send would wait forever); the error says so at once.
  (Code that interleaves both kinds on one pair and group and relies on each kind keeping
  its own order is refused by this count, though NCCL might complete it.)
- Rendezvous, at any size. An op moves only when its entry is at the head of its stream AND
  the op it meets is in the entry at the head of the peer's corresponding stream (the
  pair's stream for an unbatched op; the group's stream for a batched one): a send
  completes when the peer's stream reaches the matching receive; small sends do not
  complete eagerly.
- A batch completes as a unit: it leaves its stream only when all its ops are done, so a
  batch that receives from one peer holds every later batch of the group on this rank,
  whatever their peers (a ring of stages on one group whose batches each receive before
  they send deadlocks; give each communicating pair its own group to have per-pair streams).
- ``work.wait()`` blocks until its op (for a batch: the whole batch) is done;
  ``is_completed()`` says whether it is; blocking ``send``/``recv`` are issue + wait.
  Progress happens in the background, as on NCCL's streams: a rank computing, or blocked in
  a collective, still completes the ops it issued.
- Collectives. A collective on group G joins G's stream of batches and collectives: it
  first waits for this rank's uncompleted batches on G issued before it, then runs, and
  batches issued on G while it runs (from another thread) wait behind it. It does not wait
  for unbatched ops on G (they are on the pairs' communicators), nor for anything on other
  groups. (A collective issued by another thread while one runs is not held by it: gloo
  orders those itself.) Wrapped: ``COLLECTIVES`` below, at the ``torch.distributed``
  function level, which is where this code base, accelerate, DCP and FSDP2
  (``dist.all_gather_single``, ``dist.reduce_scatter_single``, ``dist.all_reduce``,
  ``dist.barrier``) call them. Not caught: collectives called as process-group methods
  (``group.allreduce(...)``) or through the functional collectives
  (``torch.distributed._functional_collectives``, the C++ ``_c10d_functional`` ops DTensor
  redistributes with). Those run without first waiting for this rank's batches, so they
  can only make the harness miss a hang, never invent one; nothing in this code base
  issues batches on a group those paths use.
- Not emulated (refused with an error): a receive from any source (NCCL has none) and a
  transfer to oneself. Not modelled: a communicator's creation (NCCL's first op on a pair's
  or a group's communicator is a host-blocking rendezvous of its ranks), and eager
  initialisation (``init_process_group(device_id=...)``), under which unbatched ops too run
  on the group's communicator.

Hangs. A rank whose main thread has waited longer than the bound (``timeout_seconds``,
default ``LONGSTRAW_NCCL_RULES_TIMEOUT`` or 60 s) asks every rank for its state. When every
rank is blocked (in a harness wait or a wrapped collective) with no progress for half the
bound, NCCL would wait forever: one rank prints the report (each rank's state and pending
ops: kind, peer, sequence number, dtype/shape, place in its stream, how long pending; the
collective a rank is in), the ranks in a harness wait raise ``NcclRulesError``, and the
others (in a gloo collective) exit with status 1, so torchrun ends the run. A wait with no
such proof (a rank still computing) is reported anyway after three bounds.

Machinery (``nccl_rules_state``, ``nccl_rules_streams``, ``nccl_rules_wire``): per rank a
private gloo backend for the data (built from the default store, so it shares no gloo
context with the caller's collectives and no group numbering with the caller's groups), a
listener thread for the peers' control messages over local TCP, a completer thread for the
gloo transfers, and a watchdog thread for hangs.

Use. ``install()`` before ``init_process_group`` (the wrapped ``init_process_group``
attaches the harness once the group exists), or right after it, on every rank at the same
point. ``tests/support/nccl_rules_run.py SCRIPT ARGS...`` runs a script as ``python SCRIPT ARGS``
would, under the harness; ``tests/support/launch.py`` starts every torchrun of the tests that way
unless ``LONGSTRAW_NCCL_RULES=0``.
"""

from __future__ import annotations

import atexit
import functools
import inspect
import os
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from nccl_rules_state import Entry, NcclRulesError, RankStreams

__all__ = ["ENABLED", "TIMEOUT", "NcclRulesError", "enabled", "install", "installed"]

ENABLED = "LONGSTRAW_NCCL_RULES"  # "0" turns the harness off (debugging)
TIMEOUT = "LONGSTRAW_NCCL_RULES_TIMEOUT"  # seconds; the hang bound
DEFAULT_TIMEOUT = 60.0

COLLECTIVES = (
    "broadcast", "all_reduce", "all_reduce_coalesced", "reduce", "all_gather",
    "all_gather_single", "all_gather_into_tensor", "_all_gather_base", "all_gather_coalesced",
    "all_gather_object", "gather", "gather_object", "scatter", "scatter_object_list",
    "broadcast_object_list", "reduce_scatter", "reduce_scatter_single",
    "reduce_scatter_tensor", "_reduce_scatter_base", "all_to_all", "all_to_all_single",
    "barrier", "monitored_barrier",
)  # fmt: skip

_original: dict[str, Callable] = {}
_streams: RankStreams | None = None
_timeout = DEFAULT_TIMEOUT
_generation = 0
_local = threading.local()  # .depth: collectives inside a wrapped one (object collectives)


def enabled(environ: dict[str, str] | None = None) -> bool:
    """Whether the harness is on (``LONGSTRAW_NCCL_RULES`` is not ``0``)."""
    return (environ if environ is not None else os.environ).get(ENABLED, "1") != "0"


def install(timeout_seconds: float | None = None) -> None:
    """Enforce NCCL's point-to-point rules on ``torch.distributed`` in this process.

    Call it before ``init_process_group`` or right after it (on every rank at the same
    point: attaching builds a gloo backend over all ranks). Calling it again only changes
    the bound for groups made afterwards.
    """
    global _timeout
    if timeout_seconds is None:
        text = os.environ.get(TIMEOUT, str(DEFAULT_TIMEOUT))
        try:
            timeout_seconds = float(text)
        except ValueError:
            raise ValueError(f"{TIMEOUT}={text!r} must be a number of seconds") from None
    if not timeout_seconds > 0:
        raise ValueError(f"the NCCL rules bound must be positive seconds, got {timeout_seconds}")
    _timeout = timeout_seconds
    if not _original:
        _patch()
        atexit.register(_detach)
    if dist.is_initialized() and _streams is None:
        _attach()


def installed() -> bool:
    """Whether the harness is attached to this process's process group."""
    return _streams is not None


# --- attaching to a process group ----------------------------------------------------------------


def _attach() -> None:
    global _streams, _generation
    if dist.get_world_size() == 1 or "nccl" in str(dist.get_backend()):
        return  # no peers; or real NCCL, which needs no emulation
    _generation += 1  # a process may make its world more than once (keys stay in the store)
    store = dist.PrefixStore(f"nccl_rules/{_generation}", c10d._get_default_store())
    _streams = RankStreams(dist.get_rank(), dist.get_world_size(), store, _timeout)


def _detach() -> None:
    global _streams
    streams, _streams = _streams, None
    if streams is not None:
        streams.close()


def _init_process_group(*args: Any, **kwargs: Any) -> None:
    _original["init_process_group"](*args, **kwargs)
    _attach()


def _destroy_process_group(group: dist.ProcessGroup | None = None) -> None:
    if group is None or (dist.is_initialized() and group is c10d._get_default_group()):
        _detach()
    _original["destroy_process_group"](group)


# --- point-to-point ------------------------------------------------------------------------------


class _Work(dist.Work):
    """The request an emulated op returns; a ``dist.Work`` so type checks pass."""

    def __init__(self, streams: RankStreams, entry: Entry) -> None:
        super().__init__()
        self._streams = streams
        self._entry = entry

    def wait(self, timeout: timedelta | None = None) -> bool:
        seconds = None
        if timeout is not None and timeout != timedelta(0):
            seconds = timeout.total_seconds()
        ops = ", ".join(op.describe() for op in self._entry.ops)
        self._streams.wait(self._entry, f"{self._entry.label} ({ops})", seconds)
        return True

    def is_completed(self) -> bool:
        return self._entry.done

    def is_success(self) -> bool:
        return self._entry.done and self._entry.error is None

    def exception(self) -> BaseException | None:
        return self._entry.error

    def get_future(self) -> torch.futures.Future:
        return self._streams.future(self._entry)


def _group(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    return c10d._group_or_default_group(group)


def _issue(
    label: str,
    kind: str,
    tensor: torch.Tensor,
    rank: int | None,
    group: dist.ProcessGroup | None,
    group_rank: int | None,
) -> _Work:
    """One emulated op (``rank`` global or ``group_rank`` in ``group``), as ``label``."""
    streams = _streams
    assert streams is not None
    c10d._check_single_tensor(tensor, "tensor")
    if kind == "recv" and rank is None and group_rank is None:
        raise NcclRulesError(
            "NCCL rules: a receive from any source (src=None) does not exist on NCCL; "
            "pass the sender's rank"
        )
    resolved = _group(group)
    peer = c10d._canonicalize_group_rank(resolved, rank, group_rank, return_global=True)
    entry = streams.issue(label, [(kind, peer, resolved.group_name, tensor)], batched=False)
    return _Work(streams, entry)


def _isend(
    tensor: torch.Tensor,
    dst: int | None = None,
    group: dist.ProcessGroup | None = None,
    tag: int = 0,
    group_dst: int | None = None,
) -> dist.Work | None:
    if _streams is None or c10d._rank_not_in_group(group):
        return _original["isend"](tensor, dst=dst, group=group, tag=tag, group_dst=group_dst)
    return _issue("isend", "send", tensor, dst, group, group_dst)


def _irecv(
    tensor: torch.Tensor,
    src: int | None = None,
    group: dist.ProcessGroup | None = None,
    tag: int = 0,
    group_src: int | None = None,
) -> dist.Work | None:
    if _streams is None or c10d._rank_not_in_group(group):
        return _original["irecv"](tensor, src=src, group=group, tag=tag, group_src=group_src)
    return _issue("irecv", "recv", tensor, src, group, group_src)


def _send(
    tensor: torch.Tensor,
    dst: int | None = None,
    group: dist.ProcessGroup | None = None,
    tag: int = 0,
    group_dst: int | None = None,
) -> None:
    if _streams is None or c10d._rank_not_in_group(group):
        return _original["send"](tensor, dst=dst, group=group, tag=tag, group_dst=group_dst)
    _issue("send", "send", tensor, dst, group, group_dst).wait()


def _recv(
    tensor: torch.Tensor,
    src: int | None = None,
    group: dist.ProcessGroup | None = None,
    tag: int = 0,
    group_src: int | None = None,
) -> int:
    if _streams is None or c10d._rank_not_in_group(group):
        return _original["recv"](tensor, src=src, group=group, tag=tag, group_src=group_src)
    _issue("recv", "recv", tensor, src, group, group_src).wait()
    return c10d._canonicalize_group_rank(_group(group), src, group_src, return_global=True)


def _batch_isend_irecv(p2p_op_list: list[dist.P2POp]) -> list[dist.Work]:
    streams = _streams
    if streams is None:
        return _original["batch_isend_irecv"](p2p_op_list)
    c10d._check_p2p_op_list(p2p_op_list)
    group = _group(p2p_op_list[0].group)
    if c10d._rank_not_in_group(group):
        return []
    sends = (_isend, _original["isend"])
    ops = [
        ("send" if op.op in sends else "recv", op.peer, group.group_name, op.tensor)
        for op in p2p_op_list
    ]
    entry = streams.issue("batch_isend_irecv", ops, batched=True)
    return [_Work(streams, entry) for _ in p2p_op_list]


# --- collectives ---------------------------------------------------------------------------------


def _collective(name: str, original: Callable) -> Callable:
    """``original`` that first waits for this rank's batches on its group's stream."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        streams = _streams
        if streams is None or getattr(_local, "depth", 0):
            return original(*args, **kwargs)
        group = signature.bind_partial(*args, **kwargs).arguments.get("group")
        if group is not None and not isinstance(group, dist.ProcessGroup):
            return original(*args, **kwargs)  # a non-member sentinel: torch warns and skips
        if c10d._rank_not_in_group(group):
            return original(*args, **kwargs)
        _local.depth = 1
        try:
            with streams.collective(name, _group(group).group_name):
                return original(*args, **kwargs)
        finally:
            _local.depth = 0

    return wrapper


# --- patching ------------------------------------------------------------------------------------


def _patch() -> None:
    """Replace the functions on both ``torch.distributed`` and ``distributed_c10d``:
    ``P2POp`` checks ``op in [isend, irecv]`` against the module globals, torch's pipelining
    builds ``dist.P2POp(dist.isend, ...)``, and the object collectives call ``send``/``recv``
    and ``broadcast`` through the module globals."""
    replacements: dict[str, Callable] = {
        "isend": _isend,
        "irecv": _irecv,
        "send": _send,
        "recv": _recv,
        "batch_isend_irecv": _batch_isend_irecv,
        "init_process_group": _init_process_group,
        "destroy_process_group": _destroy_process_group,
    }
    for name in COLLECTIVES:
        if hasattr(c10d, name):
            replacements[name] = _collective(name, getattr(c10d, name))
    for name, replacement in replacements.items():
        original = getattr(c10d, name)
        _original[name] = original
        if name in ("isend", "irecv", "send", "recv", "batch_isend_irecv"):
            functools.update_wrapper(replacement, original)
        for module in (c10d, dist):
            if getattr(module, name, None) is original:
                setattr(module, name, replacement)
