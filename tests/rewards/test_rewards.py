"""Rewards in TRL's convention.

Table-driven checks of each built-in (malformed, empty and missing outputs included); the
weighted, NaN-aware combination with error isolation; and, against a real TRL 1.16
``GRPOTrainer`` on a tiny model, that every kind of reward function (TRL's own, and user
functions of every signature style, sync and async) receives exactly the arguments TRL
passes it, and that rows no function could score get TRL's advantages and metrics.
"""

import asyncio
import functools
import logging
import math
import textwrap
import threading
import time
from collections import defaultdict
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from transformers import TrainerState
from trl import GRPOConfig as TRLGRPOConfig
from trl import GRPOTrainer
from trl.data_utils import is_conversational as trl_is_conversational
from trl.rewards import (
    get_repetition_penalty_reward,
    get_soft_overlong_punishment,
    think_format_reward,
)
from trl.trainer.utils import is_async_callable as trl_is_async_callable

from longstraw_core import rewards
from longstraw_core.config import ConfigError, load_config
from longstraw_core.data.samples import record_to_sample
from longstraw_core.data.tasks import Sample
from longstraw_core.data.tokenizer import load_tokenizer
from longstraw_core.grpo.losses import group_advantages
from longstraw_core.metrics import names
from longstraw_core.models.tiny import tiny_model
from longstraw_core.rewards import (
    DEFAULT_TIMEOUT_SECONDS,
    RewardError,
    RewardResult,
    RewardSet,
    completion_text,
    contains,
    exact_match,
    extract_answer,
    extract_regex,
    extract_tag,
    format_reward,
    is_async_callable,
    is_conversational,
    make_format_reward,
    make_numeric_match,
    normalize,
    numeric_match,
    parse_number,
    resolve_reward,
    sample_columns,
)
from longstraw_core.training.tracking import MAX_CELL_CHARS, completion_rows

NAN = math.nan
TINY = Path(__file__).resolve().parents[2] / "configs" / "qwen36" / "tiny_grpo_cpu.yaml"


def S(answer="42", i=0, prompt="q", **meta):  # a short constructor keeps the tables readable
    return Sample(id=f"s{i}", prompt=prompt, answer=answer, meta=meta)


def ids_for(n):
    return [[1, 2]] * n


def nan_equal(a, b, tol=1e-6):
    assert len(a) == len(b), (a, b)
    for x, y in zip(a, b, strict=True):
        assert (math.isnan(x) and math.isnan(y)) or x == pytest.approx(y, rel=tol, abs=tol), (a, b)


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
    """Called as TRL calls it: keywords, the reference in the ``answer`` column."""
    columns = {key: [value] for key, value in meta.items()}
    (value,) = fn(
        prompts=["q"], completions=[completion], completion_ids=[[1]], answer=[answer],
        **columns, trainer_state=TrainerState(), log_extra=print, log_metric=print,
    )  # fmt: skip
    assert value == (pytest.approx(expected) if expected is not None else None)


def test_rewards_check_lengths():
    with pytest.raises(ValueError):
        exact_match(completions=["a", "b"], answer=["42"])


def test_end_to_end_on_a_task_sample():
    from longstraw_core.data.tasks import passkey_retrieval

    sample = passkey_retrieval(load_tokenizer(None), 1024, seed=0)
    good = f"I found it. <answer>{sample.answer}</answer>"
    result = RewardSet(["exact_match", "contains", "numeric_match", "format"])(
        [good, "no idea"], [sample, sample], completion_ids=ids_for(2)
    )
    assert result.rewards == [4.0, 0.0]
    # A chat prompt: the completions are the assistant messages TRL builds.
    assert result.completions[0] == [{"role": "assistant", "content": good}]


# --------------------------------------------------------------------------- RewardSet


def fixed(name, values):
    def fn(completions, **kwargs):
        return list(values)

    fn.__name__ = name
    return fn


