"""A reward for fault tests that varies within every group, so every step trains.

Random tokens almost never score on the built-in rewards at tiny sizes; the fault tests
need each step to update the weights, so this one scores a completion by the share of its
characters with an even code point: deterministic, and different between completions.
``even_characters_drawing`` also draws from the global random streams. Written in TRL's
convention (keyword arguments, ``**kwargs`` for the rest), as the recipes
call every reward function.
"""

from __future__ import annotations

import os
import random
import sys
import time
from typing import Any

import numpy as np
import torch

from longstraw_core.rewards import completion_text


def even_characters(completions: list[Any], **kwargs: Any) -> list[float]:
    texts = [completion_text(c) for c in completions]
    return [sum(ord(c) % 2 == 0 for c in text) / max(len(text), 1) for text in texts]


def even_characters_drawing(completions: list[Any], **kwargs: Any) -> list[float]:
    """``even_characters``, after drawing from torch's, Python's and NumPy's global random
    streams (as a sampling reward model might): what an eval's scoring must not shift for the
    training that follows."""
    torch.rand(7)
    random.random()
    np.random.rand()
    return even_characters(completions)


def differs_by_rank(completions: list[Any], **kwargs: Any) -> list[float]:
    """``even_characters`` on the last rank (one process's only rank), 0.5 for every
    completion on the others: a judge whose answers differ between calls. Scored on each
    pipeline stage, the first stages would see no advantage and skip the replays the last
    stage runs (``grpo.replay``: a branch of zero advantage contributes nothing)."""
    last = int(os.environ.get("WORLD_SIZE", "1")) - 1
    if int(os.environ.get("RANK", "0")) == last:
        return even_characters(completions)
    return [0.5] * len(completions)


def always_fails(completions: list[Any], **kwargs: Any) -> list[float]:
    raise ConnectionError("the reward server is down")


def fails_in_step_two(completions: list[Any], **kwargs: Any) -> list[float]:
    """``even_characters``, except in step 2 (``global_step`` 1), where it raises: a step
    whose every reward failed, between two that train."""
    if kwargs["trainer_state"].global_step == 1:
        raise ConnectionError("the reward server is down for step 2")
    return even_characters(completions)


def fails_on_some_ranks(completions: list[Any], **kwargs: Any) -> list[float]:
    """``even_characters``, but raising on the ranks ``LONGSTRAW_TEST_FAIL_RANKS`` lists
    (e.g. "1"): a judge that one machine cannot reach."""
    if os.environ.get("RANK", "0") in os.environ.get("LONGSTRAW_TEST_FAIL_RANKS", "").split(","):
        raise ConnectionError(f"the reward server is unreachable from rank {os.environ['RANK']}")
    return even_characters(completions)


def sleeps(completions: list[Any], **kwargs: Any) -> list[float]:
    """``even_characters`` after sleeping ``LONGSTRAW_TEST_SLEEP`` seconds (default 0), once
    ``LONGSTRAW_TEST_SLEEP_AFTER`` steps are done (default 0): a slow step, or a hung judge.
    ``LONGSTRAW_TEST_SLEEP_RANKS`` (e.g. "1"): only on those ranks. Prints ``reward sleeps``
    (flushed) as it starts to sleep."""
    ranks = os.environ.get("LONGSTRAW_TEST_SLEEP_RANKS")
    after = int(os.environ.get("LONGSTRAW_TEST_SLEEP_AFTER", "0"))
    seconds = float(os.environ.get("LONGSTRAW_TEST_SLEEP", "0"))
    mine = ranks is None or os.environ.get("RANK", "0") in ranks.split(",")
    if seconds and mine and kwargs["trainer_state"].global_step >= after:
        print(f"reward sleeps on rank {os.environ.get('RANK', '0')}", flush=True)
        time.sleep(seconds)
    return even_characters(completions)


def exits_the_run(completions: list[Any], **kwargs: Any) -> list[float]:
    """A reward that calls ``sys.exit()`` (a user's script habit)."""
    sys.exit()
