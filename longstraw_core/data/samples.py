"""User data as ``Sample``s: a dataset file or directory read through ``datasets``, the way a
TRL script loads it (``data_files``: JSON/JSON Lines, Parquet, CSV, Arrow, ``save_to_disk``).

Each row (a JSONL line, a dataset row) is one of TRL's prompt formats:

- standard: ``{"prompt": "...", ...}``: the text is the model's input as it is (no chat
  template), as TRL's ``GRPOTrainer`` feeds it;
- conversational: ``{"prompt": [messages], ...}``: rendered through the tokenizer's chat
  template with the generation prompt and ``data.chat_template_kwargs`` (``tokenizer``);
- ``{"messages": [..., {"role": "assistant", "content": "..."}]}``: the last assistant turn
  is the answer and the turns before it are the prompt (or ``messages`` + ``answer``).

Every column is kept: ``Sample.columns`` holds the row exactly as ``datasets`` returned it
(``solution``, ``ground_truth``..., what TRL hands its reward functions); ``Sample.answer``
is the ``answer`` column as text (``""`` when there is none: no answer is required), ``id`` is
the ``id`` column when there is one (else where the row is), and ``Sample.meta`` the columns
other than ``id``, ``prompt``, ``messages`` and ``answer``. Errors name the file and the line
(JSON Lines) or row, and the field.

``sample_source`` scans the whole of ``data.path`` once, before the model is built: every
row is converted and its prompt tokenized exactly as the recipe will (one at a time: the
token ids of all prompts are never held together), so a bad row or a prompt longer than
``data.prompt_tokens`` fails before any weight loads, naming it, not hours into a run (and
again on every resume). Prompts over the limit are an error, or with ``data.on_overlong=skip``
left out and reported. A prompt too long in bytes to fit whatever its text
(``overlong_bytes``) is counted as overlong without being tokenized: one 30 MB record
would otherwise take a minute and gigabytes to measure. The kept rows are read in a seeded
shuffled order (``data.shuffle``, TRL's ``shuffle_dataset``; ``data_order``)::

    source = sample_source(cfg.data, tok)      # raises DataError before any weight loads
    source.size, source.longest, source.skipped
    sample = source(index)                     # deterministic by index: runs resume exactly
"""

from __future__ import annotations

import functools
import math
import os
from array import array
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tqdm.auto import tqdm

from longstraw_core.data.files import (
    DEFAULT_SPLIT,
    DataError,
    OpenedData,
    open_data,
)
from longstraw_core.data.files import fingerprint as file_fingerprint
from longstraw_core.data.order import DataOrder
from longstraw_core.data.tasks import Sample, sample_at
from longstraw_core.data.tokenizer import encode_prompt

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from longstraw_core.schema.run_config import DataSection

__all__ = ["DataError", "Sample", "SampleSource", "Skipped", "load_samples", "sample_source"]

RESERVED = ("id", "prompt", "messages", "answer")
ON_OVERLONG = ("error", "skip")  # data.on_overlong: refuse the data, or leave those prompts out
SHOWN = 5  # overlong prompts named in an error or a summary; the rest are counted


def load_samples(path: str | os.PathLike, *, split: str = DEFAULT_SPLIT) -> list[Sample]:
    """Every row of a data file or dataset directory as a Sample, in order (no length check,
    no shuffling: for looking at data; a run reads it through ``sample_source``)."""
    data = open_data(path, split, progress=False)
    return [record_to_sample(row, data.where(i)) for i, row in data]


def fingerprint(data: DataSection) -> dict[str, Any] | None:
    """``data.path``'s size and sha256 (``data_files.fingerprint``), which a checkpoint
    records and every rank compares; None for a generated task (its settings say it all)."""
    if data.task is not None or data.path is None:
        return None
    return file_fingerprint(data.path)


def first_sample(path: str | os.PathLike, *, split: str = DEFAULT_SPLIT) -> Sample:
    """The first row of ``path`` as a Sample, the rest unread: what the config check needs to
    know the data's columns (``rewards.sample_columns``) before the full scan."""
    data = open_data(path, split, progress=False)
    for index, row in data:
        return record_to_sample(row, data.where(index))
    raise DataError(f"{path}: no rows")


