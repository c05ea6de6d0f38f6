"""GRPO step: LongStraw detached and exact modes vs the naive TRL-style step, one run.

Measures, on a tiny random-init Qwen3 on CPU, for LongStraw's ``gradient="detached"`` (the
paper's behaviour), ``gradient="exact"`` (the full-graph gradient, through the prompt),
``exact_kept`` (exact mode with ``keep_attention_outputs=True``: prefill keeps every
full-attention layer's output and log-sum-exp, so the sweep skips recomputing the attention
forward, for more memory) and the naive step:

1. peak memory and step time against the group size G at a fixed prompt length;
2. the longest prompt whose step fits a memory budget, for each method;
3. the step time of each at a 16K prompt with G=8, with the ratios the targets name;
4. beside exact mode, the work its sweep does, timed as transformers does it
   (``prompt_graph``: the model's own forward with autograd over the prompt, through every
   layer but the last, and its backward): one forward and one backward over the prompt,
   which any exact step that does not keep the prompt's activations must pay on top of a
   detached step. ``sweep / prompt_graph`` says how efficiently the sweep does that work.

Every measurement is one GRPO step (``loss_type="dapo"``, on-policy, no KL) in a fresh
subprocess that reports its peak RSS (``ru_maxrss``). A worker that builds the model and runs
a 2-token step (1 prompt token, two 1-token responses) gives each method's fixed cost
(Python, torch, the model and its gradients), which is subtracted. Workers run with
``MALLOC_MMAP_THRESHOLD_=1000000`` so RSS follows live memory, not glibc's heap history, and
with one torch thread (``--threads``) so other work on the machine cannot stall them at
OpenMP barriers. Step time is the wall time of that one step, with no warm-up step before
it. The fixed cost, LongStraw's G sweep and the speed-up configuration run ``--repeats``
times (median peak, fastest time). The naive baseline (``benchmarks/naive_grpo.py``) runs
every ``prompt + response`` with autograd and gradient checkpointing, one sequence at a
time, with ``logits_to_keep = |response| + 1``.

First, a gradient check at a short float32 prompt: LongStraw's detached mode against the
naive step with the prompt detached, and exact mode (outputs kept or not) against the
full-graph naive step. ``exact_kept`` is measured and judged wherever ``exact`` is, against
the same exact-mode targets.

Output: a summary table, ``grpo_benchmark.json`` (every raw measurement, model config,
budget, targets and verdicts) and PNG plots under ``benchmarks/results/``.

    python benchmarks/grpo_memory_time.py             # defaults, about 40-60 minutes
    python benchmarks/grpo_memory_time.py --quick     # smoke run, a few minutes
    python benchmarks/grpo_memory_time.py --methods detached naive   # skip both exact modes
    python benchmarks/grpo_memory_time.py --budget-gib 1 --max-longstraw-tokens 131072

Defaults: G in {2, 4, 8} at a 16384-token prompt, 256-token responses, prefill chunks of
512 tokens (exact mode recomputes one chunk at a time: its graph is exact mode's extra
transient); prompt lengths doubling from 4096 at G=2 against a 0.5 GiB budget, LongStraw
capped at 65536 tokens (262144 would take hours on 2 cores: the prefill's attention is
quadratic); step times at 16384 tokens, G=8.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
# Cheap attention (2 query heads over 1 KV head of 16 dims) so the quadratic prefill stays
# affordable on CPU. NOTE: the hidden size is 8x the per-layer K+V width (dense GQA models:
# 2-4x) and there are only 4 layers, so the naive path's per-token activations are ~70x
# LongStraw's per-token state here; on a 36-layer dense model they are ~3-4x.
MODEL: dict[str, Any] = {
    "vocab_size": 1024,
    "hidden_size": 256,
    "intermediate_size": 1024,
    "num_hidden_layers": 4,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 16,
}
TARGETS = {
    "longstraw_memory_growth_g2_to_g8_max": 0.03,  # detached mode (issue #3)
    "longest_prompt_ratio_min": 8.0,  # detached vs naive (issue #3)
    "speedup_min": 5.0,  # detached vs naive (issue #3)
    "exact_peak_vs_detached_max": 2.5,  # issue #6, at the same prompt length
    "exact_longest_prompt_ratio_min": 5.0,  # exact vs naive (issue #6)
    "exact_time_vs_detached_max": 2.5,  # issue #6
    "exact_speedup_min": 3.0,  # exact vs naive (issue #6)
}
METHODS = ("detached", "exact", "exact_kept", "naive")
LONGSTRAW = ("detached", "exact", "exact_kept")
# Exact-gradient modes: each is judged against the exact-mode targets. ``exact_kept`` is exact
# mode with ``keep_attention_outputs=True`` (see longstraw_config).
EXACT_MODES = ("exact", "exact_kept")
# Timed at the speed-up configuration beside exact mode; not a GRPO step (see run_step).
PROMPT_GRAPH = "prompt_graph"
GIB = 2**30
MIB = 2**20


# --- worker side: one step in this process ----------------------------------------------------


def make_group(
    prompt_tokens: int, group_size: int, response_tokens: int, seed: int = 0
) -> tuple[Any, list[Any], list[float]]:
    """Random prompt, G random responses, distinct rewards (so no advantage is zero)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    vocab = MODEL["vocab_size"]
    prompt = torch.randint(0, vocab, (prompt_tokens,), generator=generator)
    responses = [
        torch.randint(0, vocab, (response_tokens,), generator=generator) for _ in range(group_size)
    ]
    return prompt, responses, [float(i) for i in range(group_size)]