def test_weighted_nansum_matches_trl():
    a = [1.0, None, NAN, 1.0, 0.0]
    b = [0.5, 0.5, None, None, 1.0]
    weights = [2.0, -1.0]
    samples = [S(i=i) for i in range(5)]
    result = RewardSet([fixed("a", a), fixed("b", b)], weights)(
        ["c"] * 5, samples, completion_ids=ids_for(5)
    )
    # TRL (_generate_and_score_completions): None -> NaN, (rewards_per_func * weights)
    # .nansum(dim=1), then rewards[unscorable_mask] = NaN for rows where all are NaN.
    t = torch.tensor([[NAN if v is None else v for v in row] for row in zip(a, b, strict=True)])
    trl = (t * torch.tensor(weights)).nansum(dim=1)
    trl[torch.isnan(t).all(dim=1)] = NAN
    nan_equal(result.rewards, trl.tolist())
    assert result.unscorable == [2] and math.isnan(result.rewards[2])
    assert result.names == ["a", "b"]
    assert math.isnan(result.rewards_per_func[1][0]) and result.rewards_per_func[1][1] == 0.5
    cols = result.columns()
    assert cols["b"][:2] == [0.5, 0.5] and math.isnan(cols["b"][2])
    m = result.metrics()
    assert m["rewards/a/mean"] == pytest.approx(2 / 3)
    assert m["rewards/b/mean"] == pytest.approx(2 / 3)
    assert m["rewards/b/std"] == pytest.approx(torch.tensor([0.5, 0.5, 1.0]).std().item())
    assert m[names.REWARD] == pytest.approx(torch.nanmean(trl).item())
    assert m[names.REWARD_UNSCORABLE_COUNT] == 1.0 and m[names.FRAC_REWARD_ZERO_STD] == 0.0


def test_default_weights_are_one():
    result = RewardSet([fixed("a", [1, True, 0.25]), fixed("b", [1, 0, None])])(
        ["x"] * 3, [S(i=i) for i in range(3)], completion_ids=ids_for(3)
    )
    assert result.rewards == [2.0, 1.0, 0.25]


def test_unscorable_rows_stay_nan_or_raise(caplog):
    samples = [S(i=0), S(i=1)]
    with caplog.at_level(logging.WARNING, logger="longstraw_core.rewards"):
        result = RewardSet([fixed("a", [None, 1.0])])(
            ["x", "y"], samples, completion_ids=ids_for(2)
        )
    assert math.isnan(result.rewards[0]) and result.rewards[1] == 1.0
    assert "rows [0] (samples ['s0'])" in caplog.text and "zero advantage" in caplog.text
    rs = RewardSet([fixed("a", [None, 1.0])], unscorable="raise")
    with pytest.raises(RewardError, match=r"samples \['s0'\]"):
        rs(["x", "y"], samples, completion_ids=ids_for(2))


def boom(completions, **kwargs):
    raise ZeroDivisionError("bad reward")


async def async_boom(completions, **kwargs):
    raise ZeroDivisionError("bad async reward")


@pytest.mark.parametrize(
    ("bad", "why"),
    [
        (boom, "bad reward"),
        (async_boom, "bad async reward"),
        (fixed("short", [1.0]), "returned 1 rewards for 2"),
        (fixed("text", ["1.0", "0"]), "string"),
        (fixed("junk", [[1], [2]]), "list"),
    ],
)
def test_failing_function_is_isolated_and_logged(caplog, bad, why):
    samples = [S(i=7), S(i=8)]
    rs = RewardSet([bad, fixed("ok", [1.0, 0.0])], [1.0, 3.0])
    with caplog.at_level(logging.ERROR, logger="longstraw_core.rewards"):
        result = rs(["x", "y"], samples, completion_ids=ids_for(2))
    assert result.rewards == [3.0, 0.0]
    assert all(math.isnan(row[0]) for row in result.rewards_per_func)
    assert result.failed == {bad.__name__: ["s7", "s8"]}
    assert "s7" in caplog.text and "s8" in caplog.text and why in caplog.text
    assert result.metrics()[names.REWARD_FAILED_FUNCS] == 1.0


def test_failing_function_raises_when_configured():
    rs = RewardSet([boom], raise_errors=True)
    with pytest.raises(RewardError, match=r"'boom' failed on samples \['s1'\]") as info:
        rs(["x"], [S(i=1)], completion_ids=ids_for(1))
    assert isinstance(info.value.__cause__, ZeroDivisionError)


def test_failures_are_one_line_per_function_and_step_with_the_count_and_distinct_ids(caplog):
    """Two groups of one step (each a sample repeated 4 times): one line per failing
    function when the step reports, its count over the step, each sample id once, its
    distinct errors; an infinite value is tallied the same way. Nothing logged before."""
    calls = iter([ZeroDivisionError("first"), ValueError("second")])

    def flaky(completions, **kwargs):
        raise next(calls)

    functions = [flaky, boom, fixed("inf", [math.inf, 1.0, 1.0, 1.0]), fixed("ok", [1.0] * 4)]
    rs = RewardSet(functions, report_each_call=False)
    with caplog.at_level(logging.WARNING, logger="longstraw_core.rewards"):
        for i in (1, 2):
            rs(["x"] * 4, [S(i=i)] * 4, completion_ids=ids_for(4))
        assert caplog.records == []
        lines = rs.report_failures("step 3")
    assert [r.getMessage() for r in caplog.records] == lines
    assert lines == [
        "step 3: reward function 'flaky' failed on 8 of 8 completions (samples 's1', 's2'): "
        "ZeroDivisionError('first') (and 1 other error)",
        "step 3: reward function 'boom' failed on 8 of 8 completions (samples 's1', 's2'): "
        "ZeroDivisionError('bad reward')",
        "step 3: reward function 'inf' gave an infinite value for 2 of 8 completions (samples "
        "'s1', 's2'); used as NaN",
    ]
    assert rs.report_failures("step 4") == []  # the tally restarts


