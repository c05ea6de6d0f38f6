"""Tokenizers (built-in byte-level, local paths) and user data loading (JSONL, datasets)."""

import json
import re

import datasets
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from longstraw_core.data.samples import DataError, load_samples
from longstraw_core.data.tasks import Sample
from longstraw_core.data.tokenizer import (
    BUILTIN_SPECIAL_TOKENS,
    count_prompt_tokens,
    encode_prompt,
    has_chat_template,
    load_tokenizer,
    padded_vocab_size,
    render_prompt,
)

CHAT = [{"role": "user", "content": "hé"}]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(None)


@pytest.fixture(scope="module")
def word_tok():
    """A word-level tokenizer with no chat template that adds a BOS to plain text."""
    vocab = {w: i for i, w in enumerate(["<unk>", "<s>", "</s>", "hello", "world", "hé"])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    core.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", 1)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


# --------------------------------------------------------------------------- tokenizer


def test_builtin_is_byte_level(tok):
    text = "Hello, wörld! 💡\n"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids == list(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert len(tok) == 260 and padded_vocab_size(tok) == 512


def test_builtin_special_tokens(tok):
    assert [tok.convert_tokens_to_ids(t) for t in BUILTIN_SPECIAL_TOKENS] == [256, 257, 258, 259]
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 259
    assert tok.pad_token == "<|pad|>" and tok.pad_token_id == 257
    ids = tok("a<|endoftext|>b", add_special_tokens=False)["input_ids"]
    assert ids == [97, 256, 98]
    assert tok.decode(ids, skip_special_tokens=True) == "ab"


def test_builtin_chat_template(tok):
    assert has_chat_template(tok)
    text = render_prompt(tok, [{"role": "system", "content": "be brief"}, *CHAT])
    assert text == (
        "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhé<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    ids = encode_prompt(tok, CHAT)
    expected = [258, *b"user\n", *"hé".encode(), 259, *b"\n", 258, *b"assistant\n"]
    assert ids == expected  # turn markers are single tokens, nothing added twice
    assert count_prompt_tokens(tok, CHAT) == len(expected)


def test_load_tokenizer_by_name_and_path(tok, tmp_path):
    assert load_tokenizer("builtin:bytes")("abc")["input_ids"] == tok("abc")["input_ids"]
    tok.save_pretrained(tmp_path)
    again = load_tokenizer(tmp_path)
    assert again.chat_template == tok.chat_template
    assert encode_prompt(again, CHAT) == encode_prompt(tok, CHAT)
    assert again.eos_token_id == 259


def test_load_tokenizer_errors(tmp_path):
    missing = tmp_path / "missing"
    with pytest.raises(FileNotFoundError, match=re.escape(str(missing))):
        load_tokenizer(missing)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"could not load a tokenizer from .*empty"):
        load_tokenizer(tmp_path / "empty")


def test_render_without_chat_template(word_tok):
    assert not has_chat_template(word_tok)
    assert render_prompt(word_tok, "hello world") == "hello world"
    assert render_prompt(word_tok, [{"role": "user", "content": "hello"}]) == "hello"
    convo = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "world"}]
    assert render_prompt(word_tok, convo) == "user: hello\nassistant: world\nassistant:"


def test_special_tokens_plain_vs_chat(word_tok, tok):
    assert encode_prompt(word_tok, "hello world") == [1, 3, 4]  # plain text gets its BOS
    assert encode_prompt(word_tok, [{"role": "user", "content": "hello"}]) == [1, 3]
    assert encode_prompt(tok, "hé") == [104, 195, 169]


# --------------------------------------------------------------------------- data

GOOD_RECORDS = [
    # (record, expected prompt, expected answer, expected meta)
    ({"prompt": "2+2?", "answer": "4"}, "2+2?", "4", {}),  # plain text stays plain (TRL)
    ({"prompt": "2+2?", "answer": 4}, "2+2?", "4", {}),
    ({"prompt": "2+2?", "solution": "4"}, "2+2?", "", {"solution": "4"}),  # no answer needed
    (
        {"prompt": [{"role": "user", "content": "hi"}], "answer": "yo", "level": 3},
        [{"role": "user", "content": "hi"}],
        "yo",
        {"level": 3},
    ),
    (
        {
            "messages": [
                {"role": "system", "content": "s"},
                {"role": "user", "content": "u"},
                {"role": "assistant", "content": "a"},
            ]
        },
        [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}],
        "a",
        {},
    ),
    (
        {"messages": [{"role": "user", "content": "u"}], "answer": 2.5},
        [{"role": "user", "content": "u"}],
        "2.5",
        {},
    ),
    ({"messages": [{"role": "user", "content": "u"}]}, [{"role": "user", "content": "u"}], "", {}),
]


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.mark.parametrize(("record", "prompt", "answer", "meta"), GOOD_RECORDS)
def test_jsonl_records(tmp_path, record, prompt, answer, meta):
    path = write_jsonl(tmp_path / "d.jsonl", [record])
    (sample,) = load_samples(path)
    assert sample == Sample(id=f"{path}:1", prompt=prompt, answer=answer, meta=meta, columns=record)


