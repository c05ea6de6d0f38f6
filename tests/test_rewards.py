"""Rewards: table-driven checks of each built-in (malformed, empty and missing outputs
included) and of the TRL-style weighted, NaN-safe combination with error isolation."""

import logging
import math
import textwrap

import pytest
import torch

from longstraw_core.rewards import (
    RewardError,
    RewardSet,
    contains,
    exact_match,
    extract_answer,
    extract_regex,
    extract_tag,
    format_reward,
    make_format_reward,
    make_numeric_match,
    normalize,
    numeric_match,
    parse_number,
    resolve_reward,
)
from longstraw_core.tasks import Sample
from longstraw_core.tokenizer import load_tokenizer

NAN = math.nan


def S(answer="42", i=0, **meta):  # a short constructor keeps the tables readable
    return Sample(id=f"s{i}", prompt="q", answer=answer, meta=meta)


def one(fn, completion, answer="42", **meta):
    (value,) = fn([completion], [S(answer, **meta)])
    return value


# --------------------------------------------------------------------------- helpers


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("<answer>42</answer>", "42"),
        ("<answer> 4 2 \n</answer>", "4 2"),
        ("<answer>1</answer> then <answer>2</answer>", "2"),
        ("<answer>\nmulti\nline\n</answer>", "multi\nline"),
        ("<answer>42", None),
        ("42</answer>", None),
        ("", None),
    ],
)
def test_extract_tag(text, expected):
    assert extract_tag(text) == expected


@pytest.mark.parametrize(
    ("text", "pattern", "expected"),
    [
        ("Final answer: 7. Final answer: 9", r"Final answer: (\d+)", "9"),
        ("x = 3", r"\d+", "3"),
        ("nothing", r"\d+", None),
    ],
)
def test_extract_regex(text, pattern, expected):
    assert extract_regex(text, pattern) == expected


@pytest.mark.parametrize(
    ("completion", "kw", "expected"),
    [
        ("reasoning <answer>B</answer>", {}, "B"),
        ("  no tag  ", {}, "no tag"),
        ("Answer: C", {"pattern": r"Answer: (\w)"}, "C"),
        ("Answer: C", {"tag": None}, "Answer: C"),
        ([{"role": "assistant", "content": "<answer>D</answer>"}], {}, "D"),
        ([], {}, ""),
        (None, {}, ""),
    ],
)
def test_extract_answer(completion, kw, expected):
    assert extract_answer(completion, **kw) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("42", 42.0),
        ("1,234,567.5", 1234567.5),
        ("-3e-4", -3e-4),
        ("+2.5E3", 2500.0),
        (".5", 0.5),
        ("costs $1,000.", 1000.0),
        ("3 apples and 7 pears", 7.0),
        ("the answer is 42.", 42.0),
        ("1e999", None),
        ("nan", None),
        ("inf", None),
        ("", None),
        ("no digits", None),
    ],
)
def test_parse_number(text, expected):
    assert parse_number(text) == expected


def test_normalize():
    assert normalize("  Hello,\tWORLD!! ") == "hello world"
    assert normalize("5ac1-dec7") == "5ac1 dec7"


# --------------------------------------------------------------------------- built-ins