class Hangs:
    """A sync reward that blocks until released (a hung judge); counts its calls."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.calls = 0
        self.__name__ = "hangs"

    def __call__(self, completions, **kwargs):
        self.calls += 1
        self.release.wait(60)
        return [1.0] * len(completions)


def test_a_sync_reward_past_its_timeout_fails_that_call_and_is_not_called_while_it_hangs(caplog):
    hangs = Hangs()
    rs = RewardSet([hangs, fixed("ok", [1.0, 0.0])], timeouts=[0.5, None])
    try:
        started = time.monotonic()
        with caplog.at_level(logging.ERROR, logger="longstraw_core.rewards"):
            result = rs(["x", "y"], [S(i=1), S(i=2)], completion_ids=ids_for(2))
        assert time.monotonic() - started < 5  # not the 60 s the call would take
        assert result.failed == {"hangs": ["s1", "s2"]} and result.rewards == [1.0, 0.0]
        assert "took longer than its timeout of 0.5 s" in caplog.text
        # Still hung: the next batch fails at once, without a second call piling up.
        again = rs(["x", "y"], [S(i=3), S(i=4)], completion_ids=ids_for(2))
        assert again.failed == {"hangs": ["s3", "s4"]} and hangs.calls == 1
        assert "still running" in caplog.text
    finally:
        hangs.release.set()
    for _ in range(100):  # the abandoned call returns; the function is called again
        if not rs._lingering[0].is_alive():
            break
        time.sleep(0.05)
    result = rs(["x", "y"], [S(i=5), S(i=6)], completion_ids=ids_for(2))
    assert result.failed == {} and result.rewards == [2.0, 1.0] and hangs.calls == 2


def test_a_timeout_raises_with_raise_errors_and_defaults_to_ten_minutes():
    assert DEFAULT_TIMEOUT_SECONDS == 600.0
    assert RewardSet([boom]).timeouts == [600.0]
    hangs = Hangs()
    try:
        rs = RewardSet([hangs], raise_errors=True, timeouts=0.2)
        with pytest.raises(RewardError, match=r"'hangs' failed .*longer than its timeout"):
            rs(["x"], [S(i=1)], completion_ids=ids_for(1))
    finally:
        hangs.release.set()
    with pytest.raises(ValueError, match="timeouts"):
        RewardSet([boom], timeouts=[0])


async def async_sleeps(completions, **kwargs):
    await asyncio.sleep(60)
    return [1.0] * len(completions)


async def async_blocks_its_loop(completions, **kwargs):
    time.sleep(1.5)  # never awaits: the event loop itself is stuck
    return [1.0] * len(completions)


async def async_own_timeout(completions, **kwargs):
    raise TimeoutError("the judge's HTTP client gave up")


async def async_quick(completions, **kwargs):
    await asyncio.sleep(0)
    return [0.5] * len(completions)


def test_async_rewards_past_their_timeout_fail_and_a_blocked_loop_is_replaced(caplog, monkeypatch):
    rs = RewardSet([async_sleeps, async_own_timeout, fixed("ok", [1.0])], timeouts=0.3)
    started = time.monotonic()
    with caplog.at_level(logging.ERROR, logger="longstraw_core.rewards"):
        result = rs(["x"], [S(i=1)], completion_ids=ids_for(1))
    assert time.monotonic() - started < 5
    assert set(result.failed) == {"async_sleeps", "async_own_timeout"}
    assert "took longer than its timeout of 0.3 s" in caplog.text
    assert "the judge's HTTP client gave up" in caplog.text  # its own error, as it was
    monkeypatch.setattr(rewards.reward_set, "LOOP_GRACE_SECONDS", 0.3)
    blocked = RewardSet([async_blocks_its_loop, async_quick], timeouts=0.2)
    first_loop = blocked._loop
    result = blocked(["x"], [S(i=2)], completion_ids=ids_for(1))
    assert set(result.failed) == {"async_blocks_its_loop", "async_quick"}
    assert "event loop was blocked" in caplog.text
    assert blocked._loop is not first_loop  # later calls get a fresh loop
    first_loop.thread.join(5)  # the abandoned loop finishes its sleep and stops
    assert not first_loop.thread.is_alive()
    blocked.funcs[0] = async_quick
    assert blocked(["x"], [S(i=3)], completion_ids=ids_for(1)).rewards == [1.0]


def exits(completions, **kwargs):
    raise SystemExit(0)


def interrupts(completions, **kwargs):
    raise KeyboardInterrupt


async def async_exits(completions, **kwargs):
    raise SystemExit(3)


@pytest.mark.parametrize("timeouts", [None, 5.0], ids=["in-this-thread", "in-a-worker"])
def test_keyboard_interrupt_in_a_reward_stops_naming_it(timeouts):
    rs = RewardSet([fixed("ok", [1.0]), interrupts], timeouts=timeouts)
    with pytest.raises(RewardError) as info:
        rs(["x"], [S(i=1)], completion_ids=ids_for(1))
    message = str(info.value)
    assert "reward function 'interrupts' raised" in message and "\n" not in message
    assert "ends the run" in message


@pytest.mark.parametrize("timeouts", [None, 5.0], ids=["in-this-thread", "in-a-worker"])
@pytest.mark.parametrize("exiting", [exits, async_exits])
def test_system_exit_in_a_reward_is_that_functions_failure_as_in_a_tool(exiting, timeouts):
    rs = RewardSet([fixed("ok", [1.0]), exiting], timeouts=timeouts)
    result = rs(["x"], [S(i=1)], completion_ids=ids_for(1))
    assert result.failed == {exiting.__name__: ["s1"]}
    assert result.rewards == [1.0]  # the other function's value stands


def test_infinite_value_becomes_nan_with_a_warning(caplog):
    rs = RewardSet([fixed("a", [math.inf, 1.0]), fixed("b", [1.0, -math.inf])])
    with caplog.at_level(logging.WARNING, logger="longstraw_core.rewards"):
        result = rs(["x", "y"], [S(i=0), S(i=1)], completion_ids=ids_for(2))
    assert result.rewards == [1.0, 1.0]
    assert "s0" in caplog.text and "s1" in caplog.text


def legacy(completions, samples):  # LongStraw's former convention
    return [0.0] * len(completions)


def positional_only(completions, /, **kwargs):
    return [0.0] * len(completions)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"funcs": []}, "at least one"),
        ({"funcs": ["contains"], "weights": [1.0, 2.0]}, "Number of reward weights"),
        ({"funcs": ["contains"], "weights": [NAN]}, "finite"),
        ({"funcs": ["contains"], "unscorable": "zero"}, "unscorable"),
        ({"funcs": ["no_such_reward"]}, "unknown reward"),
        ({"funcs": [legacy]}, "'legacy' does not accept 'prompts', 'completion_ids'"),
        ({"funcs": [positional_only]}, "'completions' by position only"),
    ],
)
def test_reward_set_rejects_bad_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RewardSet(**kwargs)


def test_reward_set_checks_batch_lengths():
    with pytest.raises(ValueError, match="2 completions, 1 samples and 2 completion_ids"):
        RewardSet(["contains"])(["a", "b"], [S()], completion_ids=ids_for(2))


CALLED: list[str] = []


def needs_solution(completions, solution, **kwargs):
    CALLED.append("needs_solution")
    return [1.0] * len(completions)


def harmless(completions, **kwargs):
    CALLED.append("harmless")
    return [1.0] * len(completions)


def test_a_call_the_signature_cannot_bind_is_refused_before_any_function_runs():
    CALLED.clear()
    rs = RewardSet([harmless, needs_solution])
    with pytest.raises(RewardError, match=r"'needs_solution' needs 'solution'.*column of the data"):
        rs(["x"], [S(i=0, task="t")], completion_ids=ids_for(1))
    assert CALLED == []  # not even the function that could have run
    rs(["x"], [S(i=0, solution="7")], completion_ids=ids_for(1))
    assert CALLED == ["harmless", "needs_solution"]


def test_columns_come_from_the_sample_and_must_agree_within_a_batch():
    sample = S("7", i=0, solution="7", level=3, completion="dropped", prompt="p")
    assert sample_columns(sample) == {"answer": "7", "solution": "7", "level": 3}
    with pytest.raises(RewardError, match="same columns"):
        RewardSet([harmless])(["x", "y"], [sample, S(i=1)], completion_ids=ids_for(2))
    with pytest.raises(RewardError, match="'completions', which TRL passes"):
        RewardSet([harmless])(["x"], [S(completions="oops")], completion_ids=ids_for(1))


def test_log_extra_and_log_metric_reach_the_table_and_the_metrics():
    def judged(completions, answer, log_extra, log_metric, **kwargs):
        log_extra("verdict", [f"ok {a}" for a in answer])
        log_metric("judge/calls", 1.0)
        log_metric("judge/calls", 3.0)
        return [1.0, None]

    long_prompt = "x" * 10_000
    samples = [S("1", i=0, prompt=long_prompt), S("2", i=1, prompt=long_prompt)]
    scored = RewardSet([judged])(["a", "b"], samples, completion_ids=ids_for(2))
    assert scored.extra_columns == {"verdict": ["ok 1", "ok 2"]}
    assert scored.metrics()["judge/calls"] == 2.0
    rows = completion_rows(scored, [0.5, 0.0], sample="s")
    assert list(rows[0]) == [
        "sample", "prompt", "completion", "judged", "reward", "verdict", "advantage",
    ]  # fmt: skip
    assert len(rows[0]["prompt"]) < MAX_CELL_CHARS + 100 < len(long_prompt)
    assert rows[0]["prompt"].startswith("xxx") and "characters ..." in rows[0]["prompt"]
    assert rows[1]["completion"] == "b" and rows[1]["verdict"] == "ok 2"
    assert math.isnan(rows[1]["judged"]) and rows[1]["advantage"] == 0.0


def test_chat_completions_are_shown_as_text_in_the_table():
    sample = S(prompt=[{"role": "user", "content": "hi"}])
    scored = RewardSet([harmless])(["<answer>1</answer>"], [sample], completion_ids=ids_for(1))
    (row,) = completion_rows(scored, [0.0])
    assert row["prompt"] == "user: hi" and row["completion"] == "assistant: <answer>1</answer>"


# --------------------------------------------------------------------------- resolve_reward


@pytest.mark.parametrize(
    ("spec", "name", "fn"),
    [
        ("exact_match", "exact_match", exact_match),
        ("format", "format", format_reward),
        ("longstraw_core.rewards:contains", "contains", contains),
        ("longstraw_core.rewards.numeric_match", "numeric_match", numeric_match),
        (contains, "contains", contains),
        ("trl.rewards:think_format_reward", "think_format_reward", think_format_reward),
    ],
)
def test_resolve_reward(spec, name, fn):
    assert resolve_reward(spec) == (name, fn)


def test_resolve_custom_reward_from_a_user_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        textwrap.dedent(
            """
            def length_penalty(completions, **kwargs):
                return [-len(c) / 100 for c in completions]
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    name, fn = resolve_reward("my_rewards:length_penalty")
    assert name == "length_penalty" and fn(completions=["ab"]) == [-0.02]
    scored = RewardSet(["my_rewards.length_penalty"])(["abcd"], [S()], completion_ids=ids_for(1))
    assert scored.rewards == [-0.04]


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