def test_jsonl_ids_blank_lines_and_rendering(tmp_path, tok):
    path = tmp_path / "d.jsonl"
    path.write_text(
        json.dumps({"id": 17, "prompt": "a", "answer": "b"})
        + "\n\n"
        + json.dumps({"prompt": "c", "answer": "d"})
        + "\n"
    )
    first, second = load_samples(path)
    assert first.id == "17" and second.id == f"{path}:3"  # named by line, blank lines counted
    assert render_prompt(tok, first.prompt) == "a"


def test_jsonl_mixing_plain_and_message_prompts(tmp_path, tok):
    """datasets stores a column of mixed types as JSON: each row keeps its own type."""
    chat = [{"role": "user", "content": "c"}]
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a"}, {"prompt": chat}])
    plain, templated = load_samples(path)
    assert (plain.prompt, templated.prompt) == ("a", chat)
    assert render_prompt(tok, templated.prompt) == (
        "<|im_start|>user\nc<|im_end|>\n<|im_start|>assistant\n"
    )
    # ... but datasets' reader of such files fails on a blank line: the error says so.
    path.write_text(path.read_text().replace("\n", "\n\n", 1))
    with pytest.raises(DataError, match="line 2 is blank: remove the blank lines"):
        load_samples(path)


BAD_RECORDS = [
    # (line text, message fragment)
    ("{not json", "invalid JSON"),
    ("[1, 2]", "expected a JSON object"),
    ('{"answer": "x"}', "missing field 'prompt'"),
    ('{"prompt": "x", "answer": ["a"]}', "'answer' must be a string or a number"),
    ('{"prompt": "x", "answer": true}', "'answer' must be a string or a number"),
    ('{"prompt": "x", "messages": [], "answer": "a"}', "both 'prompt' and 'messages'"),
    ('{"prompt": [], "answer": "a"}', "'prompt' must be a string or a non-empty list"),
    ('{"messages": [{"role": "user"}], "answer": "a"}', "messages[0] needs a string 'content'"),
    ('{"messages": [{"content": "x"}], "answer": "a"}', "messages[0] needs a string 'role'"),
    ('{"messages": [{"role": "assistant", "content": "a"}]}', "no prompt"),
    ('{"prompt": " ", "answer": "a"}', "field 'prompt' is empty"),
    ('{"messages": [{"role": "user", "content": ""}], "answer": "a"}', "'content' is empty"),
    (
        '{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],'
        ' "answer": "a"}',
        "also given",
    ),
]


@pytest.mark.parametrize(("line", "fragment"), BAD_RECORDS)
def test_jsonl_errors_name_file_line_and_field(tmp_path, line, fragment):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"prompt": "ok", "answer": "ok"}) + "\n" + line + "\n")
    with pytest.raises(DataError) as info:
        load_samples(path)
    assert f"{path}:2:" in str(info.value)
    assert fragment in str(info.value)


def test_missing_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="nothing"):
        load_samples(tmp_path / "nothing.jsonl")


def test_saved_dataset(tmp_path, tok):
    rows = [
        {"prompt": "p0", "answer": "a0", "source": "x"},
        {"prompt": "p1", "answer": "a1", "source": "y"},
    ]
    datasets.Dataset.from_list(rows).save_to_disk(tmp_path / "ds")
    samples = load_samples(tmp_path / "ds")
    assert [s.answer for s in samples] == ["a0", "a1"]
    assert samples[1].meta == {"source": "y"}
    assert samples[0].id == f"{tmp_path / 'ds'}:row 0"
    assert samples[1].columns == rows[1]
    assert encode_prompt(tok, samples[0].prompt) == list(b"p0")  # plain: no template


def test_saved_dataset_messages_with_null_columns(tmp_path):
    columns = {
        "messages": [
            [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
            [{"role": "user", "content": "q2"}],
        ],
        "answer": [None, "a2"],  # a dataset has every column in every row
    }
    datasets.Dataset.from_dict(columns).save_to_disk(tmp_path / "ds")
    first, second = load_samples(tmp_path / "ds")
    assert (first.answer, second.answer) == ("a", "a2")
    assert first.prompt == [{"role": "user", "content": "q"}]


def test_saved_dataset_dict_splits(tmp_path):
    one = datasets.Dataset.from_list([{"prompt": "p", "answer": "a"}])
    bad = datasets.Dataset.from_list([{"question": "p", "other": "a"}])
    datasets.DatasetDict({"train": one, "test": bad}).save_to_disk(tmp_path / "dd")
    assert [s.answer for s in load_samples(tmp_path / "dd")] == ["a"]  # "train" by default
    assert [s.answer for s in load_samples(tmp_path / "dd", split="train")] == ["a"]
    with pytest.raises(DataError, match=r"\[test\]:row 0: missing field 'prompt'"):
        load_samples(tmp_path / "dd", split="test")
    with pytest.raises(DataError, match="no split 'dev'; its splits are"):
        load_samples(tmp_path / "dd", split="dev")


def test_directory_that_is_not_a_dataset(tmp_path):
    with pytest.raises(DataError, match="save_to_disk"):
        load_samples(tmp_path)
