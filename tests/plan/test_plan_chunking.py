"""``train.chunk_size: null``: the chunk the planner chooses (``longstraw_core.plan.chunking``).

At SmolLM2-135M's dimensions (the issue's measurements: exact mode at chunk 4096 peaked at
4.8-12 GB, at 1024 at 3.3-3.6 GB and as fast), the choice keeps a chunk's graph near what
the rest of the step needs; an explicit chunk is never changed; and on a tiny model the
planner's per-token cost of a sweep chunk, and the choice it makes from it, agree with
measured peaks.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig

import longstraw_core as ls
from longstraw_core.config import ConfigError, load_config
from longstraw_core.models.tiny import tiny_model
from longstraw_core.plan import (
    ModelSpec,
    Workload,
    auto_chunk,
    chunk_for_config,
    compute_plan,
    plan_for_config,
    resolve_chunk,
)
from longstraw_core.plan.chunking import CHUNKS, SLACK, SWEEP_GRAPH, candidates
from longstraw_core.plan.units import GIB
from longstraw_core.tensors.memory import LiveTensorMemory

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "qwen36" / "tiny_grpo_cpu.yaml"
TOLERANCE = 0.15  # test_plan's: a measured peak against the plan's


def smollm2_spec(dtype: torch.dtype = torch.float32) -> ModelSpec:
    """SmolLM2-135M's dimensions (its config.json), built on ``meta``: nothing downloaded."""
    config = LlamaConfig(
        hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192,
        tie_word_embeddings=True,
    )  # fmt: skip
    return ModelSpec.from_config(config, "SmolLM2-135M", dtype)


def smollm2_work(prompt: int, dtype: torch.dtype = torch.float32, **changes) -> Workload:
    """An exact step on one GPU, as the issue's runs: G=8, 512-token responses."""
    return Workload(
        prompt_tokens=prompt, group=8, response_tokens=512, chunk_size=None, chunk_auto=True,
        gradient="exact", param_dtype=dtype, compute_dtype=dtype, device="cuda", **changes,
    )  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("prompt", [2048, 6144])
def test_smollm2_gets_a_chunk_whose_graph_stays_near_the_rest_of_the_step(prompt, dtype):
    spec, work = smollm2_spec(dtype), smollm2_work(prompt, dtype)
    choice = auto_chunk(spec, work)
    assert choice.chunk in CHUNKS and 256 <= choice.chunk <= 1024  # not the old 4096
    old = compute_plan(spec, dataclasses.replace(work, chunk_size=4096))
    assert choice.plan.peak <= (1 + SLACK) * choice.leanest.peak < old.peak
    # the largest such chunk: the next one up goes past the slack
    assert choice.larger is not None and choice.larger.peak > (1 + SLACK) * choice.leanest.peak
    # its graph: under the old default's, and under what the weights' training holds
    assert choice.graph == choice.plan.line(SWEEP_GRAPH).device
    assert choice.graph < old.line(SWEEP_GRAPH).device
    weights = ("parameters", "gradients", "optimizer (AdamW)")
    assert choice.graph <= sum(choice.plan.line(name).device for name in weights)
    note = choice.note()
    assert note.startswith(f"train.chunk_size: {choice.chunk} (auto: a chunk's graph ~")
    assert note.endswith("; set train.chunk_size to override)")


def test_smollm2_at_2k_and_6k_tokens_in_float32_takes_1024():
    """The issue's case: 1024 was as fast as 4096 at a third of the peak."""
    spec = smollm2_spec()
    assert [auto_chunk(spec, smollm2_work(prompt)).chunk for prompt in (2048, 6144)] == [1024] * 2