def test_a_mistyped_builtin_reward_name_gets_a_did_you_mean():
    with pytest.raises(
        ValueError, match=r"unknown reward 'exact_macth': did you mean 'exact_match'\?"
    ):
        resolve_reward("exact_macth")
    with pytest.raises(ValueError, match="unknown reward") as far_off:
        resolve_reward("nodots")
    assert "did you mean" not in str(far_off.value)  # no guess where nothing is close


@pytest.mark.parametrize(
    ("completion", "answer", "expected"),
    [("12345", "54321", 1.0), ("1 and 3", "123", 2 / 3), ("", "42", 0.0), ("abc", "", None),
     ("7777", "77", 1.0)],
)  # fmt: skip
def test_answer_char_recall(completion, answer, expected):
    from longstraw_core.rewards import answer_char_recall

    assert answer_char_recall(completions=[completion], answer=[answer]) == [expected]


# --------------------------------------------------------------------------- config load


def _user_module(tmp_path, monkeypatch, source):
    (tmp_path / "user_rewards.py").write_text(textwrap.dedent(source))
    monkeypatch.syspath_prepend(str(tmp_path))


USER_REWARDS = """
    def legacy(completions, samples):
        return [0.0] * len(completions)

    def by_position(completions, /, **kwargs):
        return [0.0] * len(completions)

    def no_kwargs(completions, answer):
        return [0.0] * len(completions)

    def with_solution(completions, solution, **kwargs):
        return [float(s in c) for c, s in zip(completions, solution)]

    class Judge:
        def __call__(self, prompts, completions, verdict, **kwargs):
            return [0.0] * len(completions)

    judge = Judge()
"""


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("user_rewards:legacy", "legacy needs 'samples', which is neither an argument TRL "
         "passes .* nor a column of the data \\(answer, task, seed, "
         ".*fn\\(completions, samples\\)"),
        ("user_rewards:by_position", "takes 'completions' by position only"),
        ("user_rewards:no_kwargs", "does not accept 'prompts', 'completion_ids', "
         "'trainer_state', 'log_extra', 'log_metric', 'task'.*add \\*\\*kwargs"),
        ("user_rewards:with_solution", "with_solution needs 'solution'"),
        ("user_rewards:judge", "user_rewards:judge \\(function Judge\\) needs 'verdict'"),
    ],
)  # fmt: skip
def test_unsatisfiable_signatures_are_refused_at_config_load(tmp_path, monkeypatch, spec, message):
    _user_module(tmp_path, monkeypatch, USER_REWARDS)
    overrides = ["rewards=[{name: exact_match}, {name: '" + spec + "'}]"]
    with pytest.raises(ConfigError, match=message) as error:
        load_config(TINY, overrides)
    assert error.value.key == "rewards[1].name"