REWARD_TABLE = [
    # (function, completion, answer, meta, expected)
    (exact_match, "<answer>42</answer>", "42", {}, 1.0),
    (exact_match, "42", "42", {}, 1.0),
    (exact_match, "  42 \n", "42", {}, 1.0),
    (exact_match, "<answer>43</answer>", "42", {}, 0.0),
    (exact_match, "The answer is 42", "42", {}, 0.0),
    (exact_match, "<answer>42", "42", {}, 0.0),  # malformed tag: whole text compared
    (exact_match, "<answer></answer>", "42", {}, 0.0),
    (exact_match, "", "42", {}, 0.0),
    (exact_match, None, "42", {}, 0.0),
    (exact_match, "<answer>Paris</answer>", "paris", {}, 0.0),  # exact is case sensitive
    (exact_match, "<answer>a,  b</answer>", "a, b", {}, 1.0),
    (exact_match, "anything", "", {}, None),  # no reference: not applicable
    (contains, "The pass key is 71432.", "71432", {}, 1.0),
    (contains, "714321", "71432", {}, 0.0),  # whole words only
    (contains, "HELLO,   world!", "hello world", {}, 1.0),
    (contains, "uuid 5AC1-DEC7 found", "5ac1-dec7", {}, 1.0),
    (contains, "<answer>no</answer> 71432", "71432", {}, 0.0),  # the tag's content decides
    (contains, "", "71432", {}, 0.0),
    (contains, None, "71432", {}, 0.0),
    (contains, "<answer>3, 1</answer>", "1, 2, 3", {"answers": ["1", "2", "3"]}, 2 / 3),
    (contains, "x", "", {}, None),
    (numeric_match, "<answer>1,234</answer>", "1234", {}, 1.0),
    (numeric_match, "1.5e3", "1500", {}, 1.0),
    (numeric_match, "-0.5", "-.5", {}, 1.0),
    (numeric_match, "so it is 42.", "42", {}, 1.0),
    (numeric_match, "3 then 7", "7", {}, 1.0),
    (numeric_match, "41.99", "42", {}, 0.0),
    (numeric_match, "no number", "42", {}, 0.0),
    (numeric_match, "", "42", {}, 0.0),
    (numeric_match, "nan", "42", {}, 0.0),
    (numeric_match, "inf", "42", {}, 0.0),
    (numeric_match, "42", "forty-two", {}, None),  # reference not numeric: not applicable
    (make_numeric_match(rel_tol=0.01), "41.9", "42", {}, 1.0),
    (format_reward, "<answer>x</answer>", "", {}, 1.0),
    (format_reward, "thinking... <answer>x</answer> done", "", {}, 1.0),
    (format_reward, "<answer></answer>", "", {}, 0.0),
    (format_reward, "<answer>  </answer>", "", {}, 0.0),
    (format_reward, "<answer>x", "", {}, 0.0),
    (format_reward, "</answer>x<answer>", "", {}, 0.0),
    (format_reward, "<answer>a</answer><answer>b</answer>", "", {}, 0.0),
    (format_reward, "<answer><answer>a</answer>", "", {}, 0.0),
    (format_reward, "", "", {}, 0.0),
    (format_reward, None, "", {}, 0.0),
    (make_format_reward("final"), "<final>1</final>", "", {}, 1.0),
]


@pytest.mark.parametrize(("fn", "completion", "answer", "meta", "expected"), REWARD_TABLE)
def test_builtin_rewards(fn, completion, answer, meta, expected):
    value = one(fn, completion, answer, **meta)
    assert value == (pytest.approx(expected) if expected is not None else None)


def test_rewards_check_lengths():
    with pytest.raises(ValueError):
        exact_match(["a", "b"], [S()])


def test_end_to_end_on_a_task_sample():
    from longstraw_core.tasks import passkey_retrieval

    sample = passkey_retrieval(load_tokenizer(None), 1024, seed=0)
    good = f"I found it. <answer>{sample.answer}</answer>"
    result = RewardSet(["exact_match", "contains", "numeric_match", "format"])(
        [good, "no idea"], [sample, sample]
    )
    assert result.rewards == [4.0, 0.0]


# --------------------------------------------------------------------------- RewardSet


def fixed(name, values):
    def fn(completions, samples):
        return list(values)

    fn.__name__ = name
    return fn


def test_weighted_nansum_matches_trl():
    a = [1.0, None, NAN, 1.0, 0.0]
    b = [0.5, 0.5, None, None, 1.0]
    weights = [2.0, -1.0]
    samples = [S(i=i) for i in range(5)]
    result = RewardSet([fixed("a", a), fixed("b", b)], weights)(["c"] * 5, samples)
    # TRL: None -> NaN, (rewards_per_func * weights).nansum(dim=1)
    t = torch.tensor([[NAN if v is None else v for v in row] for row in zip(a, b, strict=True)])
    trl = (t * torch.tensor(weights)).nansum(dim=1)
    scorable = [0, 1, 3, 4]
    assert [result.rewards[i] for i in scorable] == pytest.approx(trl[scorable].tolist())
    assert result.unscorable == [2]
    assert result.rewards[2] == 0.0  # TRL keeps NaN; the GRPO step needs a finite reward
    assert result.names == ["a", "b"]
    assert math.isnan(result.rewards_per_func[1][0]) and result.rewards_per_func[1][1] == 0.5
    cols = result.columns()
    assert cols["b"][:2] == [0.5, 0.5] and math.isnan(cols["b"][2])
    m = result.metrics()
    assert m["rewards/a/mean"] == pytest.approx(2 / 3)
    assert m["rewards/b/mean"] == pytest.approx(2 / 3)
    assert m["rewards/b/std"] == pytest.approx(torch.tensor([0.5, 0.5, 1.0]).std().item())
    assert m["reward"] == pytest.approx(trl[scorable].mean().item())
    assert m["rewards/unscorable_count"] == 1.0


def test_default_weights_are_one_and_all_finite():
    result = RewardSet([fixed("a", [1, True, 0.25]), fixed("b", [1, 0, None])])(
        ["x"] * 3, [S(i=i) for i in range(3)]
    )
    assert result.rewards == [2.0, 1.0, 0.25]
    assert all(math.isfinite(r) for r in result.rewards)


