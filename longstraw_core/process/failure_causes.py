"""The one line for failures a run meets from its machine rather than its config: out of
memory, a collective that timed out, a disk it may no longer write. Without it these end in
a raw traceback (and, under torchrun, a summary naming no root cause); with it ``main``
prints what happened on which rank and what to change, and records it for the launcher.

``cause_of(error)`` reads the exception (and what it was raised from): None when it is none
of these, so anything else keeps its traceback (a bug must stay visible).
"""

from __future__ import annotations

import errno

import torch

# The allocators' own words: the CPU allocator (RuntimeError), CUDA's (torch.OutOfMemoryError).
_MEMORY_WORDS = ("can't allocate memory", "not enough memory", "out of memory")
# What gloo and NCCL say when a collective waited past the process group's timeout.
_TIMEOUT_WORDS = ("timed out", "timeout", "watchdog caught collective operation timeout")
_UNWRITABLE = {errno.EACCES, errno.EPERM, errno.EROFS}


def _chain(error: BaseException) -> list[BaseException]:
    seen, out = error, []
    while seen is not None and seen not in out:
        out.append(seen)
        seen = seen.__cause__ or seen.__context__
    return out


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def is_out_of_memory(error: BaseException) -> bool:
    return any(
        isinstance(e, MemoryError | torch.OutOfMemoryError)
        or (isinstance(e, RuntimeError) and any(w in str(e).lower() for w in _MEMORY_WORDS))
        for e in _chain(error)
    )


def is_collective_timeout(error: BaseException) -> bool:
    distributed_errors = (torch.distributed.DistError,) if torch.distributed.is_available() else ()
    return any(
        isinstance(e, (*distributed_errors, TimeoutError, RuntimeError))
        and any(w in str(e).lower() for w in _TIMEOUT_WORDS)
        and ("collective" in str(e).lower() or "gloo" in str(e).lower()
             or "nccl" in str(e).lower() or isinstance(e, distributed_errors))
        for e in _chain(error)
    )  # fmt: skip


def unwritable(error: BaseException) -> OSError | None:
    """The permission error (EACCES, EPERM, EROFS) behind ``error``, if that is its cause."""
    for e in _chain(error):
        if isinstance(e, OSError) and e.errno in _UNWRITABLE:
            return e
    return None


def cause_of(error: BaseException, *, rank: int, config_file: str) -> str | None:
    """The one line for ``error`` on ``rank`` (module docstring), or None."""
    if is_out_of_memory(error):
        return (
            f"out of memory on rank {rank} ({_first_line(error)[:200]}); see what the step "
            f"needs with `python -m longstraw_core.plan --config {config_file}`, then lower "
            "data.prompt_tokens, rollout.num_generations or train.chunk_size, or spread the "
            "run over more ranks (distributed.pipeline_stages, FSDP)"
        )
    if is_collective_timeout(error):
        return (
            f"a collective timed out on rank {rank} ({_first_line(error)[:200]}): another rank "
            "stopped or is stuck; its own error, printed above or in its log, is the cause "
            "(raise distributed.timeout_minutes only if a rank is known to be slow, not stuck)"
        )
    denied = unwritable(error)
    if denied is not None:
        where = denied.filename or "the output directory"
        return (
            f"cannot write {where} on rank {rank}: {denied.strerror or denied}; make "
            "train.output_dir writable again (or point it elsewhere), then resume with "
            "train.resume_from=latest"
        )
    return None