def test_a_column_of_the_data_satisfies_a_signature(tmp_path, monkeypatch):
    _user_module(tmp_path, monkeypatch, USER_REWARDS)
    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt": "2+2?", "answer": "4", "solution": "4"}\n')
    overrides = [f"data.path={data}", "data.task=null"]
    rewards = (
        "rewards=[{name: 'user_rewards:with_solution'}, {name: 'trl.rewards:think_format_reward'}]"
    )
    cfg = load_config(TINY, [*overrides, rewards])
    assert [r.name for r in cfg.rewards] == [
        "user_rewards:with_solution",
        "trl.rewards:think_format_reward",
    ]
    data.write_text('{"prompt": "2+2?", "answer": "4", "completions": "4"}\n')
    with pytest.raises(ConfigError, match="field\\(s\\) completions, which TRL passes") as error:
        load_config(TINY, [*overrides, rewards])
    assert error.value.key == "data.path"


# --------------------------------------------------------------------------- TRL's call
# A real TRL GRPOTrainer on a tiny model samples the completions and calls its reward
# functions; LongStraw's RewardSet then scores the same completions (the same token ids,
# decoded by the same tokenizer, as the recipes decode them) for Samples made from the same
# dataset rows. What each function received, what it returned, the advantages and the
# metrics must all be TRL's.

