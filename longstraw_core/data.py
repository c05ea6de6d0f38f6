"""User data as ``Sample``s: JSONL files, or a ``datasets`` dataset saved with ``save_to_disk``.

Each record (a JSONL line or a dataset row) is one of:

- ``{"prompt": "...", "answer": "..."}``: the prompt becomes one user message (``chat=True``,
  the default, so it is rendered through the tokenizer's chat template when there is one)
  or stays plain text (``chat=False``);
- ``{"prompt": [messages], "answer": "..."}`` or ``{"messages": [...], "answer": "..."}``;
- ``{"messages": [..., {"role": "assistant", "content": "..."}]}``: the last assistant turn is
  the answer and the turns before it are the prompt.

``id`` is taken from the record when present (else ``<file>:<line>`` / ``<dir>:<row>``); every
other field goes to ``Sample.meta``. Errors name the file, the line or row and the field.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tqdm.auto import tqdm

from longstraw_core.tasks import Sample, sample_at

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from longstraw_core.config import DataSection

RESERVED = ("id", "prompt", "messages", "answer")


class DataError(ValueError):
    """A record that cannot become a Sample; the message says where and why."""


def load_samples(
    path: str | os.PathLike, *, chat: bool = True, split: str | None = None
) -> list[Sample]:
    """Samples from a JSONL file or a ``save_to_disk`` directory (``split`` picks one split
    of a saved ``DatasetDict``)."""
    return [record_to_sample(r, where, chat=chat) for where, r in _records(path, split, False)]


def _records(
    path: str | os.PathLike, split: str | None, progress: bool | None
) -> Iterator[tuple[str, Any]]:
    """``(where, record)`` for every record, in order; ``where`` is ``<file>:<line>`` or
    ``<dir>:row <i>``. ``progress``: a tqdm bar (None: only on a terminal, as tqdm decides)."""
    p = Path(path).expanduser()  # as config's existence check reads data.path
    if p.is_dir():
        name, rows = _open_dataset(p, split)
        with _bar(progress, f"scanning {p.name}", total=len(rows), unit="row") as bar:
            for i, row in enumerate(rows):
                bar.update(1)
                yield f"{name}:row {i}", row
        return
    if not p.is_file():
        raise FileNotFoundError(f"no data file or dataset directory at {str(p)!r}")
    size = p.stat().st_size
    with _bar(progress, f"scanning {p.name}", total=size, unit="B", unit_scale=True) as bar:
        yield from _jsonl_records(p, bar.update)


def _bar(progress: bool | None, desc: str, **kwargs: Any) -> tqdm:
    disable = None if progress is None else not progress
    return tqdm(desc=desc, disable=disable, leave=False, dynamic_ncols=True, **kwargs)


def _jsonl_records(path: Path, advance: Callable[[int], object]) -> Iterator[tuple[str, Any]]:
    """Read as bytes and decode line by line, so a bad byte is reported with its line."""
    with path.open("rb") as f:
        for line_no, raw in enumerate(f, start=1):
            advance(len(raw))
            where = f"{path}:{line_no}"
            line = _decode(raw, where, first=line_no == 1)
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(
                    f"{where}: invalid JSON ({exc.msg} at column {exc.colno})"
                ) from None
            yield where, record


def _decode(raw: bytes, where: str, *, first: bool) -> str:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        byte = raw[exc.start]
        raise DataError(
            f"{where}: not valid UTF-8 (byte 0x{byte:02x} at column {exc.start + 1})"
        ) from None
    return text.removeprefix("\ufeff") if first else text  # a BOM some editors write


def _open_dataset(path: Path, split: str | None) -> tuple[str, Any]:
    """The saved ``datasets.Dataset`` (one split of a ``DatasetDict``) and its name for errors."""
    import datasets  # optional at import time: only this loader needs it

    try:
        data = datasets.load_from_disk(str(path))
    except Exception as exc:  # datasets raises several types for "not a saved dataset"
        raise DataError(f"{path}: not a dataset saved with save_to_disk ({exc})") from exc
    if isinstance(data, datasets.DatasetDict):
        if split is None:
            if len(data) != 1:
                raise DataError(f"{path}: holds splits {sorted(data)}; pass split=")
            split = next(iter(data))
        if split not in data:
            raise DataError(f"{path}: no split {split!r}; splits are {sorted(data)}")
        data = data[split]
    elif split is not None:
        raise DataError(f"{path}: a single dataset, not a DatasetDict; split={split!r} given")
    return (f"{path}[{split}]" if split else str(path)), data


def record_to_sample(record: Any, where: str, *, chat: bool = True) -> Sample:
    """One record -> Sample; ``where`` (file and line/row) prefixes every error."""
    if not isinstance(record, Mapping):
        raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
    # A dataset has every column in every row: a null there means the field is absent.
    record = {k: v for k, v in record.items() if not (k in RESERVED and v is None)}
    prompt, answer = _prompt_and_answer(record, where, chat)
    field_name = "prompt" if "prompt" in record else "messages"
    _require_text(record.get("prompt", prompt), where, field_name)  # as given, not wrapped
    sample_id = record.get("id")
    meta = {k: v for k, v in record.items() if k not in RESERVED}
    return Sample(
        id=str(sample_id) if sample_id is not None else where,
        prompt=prompt,
        answer=answer,
        meta=meta,
    )


def _prompt_and_answer(record: Mapping[str, Any], where: str, chat: bool) -> tuple[Any, str]:
    if "prompt" in record and "messages" in record:
        raise DataError(f"{where}: has both 'prompt' and 'messages'; use one")
    if "prompt" in record:
        prompt = record["prompt"]
        if isinstance(prompt, str):
            prompt = [{"role": "user", "content": prompt}] if chat else prompt
        else:
            prompt = _messages(prompt, where, "prompt")
        return prompt, _answer(record, where)
    if "messages" not in record:
        raise DataError(
            f"{where}: missing field 'prompt' (or 'messages'); fields: {sorted(record)}"
        )
    messages = _messages(record["messages"], where, "messages")
    if "answer" in record:
        if messages[-1]["role"] == "assistant":
            raise DataError(
                f"{where}: 'messages' ends with an assistant turn and 'answer' is also given; "
                "drop one (the last assistant turn is the answer when 'answer' is absent)"
            )
        return messages, _answer(record, where)
    if messages[-1]["role"] != "assistant":
        raise DataError(
            f"{where}: missing field 'answer', and 'messages' does not end with an assistant "
            "turn to take it from"
        )
    if len(messages) < 2:
        raise DataError(f"{where}: 'messages' has only the assistant answer, no prompt")
    return messages[:-1], messages[-1]["content"]


def _require_text(prompt: Any, where: str, field_name: str) -> None:
    """An empty prompt gives the model nothing to answer: refuse it with its line."""
    if isinstance(prompt, str):
        if not prompt.strip():
            raise DataError(f"{where}: field {field_name!r} is empty (or only whitespace)")
    elif not any(m["content"].strip() for m in prompt):
        raise DataError(
            f"{where}: field {field_name!r}: every prompt message's 'content' is empty "
            "(or only whitespace)"
        )


def _messages(value: Any, where: str, field_name: str) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise DataError(f"{where}: field {field_name!r} must be a non-empty list of messages")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise DataError(f"{where}: {field_name}[{i}] needs a string 'role'")
        if not isinstance(m.get("content"), str):
            raise DataError(f"{where}: {field_name}[{i}] needs a string 'content'")
        out.append({"role": m["role"], "content": m["content"]})
    return out


def _answer(record: Mapping[str, Any], where: str) -> str:
    if "answer" not in record:
        raise DataError(f"{where}: missing field 'answer'; fields: {sorted(record)}")
    answer = record["answer"]
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise DataError(
            f"{where}: field 'answer' must be a string or a number, got {type(answer).__name__}"
        )
    return str(answer)


def sample_source(data: DataSection, tokenizer: PreTrainedTokenizerBase) -> Callable[[int], Sample]:
    """Sample ``i`` of a run's data, the same whatever came before (so runs resume exactly).

    A task generates sample ``i`` from ``(data.seed, i)``; a dataset cycles through its rows.
    """
    if data.task is not None:
        return functools.partial(
            _task_sample, data.task, tokenizer, data.prompt_tokens, data.seed, data.depth,
            dict(data.task_kwargs),
        )  # fmt: skip
    samples = load_samples(data.path)
    if not samples:
        raise DataError(f"{data.path}: no samples (data.path)")
    return lambda index: samples[index % len(samples)]


def _task_sample(
    task: str,
    tokenizer: PreTrainedTokenizerBase,
    prompt_tokens: int,
    seed: int,
    depth: float | None,
    task_kwargs: dict[str, Any],
    index: int,
) -> Sample:
    return sample_at(task, tokenizer, prompt_tokens, seed, index, depth=depth, **task_kwargs)