def test_unscorable_raise():
    rs = RewardSet([fixed("a", [None, 1.0])], unscorable="raise")
    with pytest.raises(RewardError, match=r"samples \['s0'\]"):
        rs(["x", "y"], [S(i=0), S(i=1)])


def boom(completions, samples):
    raise ZeroDivisionError("bad reward")


@pytest.mark.parametrize(
    ("bad", "why"),
    [
        (boom, "bad reward"),
        (fixed("short", [1.0]), "returned 1 rewards for 2"),
        (fixed("text", ["1.0", "0"]), "string"),
        (fixed("junk", [[1], [2]]), "list"),
    ],
)
def test_failing_function_is_isolated_and_logged(caplog, bad, why):
    samples = [S(i=7), S(i=8)]
    rs = RewardSet([bad, fixed("ok", [1.0, 0.0])], [1.0, 3.0])
    with caplog.at_level(logging.ERROR, logger="longstraw_core.rewards"):
        result = rs(["x", "y"], samples)
    assert result.rewards == [3.0, 0.0]
    assert all(math.isnan(row[0]) for row in result.rewards_per_func)
    assert result.failed == {bad.__name__: ["s7", "s8"]}
    assert "s7" in caplog.text and "s8" in caplog.text and why in caplog.text
    assert result.metrics()["rewards/failed_funcs"] == 1.0


def test_failing_function_raises_when_configured():
    rs = RewardSet([boom], raise_errors=True)
    with pytest.raises(RewardError, match=r"'boom' failed on samples \['s1'\]") as info:
        rs(["x"], [S(i=1)])
    assert isinstance(info.value.__cause__, ZeroDivisionError)


def test_infinite_value_becomes_nan_with_a_warning(caplog):
    rs = RewardSet([fixed("a", [math.inf, 1.0]), fixed("b", [1.0, -math.inf])])
    with caplog.at_level(logging.WARNING, logger="longstraw_core.rewards"):
        result = rs(["x", "y"], [S(i=0), S(i=1)])
    assert result.rewards == [1.0, 1.0]
    assert "s0" in caplog.text and "s1" in caplog.text


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"funcs": []}, "at least one"),
        ({"funcs": ["contains"], "weights": [1.0, 2.0]}, "Number of reward weights"),
        ({"funcs": ["contains"], "weights": [NAN]}, "finite"),
        ({"funcs": ["contains"], "unscorable": "nan"}, "unscorable"),
        ({"funcs": ["no_such_reward"]}, "unknown reward"),
    ],
)
def test_reward_set_rejects_bad_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RewardSet(**kwargs)


def test_reward_set_checks_batch_lengths():
    with pytest.raises(ValueError, match="2 completions for 1 samples"):
        RewardSet(["contains"])(["a", "b"], [S()])


# --------------------------------------------------------------------------- resolve_reward


@pytest.mark.parametrize(
    ("spec", "name", "fn"),
    [
        ("exact_match", "exact_match", exact_match),
        ("format", "format", format_reward),
        ("longstraw_core.rewards:contains", "contains", contains),
        ("longstraw_core.rewards.numeric_match", "numeric_match", numeric_match),
        (contains, "contains", contains),
    ],
)
def test_resolve_reward(spec, name, fn):
    assert resolve_reward(spec) == (name, fn)


def test_resolve_custom_reward_from_a_user_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        textwrap.dedent(
            """
            def length_penalty(completions, samples):
                return [-len(c) / 100 for c in completions]
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    name, fn = resolve_reward("my_rewards:length_penalty")
    assert name == "length_penalty" and fn(["ab"], [S()]) == [-0.02]
    assert RewardSet(["my_rewards.length_penalty"])(["abcd"], [S()]).rewards == [-0.04]


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("nodots", "unknown reward"),
        ("no_such_module_xyz:f", "cannot import"),
        ("longstraw_core.rewards:nope", "cannot import"),
        ("longstraw_core.rewards:BUILTIN_REWARDS", "not callable"),
    ],
)
def test_resolve_reward_errors(spec, match):
    with pytest.raises(ValueError, match=match):
        resolve_reward(spec)


@pytest.mark.parametrize(
    ("completion", "answer", "expected"),
    [("12345", "54321", 1.0), ("1 and 3", "123", 2 / 3), ("", "42", 0.0), ("abc", "", None),
     ("7777", "77", 1.0)],
)  # fmt: skip
def test_answer_char_recall(completion, answer, expected):
    from longstraw_core.rewards import answer_char_recall

    sample = Sample(id="s", prompt="p", answer=answer, meta={})
    assert answer_char_recall([completion], [sample]) == [expected]
