"""Dry runs at real dimensions (``longstraw_core.scale_check``), reduced to run in the suite.

Qwen3.6-27B's real widths (hidden 5120, 248K vocabulary, DeltaNet 48 x 128 heads, gated
attention 24 q / 4 kv heads of 256) with 4 layers (three Gated DeltaNet, one full attention)
on 2 pipeline stages and a 4K prompt: a whole GRPO step per stage on fake tensors, through
the real staged passes. Each stage's tracked peak must be within 10% of the planner's for
that stage and within the 96 GiB budget. ``make scale-check`` runs the paper's sizes.
"""

from __future__ import annotations

import pytest
import torch

from longstraw_core.fake import is_fake, known_bool, known_float, known_list
from longstraw_core.scale_check.runs import QWEN, TOLERANCE, DryRun, run_config, table

REDUCED = DryRun(
    "qwen36-27b-widths-4-layers",
    QWEN,
    "Qwen3.6-27B",
    (
        "data.prompt_tokens=4097",
        "train.chunk_size=2048",
        "rollout.max_new_tokens=32",
        "distributed.pipeline_stages=2",
    ),
    (("num_hidden_layers", 4),),
    rollout_tokens=2,
)


@pytest.fixture(scope="module")
def reduced() -> dict:
    return run_config(REDUCED)


def test_every_stage_runs_a_whole_step(reduced):
    print(table(reduced))
    assert [row["stage"] for row in reduced["rows"]] == [0, 1]
    for row in reduced["rows"]:
        assert set(row["tracked_phases"]) == {"prefill", "rollout", "replay", "sweep", "optimizer"}
        # the weights alone: a real-width stage holds gigabytes, none of it allocated here
        assert row["tracked"] > 2**30


def test_tracked_peaks_match_the_planner_and_fit(reduced):
    for row in reduced["rows"]:
        assert abs(row["error"]) <= TOLERANCE, table(reduced)
    assert reduced["within_plan"] and reduced["within_budget"]


def test_value_helpers_read_real_tensors_and_stand_in_for_fake_ones():
    from torch._subclasses.fake_tensor import FakeTensorMode

    real = torch.tensor([1, 0])
    assert not is_fake(real)
    assert known_list(real, fake=7) == [1, 0]
    assert known_bool(real[0], fake=False) is True
    assert known_float(real.float().sum()) == 1.0
    with FakeTensorMode():
        fake = torch.zeros(3)
        assert is_fake(fake)
        assert known_list(fake, fake=7) == [7, 7, 7]
        assert known_bool(fake.any(), fake=True) is True
        assert known_float(fake.sum(), 2.0) == 2.0
