"""The task registry (``TASKS``, by the name ``data.task`` gives) and the deterministic streams
drawn from it: sample ``index`` of a stream is the same whatever came before, so a resumed
run continues at its data position."""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator
from typing import Any

from transformers import PreTrainedTokenizerBase

from longstraw_core.data.tasks.agent import agent_lookup
from longstraw_core.data.tasks.generators import (
    doc_lookup,
    kv_chain,
    multi_needle,
    passkey_retrieval,
    uuid_retrieval,
    variable_tracking,
)
from longstraw_core.data.tasks.sample import Depth, Sample, TaskFn

TASKS: dict[str, TaskFn] = {
    "passkey_retrieval": passkey_retrieval,
    "uuid_retrieval": uuid_retrieval,
    "multi_needle": multi_needle,
    "kv_chain": kv_chain,
    "variable_tracking": variable_tracking,
    "agent_lookup": agent_lookup,
    "doc_lookup": doc_lookup,
}


def _derive_seed(*parts: object) -> int:
    """A 63-bit seed from any parts; stable across processes (unlike ``hash``)."""
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def sample_at(
    name: str,
    tokenizer: PreTrainedTokenizerBase,
    prompt_tokens: int,
    seed: int,
    index: int,
    *,
    depth: Depth | None = None,
    **kw: Any,
) -> Sample:
    """Sample ``index`` of the stream ``(name, seed)``: the same whatever came before.

    Without ``depth`` each sample draws its own uniform depth from its seed.
    """
    if name not in TASKS:
        raise KeyError(f"unknown task {name!r}; known: {sorted(TASKS)}")
    sample_seed = _derive_seed("stream", name, seed, index)
    if depth is None:
        depth = random.Random(sample_seed).random()
    sample = TASKS[name](
        tokenizer, prompt_tokens, depth=depth, seed=sample_seed, id=f"{name}:{seed}:{index}", **kw
    )
    sample.meta["index"] = index
    return sample


def make_task_stream(
    name: str,
    tokenizer: PreTrainedTokenizerBase,
    prompt_tokens: int,
    seed: int = 0,
    *,
    start: int = 0,
    **kw: Any,
) -> Iterator[Sample]:
    """Endless deterministic stream; ``start`` resumes at a data position (see ``sample_at``)."""
    if name not in TASKS:
        raise KeyError(f"unknown task {name!r}; known: {sorted(TASKS)}")
    index = start
    while True:
        yield sample_at(name, tokenizer, prompt_tokens, seed, index, **kw)
        index += 1
