"""The scan of ``data.path`` before the model loads: every fault named by file and line (or
row), prompts over ``data.prompt_tokens`` refused or skipped, and the config key checked."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import datasets
import pytest
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from longstraw_core.config import ConfigError, DataSection, load_config
from longstraw_core.data.files import fingerprint
from longstraw_core.data.samples import (
    SHOWN,
    DataError,
    SampleSource,
    Skipped,
    load_samples,
    max_token_bytes,
    sample_source,
    scan_samples,
)
from longstraw_core.data.tasks import sample_at
from longstraw_core.data.tokenizer import encode_prompt, load_tokenizer

TINY = Path(__file__).resolve().parents[2] / "configs" / "qwen36" / "tiny_grpo_cpu.yaml"
POSITIONS, NEW_TOKENS = 32768, 16  # TINY's model positions and rollout.max_new_tokens


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(None)


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def record(n: int, answer: str = "a") -> dict:
    """A record whose prompt content is ``n`` characters (bytes, for the built-in tokenizer)."""
    return {"prompt": "x" * n, "answer": answer}


def tokens(tok, n: int) -> int:
    return len(encode_prompt(tok, "x" * n))  # plain text is not templated: n bytes


def scan(path: Path, tok, prompt_tokens: int = 10_000, **kwargs) -> SampleSource:
    return scan_samples(path, tok, prompt_tokens=prompt_tokens, progress=False, **kwargs)


def scan_error(path: Path, tok, **kwargs) -> str:
    with pytest.raises(DataError) as info:
        scan(path, tok, **kwargs)
    return str(info.value)


# --------------------------------------------------------------------------- good data


def test_good_file_serves_the_samples_load_samples_gives(tmp_path, tok):
    path = tmp_path / "d.jsonl"
    path.write_text(
        json.dumps(record(3, "a0")) + "\n\n" + json.dumps({"id": 7, **record(40, "a1")}) + "\n"
    )
    source = scan(path, tok)
    samples = load_samples(path)
    assert (source.size, source.longest, source.skipped) == (2, tokens(tok, 40), ())
    assert [source(i) for i in range(5)] == [samples[i % 2] for i in range(5)]
    assert source(1).id == "7" and source(0).id == f"{path}:1"
    assert source.summary() == (
        f"{path}: 2 samples, longest prompt {tokens(tok, 40)} tokens (data.prompt_tokens=10000)"
    )


def test_progress_bar_draws_and_closes(tmp_path, tok, capsys):
    path = write_jsonl(tmp_path / "d.jsonl", [record(3)])
    scan_samples(path, tok, prompt_tokens=100, progress=True)
    assert "scanning d.jsonl" in capsys.readouterr().err


def test_saved_dataset_scans_and_names_rows(tmp_path, tok):
    rows = [record(3, "a0"), record(500, "a1"), record(5, "a2")]
    datasets.Dataset.from_list(rows).save_to_disk(tmp_path / "ds")
    message = scan_error(tmp_path / "ds", tok, prompt_tokens=100)
    assert f"{tmp_path / 'ds'}:row 1: {tokens(tok, 500)} tokens" in message
    source = scan(tmp_path / "ds", tok, prompt_tokens=100, on_overlong="skip")
    assert [source(i).answer for i in range(3)] == ["a0", "a2", "a0"]
    assert source.skipped == (Skipped(f"{tmp_path / 'ds'}:row 1", tokens(tok, 500)),)


def test_sample_source_scans_a_path_and_generates_a_task(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", [record(3), record(900)])
    data = DataSection(path=str(path), prompt_tokens=100, on_overlong="skip")
    source = sample_source(data, tok, progress=False)
    assert source.size == 1 and len(source.skipped) == 1
    with pytest.raises(DataError, match=re.escape("data.on_overlong=skip")):
        sample_source(DataSection(path=str(path), prompt_tokens=100), tok, progress=False)
    task = DataSection(task="passkey_retrieval", prompt_tokens=300)
    generated = sample_source(task, tok)
    assert isinstance(generated, SampleSource) and generated.size is None
    assert generated(3) == sample_at("passkey_retrieval", tok, 300, 0, 3, depth=None)


# --------------------------------------------------------------------------- faults


def test_empty_file_and_blank_lines_name_the_file(tmp_path, tok):
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")
    assert (
        scan_error(empty, tok)
        == f"{empty}: no records (the file is empty or holds only blank lines)"
    )
    blank = tmp_path / "blank.jsonl"
    blank.write_text("\n  \n")
    assert scan_error(blank, tok).startswith(f"{blank}: no records")


@pytest.mark.parametrize(
    ("line", "message"),
    [
        (
            "{not json",
            "invalid JSON (Expecting property name enclosed in double quotes at column 2)",
        ),
        ('{"answer": "a"}', "missing field 'prompt' (or 'messages'); fields: ['answer']"),
        ('{"prompt": "", "answer": "a"}', "field 'prompt' is empty (or only whitespace)"),
        ('{"prompt": " \\n", "answer": "a"}', "field 'prompt' is empty (or only whitespace)"),
        (
            '{"messages": [{"role": "system", "content": ""}, {"role": "user", "content": " "},'
            ' {"role": "assistant", "content": "a"}]}',
            "field 'messages': every prompt message's 'content' is empty (or only whitespace)",
        ),
    ],
)
def test_bad_line_is_named_by_file_line_and_field(tmp_path, tok, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(record(3)) + "\n" + line + "\n" + json.dumps(record(3)) + "\n")
    assert scan_error(path, tok) == f"{path}:2: {message}"


def test_non_utf8_bytes_name_line_byte_and_column(tmp_path, tok):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"prompt": "ok", "answer": "a"}\n{"prompt": "caf\xe9", "answer": "a"}\n')
    assert scan_error(path, tok) == f"{path}:2: not valid UTF-8 (byte 0xe9 at column 16)"
    with pytest.raises(DataError, match=re.escape(f"{path}:2: not valid UTF-8")):
        load_samples(path)


def test_utf8_bom_is_accepted(tmp_path, tok):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(record(3)).encode() + b"\n")
    assert scan(path, tok).size == 1


def test_prompt_of_zero_tokens_is_refused(tmp_path):
    """A tokenizer that normalizes the prompt away leaves nothing to feed the model."""
    core = Tokenizer(models.WordLevel({"<unk>": 0, "hi": 1}, unk_token="<unk>"))
    core.normalizer = normalizers.Replace("\u200b", "")
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    vanishing = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>")
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "hi", "answer": "a"}, record(0)])
    path.write_text(path.read_text().replace('"prompt": ""', '"prompt": "\\u200b"'))
    assert scan_error(path, vanishing) == f"{path}:2: the prompt tokenizes to 0 tokens"


def test_a_key_given_twice_is_named_by_line_and_key(tmp_path, tok):
    path = tmp_path / "dup.jsonl"
    path.write_text('{"prompt": "hi", "answer": "a"}\n{"prompt": "a", "prompt": "b"}\n')
    assert scan_error(path, tok) == (
        f"{path}:2: the key 'prompt' appears twice in one object; keep one (a JSON object's "
        "keys must differ, and datasets' reader refuses the file)"
    )


@pytest.mark.parametrize(
    ("text", "line", "what"),
    [
        ("prompt,answer\nhi,1\nbad,3,extra\nok,4\n", 3, "3 fields, but the header has 2"),
        ("prompt,answer\nhi,1\n\nonly\nok,4\n", 4, "1 field, but the header has 2"),
        ('prompt,answer\nhi,1\n"never closed,2\nok,4\n', 3, "a quote opened in this record"),
    ],
    ids=["long-row", "short-row", "open-quote"],
)
def test_a_bad_csv_row_is_named_by_file_and_line(tmp_path, tok, text, line, what):
    path = tmp_path / "d.csv"
    path.write_text(text)
    assert scan_error(path, tok).startswith(f"{path}:{line}: {what}")


def test_csv_rows_are_named_by_the_line_their_record_starts_on(tmp_path, tok):
    path = tmp_path / "d.csv"
    path.write_text('prompt,answer\n\nhi,1\n"two\nlines",2\n" ",3\n')
    assert scan_error(path, tok) == f"{path}:6: field 'prompt' is empty (or only whitespace)"
    path.write_text('prompt,answer\n\nhi,1\n"two\nlines",2\n')
    assert [s.id for s in load_samples(path)] == [f"{path}:3", f"{path}:4"]


def test_the_fingerprint_is_the_bytes_not_the_file_times(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [record(3), record(4)])
    first = fingerprint(path)
    assert first["bytes"] == path.stat().st_size and len(first["sha256"]) == 64
    path.write_bytes(path.read_bytes())  # rewritten, the same bytes
    assert fingerprint(path) == first
    path.write_text(path.read_text().replace('"a"', '"b"'))  # the same size, other bytes
    assert fingerprint(path)["bytes"] == first["bytes"] and fingerprint(path) != first
    folder = tmp_path / "ds"
    datasets.Dataset.from_list([record(3)]).save_to_disk(str(folder))
    saved = fingerprint(folder)
    assert saved == fingerprint(folder) and saved["bytes"] > 0
    (folder / "extra.txt").write_text("x")
    assert fingerprint(folder) != saved


# --------------------------------------------------------------------------- overlong prompts


def overlong_file(tmp_path: Path) -> tuple[Path, list[int]]:
    """Lines 1-3 fit 100 tokens; lines 4-10 (7 prompts, more than SHOWN) do not."""
    lengths = [3, 5, 7, 300, 120, 3000, 150, 101, 200, 400]
    return write_jsonl(
        tmp_path / "d.jsonl", [record(n, f"a{i}") for i, n in enumerate(lengths)]
    ), lengths


def test_overlong_prompts_are_one_error_naming_the_first_and_the_longest(tmp_path, tok):
    path, lengths = overlong_file(tmp_path)
    message = scan_error(path, tok, prompt_tokens=100)
    longest = tokens(tok, 3000)
    named = [f"  {path}:{line}: {tokens(tok, lengths[line - 1])} tokens" for line in range(4, 9)]
    assert message == "\n".join(
        [
            f"{path}: 7 of 10 prompts are longer than data.prompt_tokens=100 "
            f"(the longest has {longest} tokens):",
            *named,
            "  ... and 2 more",
            f"Fix: raise data.prompt_tokens to at least {longest}, or set data.on_overlong=skip "
            "to leave these records out (prompt + rollout.max_new_tokens must fit the model's "
            "positions).",
        ]
    )
    assert SHOWN == 5


def test_overlong_prompts_skipped_are_counted_and_indexes_cycle_over_the_rest(tmp_path, tok):
    path, lengths = overlong_file(tmp_path)
    source = scan(path, tok, prompt_tokens=100, on_overlong="skip")
    assert source.size == 3 and source.longest == tokens(tok, 7)
    assert source.skipped == tuple(
        Skipped(f"{path}:{line}", tokens(tok, lengths[line - 1])) for line in range(4, 11)
    )
    assert [source(i).answer for i in range(7)] == ["a0", "a1", "a2", "a0", "a1", "a2", "a0"]
    summary = source.summary()
    assert "3 samples" in summary and "skipped 7 longer than data.prompt_tokens" in summary
    assert f"{path}:4 ({tokens(tok, 300)} tokens)" in summary and "and 2 more" in summary


def test_prompt_exactly_at_the_limit_is_kept(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", [record(50)])
    assert scan(path, tok, prompt_tokens=tokens(tok, 50)).size == 1
    assert "1 of 1" not in scan_error(path, tok, prompt_tokens=tokens(tok, 50) - 1)


def test_all_prompts_overlong_is_an_error_even_when_skipping(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", [record(200), record(300)])
    message = scan_error(path, tok, prompt_tokens=100, on_overlong="skip")
    assert message.startswith(f"{path}: all 2 prompts are longer than data.prompt_tokens=100")
    assert f"at least {tokens(tok, 200)} to keep any, {tokens(tok, 300)} to keep all" in message


def test_a_huge_record_is_refused_by_its_size_without_being_tokenized(tmp_path, tok):
    """One 30 MB record took a minute and 6.6 GB to measure; its bytes tell it cannot fit."""
    huge = 8_000_000
    path = write_jsonl(tmp_path / "d.jsonl", [record(3), record(huge), record(5)])
    started = time.monotonic()
    message = scan_error(path, tok, prompt_tokens=1000)
    assert time.monotonic() - started < 60
    assert (
        f"  {path}:2: {huge} bytes, more than 1000 tokens whatever its text (not tokenized)"
        in message
    )
    assert f"shorten or remove the records too long to tokenize (the first: {path}:2" in message
    source = scan(path, tok, prompt_tokens=1000, on_overlong="skip")
    assert source.size == 2 and source.skipped == (Skipped(f"{path}:2", 1001, bytes=huge),)


def test_the_size_bound_is_the_longest_token_and_never_refuses_a_prompt_that_fits(tmp_path):
    """60 bytes in one (added) token: a prompt of 100 of them is 100 tokens, kept."""
    word = "a" * 60
    core = Tokenizer(models.BPE(vocab={"a": 0}, merges=[]))
    core.add_tokens([word])
    long_tokens = PreTrainedTokenizerFast(tokenizer_object=core)
    assert max_token_bytes(long_tokens) == 60
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": word * 100}])
    assert scan(path, long_tokens, prompt_tokens=100).longest == 100
    # A WordLevel model reads any unknown word as one token: no bound, everything measured.
    unknown = Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>"))
    unknown.pre_tokenizer = pre_tokenizers.Whitespace()
    words = PreTrainedTokenizerFast(tokenizer_object=unknown, unk_token="<unk>")
    assert max_token_bytes(words) is None
    path = write_jsonl(tmp_path / "w.jsonl", [{"prompt": "b" * 100_000}])
    assert scan(path, words, prompt_tokens=1).longest == 1


def test_unknown_on_overlong_is_refused(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", [record(3)])
    with pytest.raises(ValueError, match="allowed: error, skip"):
        scan(path, tok, on_overlong="truncate")


# --------------------------------------------------------------------------- config


def test_on_overlong_is_validated(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [record(3)])
    as_path = ["data.task=null", f"data.path={path}"]
    assert load_config(TINY, [*as_path, "data.on_overlong=skip"]).data.on_overlong == "skip"
    assert load_config(TINY, as_path).data.on_overlong == "error"
    with pytest.raises(ConfigError) as info:
        load_config(TINY, [*as_path, "data.on_overlong=truncate"])
    assert info.value.key == "data.on_overlong"
    assert str(info.value) == "data.on_overlong: 'truncate' is invalid; allowed: error, skip"
    with pytest.raises(ConfigError, match=re.escape("only applies with data.path")) as info:
        load_config(TINY, ["data.on_overlong=skip"])  # TINY generates a task
    assert info.value.key == "data.on_overlong"


def test_path_prompt_tokens_is_a_hard_maximum_without_the_task_tolerance(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [record(3)])
    as_path = ["data.task=null", f"data.path={path}"]
    fits = POSITIONS - NEW_TOKENS
    load_config(TINY, [*as_path, f"data.prompt_tokens={fits}"])
    with pytest.raises(ConfigError) as info:
        load_config(TINY, [*as_path, f"data.prompt_tokens={fits + 1}"])
    assert str(info.value).startswith(
        f"data.prompt_tokens: {fits + 1} + rollout.max_new_tokens {NEW_TOKENS} = {POSITIONS + 1} "
        f"exceeds the model's {POSITIONS} positions"
    )
    with pytest.raises(ConfigError, match="with the task's length tolerance"):
        load_config(TINY, [f"data.prompt_tokens={fits}"])  # a task may run 1% over


def test_task_settings_it_cannot_meet_fail_before_the_model_loads():
    data = load_config(TINY, ["data.prompt_tokens=256"]).data
    with pytest.raises(
        DataError, match=r"data\.task=passkey_retrieval .*prompt_tokens=256 is too small"
    ):
        sample_source(data, load_tokenizer(None))
