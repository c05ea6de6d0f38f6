"""``doc_lookup``: a note hidden in real text (the standard library's docstrings). On length
with the real SmolLM2 tokenizer and the byte tokenizer, the answer in the document at the
requested depth, the document the modules' own text, train and held-out modules disjoint,
deterministic; its rewards (exact match, token F1) on written completions."""

import itertools
import re
from pathlib import Path

import pytest
from real_model import smollm2_dir
from test_tasks import check, parse_doc_note
from transformers import AutoTokenizer

from longstraw_core.config import ConfigError, eval_data, load_config
from longstraw_core.data.tasks import (
    DOC_KINDS,
    STDLIB_MODULES,
    DocumentFiller,
    doc_lookup,
    doc_modules,
    make_task_stream,
    module_split,
    module_text,
    sample_at,
)
from longstraw_core.data.tokenizer import load_tokenizer, render_prompt
from longstraw_core.rewards import BUILTIN_REWARDS, answer_token_f1, exact_match

TINY = Path(__file__).resolve().parents[2] / "configs" / "qwen36" / "tiny_grpo_cpu.yaml"
HELDOUT = (
    "calendar", "cmd", "dis", "enum", "fnmatch", "ftplib", "getpass", "glob", "inspect",
    "pickletools", "pkgutil", "platform", "poplib", "pstats", "shlex", "shutil", "statistics",
    "string", "tabnanny", "types", "unittest.case", "uuid", "zipfile",
)  # fmt: skip


@pytest.fixture(scope="module")
def builtin():
    return load_tokenizer(None)


@pytest.fixture(scope="module")
def smollm2():
    return AutoTokenizer.from_pretrained(smollm2_dir())


def _body(sample) -> str:
    """The document: the prompt's text between the instruction and the question."""
    content = sample.prompt[0]["content"]
    return content[content.index("\n\n") + 2 : content.rindex("\n\n")]


def _note(sample) -> str:
    if sample.meta["kind"] == "quote":
        return sample.answer
    (note,) = re.findall(rf"The [^.\n]* {re.escape(sample.answer)}\.", _body(sample))
    return note


# --------------------------------------------------------------------------- length, depth


@pytest.mark.parametrize("length", [1024, 4096, 8192])
@pytest.mark.parametrize("tok_name", ["smollm2", "builtin"])
def test_on_length_with_the_answer_in_the_document(request, tok_name, length):
    tok = request.getfixturevalue(tok_name)
    for seed, split in enumerate(("train", "heldout", "train")):
        depth = (0.0, 0.5, 1.0)[seed]
        s = doc_lookup(tok, length, depth=depth, seed=seed, split=split)
        check(s, tok, length)  # the parser finds the answer; within 1% of the length
        assert s.meta["target_tokens"] == length and s.meta["split"] == split
        assert s.answer in _body(s) and s.meta["kind"] in DOC_KINDS
        if length >= 4096:
            assert abs(s.meta["needle_depths"][0] - depth) < 0.05
    plain = doc_lookup(tok, length, depth=0.3, seed=7, chat=False)
    assert isinstance(plain.prompt, str) and "<|im_start|>" not in plain.prompt
    check(plain, tok, length)


@pytest.mark.parametrize("depth", [0.1, 0.25, 0.5, 0.75, 0.9])
def test_the_note_sits_at_the_depth_at_a_paragraph_or_sentence_start(smollm2, depth):
    for length in (2048, 8192):
        s = doc_lookup(smollm2, length, depth=depth, seed=3)
        body, note = _body(s), _note(s)
        before = body[: body.index(note)]
        assert before.endswith("\n\n") or re.search(r"[.!?][\"')\]]*[ \n]$", before), before[-80:]
        assert abs(s.meta["needle_depths"][0] - depth) < 0.05
        # the position in the text agrees with the depth the sample records (tokens ~ chars)
        assert abs(len(before) / len(body) - depth) < 0.1