def test_a_budget_keeps_only_the_chunks_that_fit():
    spec, work = smollm2_spec(), smollm2_work(6144)
    free = auto_chunk(spec, work)
    tight = dataclasses.replace(work, budget=free.plan.peak - 1)
    choice = auto_chunk(spec, tight)
    assert choice.chunk < free.chunk and choice.plan.fits
    assert " of " in choice.reason()  # the budget is named
    # nothing fits: the leanest chunk, for check_fits to name a fix
    hopeless = auto_chunk(spec, dataclasses.replace(work, budget=GIB // 4))
    assert hopeless.chunk == hopeless.leanest.work.chunk_size and hopeless.plan.fits is False


def test_candidates_stop_at_the_first_chunk_that_holds_the_prompt():
    def tried(prompt: int) -> tuple[int, ...]:
        return candidates(smollm2_work(prompt))

    assert tried(100) == (256,)
    assert tried(2048) == (256, 512, 1024, 2048)  # 2047 stored positions: one chunk of 2048
    assert tried(2049) == (256, 512, 1024, 2048)
    assert tried(2050) == (256, 512, 1024, 2048, 4096)
    assert tried(2_000_000) == CHUNKS and CHUNKS[-1] == 8192
    short = auto_chunk(smollm2_spec(), dataclasses.replace(smollm2_work(200), gradient="detached"))
    assert short.chunk == 256 and short.one_chunk
    assert "a prefill chunk ~" in short.reason() and "the prompt fits one chunk" in short.reason()


def test_an_explicit_chunk_size_is_never_changed():
    cfg = load_config(TINY, ["train.chunk_size=3000"], check_paths=False)
    spec, work = plan_for_config(cfg)
    assert (work.chunk_size, work.chunk_auto) == (3000, False)
    assert chunk_for_config(cfg) is None and resolve_chunk(spec, work) is work
    assert cfg.train.chunk_size == 3000


def test_null_is_the_default_and_the_planner_resolves_it():
    cfg = load_config(TINY, ["train.chunk_size=null"], check_paths=False)
    assert cfg.train.chunk_size is None
    spec, work = plan_for_config(cfg)
    choice = chunk_for_config(cfg)
    assert work.chunk_auto and work.chunk_size == choice.chunk in CHUNKS
    # chosen again for a changed workload
    longer = resolve_chunk(spec, dataclasses.replace(work, response_tokens=1024, group=16))
    assert longer.chunk_size == auto_chunk(spec, longer).chunk
    with pytest.raises(ValueError, match="chunk_size=None"):
        compute_plan(spec, dataclasses.replace(work, chunk_size=None))
    from longstraw_core.schema.run_config import TrainSection

    assert TrainSection().chunk_size is None


@pytest.mark.parametrize("value", ["0", "-4"])
def test_a_chunk_below_one_is_refused(value):
    with pytest.raises(ConfigError, match=r"train\.chunk_size.*null \(auto\) or an int >= 1"):
        load_config(TINY, [f"train.chunk_size={value}"], check_paths=False)


def _cli(capsys, *args: str) -> tuple[int, str, str]:
    """``python -m longstraw_core.plan --config TINY ...`` in this process: (exit code,
    stdout with rich's line wraps undone, stderr)."""
    from longstraw_core.plan.cli import main

    try:
        code = main(["--config", str(TINY), *args])
    except SystemExit as exit:  # argparse's refusal
        code = exit.code
    out, err = capsys.readouterr()
    return code, " ".join(out.split()), err


def test_the_plan_cli_says_which_chunk_auto_chose_and_keeps_an_explicit_one(capsys):
    code, out, err = _cli(capsys, "--chunk-size", "auto", "--response-tokens", "64")
    assert code == 0, err
    cfg = load_config(
        TINY, ["train.chunk_size=null", "rollout.max_new_tokens=64"], check_paths=False
    )
    chunk = chunk_for_config(cfg).chunk  # chosen for the workload as the flags change it
    assert f"chunk {chunk} (auto)" in out
    assert f"advice: train.chunk_size: {chunk} (auto: a chunk's graph ~" in out
    code, out, err = _cli(capsys, "--chunk-size", "1000")
    assert code == 0, err
    assert "chunk 1000," in out and "(auto" not in out
    code, _, err = _cli(capsys, "--chunk-size", "zero")
    assert code == 2 and "a positive int or auto" in err


# --- against measured peaks --------------------------------------------------------------

PROMPT, GROUP, RESPONSE = 2048, 2, 128
# A small llama whose replayed branch (a 4096-token vocabulary's logits) is the step's
# peak at the smallest chunks, so that the choice is neither the smallest nor the largest.
LLAMA = dict(
    hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=32, vocab_size=4096,
)  # fmt: skip


def measure_exact_step(model: torch.nn.Module, chunk: int) -> LiveTensorMemory:
    """One exact step in steady state (AdamW moments exist), the sweep a phase of its own."""
    adapter = ls.adapt(model)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    prompt = torch.randint(
        0, adapter.vocab_size, (PROMPT,), generator=torch.Generator().manual_seed(0)
    )
    config = ls.GRPOConfig(num_generations=GROUP, gradient="exact")
    tracked = [*model.parameters(), *model.buffers(), optimizer.state_dict()["state"], prompt]
    with LiveTensorMemory(tracked) as memory:
        sweep = adapter.backprop_prompt

        def backprop_prompt(*args, **kwargs):
            with memory.phase("sweep"):
                return sweep(*args, **kwargs)

        adapter.backprop_prompt = backprop_prompt
        with memory.phase("prefill"):
            state = adapter.prefill(prompt, chunk_size=chunk, checkpoints="device")
        with memory.phase("rollout"):
            out = ls.rollout(adapter, state, GROUP, RESPONSE, seed=0)
        with memory.phase("replay"):
            rewards = [float(i) for i in range(GROUP)]
            ls.grpo_step(adapter, prompt, out.responses, rewards, config=config, state=state)
        del state
        with memory.phase("optimizer"):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return memory


def test_the_sweep_graphs_cost_and_the_choice_agree_with_measured_peaks():
    """Each chunk's sweep peak within test_plan's tolerance of the plan's, the graph's cost
    per token too, and the rule applied to the measured peaks picks the planner's chunk."""
    torch.set_num_threads(1)
    model = tiny_model("llama", max_position_embeddings=PROMPT + RESPONSE + 8, **LLAMA).train()
    spec = ModelSpec.from_model(model, "llama")
    work = Workload(
        prompt_tokens=PROMPT, group=GROUP, response_tokens=RESPONSE, chunk_size=None,
        chunk_auto=True, gradient="exact", device="cpu",
    )  # fmt: skip
    choice = auto_chunk(spec, work)
    tried = candidates(work)
    measured = {chunk: measure_exact_step(model, chunk) for chunk in tried}
    planned = {
        chunk: compute_plan(spec, dataclasses.replace(work, chunk_size=chunk)) for chunk in tried
    }
    for chunk in tried:
        sweep, plan = measured[chunk].phases["sweep"], planned[chunk].phases["sweep"]
        assert abs(plan - sweep) <= TOLERANCE * sweep, (chunk, sweep, plan)
    low, high = tried[0], tried[-1]
    per_token = (measured[high].phases["sweep"] - measured[low].phases["sweep"]) / (high - low)
    planned_per_token = (planned[high].phases["sweep"] - planned[low].phases["sweep"]) / (
        high - low
    )
    assert abs(planned_per_token - per_token) <= TOLERANCE * per_token
    leanest = min(memory.peak for memory in measured.values())
    by_measure = max(c for c in tried if measured[c].peak <= (1 + SLACK) * leanest)
    assert tried[0] < choice.chunk == by_measure < tried[-1]
