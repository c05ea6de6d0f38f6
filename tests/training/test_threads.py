"""Threads per process (``longstraw_core.process.threads``): the node's cores not busy with other
work, shared by its processes, unless ``OMP_NUM_THREADS`` says otherwise (a run's own is read from its shape
block: ``test_run_output``, and the 2-rank run of ``test_recipes_distributed``)."""

from __future__ import annotations

import multiprocessing

import torch

from longstraw_core.process import threads


def test_the_cores_are_shared_by_the_processes_of_the_node_at_least_one_each():
    assert threads.choose({}, cores=16, local_processes=2).threads == 8
    assert threads.choose({}, cores=2, local_processes=2).threads == 1
    assert threads.choose({}, cores=2, local_processes=8).threads == 1
    choice = threads.choose({"OMP_NUM_THREADS": ""}, cores=3, local_processes=1)
    assert choice.describe() == (
        "3 per process (3 cores available / 1 process on this node; OMP_NUM_THREADS overrides)"
    )


def test_cores_busy_with_other_work_are_left_to_it():
    assert threads.choose({}, cores=2, local_processes=1, busy=1.9).threads == 1
    assert threads.choose({}, cores=2, local_processes=1, busy=0.2).threads == 2
    assert threads.choose({}, cores=16, local_processes=2, busy=6.4).threads == 5  # 10 free
    assert threads.choose({}, cores=4, local_processes=1, busy=9.0).threads == 1
    choice = threads.choose({}, cores=2, local_processes=1, busy=1.94)
    assert choice.describe() == (
        "1 per process (2 cores available, 1.9 busy with other work / 1 process on this node;"
        " OMP_NUM_THREADS overrides)"
    )


def _spin() -> None:
    while True:
        sum(range(10_000))


def test_a_busy_process_is_seen_on_the_cores():
    """While a process spins, some allowed core runs it or other work at every instant, so
    at least one core's worth is busy, less /proc/stat's tick granularity (10 ms of 250)."""
    cores = threads.allowed_cores()
    spinner = multiprocessing.get_context("fork").Process(target=_spin, daemon=True)
    spinner.start()
    try:
        busy = threads.busy_cores(cores, seconds=0.5)
    finally:
        spinner.kill()
        spinner.join()
    assert busy is not None
    assert 0.8 <= busy <= len(cores) + 0.1


def test_omp_num_threads_wins_and_torch_keeps_its_count():
    assert threads.choose({"OMP_NUM_THREADS": "4"}, cores=16, local_processes=1) is None
    before = torch.get_num_threads()
    choice = threads.apply({"OMP_NUM_THREADS": "4", "LOCAL_WORLD_SIZE": "1"})
    assert torch.get_num_threads() == before == choice.threads
    assert choice.describe() == f"{before} per process (OMP_NUM_THREADS=4)"


def test_without_omp_num_threads_torch_is_set_to_the_choice():
    before = torch.get_num_threads()
    try:
        choice = threads.apply({"LOCAL_WORLD_SIZE": "1"})
        assert 1 <= choice.threads <= threads.available_cores()
        assert choice.threads == torch.get_num_threads()
        many = threads.apply({"LOCAL_WORLD_SIZE": str(threads.available_cores() * 4)})
        assert many.threads == 1 == torch.get_num_threads()
    finally:
        torch.set_num_threads(before)