def record_to_sample(record: Any, where: str) -> Sample:
    """One row -> Sample; ``where`` (file and line/row) prefixes every error."""
    if not isinstance(record, Mapping):
        raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
    columns = dict(record)
    # A dataset has every column in every row: a null there means the field is absent.
    record = {k: v for k, v in record.items() if not (k in RESERVED and v is None)}
    prompt, answer = _prompt_and_answer(record, where)
    field_name = "prompt" if "prompt" in record else "messages"
    _require_text(prompt, where, field_name)
    sample_id = record.get("id")
    meta = {k: v for k, v in record.items() if k not in RESERVED}
    return Sample(
        id=str(sample_id) if sample_id is not None else where,
        prompt=prompt,
        answer=answer,
        meta=meta,
        columns=columns,
    )


def _prompt_and_answer(record: Mapping[str, Any], where: str) -> tuple[Any, str]:
    if "prompt" in record and "messages" in record:
        raise DataError(f"{where}: has both 'prompt' and 'messages'; use one")
    if "prompt" in record:
        prompt = record["prompt"]
        if not isinstance(prompt, str):
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
        return messages, ""  # a prompt without a reference answer
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


def _messages(value: Any, where: str, field_name: str) -> list[dict[str, Any]]:
    """The messages as given (every key kept: the chat template reads them as TRL's does)."""
    if not isinstance(value, list) or not value:
        raise DataError(
            f"{where}: field {field_name!r} must be a string or a non-empty list of messages"
        )
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise DataError(f"{where}: {field_name}[{i}] needs a string 'role'")
        if not isinstance(m.get("content"), str):
            raise DataError(f"{where}: {field_name}[{i}] needs a string 'content'")
        out.append(dict(m))
    return out


def _answer(record: Mapping[str, Any], where: str) -> str:
    """The ``answer`` column as text; ``""`` without one (rewards that need it say so)."""
    if "answer" not in record:
        return ""
    answer = record["answer"]
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise DataError(
            f"{where}: field 'answer' must be a string or a number (the built-in rewards "
            f"compare the completion with it), got {type(answer).__name__}; keep other values "
            "in another column, which reward functions read from Sample.columns"
        )
    return str(answer)


@dataclass(frozen=True)
class Skipped:
    """A record left out of the run: its prompt is longer than ``data.prompt_tokens``."""

    where: str  # <file>:<line> or <path>:row <i>
    tokens: int  # the prompt's length as the recipe tokenizes it (a lower bound: see bytes)
    bytes: int | None = None  # set when too long in bytes to be worth tokenizing

    def __str__(self) -> str:
        if self.bytes is None:
            return f"{self.where} ({self.tokens} tokens)"
        return f"{self.where} ({self.bytes} bytes: {self.tokens}+ tokens, not tokenized)"