def test_depth_extremes_put_the_note_at_the_ends(smollm2):
    start = doc_lookup(smollm2, 2048, depth=0.0, seed=1)
    end = doc_lookup(smollm2, 2048, depth=1.0, seed=1)
    assert _body(start).startswith(_note(start) + "\n\n# Module ")
    assert _body(end).endswith("\n\n" + _note(end))


# --------------------------------------------------------------------------- the text


def test_the_document_is_the_modules_text_in_the_fillers_order(smollm2):
    for split in ("train", "heldout"):
        s = doc_lookup(smollm2, 4096, depth=0.4, seed=5, split=split)
        without = re.sub(r"\s*" + re.escape(_note(s)), "", _body(s), count=1)
        filler = DocumentFiller(s.meta["seed"], split)
        filler.ensure(1)
        while len("".join(filler.pieces)) < len(without) + 2:
            filler.ensure(len(filler.pieces) + 1)
        text = "\n\n".join(module_text(m) for m in filler.modules)
        assert text.startswith(without)
        assert len(without) > 3 * 4096 * 0.8  # ~4 characters a token, the instruction aside


def test_module_text_is_the_docstrings_under_headings():
    text = module_text("json")
    assert text.startswith("# Module json\n\nJSON (JavaScript Object Notation)")
    assert "\n\n## Function json.dumps\n\nSerialize ``obj`` to a JSON formatted ``str``." in text
    assert "## Class json.decoder.JSONDecoder\n\n" in module_text("json.decoder")
    assert "### Method json.decoder.JSONDecoder.decode\n\n" in module_text("json.decoder")
    assert "_default_decoder" not in text and "\t" not in text and "\n\n\n" not in text
    assert module_text("no_such_module") == ""
    assert all(module_text(m) for m in STDLIB_MODULES)  # every listed source is installed


def test_train_and_heldout_modules_are_disjoint():
    train, heldout = doc_modules("train"), doc_modules("heldout")
    assert heldout == HELDOUT  # a stable hash of the name: the same split on every machine
    assert not set(train) & set(heldout)
    assert sorted(train + heldout) == sorted(STDLIB_MODULES) == list(STDLIB_MODULES)
    assert all(module_split(m) == "heldout" for m in heldout)
    with pytest.raises(ValueError, match="split must be one of"):
        doc_modules("test")


def test_samples_read_only_their_splits_modules(builtin):
    for split in ("train", "heldout"):
        seen = set()
        for index in range(6):
            s = sample_at("doc_lookup", builtin, 8192, seed=2, index=index, split=split)
            seen |= set(re.findall(r"^# Module (\S+)$", _body(s), flags=re.MULTILINE))
        assert seen and seen <= set(doc_modules(split)), seen - set(doc_modules(split))


# --------------------------------------------------------------------------- determinism, options


def test_deterministic_and_resumable(builtin):
    a = sample_at("doc_lookup", builtin, 2048, seed=4, index=3, split="heldout")
    assert a == sample_at("doc_lookup", builtin, 2048, seed=4, index=3, split="heldout")
    stream = make_task_stream("doc_lookup", builtin, 2048, seed=4, split="heldout")
    first = list(itertools.islice(stream, 4))
    assert first[3] == a and [s.meta["index"] for s in first] == [0, 1, 2, 3]
    assert len({s.prompt[0]["content"] for s in first}) == 4
    assert len({s.answer for s in first}) == 4
    other = sample_at("doc_lookup", builtin, 2048, seed=4, index=3, split="train")
    assert _body(other) != _body(a)


