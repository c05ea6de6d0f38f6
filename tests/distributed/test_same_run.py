"""Every rank runs the same settings on the same data (``same_run``): checked in one
collective before anything loads, each differing key named with both values."""

from __future__ import annotations

import json
import re
import time

import launch
import pytest
from fault_runs import CONFIG, RECIPE, SMALL, run_env

from longstraw_core.config import load_config
from longstraw_core.launch.same_run import differences, run_record

WORKER = launch.SUPPORT / "same_run_worker.py"

# The settings the issue found going wrong when one rank had another value: silently other
# weights (optim.lr), a hang until the collective timeout (train.save_every, train.steps,
# grpo.gradient), tensor-size crashes deep in the run (G, data.seed, lora.enabled).
CASES = {
    "optim.lr": ("1e-3", "2e-3"),
    "train.save_every": ("1", "2"),
    "train.steps": ("3", "4"),
    "grpo.gradient": ("detached", "exact"),
    "rollout.num_generations": ("4", "2"),
    "data.seed": ("0", "5"),
    "lora.enabled": ("false", "true"),
}


@pytest.mark.parametrize("key", CASES)
def test_each_setting_that_differs_between_ranks_is_named_with_both_values(key):
    zero, one = (load_config(CONFIG, [*SMALL, f"{key}={value}"]) for value in CASES[key])
    found = differences([run_record(zero), run_record(one)])
    assert len(found) == 1 and found[0].startswith(f"rank 1: {key}="), found
    assert differences([run_record(zero), run_record(zero)]) == []


def test_the_record_holds_the_data_files_bytes(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "2+2?", "answer": "4"}\n')
    cfg = load_config(CONFIG, [*SMALL, "data.task=null", f"data.path={path}"])
    first = run_record(cfg)
    path.write_text('{"prompt": "2+2?", "answer": "5"}\n')  # the same size, other bytes
    (found,) = differences([first, run_record(cfg)])
    assert found.startswith("rank 1: data.path (bytes)='34 bytes, sha256 ")


@pytest.mark.multiprocess
def test_ranks_with_different_settings_stop_at_start_naming_them(tmp_path):
    """Rank 1 reads other values through its environment (``${oc.env:...}`` keyed by
    ``LOCAL_RANK``, as a node-local variable would give them)."""
    overrides = [
        "optim.lr=${oc.env:LR_${oc.env:LOCAL_RANK},0.001}",
        "train.steps=${oc.decode:${oc.env:STEPS_${oc.env:LOCAL_RANK},3}}",
        "rollout.num_generations=${oc.decode:${oc.env:G_${oc.env:LOCAL_RANK},4}}",
        "data.seed=${oc.decode:${oc.env:SEED_${oc.env:LOCAL_RANK},0}}",
        "lora.enabled=${oc.decode:${oc.env:LORA_${oc.env:LOCAL_RANK},false}}",
    ]
    env = run_env(LR_1="0.002", STEPS_1="4", G_1="2", SEED_1="5", LORA_1="true")
    out = tmp_path / "run"
    started = time.monotonic()
    code, log = launch.torchrun(
        RECIPE, "--config", str(CONFIG), *SMALL, "distributed.fsdp=true", *overrides,
        f"train.output_dir={out}", env=env, timeout=240,
    )  # fmt: skip
    assert code != 0, log[-3000:]
    lines = [line for line in log.splitlines() if line.startswith("config error:")]
    assert lines, log[-3000:]
    for line in lines:  # every rank stops with the same one line
        assert line.startswith("config error: lora.enabled: the ranks run different settings:")
        for key, now, then in [
            ("optim.lr", "0.002", "0.001"), ("train.steps", "4", "3"),
            ("rollout.num_generations", "2", "4"), ("data.seed", "5", "0"),
            ("lora.enabled", "True", "False"),
        ]:  # fmt: skip
            assert f"rank 1: {key}={now} (rank 0: {then})" in line, line
    assert not re.search(r"\[rank\d\]: Traceback", log)  # (torchrun prints its own summary)
    assert not re.search(r"^step \d", log, re.M)
    assert not out.exists()  # nothing built, nothing written
    assert time.monotonic() - started < 240


@pytest.mark.multiprocess
@pytest.mark.parametrize("data", ["same", "differ"])
def test_a_data_file_that_differs_between_nodes_is_named(tmp_path, data):
    log = launch.torchrun_ok(WORKER, str(tmp_path), data)
    # One JSON object per rank; their lines may run together in the shared log.
    decode = json.JSONDecoder().raw_decode
    rows = sorted(
        (decode(log, match.start())[0] for match in re.finditer(r'\{"rank"', log)),
        key=lambda row: row["rank"],
    )
    assert [row["rank"] for row in rows] == [0, 1], log[-3000:]
    if data == "same":
        assert all(row["error"] is None for row in rows)
        return
    for row in rows:
        assert row["error"].startswith("data.path (bytes): the ranks run different settings: ")
        assert "rank 1: data.path (bytes)='34 bytes, sha256 " in row["error"]