class SampleSource:
    """``index -> Sample`` for a run, with what the scan of its data found.

    Deterministic by index (a dataset's kept rows are read epoch after epoch, each in
    ``data_order.DataOrder``'s seeded order; a task generates sample ``i`` from
    ``(data.seed, i)``), so a resumed run continues with the same samples. ``size``,
    ``longest`` are None for a task: it generates as many prompts as asked, each of
    ``data.prompt_tokens`` tokens within the task's tolerance, so there is nothing to scan.
    ``missing_answer``: kept rows without an ``answer`` (their ``Sample.answer`` is ``""``).
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
        shuffled: bool = False,
        missing_answer: int = 0,
    ) -> None:
        self._sample_at = sample_at
        self.origin = origin  # the data file or directory, or "task <name>"
        self.prompt_tokens = prompt_tokens  # the limit the prompts were checked against
        self.size = size  # samples kept, an epoch's length
        self.longest = longest  # tokens of the longest kept prompt
        self.skipped = tuple(skipped)  # overlong records left out (data.on_overlong=skip)
        self.shuffled = shuffled  # each epoch in a seeded random order (data.shuffle)
        self.missing_answer = missing_answer

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
        shown = ", ".join(map(str, self.skipped[:SHOWN]))
        more = f" and {len(self.skipped) - SHOWN} more" if len(self.skipped) > SHOWN else ""
        return (
            f"{line}; skipped {len(self.skipped)} longer than data.prompt_tokens "
            f"(data.on_overlong=skip): {shown}{more}"
        )


def sample_source(
    data: DataSection,
    tokenizer: PreTrainedTokenizerBase,
    *,
    progress: bool | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
) -> SampleSource:
    """Sample ``i`` of a run's data, the same whatever came before (so runs resume exactly).

    A task generates sample ``i`` from ``(data.seed, i)``; ``data.path`` is scanned whole
    first (``scan_samples``), so call this before building the model: a bad record or an
    overlong prompt then fails before any weight loads. ``progress``: the scan's tqdm bar
    (None: only on a terminal; pass False on ranks other than the main one).
    ``template_kwargs``: the prompts' ``apply_chat_template`` keywords when they are more than
    ``data.chat_template_kwargs`` (an agent run's tools: ``tools.Agents.template_kwargs``).
    """
    template_kwargs = dict(
        data.chat_template_kwargs if template_kwargs is None else template_kwargs
    )
    if data.task is not None:
        generate = functools.partial(
            _task_sample, data.task, tokenizer, data.prompt_tokens, data.seed, data.depth,
            dict(data.task_kwargs, chat_template_kwargs=template_kwargs),
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
        split=data.split,
        shuffle=data.shuffle,
        seed=data.seed,
        chat_template_kwargs=template_kwargs,
        progress=progress,
    )


def scan_samples(
    path: str | os.PathLike,
    tokenizer: PreTrainedTokenizerBase,
    *,
    prompt_tokens: int,
    on_overlong: str = "error",
    split: str = DEFAULT_SPLIT,
    shuffle: bool = False,
    seed: int = 0,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    progress: bool | None = None,
) -> SampleSource:
    """Every row of ``path`` converted and its prompt measured as the recipe will encode it
    (``encode_prompt`` with ``chat_template_kwargs``); a source over the rows that fit
    ``prompt_tokens``, in file order, or each epoch shuffled (``shuffle``, seeded by ``seed``).

    Raises ``DataError`` naming the file and line (or row) of the first bad record, for no
    records at all, and (``on_overlong="error"``, or when nothing fits) for prompts longer
    than ``prompt_tokens``: one error that counts them all and names the first few. Only the
    kept rows' indices stay in memory; samples are read from the dataset when asked for.
    """
    if on_overlong not in ON_OVERLONG:
        raise ValueError(f"on_overlong={on_overlong!r}; allowed: {', '.join(ON_OVERLONG)}")
    data = open_data(path, split, progress=progress)
    too_many_bytes = overlong_bytes(prompt_tokens, max_token_bytes(tokenizer))
    kept = array("q")  # the kept rows' indices in the dataset
    overlong: list[Skipped] = []
    longest = missing_answer = 0
    bar = tqdm(
        data,
        total=len(data),
        desc=f"scanning {Path(path).name}",
        unit="row",
        disable=None if progress is None else not progress,
        leave=False,
        dynamic_ncols=True,
    )
    with bar:
        for i, row in bar:
            where = data.where(i)
            sample = record_to_sample(row, where)
            size = prompt_bytes(sample.prompt)
            if size > too_many_bytes:  # cannot fit: not worth tokenizing
                overlong.append(Skipped(where, prompt_tokens + 1, bytes=size))
                continue
            tokens = len(encode_prompt(tokenizer, sample.prompt, chat_template_kwargs))
            if tokens == 0:
                raise DataError(f"{where}: the prompt tokenizes to 0 tokens")
            if tokens > prompt_tokens:
                overlong.append(Skipped(where, tokens))
                continue
            kept.append(i)
            longest = max(longest, tokens)
            missing_answer += not sample.answer
    origin = data.origin
    if not kept and not overlong:
        raise DataError(f"{origin}: no records (the file is empty or holds only blank lines)")
    if overlong and (on_overlong == "error" or not kept):
        raise DataError(_overlong_message(origin, overlong, len(kept), prompt_tokens))
    order = DataOrder(len(kept), shuffle=shuffle, seed=seed)
    return SampleSource(
        functools.partial(_read_sample, data, kept, order),
        origin=origin,
        prompt_tokens=prompt_tokens,
        size=len(kept),
        longest=longest,
        skipped=overlong,
        shuffled=shuffle,
        missing_answer=missing_answer,
    )


def max_token_bytes(tokenizer: PreTrainedTokenizerBase) -> int | None:
    """The most bytes of text one token can stand for, bounded by the tokenizer's longest
    vocabulary entry (added tokens included) in UTF-8: a byte-level BPE entry spells one
    byte per character, a SentencePiece one its text with a 3-byte ``▁`` for each space.

    None (no bound: every prompt is tokenized) unless the tokenizer is a ``tokenizers`` BPE
    that cannot fold a run of unknown text into one token: a WordLevel or WordPiece model
    maps a whole unknown word to one ``[UNK]``, a Unigram or ``fuse_unk`` BPE a run of them.
    """
    from tokenizers import models

    model = getattr(getattr(tokenizer, "backend_tokenizer", None), "model", None)
    if not isinstance(model, models.BPE):
        return None
    if model.unk_token is not None and model.fuse_unk and not model.byte_fallback:
        return None
    return max(len(piece.encode("utf-8")) for piece in tokenizer.get_vocab())


# How far a tokenizer's normalizer may shrink text before it is split (NFKC turns a 3-byte
# full-width letter into one byte): the margin ``overlong_bytes`` keeps.
NORMALIZER_SLACK = 4


def overlong_bytes(prompt_tokens: int, per_token: int | None) -> float:
    """The prompt size in UTF-8 bytes past which no tokenization can fit ``prompt_tokens``
    (each token stands for at most ``per_token`` bytes, ``NORMALIZER_SLACK`` to spare;
    None: no bound)."""
    return math.inf if per_token is None else prompt_tokens * per_token * NORMALIZER_SLACK


def prompt_bytes(prompt: Any) -> int:
    """A prompt's text in UTF-8 bytes: the string, or every message's content (a chat
    template only adds to it)."""
    if isinstance(prompt, str):
        return len(prompt.encode("utf-8"))
    return sum(len(str(m.get("content", "")).encode("utf-8")) for m in prompt)


def _read_sample(data: OpenedData, kept: array, order: DataOrder, index: int) -> Sample:
    """Sample ``index`` of the run: kept row ``order(index)``, read from the dataset."""
    row = kept[order(index)]
    return record_to_sample(data[row], data.where(row))


def _overlong_message(origin: str, overlong: list[Skipped], kept: int, limit: int) -> str:
    """One error for all overlong prompts: how many, the first few, the two fixes."""
    total = len(overlong) + kept
    measured = [s.tokens for s in overlong if s.bytes is None]
    most = max(measured, default=None)
    lines = [f"  {_overlong_line(s, limit)}" for s in overlong[:SHOWN]]
    if len(overlong) > SHOWN:
        lines.append(f"  ... and {len(overlong) - SHOWN} more")
    huge = [s for s in overlong if s.bytes is not None]
    if huge:  # too long to measure: cut them, or leave them out
        first = f"{huge[0].where} ({huge[0].bytes} bytes)"
        cut = f"shorten or remove the records too long to tokenize (the first: {first})"
    if kept:
        head = f"{len(overlong)} of {total} prompts are longer than data.prompt_tokens={limit}"
        fixes = [f"raise data.prompt_tokens to at least {most}"] if most else []
        fixes += ["set data.on_overlong=skip to leave these records out"]
        fixes += [cut] if huge else []
        fix = f"{', '.join(fixes[:-1])}, or {fixes[-1]}"
    else:
        head = f"all {total} prompts are longer than data.prompt_tokens={limit}"
        least = min(measured, default=None)
        fix = (
            f"raise data.prompt_tokens to at least {least} to keep any, {most} to keep all"
            if most
            else ""
        )
        fix = f"{fix}; {cut}" if huge and fix else cut if huge else fix
    longest = f" (the longest has {most} tokens)" if most else ""
    return "\n".join(
        [
            f"{origin}: {head}{longest}:",
            *lines,
            f"Fix: {fix} (prompt + rollout.max_new_tokens must fit the model's positions).",
        ]
    )


def _overlong_line(skipped: Skipped, limit: int) -> str:
    if skipped.bytes is None:
        return f"{skipped.where}: {skipped.tokens} tokens"
    return (
        f"{skipped.where}: {skipped.bytes} bytes, more than {limit} tokens whatever its text "
        "(not tokenized)"
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