G = 4
_TRL_CALLS: dict[str, list[dict]] = defaultdict(list)


def _record(name, local_vars):
    """What a reward function was called with: its named parameters and its **kwargs."""
    got = {k: v for k, v in local_vars.items() if k not in ("kwargs", "self")}
    _TRL_CALLS[name].append(got | local_vars.get("kwargs", {}))


def _scores(completions):  # deterministic, varied, with None rows
    texts = [completion_text(c) for c in completions]
    return [None if i % 5 == 1 else float(len(t) % 4) for i, t in enumerate(texts)]


def completions_only(completions, **kwargs):
    _record("completions_only", locals())
    return _scores(completions)


def with_prompts(prompts, completions, **kwargs):
    _record("with_prompts", locals())
    return [float(len(str(p)) % 3) for p in prompts]


def with_column(completions, solution, **kwargs):  # TRL's accuracy_reward style
    _record("with_column", locals())
    return [float(s in completion_text(c)) for c, s in zip(completions, solution, strict=True)]


def with_ids(completion_ids, **kwargs):  # TRL's repetition / overlong penalty style
    _record("with_ids", locals())
    return [float(sum(ids) % 7) for ids in completion_ids]


def keyword_only(*, completions, trainer_state, log_extra, **kwargs):
    _record("keyword_only", locals())
    log_extra("step", [trainer_state.global_step] * len(completions))
    return [None] * len(completions)  # a function that never applies


def kwargs_only(**kwargs):
    _record("kwargs_only", locals())
    return _scores(kwargs["completions"])


def everything(prompts, completions, completion_ids, answer, solution, level, trainer_state,
               log_extra, log_metric):  # fmt: skip
    _record("everything", locals())
    log_metric("everything/calls", 1.0)
    return [float(level[i]) for i in range(len(completions))]


def with_default(completions, bonus=0.5, **kwargs):
    _record("with_default", locals())
    return [bonus] * len(completions)


def scaled(completions, scale=1.0, **kwargs):
    _record("scaled", locals())
    return [None if v is None else scale * v for v in _scores(completions)]


class CallableReward:
    def __call__(self, completions, **kwargs):
        _record("CallableReward", locals())
        return _scores(completions)


