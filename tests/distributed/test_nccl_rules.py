"""The NCCL-rules harness (``nccl_rules``) on known cases: what NCCL completes completes
(torch's own 1F1B schedule among them, with the gradients of one process; a 3-stage token
ring with a two-rank group per pair), and what NCCL hangs on (facing unbatched sends; a
collective behind a batch on its group; the same ring on one group, whose batches share
each rank's one stream) fails within the bound with every rank's pending ops in the log."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import launch
import pytest

WORKER = launch.SUPPORT / "nccl_rules_worker.py"
BOUND = "2"  # seconds: the hang bound the hanging cases run with


def _run(case: str, *args: str, ranks: int, runner: bool = True) -> tuple[int, str, float]:
    env = os.environ | {"LONGSTRAW_NCCL_RULES_TIMEOUT": BOUND}
    env["LONGSTRAW_NCCL_RULES"] = "1" if runner else "0"  # "0": the worker installs it
    start = time.monotonic()
    code, log = launch.torchrun(WORKER, case, *args, ranks=ranks, timeout=180, env=env)
    return code, log, time.monotonic() - start


@pytest.mark.multiprocess
def test_what_nccl_completes_completes(tmp_path):
    code, log, _ = _run("complete", str(tmp_path), ranks=3)
    assert code == 0, log[-5000:]
    ranks = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(3)]
    assert all(rank["installed"] for rank in ranks)
    zero, one, two = ranks
    # One batch holding a send and a receive to the same peer.
    assert (zero["batched_exchange"], one["batched_exchange"]) == ([1.0], [0.0])
    assert zero["work_type"] and one["work_type"]  # a dist.Work, as torch's own
    # Tags ignored: received with tags 2 then 1, the values come in send order.
    assert one["tags"] == [10.0, 20.0]
    # Send #3 from 0 to 1 (after the batch and the two tagged ones) meets a wrong receive.
    message = zero["mismatch"]
    assert message == one["mismatch"] and message is not None
    assert "send #3 from rank 0 to rank 1" in message and "on rank 1" in message
    assert "float32[4, 8]" in message and "int64[16]" in message
    # Send #4, unbatched, met by a batched receive: they never meet on NCCL; both ranks say so.
    message = zero["kinds"]
    assert message == one["kinds"] and message is not None
    assert "send #4 from rank 0 to rank 1 (group 0) is unbatched" in message
    assert "the receive it meets on rank 1 is batched" in message
    # A batch spanning two peers (one batch per rank): each gets the previous rank's tensor.
    assert [r["ring"] for r in ranks] == [[2.0], [0.0], [1.0]]
    # The token ring with a two-rank group per pair: rank 0 has the token, 1 the branch, 2
    # the branch + 1 (on one group it hangs: test_a_ring_on_one_group_hangs...).
    assert [r["token_ring"] for r in ranks] == [[2.0], [1.0], [2.0]]
    # A collective on the default group waited neither for an unbatched send on it (the
    # pair's communicator) nor for a batch on another group: rank 1 received both after.
    assert one["beside"] == [3.0, 4.0]
    # Progress in the background: rank 1 had rank 0's send while rank 0 was computing, and
    # rank 0's second send completed while it sat in a gloo barrier of another group.
    assert zero["done_while_computing"] and one["received_at"] < zero["computed_until"]
    assert zero["done_while_in_collective"] and one["values"] == [7.0, 8.0]
    assert (zero["stress"], one["stress"], two["stress"]) == (60300.0, 59700.0, 0.0)
    # Schedule1F1B: every parameter's gradient as in one process.
    assert set(zero["one_f_one_b"]) == {"0.weight", "0.bias"}
    assert set(one["one_f_one_b"]) == {"2.weight", "2.bias", "4.weight", "4.bias"}
    errors = zero["one_f_one_b"] | one["one_f_one_b"]
    assert max(errors.values()) < 1e-6, errors


def _waited(log: str) -> float:
    waits = re.findall(r"rank \d waited ([\d.]+) s in ", log)
    # One rank reports; launch.torchrun repeats its report at the log's end.
    assert len(waits) == 2 and waits[0] == waits[1], log[-5000:]
    return float(waits[0])


@pytest.mark.multiprocess
def test_unbatched_sends_facing_each_other_hang_and_are_reported():
    code, log, seconds = _run("facing_sends", BOUND, ranks=2, runner=False)
    assert code != 0 and "facing sends completed" not in log, log[-5000:]
    assert "NCCL rules: a hang (every rank is blocked" in log, log[-5000:]
    assert _waited(log) < 3 * float(BOUND) and seconds < 120
    log = log[-4000:]  # the report is repeated at the end, where a test's message shows it
    for rank, peer in ((0, 1), (1, 0)):
        assert f"rank {rank}: blocked" in log
        head = f"[head] isend: send to rank {peer} #0 float32[2048] (group 0)"
        assert f"{head}, pending" in log and f"waiting for rank {peer} to reach its matching" in log
        assert f"[#2] recv: recv from rank {peer} #0 float32[2048] (group 0)" in log


@pytest.mark.multiprocess
def test_a_collective_waits_behind_the_ranks_batches_on_its_group():
    code, log, _ = _run("batch_then_collective", ranks=2)
    assert code != 0 and "batch then collective completed" not in log, log[-5000:]
    assert "NCCL rules: a hang (every rank is blocked" in log, log[-5000:]
    assert _waited(log) < 3 * float(BOUND)
    log = log[-4000:]
    assert re.search(
        r"rank 0: blocked [\d.]+ s in broadcast on group 0, which first waits for this "
        r"rank's 1 uncompleted batch ahead of it on that group's stream",
        log,
    ), log
    stream = "group 0, batches and collectives (the group's communicator): 2 entries"
    assert stream in log, log
    assert "[head] batch_isend_irecv: send to rank 1 #0 float32[2048] (group 0)" in log
    assert re.search(r"\[#2\] broadcast: a collective on group 0, pending [\d.]+ s: waiting", log)
    assert re.search(r"rank 1: blocked [\d.]+ s in broadcast on group 0 \(in gloo\)", log)
    assert re.search(r"\[head\] broadcast: a collective on group 0, pending [\d.]+ s: running", log)


@pytest.mark.multiprocess
def test_a_ring_on_one_group_hangs_where_each_rank_has_one_stream():
    code, log, _ = _run("ring_on_one_group", ranks=3)
    assert code != 0 and "ring on one group completed" not in log, log[-5000:]
    assert "NCCL rules: a hang (every rank is blocked" in log, log[-5000:]
    assert _waited(log) < 3 * float(BOUND)
    log = log[-4000:]
    waiting = r", pending [\d.]+ s: waiting for rank {} to reach its matching {}"
    head = r"\[head\] batch_isend_irecv: {} float32\[2048\] \(group 0\)" + waiting
    # Rank 2's stream: the receive from rank 1 ahead of the token's send to rank 0.
    assert re.search(head.format("recv from rank 1 #0", 1, "send"), log), log
    assert "[#2] batch_isend_irecv: send to rank 0 #0 float32[2048] (group 0)" in log
    assert re.search(head.format("recv from rank 0 #0", 0, "send"), log), log  # rank 1
    assert re.search(head.format("recv from rank 2 #0", 2, "send"), log), log  # rank 0


SCRIPT = """\
import json, sys
import torch.distributed as dist
print(json.dumps({
    "name": __name__, "file": __file__, "argv": sys.argv[1:], "path0": sys.path[0],
    "harness": dist.isend.__code__.co_filename.endswith("nccl_rules.py"),
}))
sys.exit(3)
"""


@pytest.mark.multiprocess
def test_the_runner_runs_a_script_as_python_does(tmp_path):
    script = tmp_path / "nested" / "script.py"
    script.parent.mkdir()
    script.write_text(SCRIPT)
    runs = {}
    for name, prefix in (("python", []), ("runner", [str(launch.NCCL_RULES_RUN)])):
        done = subprocess.run(
            [sys.executable, *prefix, str(script), "a", "--b=c"], capture_output=True, text=True
        )
        assert done.returncode == 3, done.stderr
        runs[name] = json.loads(done.stdout)
    assert runs["python"].pop("harness") is False and runs["runner"].pop("harness") is True
    assert runs["runner"] == runs["python"]
    assert runs["python"] == {
        "name": "__main__",
        "file": str(script),
        "argv": ["a", "--b=c"],
        "path0": str(script.parent),
    }


def test_every_torchrun_of_the_tests_runs_under_the_rules():
    command = launch.torchrun_command("recipe.py", "x=1", ranks=3, env={})
    assert command[-3:] == [str(launch.NCCL_RULES_RUN), "recipe.py", "x=1"]
    assert "--nproc_per_node" in command and "3" in command
    off = launch.torchrun_command("recipe.py", "x=1", env={"LONGSTRAW_NCCL_RULES": "0"})
    assert off[-2:] == ["recipe.py", "x=1"] and str(launch.NCCL_RULES_RUN) not in off
