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

``sample_source`` scans the whole of ``data.path`` once, before the model is built: every
record is parsed, converted and its prompt tokenized exactly as the recipe will, so a bad
line or a prompt longer than ``data.prompt_tokens`` fails before any weight loads, naming its
line, not hours into a run (and again on every resume). Prompts over the limit are an error,
or with ``data.on_overlong=skip`` left out and reported::

    source = sample_source(cfg.data, tok)      # raises DataError before any weight loads
    source.size, source.longest, source.skipped
    sample = source(index)                     # deterministic by index: runs resume exactly
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tqdm.auto import tqdm

from longstraw_core.tasks import Sample, sample_at
from longstraw_core.tokenizer import encode_prompt

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from longstraw_core.config import DataSection

RESERVED = ("id", "prompt", "messages", "answer")
ON_OVERLONG = ("error", "skip")  # data.on_overlong: refuse the data, or leave those prompts out
SHOWN = 5  # overlong prompts named in an error or a summary; the rest are counted


class DataError(ValueError):
    """A record that cannot become a Sample; the message says where and why."""


def load_samples(
    path: str | os.PathLike, *, chat: bool = True, split: str | None = None
) -> list[Sample]:
    """Samples from a JSONL file or a ``save_to_disk`` directory (``split`` picks one split
    of a saved ``DatasetDict``)."""
    return [record_to_sample(r, where, chat=chat) for where, r in _records(path, split, False)]


def first_sample(path: str | os.PathLike, *, chat: bool = True, split: str | None = None) -> Sample:
    """The first record of ``path`` as a Sample, the rest unread: what the config check needs
    to know the data's columns (``rewards.sample_columns``) before the full scan."""
    for where, record in _records(path, split, False):
        return record_to_sample(record, where, chat=chat)
    raise DataError(f"{path}: no records")


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


@dataclass(frozen=True)
class Skipped:
    """A record left out of the run: its prompt is longer than ``data.prompt_tokens``."""

    where: str  # <file>:<line> or <dir>:row <i>
    tokens: int  # the prompt's length as the recipe tokenizes it


class SampleSource:
    """``index -> Sample`` for a run, with what the scan of its data found.

    Deterministic by index (a dataset cycles over its kept samples; a task generates sample
    ``i`` from ``(data.seed, i)``), so a resumed run continues with the same samples.
    ``size``, ``longest`` are None for a task: it generates as many prompts as asked, each of
    ``data.prompt_tokens`` tokens within the task's tolerance, so there is nothing to scan.
    """

    def __init__(
        self,
        sample_at: Callable[[int], Sample],
        *,
        origin: str,
        prompt_tokens: int,
        size: int | None = None,
        longest: int | None = None,
        skipped: Sequence[Skipped] = (),
    ) -> None:
        self._sample_at = sample_at
        self.origin = origin  # the data file or directory, or "task <name>"
        self.prompt_tokens = prompt_tokens  # the limit the prompts were checked against
        self.size = size  # samples kept, the cycle's length
        self.longest = longest  # tokens of the longest kept prompt
        self.skipped = tuple(skipped)  # overlong records left out (data.on_overlong=skip)

    def __call__(self, index: int) -> Sample:
        return self._sample_at(index)

    def __repr__(self) -> str:
        return f"SampleSource({self.summary()!r})"

    def summary(self) -> str:
        """One line for the run log; with skipped records, how many and where the first are."""
        if self.size is None:
            return f"{self.origin}: generated, {self.prompt_tokens} prompt tokens"
        line = (
            f"{self.origin}: {self.size} samples, longest prompt {self.longest} tokens "
            f"(data.prompt_tokens={self.prompt_tokens})"
        )
        if not self.skipped:
            return line
        shown = ", ".join(f"{s.where} ({s.tokens} tokens)" for s in self.skipped[:SHOWN])
        more = f" and {len(self.skipped) - SHOWN} more" if len(self.skipped) > SHOWN else ""
        return (
            f"{line}; skipped {len(self.skipped)} longer than data.prompt_tokens "
            f"(data.on_overlong=skip): {shown}{more}"
        )