def build_model(positions: int) -> Any:
    """The benchmark's tiny float32 Qwen3, sized to hold ``positions`` positions."""
    from longstraw_core.models.tiny import tiny_model

    return tiny_model("qwen3", max_position_embeddings=positions, **MODEL)


def longstraw_config(method: str, group_size: int) -> Any:
    """LongStraw's config for ``method``: a gradient mode, or ``"exact_kept"`` (exact mode
    with every full-attention layer's output and log-sum-exp kept from prefill)."""
    import longstraw_core as ls

    if method == "exact_kept":
        return ls.GRPOConfig(
            loss_type="dapo",
            num_generations=group_size,
            gradient="exact",
            keep_attention_outputs=True,
        )
    return ls.GRPOConfig(loss_type="dapo", num_generations=group_size, gradient=method)


def run_step(
    method: str, model: Any, group: tuple[Any, list[Any], list[float]], chunk_size: int
) -> dict[str, float]:
    """One GRPO step of ``method``; returns its timings (gradients are left in ``.grad``).

    ``method`` is LongStraw's gradient mode, ``"exact_kept"`` (exact mode keeping the
    attention outputs, see longstraw_config) or ``"naive"`` (always the full graph).
    """
    from naive_grpo import naive_grpo_step, prepare_naive

    import longstraw_core as ls

    prompt, responses, rewards = group
    group_size = max(len(responses), 2)
    if method == PROMPT_GRAPH:
        return prompt_graph_step(model, prompt)
    if method == "naive":
        config = ls.GRPOConfig(loss_type="dapo", num_generations=group_size)
        prepare_naive(model)
        started = time.perf_counter()
        metrics = naive_grpo_step(model, prompt, responses, rewards, config)
        return {"seconds": time.perf_counter() - started, **metrics}
    config = longstraw_config(method, group_size)
    adapter = ls.adapt(model)
    started = time.perf_counter()
    result = ls.grpo_step(adapter, prompt, responses, rewards, config=config, chunk_size=chunk_size)
    seconds = time.perf_counter() - started
    return {
        "seconds": seconds,
        "loss": result.loss,
        "prefill_seconds": result.prefill_seconds,
        "replay_seconds": result.replay_seconds,
        "sweep_seconds": result.sweep_seconds,
        "state_bytes": result.state_bytes,
        "attention_output_bytes": result.attention_output_bytes,  # 0 unless exact_kept
    }


def prompt_graph_step(model: Any, prompt: Any) -> dict[str, float]:
    """One forward with autograd over the prompt and its backward, through transformers' own
    decoder: the work exact mode's sweep does (it recomputes every prompt chunk and
    backpropagates it), as the model itself does it, in one piece.

    The last decoder layer is left out: the sweep needs only its keys and values (two small
    projections), so this slightly under-counts the sweep's work. The loss is a sum of squares of the output, so the backward runs
    through every remaining layer with a dense gradient, as the sweep's ``dS`` does.
    """
    decoder = model.model
    decoder.layers = decoder.layers[:-1]
    decoder.config.num_hidden_layers -= 1
    started = time.perf_counter()
    hidden = decoder(input_ids=prompt[None], use_cache=False).last_hidden_state
    forward_seconds = time.perf_counter() - started
    hidden.float().square().mean().backward()
    seconds = time.perf_counter() - started
    return {
        "seconds": seconds,
        "forward_seconds": forward_seconds,
        "backward_seconds": seconds - forward_seconds,
    }


def worker(args: argparse.Namespace) -> dict[str, Any]:
    """Measure one configuration in this (fresh) process: peak RSS and step time."""
    import torch

    prompt_tokens, group_size, response_tokens = args.worker_config
    model = build_model(prompt_tokens + response_tokens)
    group = make_group(prompt_tokens, group_size, response_tokens)
    timings = run_step(args.worker_method, model, group, args.chunk_size)
    return {
        "method": args.worker_method,
        "prompt_tokens": prompt_tokens,
        "group_size": group_size,
        "response_tokens": response_tokens,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "vm_hwm_bytes": _vm_hwm_bytes(),
        "load_average": os.getloadavg(),  # other work on the machine slows every step
        "torch_threads": torch.get_num_threads(),
        **timings,
    }


def _vm_hwm_bytes() -> int | None:
    """This address space's own peak RSS (``VmHWM``), a cross-check of ``ru_maxrss``.

    ``ru_maxrss`` survives ``exec``: a child starts from its parent's peak. The driver
    keeps itself small (no torch) so that it never matters; ``VmHWM`` does not inherit.
    """
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return None
    line = next((x for x in status.splitlines() if x.startswith("VmHWM:")), None)
    return int(line.split()[1]) * 1024 if line else None


# --- driver side: subprocesses, sweeps --------------------------------------------------------