async def async_reward(completions, **kwargs):
    await asyncio.sleep(0)
    _record("async_reward", locals())
    return [float(len(completion_text(c)) % 2) for c in completions]


class AsyncCallable:
    async def __call__(self, prompts, completions, **kwargs):
        await asyncio.sleep(0)
        _record("AsyncCallable", locals())
        return _scores(completions)


def signature_styles():
    return [
        completions_only, with_prompts, with_column, with_ids, keyword_only, kwargs_only,
        everything, with_default, functools.partial(scaled, scale=2.0), CallableReward(),
        async_reward, AsyncCallable(),
    ]  # fmt: skip


ROWS = [  # the column order is the dataset's, which TRL passes on
    {"prompt": "What is 6*7?", "answer": "42", "solution": "4", "level": 3},
    {"prompt": "Say hi", "answer": "hi", "solution": "h", "level": 1},
]
CHAT_ROWS = [
    {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "6*7?"}],
     "answer": "42", "solution": "4", "level": 2},
    {"prompt": [{"role": "user", "content": "Say hi"}], "answer": "hi", "solution": "h",
     "level": 5},
]  # fmt: skip


@pytest.fixture(scope="module")
def tiny_policy():
    tokenizer = load_tokenizer(None)
    model = tiny_model("qwen3", seed=0, vocab_size=len(tokenizer))
    return model, tokenizer


def run_trl(tiny_policy, tmp_path, funcs, rows, **config):
    """TRL's own generation and scoring of one batch (G completions per row): the trainer,
    the batch it scored and its outputs (advantages)."""
    model, tokenizer = tiny_policy
    args = TRLGRPOConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=G * len(rows), num_generations=G,
        max_completion_length=6, use_cpu=True, report_to="none", bf16=False, seed=0, **config,
    )  # fmt: skip
    trainer = GRPOTrainer(
        model=model, reward_funcs=funcs, args=args, train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
    )  # fmt: skip
    trainer.model.train()
    inputs = [trainer.train_dataset[i] for i in range(len(rows)) for _ in range(G)]
    _TRL_CALLS.clear()
    output = trainer._generate_and_score_completions(inputs)
    return trainer, inputs, output


def score_like_the_recipe(tiny_policy, trainer, inputs, output, funcs, **kwargs):
    """LongStraw's scoring of TRL's completion ids, as the recipes do it: decoded with the
    tokenizer, one Sample per dataset row (``record_to_sample``), TRL's trainer state."""
    _, tokenizer = tiny_policy
    ids = [row[mask.bool()].tolist() for row, mask in
           zip(output["completion_ids"], output["completion_mask"], strict=True)]  # fmt: skip
    texts = tokenizer.batch_decode(ids, skip_special_tokens=True)
    samples = [record_to_sample(row, f"row {i // G}") for i, row in enumerate(inputs)]
    trl_calls = dict(_TRL_CALLS)
    _TRL_CALLS.clear()
    scored = RewardSet(funcs, **kwargs)(
        texts, samples, completion_ids=ids, trainer_state=trainer.state
    )
    return scored, trl_calls, dict(_TRL_CALLS)


def assert_same_call(trl_call, our_call):
    assert list(our_call) == list(trl_call)  # the same arguments, in the same order
    for key, value in trl_call.items():
        if key in ("log_extra", "log_metric"):
            assert callable(our_call[key])
        elif key == "trainer_state":
            assert our_call[key] is value
        else:
            assert our_call[key] == value, key


@pytest.mark.parametrize("rows", [ROWS, CHAT_ROWS], ids=["standard", "conversational"])
def test_every_signature_style_receives_what_trl_passes(tiny_policy, tmp_path, rows):
    funcs = signature_styles()
    trainer, inputs, output = run_trl(tiny_policy, tmp_path, funcs, rows)
    scored, trl_calls, our_calls = score_like_the_recipe(
        tiny_policy, trainer, inputs, output, funcs
    )
    assert sorted(trl_calls) == sorted(our_calls) and len(trl_calls) == len(funcs)
    for name in trl_calls:
        (trl_call,), (our_call,) = trl_calls[name], our_calls[name]
        assert_same_call(trl_call, our_call)
    # The arguments themselves, as TRL builds them for this prompt format.
    passed = our_calls["kwargs_only"][0]
    assert list(passed) == [
        "prompts", "completions", "completion_ids", "answer", "solution", "level",
        "trainer_state", "log_extra", "log_metric",
    ]  # fmt: skip
    assert passed["prompts"] == [row["prompt"] for row in inputs]
    chat = rows is CHAT_ROWS
    assert all(isinstance(c, list) if chat else isinstance(c, str) for c in passed["completions"])
    assert passed["trainer_state"].global_step == 0
    # What they returned, by TRL's names for them, and the weighted sums.
    assert scored.names == list(trainer._logs["rewards"])
    for name, column in scored.columns().items():
        nan_equal(column, list(trainer._logs["rewards"][name]))
    assert scored.extra_columns == {k: list(v) for k, v in trainer._logs["extra"].items()}
    for key, values in trainer._metrics["train"].items():
        if key.startswith(("reward", "everything/")):
            assert scored.metrics()[key] == pytest.approx(values[-1], rel=1e-5, nan_ok=True), key