def sample_source(
    data: DataSection, tokenizer: PreTrainedTokenizerBase, *, progress: bool | None = None
) -> SampleSource:
    """Sample ``i`` of a run's data, the same whatever came before (so runs resume exactly).

    A task generates sample ``i`` from ``(data.seed, i)``; ``data.path`` is scanned whole
    first (``scan_samples``), so call this before building the model: a bad record or an
    overlong prompt then fails before any weight loads. ``progress``: the scan's tqdm bar
    (None: only on a terminal; pass False on ranks other than the main one).
    """
    if data.task is not None:
        generate = functools.partial(
            _task_sample, data.task, tokenizer, data.prompt_tokens, data.seed, data.depth,
            dict(data.task_kwargs),
        )  # fmt: skip
        try:  # one sample up front: settings the task cannot meet fail before the model loads
            generate(0)
        except ValueError as error:
            raise DataError(f"data.task={data.task} with these data settings: {error}") from None
        return SampleSource(generate, origin=f"task {data.task}", prompt_tokens=data.prompt_tokens)
    return scan_samples(
        data.path,
        tokenizer,
        prompt_tokens=data.prompt_tokens,
        on_overlong=data.on_overlong,
        progress=progress,
    )


def scan_samples(
    path: str | os.PathLike,
    tokenizer: PreTrainedTokenizerBase,
    *,
    prompt_tokens: int,
    on_overlong: str = "error",
    chat: bool = True,
    split: str | None = None,
    progress: bool | None = None,
) -> SampleSource:
    """Every record of ``path`` parsed, converted and its prompt measured as the recipe will
    encode it (``encode_prompt``); the samples that fit ``prompt_tokens``, in file order.

    Raises ``DataError`` naming the file and line (or row) of the first bad record, for no
    records at all, and (``on_overlong="error"``, or when nothing fits) for prompts longer
    than ``prompt_tokens``: one error that counts them all and names the first few.
    """
    if on_overlong not in ON_OVERLONG:
        raise ValueError(f"on_overlong={on_overlong!r}; allowed: {', '.join(ON_OVERLONG)}")
    kept: list[Sample] = []
    overlong: list[Skipped] = []
    longest = 0
    for where, record in _records(path, split, progress):
        sample = record_to_sample(record, where, chat=chat)
        tokens = len(encode_prompt(tokenizer, sample.prompt))
        if tokens == 0:
            raise DataError(f"{where}: the prompt tokenizes to 0 tokens")
        if tokens > prompt_tokens:
            overlong.append(Skipped(where, tokens))
        else:
            kept.append(sample)
            longest = max(longest, tokens)
    origin = str(Path(path).expanduser())
    if not kept and not overlong:
        raise DataError(f"{origin}: no records (the file is empty or holds only blank lines)")
    if overlong and (on_overlong == "error" or not kept):
        raise DataError(_overlong_message(origin, overlong, len(kept), prompt_tokens))
    return SampleSource(
        functools.partial(_cycle, tuple(kept)),
        origin=origin,
        prompt_tokens=prompt_tokens,
        size=len(kept),
        longest=longest,
        skipped=overlong,
    )


def _cycle(samples: tuple[Sample, ...], index: int) -> Sample:
    return samples[index % len(samples)]


def _overlong_message(origin: str, overlong: list[Skipped], kept: int, limit: int) -> str:
    """One error for all overlong prompts: how many, the first few, the two fixes."""
    total = len(overlong) + kept
    most = max(s.tokens for s in overlong)
    lines = [f"  {s.where}: {s.tokens} tokens" for s in overlong[:SHOWN]]
    if len(overlong) > SHOWN:
        lines.append(f"  ... and {len(overlong) - SHOWN} more")
    if kept:
        head = f"{len(overlong)} of {total} prompts are longer than data.prompt_tokens={limit}"
        fix = (
            f"raise data.prompt_tokens to at least {most}, or set data.on_overlong=skip "
            "to leave these records out"
        )
    else:
        head = f"all {total} prompts are longer than data.prompt_tokens={limit}"
        least = min(s.tokens for s in overlong)
        fix = f"raise data.prompt_tokens to at least {least} to keep any, {most} to keep all"
    return "\n".join(
        [
            f"{origin}: {head} (the longest has {most} tokens):",
            *lines,
            f"Fix: {fix} (prompt + rollout.max_new_tokens must fit the model's positions).",
        ]
    )


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