class Runner:
    """Runs workers in fresh subprocesses and caches their runs by configuration.

    The sweeps share configurations (16K at the smallest G is in the G sweep and in the
    length sweep), so each is measured once; asking again with more ``repeats`` tops it up.
    Other work on the machine inflates a run's time far more than its memory, so a
    configuration's time is its fastest run and its peak the median run's.
    """

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.runs: dict[tuple[str, int, int, int], list[dict[str, Any]]] = {}
        self.fixed: dict[str, dict[str, Any]] = {}

    def fixed_cost(self, method: str) -> int:
        """Peak RSS of a 2-token step: interpreter, libraries, model, gradients.

        The row is kept: its step time bounds the method's cold-start overhead (first calls
        into checkpointing, autograd and lazy imports), which every timed step also pays.
        """
        if method not in self.fixed:
            runs = [self._spawn(method, 1, 2, 1) for _ in range(self.args.repeats)]
            self.fixed[method] = aggregate(runs)
        return self.fixed[method]["peak_rss_bytes"]

    def measure(
        self, method: str, prompt_tokens: int, group_size: int, repeats: int = 1
    ) -> dict[str, Any]:
        """The aggregated row of a configuration, with at least ``repeats`` runs behind it."""
        key = (method, prompt_tokens, group_size, self.args.response_tokens)
        runs = self.runs.setdefault(key, [])
        while len(runs) < repeats:
            run = self._spawn(method, prompt_tokens, group_size, self.args.response_tokens)
            runs.append(run)
            above = (run["peak_rss_bytes"] - self.fixed_cost(method)) / MIB
            print(
                f"  {method:>12} | prompt {prompt_tokens:>7} | G {group_size} | peak "
                f"{run['peak_rss_bytes'] / MIB:7.1f} MiB ({above:7.1f} above fixed) | "
                f"{run['seconds']:6.1f} s | load {run['load_average'][0]:.1f}",
                flush=True,
            )
        row = aggregate(runs)
        row["fixed_rss_bytes"] = self.fixed_cost(method)
        row["peak_above_fixed_bytes"] = row["peak_rss_bytes"] - row["fixed_rss_bytes"]
        return row

    def rows(self) -> list[dict[str, Any]]:
        """Every measured configuration, aggregated, in the order first measured."""
        return [self.measure(method, length, g) for method, length, g, _ in self.runs]

    def _spawn(
        self, method: str, prompt_tokens: int, group_size: int, response_tokens: int
    ) -> dict[str, Any]:
        return run_python(
            "--worker-method",
            method,
            "--worker-config",
            str(prompt_tokens),
            str(group_size),
            str(response_tokens),
            "--chunk-size",
            str(self.args.chunk_size),
            threads=self.args.threads,
        )