def test_trl_reward_functions_run_unchanged(tiny_policy, tmp_path):
    funcs = [think_format_reward, get_soft_overlong_punishment(6, 3),
             get_repetition_penalty_reward(2, -1.0)]  # fmt: skip
    trainer, inputs, output = run_trl(tiny_policy, tmp_path, funcs, CHAT_ROWS)
    scored, _, _ = score_like_the_recipe(tiny_policy, trainer, inputs, output, funcs)
    assert not scored.failed
    assert scored.names == list(trainer._logs["rewards"])
    for name, column in scored.columns().items():
        nan_equal(column, list(trainer._logs["rewards"][name]))
    # Their values where they are not all 0: TRL's documented input, LongStraw's chat Samples.
    texts = ["<think>\nreasoning\n</think>\nanswer", "no think", "<think>a</think><think>b</think>"]
    samples = [S(prompt=[{"role": "user", "content": "q"}], i=i) for i in range(3)]
    got = RewardSet([think_format_reward])(texts, samples, completion_ids=ids_for(3))
    expected = think_format_reward([[{"role": "assistant", "content": t}] for t in texts])
    assert got.rewards == expected == [1.0, 0.0, 0.0]


def test_is_conversational_and_async_detection_agree_with_trl():
    for prompt in ("text", [{"role": "user", "content": "x"}], [{"content": "x"}], ["text"]):
        assert is_conversational(prompt) == trl_is_conversational({"prompt": prompt})
    for fn in [*signature_styles(), functools.partial(async_reward)]:
        assert is_async_callable(fn) == trl_is_async_callable(fn), fn


# Per-function rewards of 3 groups of 4 (None: not applicable), covering TRL's cases: some
# rows unscorable, a whole group unscorable, one scorable reward, equal scorable rewards;
# the second function scores rows the first skips (nansum), so only all-None rows are NaN.
PRESET = {
    "first": [None, 1.0, 0.0, None, None, None, None, None, 2.0, 2.0, None, 2.0],
    "second": [None, 0.5, None, 3.0, None, None, None, None, None, None, None, None],
}


def first(completions, **kwargs):
    return list(PRESET["first"])


def second(completions, **kwargs):
    return list(PRESET["second"])


@pytest.mark.parametrize("scale_rewards", ["group", "none"])
def test_unscorable_rows_get_trl_advantages_and_metrics(tiny_policy, tmp_path, scale_rewards):
    rows = [ROWS[0], ROWS[1], ROWS[0]]
    weights = [2.0, -1.0]
    trainer, inputs, output = run_trl(
        tiny_policy, tmp_path, [first, second], rows, scale_rewards=scale_rewards,
        reward_weights=weights,
    )  # fmt: skip
    scored, _, _ = score_like_the_recipe(
        tiny_policy, trainer, inputs, output, [first, second], weights=weights
    )
    assert scored.unscorable == [0, 4, 5, 6, 7, 10]
    ours = torch.cat(
        [group_advantages(scored.rewards[g : g + G], scale_rewards) for g in (0, 4, 8)]
    )
    torch.testing.assert_close(ours.float(), output["advantages"], rtol=1e-5, atol=1e-6)
    assert not bool(torch.isnan(output["advantages"]).any())
    # TRL's metrics of the batch; frac_reward_zero_std is its mean over the groups.
    metrics = trainer._metrics["train"]
    ours = scored.metrics()
    for key in ("reward", "reward_std", "rewards/first/mean", "rewards/first/std",
                "rewards/second/mean", "rewards/second/std"):  # fmt: skip
        assert ours[key] == pytest.approx(metrics[key][-1], rel=1e-5), key
    per_group = [
        RewardResult(scored.names, scored.rewards[g : g + G], scored.rewards_per_func[g : g + G])
        for g in (0, 4, 8)
    ]
    fraction = sum(r.metrics()[names.FRAC_REWARD_ZERO_STD] for r in per_group) / 3
    assert fraction == pytest.approx(metrics[names.FRAC_REWARD_ZERO_STD][-1])