def test_kinds_and_distractors(builtin):
    answers = {
        "name": r"[A-Z][a-z]+ [A-Z][a-z]+",
        "number": r"[1-9]\d{4}",
        "colour": r"[a-z]+ [a-z]+",
    }
    for kind, pattern in answers.items():
        s = doc_lookup(builtin, 4096, depth=0.6, seed=8, kinds=kind, num_distractors=3)
        check(s, builtin, 4096)
        assert s.meta["kind"] == s.meta["note"] == kind and re.fullmatch(pattern, s.answer)
        text = render_prompt(builtin, s.prompt)
        assert parse_doc_note(text) == s.answer
        assert len(re.findall(r"(?:reading room is|this reference is) ", text)) == 4
    # quote: the answer is the asked note's whole sentence, among notes of the same kind
    notes = set()
    for seed in range(12):
        s = doc_lookup(builtin, 2048, depth=0.3, seed=seed, kinds=["quote"], num_distractors=2)
        check(s, builtin, 2048)
        assert s.meta["kind"] == "quote" and s.meta["note"] in answers
        assert s.answer.startswith("The ") and s.answer.endswith(".") and s.answer in _body(s)
        assert len(re.findall(r"(?:reading room is|this reference is) ", _body(s))) == 3
        notes.add(s.meta["note"])
    assert notes == set(answers)
    assert {doc_lookup(builtin, 1024, seed=i).meta["kind"] for i in range(24)} == set(DOC_KINDS)
    s = doc_lookup(builtin, 2048, seed=1, kinds=["number"], digits=7)
    assert re.fullmatch(r"[1-9]\d{6}", s.answer)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"split": "test"}, "split must be one of train, heldout"),
        ({"kinds": ["smell"]}, "kinds must be some of name, number, colour, quote"),
        ({"kinds": []}, "kinds must be some of"),
        ({"num_distractors": 99}, "num_distractors must be in"),
        ({"depth": 1.5}, r"depth must be in \[0, 1\]"),
    ],
)
def test_bad_arguments(builtin, kwargs, match):
    with pytest.raises(ValueError, match=match):
        doc_lookup(builtin, 2048, **kwargs)


def test_a_config_takes_the_split_for_its_eval_data():
    cfg = load_config(
        TINY,
        [
            "data.task=doc_lookup",
            "data.prompt_tokens=2048",
            "data.task_kwargs={kinds: [quote], num_distractors: 2}",
            "eval.every=1",
            "eval.samples=2",
            "eval.data={task_kwargs: {kinds: [quote], num_distractors: 2, split: heldout}}",
        ],
    )
    assert cfg.data.task_kwargs == {"kinds": ["quote"], "num_distractors": 2}
    assert eval_data(cfg).task_kwargs == {**cfg.data.task_kwargs, "split": "heldout"}
    with pytest.raises(ConfigError, match="not an argument of task 'doc_lookup'"):
        load_config(TINY, ["data.task=doc_lookup", "data.task_kwargs={splits: heldout}"])


# --------------------------------------------------------------------------- rewards


def test_exact_and_partial_credit_rewards():
    assert BUILTIN_REWARDS["answer_token_f1"] is answer_token_f1
    gold = "Ilse Varga"
    cases = [
        ("<answer>Ilse Varga</answer>", 1.0, 1.0),
        ("The note says <answer> Ilse  Varga </answer>", 1.0, 1.0),
        ("<answer>ilse varga.</answer>", 0.0, 1.0),  # case and punctuation: F1 only
        ("<answer>Varga</answer>", 0.0, 2 / 3),
        ("<answer>The archivist is Ilse Varga</answer>", 0.0, 2 * 2 / (4 + 2)),  # "the" dropped
        ("The archivist who indexed this reference is named Ilse Varga.", 0.0, 2 * 2 / (9 + 2)),
        ("<answer>Marta Okafor</answer>", 0.0, 0.0),
        ("", 0.0, 0.0),
        ([{"role": "assistant", "content": "<answer>Ilse Varga</answer>"}], 1.0, 1.0),
    ]
    completions = [c for c, _, _ in cases]
    golds = [gold] * len(cases)
    assert exact_match(completions=completions, answer=golds) == [e for _, e, _ in cases]
    assert answer_token_f1(completions=completions, answer=golds) == pytest.approx(
        [f for _, _, f in cases]
    )
    assert answer_token_f1(completions=["<answer>48213</answer>", "x"], answer=["48213", ""]) == [
        1.0,
        None,
    ]
    # repeated words count once each: "red red" against "red" is P=1/2, R=1
    assert answer_token_f1(completions=["red red"], answer=["red"]) == [pytest.approx(2 / 3)]