def aggregate(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One row for repeated runs: the fastest run's times, the median peak, all raw runs."""
    fastest = min(runs, key=lambda run: run["seconds"])
    peaks = sorted(run["peak_rss_bytes"] for run in runs)
    return {
        **fastest,
        "peak_rss_bytes": peaks[len(peaks) // 2],
        "peak_rss_spread_bytes": peaks[-1] - peaks[0],
        "runs": runs,
    }


def run_python(*flags: str, threads: int) -> dict[str, Any]:
    """Run this script with ``flags`` in a fresh process; return the JSON of its last line.

    NOTE: glibc's dynamic mmap threshold keeps freed large blocks in the heap, so RSS would
    reflect the allocator's history; a fixed threshold returns them to the OS.
    ``threads`` sets the worker's OpenMP threads (see ``--threads``).
    """
    command = [sys.executable, __file__, *flags]
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "1000000", "OMP_NUM_THREADS": str(threads)}
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"worker {list(flags)} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def sweep_group_sizes(runner: Runner) -> list[dict[str, Any]]:
    """Every method at the fixed prompt length, for every G."""
    args = runner.args
    print(f"memory and time vs G at a {args.prompt_tokens}-token prompt:", flush=True)
    # The flatness target is LongStraw's: only its runs are repeated (a few MiB of noise).
    return [
        runner.measure(
            method, args.prompt_tokens, group_size, 1 if method == "naive" else args.repeats
        )
        for group_size in args.group_sizes
        for method in args.methods
    ]


def sweep_prompt_lengths(runner: Runner) -> dict[str, list[dict[str, Any]]]:
    """Double the prompt from ``--start-tokens`` until the step passes the budget or the cap.

    The naive run stops at the first length over budget (or ``--max-naive-tokens``);
    LongStraw's the same way, capped at ``--max-longstraw-tokens``.
    """
    args = runner.args
    budget = args.budget_gib * GIB
    group_size = min(args.group_sizes)
    rows: dict[str, list[dict[str, Any]]] = {}
    for method in args.methods:
        cap = args.max_naive_tokens if method == "naive" else args.max_longstraw_tokens
        print(f"{method}: prompt length vs the {args.budget_gib} GiB budget, G={group_size}:")
        rows[method] = []
        length = args.start_tokens
        while length <= cap:
            row = runner.measure(method, length, group_size)
            rows[method].append(row)
            if row["peak_above_fixed_bytes"] > budget:
                break
            length *= 2
    return rows


def _gradients(model: Any, step: Any) -> dict[str, Any]:
    """Run ``step`` from zeroed gradients; return a copy of every parameter's gradient."""
    model.zero_grad(set_to_none=True)
    step()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def _relative_errors(got: dict[str, Any], want: dict[str, Any]) -> dict[str, float]:
    """Global ``|got - want| / |want|`` over all parameters, and the worst single parameter."""
    import torch

    difference = torch.cat([(got[n] - want[n]).flatten() for n in want])
    reference = torch.cat([want[n].flatten() for n in want])
    worst = max(float((got[n] - want[n]).norm() / want[n].norm().clamp(min=1e-30)) for n in want)
    return {"relative_error": float(difference.norm() / reference.norm()), "worst_parameter": worst}


def check_gradients(prompt_tokens: int, chunk_size: int) -> dict[str, Any]:
    """Naive and LongStraw parameter gradients at a short float32 prompt.

    LongStraw's default ``gradient="detached"`` treats the prompt's keys/values as constants,
    so it must equal the naive step with the prompt detached (same loss, same weights), not
    the full-graph naive step: their gap is the gradient through the prompt that detached
    mode drops. ``gradient="exact"`` must equal the full-graph step, with or without the
    attention outputs kept (``exact_kept``). One model serves every step; the full-graph
    naive step runs last, in train mode with checkpointing, which does not change its math
    (every dropout is 0).
    """
    import torch
    from naive_grpo import naive_grpo_step, prepare_naive

    import longstraw_core as ls

    model = build_model(prompt_tokens + 64)
    prompt, _, _ = make_group(prompt_tokens, 0, 0, seed=1)
    lengths, rewards = [17, 33, 9], [0.1, 0.9, 0.4]
    generator = torch.Generator().manual_seed(2)
    responses = [torch.randint(0, MODEL["vocab_size"], (n,), generator=generator) for n in lengths]

    def longstraw_step(method: str) -> Any:
        config = longstraw_config(method, group_size=3)
        adapter = ls.adapt(model)
        return lambda: ls.grpo_step(
            adapter, prompt, responses, rewards, config=config, chunk_size=chunk_size
        )

    def naive_step(detach_prompt: bool) -> Any:
        config = ls.GRPOConfig(loss_type="dapo", num_generations=3)
        return lambda: naive_grpo_step(
            model, prompt, responses, rewards, config, detach_prompt=detach_prompt
        )

    detached = _gradients(model, longstraw_step("detached"))
    exact = _gradients(model, longstraw_step("exact"))
    exact_kept = _gradients(model, longstraw_step("exact_kept"))
    # Before prepare_naive: with checkpointing in train mode transformers refuses the cache.
    naive_detached = _gradients(model, naive_step(detach_prompt=True))
    prepare_naive(model)
    naive_full = _gradients(model, naive_step(detach_prompt=False))
    return {
        "prompt_tokens": prompt_tokens,
        "response_lengths": lengths,
        "chunk_size": chunk_size,
        "detached_vs_naive_detached_prompt": _relative_errors(detached, naive_detached),
        "detached_vs_naive_full_graph": _relative_errors(detached, naive_full),
        "exact_vs_naive_full_graph": _relative_errors(exact, naive_full),
        "exact_kept_vs_naive_full_graph": _relative_errors(exact_kept, naive_full),
    }


# --- summary ----------------------------------------------------------------------------------


def growth(rows: list[dict[str, Any]], method: str, key: str) -> float:
    """(peak at the largest G - peak at the smallest G) / peak at the smallest G."""
    mine = sorted((r for r in rows if r["method"] == method), key=lambda r: r["group_size"])
    return (mine[-1][key] - mine[0][key]) / mine[0][key]


def longest_within(rows: list[dict[str, Any]], budget: float) -> dict[str, Any]:
    """Longest measured prompt under budget, and whether the sweep ever crossed the budget.

    A sweep that stopped at its cap without crossing gives only a lower bound.
    """
    fitting = [r["prompt_tokens"] for r in rows if r["peak_above_fixed_bytes"] <= budget]
    crossed = any(r["peak_above_fixed_bytes"] > budget for r in rows)
    return {"longest_prompt_tokens": max(fitting, default=None), "crossed_budget": crossed}


def extrapolated_crossing(rows: list[dict[str, Any]], budget: float) -> float | None:
    """Prompt length at which the line through the two longest prompts' peaks meets the budget.

    An estimate, for a sweep stopped at its length cap before crossing. LongStraw's peak is
    a transient (prefill chunk, one branch's backward) that stops growing once the prompt
    outgrows one attention block, plus the state, linear in the prompt length; the two
    longest prompts give that linear slope, the shorter ones would flatten it.
    """
    if len(rows) < 2:
        return None
    shorter, longer = sorted(rows, key=lambda r: r["prompt_tokens"])[-2:]
    slope = (longer["peak_above_fixed_bytes"] - shorter["peak_above_fixed_bytes"]) / (
        longer["prompt_tokens"] - shorter["prompt_tokens"]
    )
    if slope <= 0:
        return None
    return longer["prompt_tokens"] + (budget - longer["peak_above_fixed_bytes"]) / slope


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    return numerator / denominator if numerator and denominator else None


def _ratio_kind(mine: dict[str, Any], naive: dict[str, Any]) -> str:
    """A method stopping at its cap makes the ratio a lower bound; naive stopping at its
    cap makes it an upper bound."""
    if not naive["crossed_budget"]:
        return "undetermined (the naive run never crossed the budget)"
    return "exact (both crossed the budget)" if mine["crossed_budget"] else "lower bound"


def summarise(
    args: argparse.Namespace,
    by_g: list[dict[str, Any]],
    by_length: dict[str, list[dict[str, Any]]],
    speed: dict[str, dict[str, Any]],
) -> dict[str, Any]:
    """Ratios and verdicts against the targets, for whichever methods ran."""
    budget = args.budget_gib * GIB
    longest = {method: longest_within(rows, budget) for method, rows in by_length.items()}
    summary: dict[str, Any] = {"longest": longest, "verdicts": {}, "by_mode": {}}
    verdicts = summary["verdicts"]
    naive_long = longest.get("naive", {}).get("longest_prompt_tokens")
    for mode in (m for m in LONGSTRAW if m in by_length):
        crossing = extrapolated_crossing(by_length[mode], budget)
        mine = {
            "growth_above_fixed": growth(by_g, mode, "peak_above_fixed_bytes"),
            "growth_absolute": growth(by_g, mode, "peak_rss_bytes"),
            "extrapolated_budget_tokens": crossing,
            "extrapolated_ratio": _ratio(crossing, naive_long),
        }
        if "naive" in by_length:
            mine["longest_prompt_ratio"] = _ratio(
                longest[mode]["longest_prompt_tokens"], naive_long
            )
            mine["longest_prompt_ratio_kind"] = _ratio_kind(longest[mode], longest["naive"])
            mine["speedup"] = speed["naive"]["seconds"] / speed[mode]["seconds"]
        summary["by_mode"][mode] = mine
    if "naive" in by_length:
        summary["naive_growth_above_fixed"] = growth(by_g, "naive", "peak_above_fixed_bytes")
        summary["naive_growth_absolute"] = growth(by_g, "naive", "peak_rss_bytes")
    if "detached" in summary["by_mode"]:
        detached = summary["by_mode"]["detached"]
        limit = TARGETS["longstraw_memory_growth_g2_to_g8_max"]
        verdicts["detached_memory_flat_in_g_above_fixed"] = detached["growth_above_fixed"] <= limit
        verdicts["detached_memory_flat_in_g_absolute"] = detached["growth_absolute"] <= limit
        if "naive" in by_length:
            ratio = detached["longest_prompt_ratio"]
            verdicts["detached_longest_prompt_ratio"] = (
                ratio is not None and ratio >= TARGETS["longest_prompt_ratio_min"]
            )
            verdicts["detached_speedup"] = detached["speedup"] >= TARGETS["speedup_min"]
    # Every exact mode against the same exact-mode targets; verdicts are "<mode>_<name>".
    for mode in (m for m in EXACT_MODES if m in summary["by_mode"]):
        exact = summary["by_mode"][mode]
        if "detached" in summary["by_mode"]:
            exact["peak_vs_detached"] = _peak_ratios(mode, by_g, by_length)
            exact["time_vs_detached"] = speed[mode]["seconds"] / speed["detached"]["seconds"]
            worst = max(exact["peak_vs_detached"].values())
            verdicts[f"{mode}_peak_vs_detached"] = worst <= TARGETS["exact_peak_vs_detached_max"]
            verdicts[f"{mode}_time_vs_detached"] = (
                exact["time_vs_detached"] <= TARGETS["exact_time_vs_detached_max"]
            )
            prompt_graph = speed[PROMPT_GRAPH]["seconds"]
            exact["sweep_vs_prompt_graph"] = speed[mode]["sweep_seconds"] / prompt_graph
            exact["time_vs_detached_with_prompt_graph"] = (
                1 + prompt_graph / speed["detached"]["seconds"]
            )
        if "naive" in by_length:
            ratio = exact["longest_prompt_ratio"]
            verdicts[f"{mode}_longest_prompt_ratio"] = (
                ratio is not None and ratio >= TARGETS["exact_longest_prompt_ratio_min"]
            )
            verdicts[f"{mode}_speedup"] = exact["speedup"] >= TARGETS["exact_speedup_min"]
    return summary


def _peak_ratios(
    mode: str, by_g: list[dict[str, Any]], by_length: dict[str, list[dict[str, Any]]]
) -> dict[str, float]:
    """``mode`` (an exact mode) / detached peak above the fixed cost, for every configuration
    both measured."""
    rows = [*by_g, *(row for method_rows in by_length.values() for row in method_rows)]
    peaks = {(r["method"], r["prompt_tokens"], r["group_size"]): r for r in rows}
    ratios = {}
    for (method, tokens, group_size), row in sorted(peaks.items()):
        detached = peaks.get(("detached", tokens, group_size))
        if method == mode and detached is not None:
            ratio = row["peak_above_fixed_bytes"] / detached["peak_above_fixed_bytes"]
            ratios[f"prompt {tokens}, G={group_size}"] = ratio
    return ratios


def print_summary(
    args: argparse.Namespace,
    by_g: list[dict[str, Any]],
    summary: dict[str, Any],
    speed: dict[str, dict[str, Any]],
    fixed: dict[str, dict[str, Any]],
) -> None:
    """A readable table of every headline number and whether its target is met."""
    verdicts = summary["verdicts"]

    def verdict(key: str) -> str:
        return "MET" if verdicts[key] else "NOT MET"

    print(f"\nmemory vs G (prompt {args.prompt_tokens}, responses {args.response_tokens}):")
    header = f"{'G':>3} | {'method':>10} | {'peak MiB':>9} | {'above fixed MiB':>15} | "
    print(f"  {header}{'spread MiB':>10} | {'runs':>4} | {'step s':>7}")
    for row in sorted(by_g, key=lambda r: (r["group_size"], METHODS.index(r["method"]))):
        print(
            f"  {row['group_size']:>3} | {row['method']:>10} | {row['peak_rss_bytes'] / MIB:9.1f} "
            f"| {row['peak_above_fixed_bytes'] / MIB:15.1f} | "
            f"{row['peak_rss_spread_bytes'] / MIB:10.1f} | {len(row['runs']):>4} | "
            f"{row['seconds']:7.1f}"
        )
    g_lo, g_hi = min(args.group_sizes), max(args.group_sizes)
    target = TARGETS["longstraw_memory_growth_g2_to_g8_max"]
    for mode, mine in summary["by_mode"].items():
        judged = (
            f" [{verdict('detached_memory_flat_in_g_above_fixed')}, target <= {target:.0%}]"
            if mode == "detached"
            else ""
        )
        print(
            f"{mode} peak growth G={g_lo}->{g_hi}: {mine['growth_above_fixed']:+.1%} above "
            f"fixed cost{judged}, {mine['growth_absolute']:+.1%} absolute"
        )
    if "naive_growth_above_fixed" in summary:
        print(
            f"naive peak growth: {summary['naive_growth_above_fixed']:+.1%} above fixed, "
            f"{summary['naive_growth_absolute']:+.1%} absolute (one sequence per micro-batch "
            "keeps the naive step flat in G too)"
        )
    exact_modes = {m: summary["by_mode"][m] for m in EXACT_MODES if m in summary["by_mode"]}
    for mode, exact in exact_modes.items():
        if "peak_vs_detached" not in exact:
            continue
        print(f"{mode} / detached peak above fixed cost, same configuration:")
        for where, ratio in exact["peak_vs_detached"].items():
            print(f"  {where}: {ratio:.2f}x")
        limit = TARGETS["exact_peak_vs_detached_max"]
        print(f"  worst {max(exact['peak_vs_detached'].values()):.2f}x "
              f"[{verdict(f'{mode}_peak_vs_detached')}, target <= {limit}x]")  # fmt: skip

    print(f"\nlongest prompt within {args.budget_gib} GiB above the fixed cost:")
    for method, info in summary["longest"].items():
        note = "" if info["crossed_budget"] else " (never crossed the budget: a lower bound)"
        print(f"  {method:>10}: {info['longest_prompt_tokens']} tokens{note}")
    for mode, mine in summary["by_mode"].items():
        if "longest_prompt_ratio" not in mine:
            continue
        ratio = mine["longest_prompt_ratio"]
        key, minimum = (
            ("detached_longest_prompt_ratio", TARGETS["longest_prompt_ratio_min"])
            if mode == "detached"
            else (f"{mode}_longest_prompt_ratio", TARGETS["exact_longest_prompt_ratio_min"])
        )
        ratio_text = "n/a" if ratio is None else f"{ratio:.0f}x"
        print(
            f"  {mode} / naive: {ratio_text} ({mine['longest_prompt_ratio_kind']}) "
            f"[{verdict(key)}, target >= {minimum:.0f}x]"
        )
        crossing = mine["extrapolated_budget_tokens"]
        if crossing and not summary["longest"][mode]["crossed_budget"]:
            extrapolated = mine["extrapolated_ratio"]
            print(
                f"    its peak, extrapolated along the slope between its two longest prompts, "
                f"meets the budget at ~{crossing:,.0f} tokens (an estimate, not measured)"
                + (f": ~{extrapolated:.0f}x the naive's longest" if extrapolated else "")
            )

    any_row = next(iter(speed.values()))
    print(f"\nstep time at prompt {any_row['prompt_tokens']}, G={any_row['group_size']}:")
    for method, row in speed.items():
        phases = ""
        if method == PROMPT_GRAPH:
            phases = (
                f" (forward {row['forward_seconds']:.1f} s, backward "
                f"{row['backward_seconds']:.1f} s; not a GRPO step)"
            )
        elif method != "naive":
            phases = (
                f" (prefill {row['prefill_seconds']:.1f} s, replay {row['replay_seconds']:.1f} s"
            )
            phases += f", sweep {row['sweep_seconds']:.1f} s" if row["sweep_seconds"] else ""
            kept = row.get("attention_output_bytes")
            phases += f", attention outputs kept {kept / MIB:.1f} MiB)" if kept else ")"
        times = ", ".join(f"{run['seconds']:.1f}" for run in row["runs"])
        loads = ", ".join(f"{run['load_average'][0]:.1f}" for run in row["runs"])
        print(
            f"  {method:>12}: {row['seconds']:.1f} s{phases}; runs {times} s "
            f"(1-min load average {loads}); fastest kept"
        )
    if "detached" in summary["by_mode"] and "speedup" in summary["by_mode"]["detached"]:
        print(
            f"  detached vs naive: {summary['by_mode']['detached']['speedup']:.1f}x faster "
            f"[{verdict('detached_speedup')}, target >= {TARGETS['speedup_min']:.0f}x]"
        )
    for mode, exact in exact_modes.items():
        if "time_vs_detached" in exact:
            print(
                f"  {mode} / detached: {exact['time_vs_detached']:.2f}x "
                f"[{verdict(f'{mode}_time_vs_detached')}, target <= "
                f"{TARGETS['exact_time_vs_detached_max']}x]"
            )
            print(
                f"  {mode}'s sweep / {PROMPT_GRAPH} (the same forward + backward in "
                f"transformers): {exact['sweep_vs_prompt_graph']:.2f}x; a detached step plus "
                f"{PROMPT_GRAPH}: {exact['time_vs_detached_with_prompt_graph']:.2f}x detached"
            )
        if "speedup" in exact:
            print(
                f"  {mode} vs naive: {exact['speedup']:.1f}x faster "
                f"[{verdict(f'{mode}_speedup')}, target >= {TARGETS['exact_speedup_min']:.0f}x]"
            )
    cold = {method: row["seconds"] for method, row in fixed.items()}
    print(
        "  (one cold step per process; a 2-token step takes "
        + ", ".join(f"{m} {t:.2f} s" for m, t in cold.items())
        + ", which bounds the cold-start overhead in each time)"
    )


def print_gradient_check(check: dict[str, Any]) -> None:
    """One line per comparison, saying what each one is expected to show."""
    print(f"gradient check (prompt {check['prompt_tokens']} tokens, float32), relative error:")
    rows = [
        ("LongStraw detached vs naive, prompt detached", "detached_vs_naive_detached_prompt"),
        ("LongStraw detached vs naive, full graph", "detached_vs_naive_full_graph"),
        ("LongStraw exact vs naive, full graph", "exact_vs_naive_full_graph"),
        (
            "LongStraw exact, attention outputs kept, vs naive, full graph",
            "exact_kept_vs_naive_full_graph",
        ),
    ]
    for label, key in rows:
        errors = check[key]
        print(
            f"  {label}: {errors['relative_error']:.1e} (worst parameter "
            f"{errors['worst_parameter']:.1e})"
        )
    print(
        "  (detached mode drops the gradient through the prompt's keys/values: the first, "
        "third and fourth lines must be ~1e-6, the second is the gradient detached mode "
        "leaves out)",
        flush=True,
    )


# --- plots ------------------------------------------------------------------------------------


def plot(
    args: argparse.Namespace,
    by_g: list[dict[str, Any]],
    by_length: dict[str, list[dict[str, Any]]],
    out: Path,
) -> list[Path]:
    """Memory vs G, memory vs prompt length (with the budget), step time per phase."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = [out / f"grpo_{name}.png" for name in ("memory_vs_g", "memory_vs_prompt", "time")]
    styles = {
        "detached": ("o-", "LongStraw detached"),
        "exact": ("^-", "LongStraw exact"),
        "exact_kept": ("v--", "LongStraw exact, attention outputs kept"),
        "naive": ("s-", "naive (TRL-style)"),
    }
    styles = {method: style for method, style in styles.items() if method in args.methods}

    figure, axis = plt.subplots(figsize=(6, 4))
    for method, (style, label) in styles.items():
        rows = sorted((r for r in by_g if r["method"] == method), key=lambda r: r["group_size"])
        sizes = [r["group_size"] for r in rows]
        axis.plot(sizes, [r["peak_above_fixed_bytes"] / MIB for r in rows], style, label=label)
    axis.set_xticks(args.group_sizes)
    axis.set_xlabel("group size G")
    axis.set_ylabel("peak RSS above fixed cost (MiB)")
    axis.set_title(f"GRPO step, {args.prompt_tokens}-token prompt (tiny qwen3, CPU)")
    axis.set_ylim(bottom=0)
    axis.legend()
    figure.tight_layout()
    figure.savefig(paths[0], dpi=120)

    figure, axis = plt.subplots(figsize=(6, 4))
    for method, (style, label) in styles.items():
        rows = by_length[method]
        tokens = [r["prompt_tokens"] for r in rows]
        axis.plot(tokens, [r["peak_above_fixed_bytes"] / MIB for r in rows], style, label=label)
    axis.axhline(args.budget_gib * 1024, color="grey", linestyle="--", label="budget")
    axis.set_xscale("log", base=2)
    axis.set_xlabel("prompt tokens")
    axis.set_ylabel("peak RSS above fixed cost (MiB)")
    axis.set_title(f"GRPO step, G={min(args.group_sizes)}: memory vs prompt length")
    axis.legend()
    figure.tight_layout()
    figure.savefig(paths[1], dpi=120)

    figure, axis = plt.subplots(figsize=(7, 4))
    sizes = sorted(args.group_sizes)
    rows = {(r["method"], r["group_size"]): r for r in by_g}
    width = 0.8 / len(styles)
    for slot, method in enumerate(styles):
        offsets = [i - 0.4 + width * (slot + 0.5) for i in range(len(sizes))]
        if method == "naive":
            axis.bar(offsets, [rows[method, g]["seconds"] for g in sizes], width, label="naive")
            continue
        bottom = [0.0] * len(sizes)
        hatch = "//" if method == "exact_kept" else None  # told apart from exact's bars
        for phase in ("prefill", "replay", "sweep"):  # sweep: exact mode's pass over the prompt
            seconds = [rows[method, g][f"{phase}_seconds"] for g in sizes]
            if any(seconds):
                axis.bar(
                    offsets, seconds, width, bottom=bottom, hatch=hatch, label=f"{method} {phase}"
                )
                bottom = [b + t for b, t in zip(bottom, seconds, strict=True)]
    axis.set_xticks(list(range(len(sizes))), [f"G={g}" for g in sizes])
    axis.set_ylabel("step wall time (s), one cold step")
    axis.set_title(f"GRPO step time by phase, {args.prompt_tokens}-token prompt")
    axis.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(paths[2], dpi=120)
    plt.close("all")
    return paths


# --- main -------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sweeps, a smoke run")
    parser.add_argument("--group-sizes", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--prompt-tokens", type=int, default=16384, help="for the G sweep")
    parser.add_argument("--response-tokens", type=int, default=256)
    parser.add_argument("--start-tokens", type=int, default=4096, help="length sweep start")
    parser.add_argument("--budget-gib", type=float, default=0.5, help="above the fixed cost")
    parser.add_argument("--max-naive-tokens", type=int, default=262144)
    # NOTE: 262144 would take hours here: LongStraw's prefill is quadratic in attention and
    # its pure-torch attention is unfused; 65536 already takes ~5-10 minutes on 2 cores.
    parser.add_argument("--max-longstraw-tokens", type=int, default=65536)
    parser.add_argument("--speed-prompt-tokens", type=int, default=16384)
    parser.add_argument("--speed-group-size", type=int, default=8)
    parser.add_argument("--chunk-size", type=int, default=512, help="LongStraw prefill chunk")
    parser.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="runs of the fixed cost, LongStraw's G sweep and the speed-up configuration",
    )
    # NOTE: with other work on the machine, two OpenMP threads wait on each other at every
    # barrier: a step then runs 2-15x slower, erratically. One thread per worker is steady.
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    parser.add_argument("--output", type=Path, default=RESULTS)
    parser.add_argument(
        "--methods", nargs="+", choices=METHODS, default=list(METHODS), help="what to measure"
    )
    parser.add_argument("--worker-method", choices=(*METHODS, PROMPT_GRAPH), help=argparse.SUPPRESS)
    parser.add_argument("--check-worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--worker-config", type=int, nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.check_prompt_tokens = 200
    if args.quick:  # overrides the sweep flags; writes under results/quick/
        args.group_sizes = [2, 4]
        args.prompt_tokens = args.speed_prompt_tokens = args.start_tokens = 1024
        args.speed_group_size = 4
        args.response_tokens = 16
        args.budget_gib = 1 / 16  # the naive step crosses 64 MiB at 2048 tokens
        args.max_naive_tokens = args.max_longstraw_tokens = 4096
        args.chunk_size = 256
        args.check_prompt_tokens = 48
        args.repeats = 1
        args.output = args.output / "quick"
    return args


def main() -> None:
    args = parse_args()
    if args.worker_method is not None:
        print(json.dumps(worker(args)))
        return
    if args.check_worker is not None:
        print(json.dumps(check_gradients(args.check_worker, chunk_size=16)))
        return
    started = time.perf_counter()
    # In a subprocess too: this driver must stay small (see _vm_hwm_bytes).
    gradients = run_python("--check-worker", str(args.check_prompt_tokens), threads=args.threads)
    print_gradient_check(gradients)
    runner = Runner(args)
    by_g = sweep_group_sizes(runner)
    by_length = sweep_prompt_lengths(runner)
    print("speed-up configuration (runs interleaved, fastest kept):", flush=True)
    any_exact = any(mode in args.methods for mode in EXACT_MODES)
    speed_methods = [*args.methods, *([PROMPT_GRAPH] if any_exact else [])]
    for repeat in range(1, args.repeats + 1):
        for method in speed_methods:
            runner.measure(method, args.speed_prompt_tokens, args.speed_group_size, repeat)
    speed = {
        method: runner.measure(method, args.speed_prompt_tokens, args.speed_group_size)
        for method in speed_methods
    }
    # Re-aggregated: the speed-up configuration is in the G sweep and may have more runs now.
    by_g = [runner.measure(r["method"], r["prompt_tokens"], r["group_size"]) for r in by_g]
    summary = summarise(args, by_g, by_length, speed)
    print_summary(args, by_g, summary, speed, runner.fixed)

    args.output.mkdir(parents=True, exist_ok=True)
    plots = plot(args, by_g, by_length, args.output)
    report = {
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "model": {"model_type": "qwen3", "dtype": "float32", **MODEL},
        "budget_bytes_above_fixed": args.budget_gib * GIB,
        "budget_note": (
            f"{args.budget_gib} GiB of peak RSS above the fixed cost, chosen so the naive "
            "baseline crosses it within a few doublings from the start length on this model"
        ),
        "timing_note": (
            f"wall time of one cold step per fresh process (no warm-up step), {args.threads} "
            "torch thread(s); repeated configurations keep their fastest run"
        ),
        "loss": (
            "GRPOConfig(loss_type='dapo'), on-policy, beta=0, LongStraw in detached and exact "
            "mode, and exact mode with keep_attention_outputs=True (exact_kept); the naive step "
            "always differentiates the full graph"
        ),
        "targets": TARGETS,
        "gradient_check": gradients,
        "fixed_cost_runs": runner.fixed,
        "by_group_size": by_g,
        "by_prompt_length": by_length,
        "speed": speed,
        "summary": summary,
        "measurements": runner.rows(),
        "total_seconds": time.perf_counter() - started,
    }
    path = args.output / "grpo_benchmark.json"
    path.write_text(json.dumps(report, indent=2))
    print(f"\nwrote {path} and {', '.join(str(p) for p in plots)}")
    print(f"total {report['total_seconds'] / 60:.1f} min")


if __name__ == "__main__":
    main()
