"""Host synchronisations of the decode loop, and results that do not depend on how often
the stop is checked (``rollout(stop_check_every=k)``, config ``rollout.stop_check_every``).

A read of a tensor's value on the host (``.item()``, ``.tolist()``, ``bool``/``int``/
``float``/``index`` of a tensor) drains a GPU's queue. They are counted with a real
``torch.overrides.TorchFunctionMode`` around a real rollout of a tiny model: the decode
loop reads once every ``k`` steps (its stop check, and after the last step), and a rollout
reads a constant number of times more (``PER_ROLLOUT``). The responses, log-probs, loss
masks and ends are bit-equal for every ``k`` (float64; the same batched computations run
for the tokens kept, only padding steps are added), on one process and on two pipeline
stages, whose ring runs one stop collective every ``k`` steps.

GLM-5's MoE layers are left out of the count: transformers' eager experts loop reads which
experts were hit (``if expert_idx == self.num_experts``) in the model's own forward.
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from pathlib import Path

import pipeline_worker as worker
import pytest
import torch
from launch import SUPPORT, torchrun_ok
from torch.overrides import TorchFunctionMode

import longstraw_core as ls
from longstraw_core.config import ConfigError, load_config
from longstraw_core.models.tiny import tiny_model
from longstraw_core.pipeline.schedule import Collective, Compute, Ring, ring_program, ring_steps
from longstraw_core.pipeline.simulate import simulate
from longstraw_core.process.guard import NonFiniteError
from longstraw_core.rollout.decode import STOP_CHECK_EVERY
from longstraw_core.schema.run_config import RolloutSection

RECIPE = Path(__file__).resolve().parents[2] / "configs" / "qwen36" / "tiny_grpo_cpu.yaml"

HOST_READS = {
    torch.Tensor.item,
    torch.Tensor.tolist,
    torch.Tensor.__bool__,
    torch.Tensor.__int__,
    torch.Tensor.__float__,
    torch.Tensor.__index__,
}
# Reads once per rollout, after the decode loop: the responses' lengths and ends (and,
# before the loop, the pad id when EOS ids are given: ``BEFORE_LOOP``).
PER_ROLLOUT = 2
BEFORE_LOOP = 1
MAX_NEW = 20
EOS = list(range(0, 512, 5))  # about one token in five ends a branch: lengths vary


class CountHostReads(TorchFunctionMode):
    """Counts host reads of tensor values, by the decode step they happen in (``step``: the
    number of ``adapter.decode`` calls begun so far, minus one; -1 before the first)."""

    def __init__(self) -> None:
        super().__init__()
        self.step = -1
        self.reads: Counter[int] = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in HOST_READS:
            self.reads[self.step] += 1
        return func(*args, **(kwargs or {}))


def _counted_rollout(adapter: ls.ModelAdapter, state, **options) -> tuple[CountHostReads, object]:
    mode = CountHostReads()
    decode = adapter.decode

    def decode_step(*args, **kwargs):  # the real decode, with the step noted first
        mode.step += 1
        return decode(*args, **kwargs)

    adapter.decode = decode_step
    try:
        with mode:
            out = ls.rollout(adapter, state, **options)
    finally:
        del adapter.decode
    return mode, out


@functools.cache
def _adapter(model_type: str) -> ls.ModelAdapter:
    return ls.adapt(tiny_model(model_type, dtype=torch.float64, seed=7))


def _prompt(length: int = 20, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 512, (length,), generator=torch.Generator().manual_seed(seed))


def _checks(steps: int, every: int) -> list[int]:
    """The decode steps whose stop check reads the host: every ``every``-th and the last."""
    return sorted({t for t in range(steps) if (t + 1) % every == 0} | {steps - 1})


# --- at most one host read every k tokens ---------------------------------------------------


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_5_text"])
@pytest.mark.parametrize("every", [1, 4, STOP_CHECK_EVERY])
def test_the_decode_loop_reads_the_host_once_every_k_steps(model_type, every):
    """No branch ends (no EOS): ``MAX_NEW`` steps, one read at each check, none between."""
    adapter = _adapter(model_type)
    state = adapter.prefill(_prompt())
    mode, out = _counted_rollout(
        adapter, state, num_generations=3, max_new_tokens=MAX_NEW, seed=1, stop_check_every=every
    )
    assert out.stats["steps"] == MAX_NEW
    assert mode.reads[-1] == 0  # nothing before the first decode step
    by_step = {t: n for t, n in mode.reads.items() if t >= 0}
    checks = _checks(MAX_NEW, every)
    # The last step's check, then the rollout's own reads after the loop.
    expected = {t: 1 for t in checks} | {MAX_NEW - 1: 1 + PER_ROLLOUT}
    assert by_step == expected
    assert sum(by_step.values()) <= math.ceil(MAX_NEW / every) + 1 + PER_ROLLOUT


def test_a_run_that_ends_early_stops_at_the_next_check():
    """Greedy with an EOS that the first steps draw: the run stops at the first check after
    every branch ended, having read once there."""
    adapter = _adapter("qwen3")
    state = adapter.prefill(_prompt())
    free = ls.rollout(adapter, state, 1, MAX_NEW, temperature=0)
    eos = int(free.responses[0][2])  # the third token ends the response
    mode, out = _counted_rollout(
        adapter, state, num_generations=1, max_new_tokens=MAX_NEW, temperature=0,
        eos_token_ids=[eos], stop_check_every=4,
    )  # fmt: skip
    ended_at = out.responses[0].tolist().index(eos)
    assert out.stats["steps"] == 4 * (ended_at // 4 + 1)
    assert mode.reads[-1] == BEFORE_LOOP
    in_loop = sum(n for t, n in mode.reads.items() if t >= 0)
    assert in_loop == out.stats["steps"] // 4 + PER_ROLLOUT


# --- the same results whatever k ------------------------------------------------------------


def _result(out) -> dict:
    return {
        "responses": [r.tolist() for r in out.responses],
        "logps": [lp.tolist() for lp in out.logps],
        "masks": [m.tolist() for m in out.loss_masks],
        "truncated": out.truncated,
    }


@pytest.mark.parametrize(
    "options",
    [
        {"num_generations": 4, "eos_token_ids": EOS, "seed": 3},
        {"num_generations": 2, "eos_token_ids": EOS, "temperature": 0.0},
        {"num_generations": 3, "eos_token_ids": EOS, "seed": 5, "top_k": 40, "min_p": 0.05,
         "repetition_penalty": 1.3},
        {"num_generations": 3, "eos_token_ids": EOS, "seed": 7,
         "turns": lambda: worker.ScriptedTurns([300, 301, 5])},
    ],
    ids=["sampled", "greedy", "options", "turns"],
)  # fmt: skip
def test_results_are_equal_for_every_k(options):
    """k = 1 (a check every step, as before), the default, and one larger than the budget
    (only the check after the last step): bit-equal responses, log-probs, masks and ends."""
    adapter = _adapter("qwen3")
    state = adapter.prefill(_prompt())
    results, steps = [], []
    for every in (1, STOP_CHECK_EVERY, 4 * MAX_NEW):
        kwargs = dict(options)
        if "turns" in kwargs:
            kwargs["turns"] = kwargs["turns"]()
        out = ls.rollout(adapter, state, max_new_tokens=MAX_NEW, stop_check_every=every, **kwargs)
        results.append(_result(out))
        steps.append(out.stats["steps"])
    assert results[1] == results[0]
    assert results[2] == results[0]
    assert steps[0] <= steps[1] <= steps[2]
    lengths = {len(r) for r in results[0]["responses"]}
    if "turns" not in options:
        assert len(lengths) > 1 or "temperature" in options  # branches end at varied steps


def test_non_finite_logits_are_raised_at_the_next_check_naming_their_step():
    """A token whose embedding is NaN, drawn at step 2, makes step 3's logits NaN; with a
    check every 8 steps the error comes at step 7 and names step 3."""
    model = tiny_model("qwen3", dtype=torch.float64, seed=7)
    adapter = ls.adapt(model)
    prompt = _prompt()
    state = adapter.prefill(prompt)
    free = ls.rollout(adapter, state, 1, MAX_NEW, temperature=0)
    poisoned = int(free.responses[0][2])
    assert poisoned not in prompt.tolist() and poisoned not in free.responses[0][:2].tolist()
    with torch.no_grad():
        model.get_input_embeddings().weight[poisoned] = math.nan
    with pytest.raises(NonFiniteError, match="non-finite logits at decode step 3:"):
        ls.rollout(adapter, state, 1, MAX_NEW, temperature=0, stop_check_every=8)


def test_the_config_key_defaults_to_the_rollouts_default_and_is_checked():
    assert RolloutSection().stop_check_every == STOP_CHECK_EVERY
    assert load_config(RECIPE, ["rollout.stop_check_every=3"]).rollout.stop_check_every == 3
    with pytest.raises(ConfigError) as info:
        load_config(RECIPE, ["rollout.stop_check_every=0"])
    assert info.value.key == "rollout.stop_check_every"


def test_stop_check_every_is_refused_below_one():
    adapter = _adapter("qwen3")
    state = adapter.prefill(_prompt())
    with pytest.raises(ValueError, match=r"rollout\.stop_check_every"):
        ls.rollout(adapter, state, 1, 4, stop_check_every=0)


# --- the ring of stages: one stop collective every k steps ----------------------------------


@pytest.mark.parametrize(("stages", "groups", "steps"), [(2, 2, 10), (3, 2, 17), (4, 4, 9)])
@pytest.mark.parametrize("every", [1, 3, 8, 64])
def test_the_ring_runs_one_stop_collective_every_k_steps(stages, groups, steps, every):
    ring = Ring(stages, groups, steps, check_every=every)
    program = ring_program(ring, 0)[0]
    names = [s.name[1] for s in program if isinstance(s, Collective)]
    assert names == [t for t in range(steps - 2) if (t + 1) % every == 0]
    simulate(ring_program(ring))  # live


@pytest.mark.parametrize("every", [1, 3, 8])
def test_the_ring_stops_two_steps_after_the_check_that_says_so(every):
    """Stopped at the first check at or after step 5: the steps run before it are the same
    in the replanned program, and the stopped plan is live."""
    ring = Ring(4, 3, 30, check_every=every)
    stop = next(t for t in ring.collective_steps() if t >= 5)
    run = []
    for step in ring_steps(ring, 0):
        run.append(step)
        if isinstance(step, Collective) and step.name == ("stop", stop):
            ring.stop_at(stop)
    assert ring.steps == stop + 2
    assert run == ring_program(ring)[0]
    assert max(s.microbatch[1] for s in run if isinstance(s, Compute)) == stop + 1
    simulate(ring_program(ring))


@pytest.mark.multiprocess
def test_two_stages_at_the_default_k_equal_one_process_at_k_1(tmp_path):
    """The pipeline worker's rollouts on two stages (the default k; its ring stops at a
    check, step 7 of 10) equal one process's: greedy and sampled with a check every step,
    the others (options, turns) at the default k, which the tests above equal to k = 1."""
    torchrun_ok(SUPPORT / "pipeline_worker.py", str(tmp_path), "2", "rollout", ranks=2)
    got = torch.load(tmp_path / "rollout-S2-W2.pt", weights_only=False)["replicas"][0]
    _, adapter = worker.build(worker.Case("qwen3", "detached"))
    prompt = worker.step_groups(0, 1)[0].prompt
    expected = worker.rollouts(adapter, prompt)
    state = adapter.prefill(prompt, chunk_size=worker.CHUNK_SIZE)
    every_step = {
        "greedy": ls.rollout(adapter, state, 2, 10, temperature=0, stop_check_every=1),
        "sampled": ls.rollout(adapter, state, 3, 10, eos_token_ids=EOS, seed=7, stop_check_every=1),
    }
    for key, out in every_step.items():
        expected[key] = [r.tolist() for r in out.responses]
    expected["sampled_logps"] = [lp.tolist() for lp in every_step["sampled"].logps]
    for key, values in expected.items():
        if key.endswith("logps"):  # float64 rounding: micro-groups are smaller batches
            for got_row, row in zip(got[key], values, strict=True):
                assert got_row == pytest.approx(row, rel=1e-12), key
        else:
            assert got[key] == values, key
