"""Synthetic tasks: well posed (a simple parser recovers the answer from the prompt text),
on length (within 1% of the requested tokens for the given tokenizer), deterministic."""

import itertools
import random
import re

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from longstraw_core.data import tasks
from longstraw_core.data.tasks import (
    TASKS,
    VaultEnvironment,
    agent_lookup,
    final_answer_match,
    kv_chain,
    make_task_stream,
    multi_needle,
    passkey_retrieval,
    sample_at,
    uuid_retrieval,
    variable_tracking,
)
from longstraw_core.data.tokenizer import count_prompt_tokens, load_tokenizer, render_prompt
from longstraw_core.rewards import sample_columns

# --------------------------------------------------------------------------- tokenizers


def _corpus(n: int = 2000):
    rng = random.Random(0)
    words = tasks.FILLER_WORDS + tasks.KEY_WORDS
    for _ in range(n):
        yield (
            " ".join(rng.choices(words, k=12)).capitalize()
            + f". The key is {rng.randrange(10**6)}. VAR ABCDE = VAR FGHIJ."
        )


@pytest.fixture(scope="module")
def builtin():
    return load_tokenizer(None)


@pytest.fixture(scope="module")
def bpe():
    """A GPT-2-style byte-level BPE with real merges: token counts do not add up per word."""
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1000,
        special_tokens=["</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(_corpus(), trainer)
    return PreTrainedTokenizerFast(tokenizer_object=core, eos_token="</s>", name_or_path="bpe")


@pytest.fixture(scope="module")
def metaspace():
    """A SentencePiece-style BPE ("▁" word marks) that adds a BOS to plain text."""
    core = Tokenizer(models.BPE(unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    core.decoder = decoders.Metaspace(prepend_scheme="first")
    trainer = trainers.BpeTrainer(
        vocab_size=1000, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False
    )
    core.train_from_iterator(_corpus(), trainer)
    core.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", core.token_to_id("<s>"))]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


# --------------------------------------------------------------------------- parsers
# Each reads only the prompt text and must find the reference answer.


def parse_passkey(text: str) -> str:
    (m,) = re.findall(r"The pass key is (\d+)\. Remember it\. (\d+) is the pass key\.", text)
    assert m[0] == m[1]
    return m[0]


def parse_uuid(text: str) -> str:
    (key,) = re.findall(r"What is the special magic uuid for (\S+) mentioned", text)
    (value,) = re.findall(rf"The special magic uuid for {key} is: ([0-9a-f-]{{36}})\.", text)
    return value


def parse_multi(text: str) -> str:
    (key,) = re.findall(r"What are all the special magic numbers for (\S+) mentioned", text)
    return ", ".join(re.findall(rf"One of the special magic numbers for {key} is: (\d+)\.", text))


def parse_kv(text: str) -> str:
    (key,) = re.findall(r"Start at the key (\S+) and follow", text)
    links = dict(re.findall(r"The key (\S+) points to the key (\S+)\.", text))
    values = dict(re.findall(r"The key (\S+) holds the value (\d+)\.", text))
    seen = set()
    while key in links:
        assert key not in seen, "cycle"
        seen.add(key)
        key = links[key]
    return values[key]


def parse_vars(text: str) -> str:
    (target,) = re.findall(r"assigned the value (\d+) in the text", text)
    value_of: dict[str, str] = {}
    holders = []
    for name, rhs in re.findall(r"VAR ([A-Z]{5}) = (VAR [A-Z]{5}|\d+)\.", text):
        value_of[name] = value_of[rhs[4:]] if rhs.startswith("VAR ") else rhs
        if value_of[name] == target:
            holders.append(name)
    return ", ".join(holders)


def parse_agent_key(text: str) -> str:
    """The agent task's parser finds the vault key; its code is the lookup tool's to give."""
    (subject,) = re.findall(r"What is the secret code of the (\w+) record\?", text)
    (key,) = re.findall(
        rf"the {subject} record was stored in the vault under the key (\S+)\.", text
    )
    return key


# doc_lookup: each kind's question (its subject) and note (the subject's value).
DOC_NOTES = (
    (
        r"What is the name of the archivist who (\w+) this reference\?",
        r"The archivist who {} this reference is named ([A-Z][a-z]+ [A-Z][a-z]+)\.",
    ),
    (r"What is the ([a-z]+ number) of this reference\?", r"The {} of this reference is (\d+)\."),
    (
        r"What colour is the (\w+) in the reading room\?",
        r"The {} in the reading room is ([a-z]+ [a-z]+)\.",
    ),
)


def parse_doc_note(text: str) -> str:
    """The asked note's value, or its whole sentence when the question asks for a quote."""
    (found,) = [
        (re.escape(subject), note)
        for question, note in DOC_NOTES
        for subject in re.findall(question, text)
    ]
    (match,) = re.finditer(found[1].format(found[0]), text)
    quote = "Answer with the sentence of the text that says it, word for word." in text
    return match.group(0) if quote else match.group(1)


PARSERS = {
    "agent_lookup": parse_agent_key,
    "doc_lookup": parse_doc_note,
    "passkey_retrieval": parse_passkey,
    "uuid_retrieval": parse_uuid,
    "multi_needle": parse_multi,
    "kv_chain": parse_kv,
    "variable_tracking": parse_vars,
}


def check(sample, tokenizer, target):
    text = render_prompt(tokenizer, sample.prompt)
    found = PARSERS[sample.meta["task"]](text)
    if sample.meta["task"] == "agent_lookup":  # the key: the code is only the tool's
        assert sample.answer not in text
        vault = VaultEnvironment()
        vault.reset(**sample_columns(sample))  # TRL's reset(**row)
        found = vault.lookup(found)
    assert found == sample.answer
    n = count_prompt_tokens(tokenizer, sample.prompt)
    assert n == sample.meta["prompt_tokens"]
    assert abs(n - target) <= 0.01 * target, (n, target)


# --------------------------------------------------------------------------- tests


def test_registry_lists_every_generator():
    assert set(TASKS) == set(PARSERS)


@pytest.mark.parametrize("depth", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("length", [2048, 16384])
@pytest.mark.parametrize("name", sorted(TASKS))
def test_answer_recoverable_and_length_within_1pct(builtin, name, length, depth):
    sample = TASKS[name](builtin, length, depth=depth, seed=11)
    check(sample, builtin, length)
    assert sample.meta["target_tokens"] == length
    # The first needle(s) are the queried ones; they sit near the requested depth.
    assert abs(sample.meta["needle_depths"][0] - depth) < 0.05


@pytest.mark.parametrize("name", sorted(TASKS))
@pytest.mark.parametrize("tok_name", ["bpe", "metaspace"])
def test_other_tokenizers_plain_text(request, name, tok_name):
    tok = request.getfixturevalue(tok_name)
    for length in (2048, 16384):
        sample = TASKS[name](tok, length, depth=0.3, seed=5, chat=False)
        assert isinstance(sample.prompt, str)
        check(sample, tok, length)


@pytest.mark.parametrize("tok_name", ["builtin", "bpe"])
def test_128k_prompt(request, tok_name):
    tok = request.getfixturevalue(tok_name)
    sample = passkey_retrieval(tok, 131_072, depth=0.75, seed=3)
    check(sample, tok, 131_072)
    assert abs(sample.meta["needle_depths"][0] - 0.75) < 0.01


def test_depth_extremes_put_the_needle_at_the_ends(builtin):
    needle = "The pass key is"
    start = passkey_retrieval(builtin, 4096, depth=0.0, seed=1).prompt[0]["content"]
    end = passkey_retrieval(builtin, 4096, depth=1.0, seed=1).prompt[0]["content"]
    assert start.split("\n\n")[1].startswith(needle)
    body = end.split("\n\n")[1]
    assert body.endswith("is the pass key.") and needle in body[-100:]


def test_chat_prompt_uses_template_and_plain_prompt_does_not(builtin):
    chat = passkey_retrieval(builtin, 2048, seed=2)
    plain = passkey_retrieval(builtin, 2048, seed=2, chat=False)
    assert chat.prompt[0]["role"] == "user"
    assert render_prompt(builtin, chat.prompt).startswith("<|im_start|>user\n")
    assert isinstance(plain.prompt, str) and "<|im_start|>" not in plain.prompt
    assert count_prompt_tokens(builtin, plain.prompt) == len(plain.prompt.encode())  # bytes
    assert chat.answer == plain.answer


def test_target_below_the_bare_prompt_but_within_tolerance(builtin):
    bare = passkey_retrieval(builtin, 280, tolerance=0.05, seed=1)  # no room for filler
    body = bare.prompt[0]["content"].split("\n\n")[1]
    assert body == f"The pass key is {bare.answer}. Remember it. {bare.answer} is the pass key."
    assert abs(bare.meta["prompt_tokens"] - 280) <= 0.05 * 280


@pytest.mark.parametrize("name", sorted(TASKS))
def test_deterministic_from_seed(builtin, name):
    a, b = (TASKS[name](builtin, 3000, depth=0.4, seed=9) for _ in range(2))
    assert a == b
    c = TASKS[name](builtin, 3000, depth=0.4, seed=10)
    assert c.answer != a.answer and c.prompt != a.prompt


def test_task_options(builtin):
    s = passkey_retrieval(builtin, 2048, digits=8, seed=1)
    assert re.fullmatch(r"[1-9]\d{7}", s.answer)
    s = multi_needle(builtin, 4096, depth=[0.9, 0.1, 0.5], num_needles=3, seed=1)
    check(s, builtin, 4096)
    assert len(s.meta["answers"]) == 3
    # answers come in order of appearance, not of the depth list
    assert s.meta["answers"] == sorted(
        s.meta["answers"], key=lambda v: s.prompt[0]["content"].index(v)
    )
    s = multi_needle(builtin, 4096, seed=1)  # depth=None spreads the needles over 0..1
    assert s.meta["needle_depths"][:4] == pytest.approx([0, 1 / 3, 2 / 3, 1], abs=0.05)
    s = kv_chain(builtin, 4096, depth=[0.1, 0.3, 0.5, 0.7, 0.9], hops=4, seed=1)
    check(s, builtin, 4096)
    assert len(s.meta["chain"]) == 5
    s = variable_tracking(builtin, 4096, depth=[0.8, 0.2, 0.5], hops=2, num_chains=3, seed=1)
    check(s, builtin, 4096)
    assert len(s.meta["answers"]) == 3
    s = uuid_retrieval(builtin, 2048, num_distractors=0, seed=1)
    check(s, builtin, 2048)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda t: passkey_retrieval(t, 50), "too small"),
        (lambda t: passkey_retrieval(t, 0), "positive int"),
        (lambda t: passkey_retrieval(t, 2048, depth=1.5), r"depth must be in \[0, 1\]"),
        (lambda t: multi_needle(t, 2048, depth=[0.1, 0.2]), "expected 4"),
        (lambda t: kv_chain(t, 2048, hops=0), "hops must be >= 1"),
        (lambda t: multi_needle(t, 2048, num_needles=0), "num_needles"),
    ],
)
def test_bad_arguments(builtin, call, match):
    with pytest.raises(ValueError, match=match):
        call(builtin)


def test_stream_is_resumable(builtin):
    kw = {"hops": 2, "num_distractor_chains": 1}
    stream = make_task_stream("kv_chain", builtin, 1024, seed=4, **kw)
    first = list(itertools.islice(stream, 4))
    resumed = next(make_task_stream("kv_chain", builtin, 1024, seed=4, start=2, **kw))
    assert resumed == first[2] == sample_at("kv_chain", builtin, 1024, 4, 2, **kw)
    assert [s.meta["index"] for s in first] == [0, 1, 2, 3]
    assert len({s.id for s in first}) == 4 and len({s.answer for s in first}) == 4
    for s in first:
        check(s, builtin, 1024)
    other_seed = next(make_task_stream("kv_chain", builtin, 1024, seed=5, **kw))
    assert other_seed.prompt != first[0].prompt


def test_unknown_task(builtin):
    with pytest.raises(KeyError, match="unknown task"):
        next(make_task_stream("nope", builtin, 1024))


def test_filler_cannot_be_mistaken_for_needles():
    words = set(tasks.FILLER_WORDS)
    assert all(w.isalpha() and w.islower() for w in words)
    assert not words & set(tasks.KEY_WORDS)
    assert not words & {"key", "pass", "var", "value", "uuid", "magic", "special", "holds"}


# --------------------------------------------------------------------------- the agent task


def test_agent_lookup_needs_the_tool_and_rewards_only_the_final_answer(builtin):
    s = agent_lookup(builtin, 4096, depth=0.2, seed=3, num_distractors=5)
    check(s, builtin, 4096)
    vault, key = s.meta["vault"], s.meta["key"]
    assert len(vault) == 6 and vault[key] == s.answer
    text = s.prompt[0]["content"]
    assert all(k in text and code not in text for k, code in vault.items())
    env = VaultEnvironment()
    assert env.reset(**sample_columns(s)) is None  # no observation: the prompt is complete
    assert env.get_reward() == 0.0
    other = next(k for k in vault if k != key)
    assert env.lookup(other) == vault[other] and env.get_reward() == 0.0
    with pytest.raises(KeyError, match="no record"):
        env.lookup("no-such-key")
    assert env.lookup(f" {key} ") == s.answer and env.get_reward() == 1.0
    env.reset(**sample_columns(s))
    assert env.get_reward() == 0.0  # reset clears the branch's calls

    call = {"role": "assistant", "content": "", "tool_calls": [{"type": "function"}]}
    result = {"role": "tool", "name": "lookup", "content": s.answer}
    answered = [call, result, {"role": "assistant", "content": f"<answer> {s.answer} </answer>"}]
    completions = [
        answered,
        [call, result],  # ended on the tool's result: the code is there, but not answered
        [call, result, {"role": "assistant", "content": s.answer}],  # no tags
        [call, result, {"role": "assistant", "content": "<answer>123</answer>"}],
        f"<answer>{s.answer}</answer>",  # a plain-text completion
    ]
    scores = final_answer_match(completions, [s.answer] * 5)
    assert scores == [1.0, 0.0, 0.0, 0.0, 1.0]
    assert final_answer_match([answered], [""]) == [None]


def test_agent_lookup_in_the_registry_and_deterministic(builtin):
    a = sample_at("agent_lookup", builtin, 2048, seed=1, index=4)
    assert a == sample_at("agent_lookup", builtin, 2048, seed=1, index=4)
    assert a.meta["subject"] in a.prompt[0]["content"]
    with pytest.raises(ValueError, match="num_distractors"):
        agent_lookup(builtin, 2048, num_distractors=99)


class _NineTokenPieces:
    """Filler whose pieces are 9 tokens each under the byte tokenizer (a space and 8 bytes):
    most targets then cannot be met exactly."""

    separator = " "

    def __init__(self, seed: int) -> None:
        self.pieces: list[str] = []
        self.boundaries: list[int] = [0]

    def ensure(self, n_pieces: int) -> None:
        while len(self.pieces) < n_pieces:
            self.pieces.append(" meadowsx")
            self.boundaries.append(len(self.pieces))


def test_a_short_prompt_fits_within_a_few_tokens_where_one_percent_is_less_than_a_piece(builtin):
    """At a few hundred tokens 1% is under one piece of filler (real text's words can be
    several tokens): a fit within ``MIN_SLACK_TOKENS`` is accepted, and the config's position
    check counts that slack (``longest_prompt``)."""
    from longstraw_core.data.tasks.haystack import MIN_SLACK_TOKENS, fit_prompt, longest_prompt

    misses = []
    for target in range(200, 209):  # every residue modulo the 9-token piece
        _, got, _ = fit_prompt(
            builtin,
            "test",
            "Read this.",
            "What?",
            [(0.5, "The key is here.")],
            target,
            seed=0,
            chat=False,
            tolerance=0.01,
            filler=_NineTokenPieces,
        )
        assert abs(got - target) <= MIN_SLACK_TOKENS, (target, got)
        misses.append(abs(got - target))
    assert max(misses) > 0.01 * 208  # the slack was needed: 1% alone would have refused
    assert longest_prompt(256, 0.01) == 256 + MIN_SLACK_TOKENS
    assert longest_prompt(10_000, 0.01) == 10_100
