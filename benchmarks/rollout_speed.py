"""Rollout: peak memory against the state it reads, and batched against one-by-one decoding.

One fresh subprocess prefills a 32K-token prompt, then samples ``G = 8`` responses of 256
tokens in one batch (``ls.rollout``), then the same 8 responses one at a time (8 rollouts
of one branch), and reports:

- **memory**: the peak RSS *during the batched rollout* above the fixed cost, against the
  prefix state plus the branches' own state (their K/V caches). The peak is reset after
  prefill (``/proc/self/clear_refs``), so the prefill's own transients do not count; the
  fixed cost (Python, torch, the model, one tiny rollout) is the peak of a second fresh
  subprocess that rolls out 2 tokens per branch from a 2-token prompt. Target: at most state + branches + 10%.
- **speed**: generated tokens per second, batched against one by one (8 rollouts of one
  branch). Each is timed ``--repeats`` times, interleaved, and the best kept: the machines
  here are shared, and a burst of another job's load would otherwise decide the ratio.
  Target: at least 3x.

Workers run with ``MALLOC_MMAP_THRESHOLD_=1000000`` (as ``prefix_memory.py``) so RSS follows
live memory rather than glibc's heap history, and with one torch thread by default: on a
2-core machine shared with other jobs, a 2-thread pool spends its time waiting for a core.
No EOS is set, so every branch decodes all 256 tokens in both runs.

Output: a table and ``rollout_speed.json`` (``rollout_speed_<model_type>.json`` for other
model types) and a PNG under ``benchmarks/results/``.

    python benchmarks/rollout_speed.py                  # qwen3, 32K prompt, G=8: ~4 minutes
    python benchmarks/rollout_speed.py --prompt-tokens 4096 --max-new-tokens 64   # quick
    python benchmarks/rollout_speed.py --model-type qwen3_5_text   # hybrid, default tiny shape
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

import bench_families

RESULTS = Path(__file__).resolve().parent / "results"
# As many KV heads as query heads: the most prefix K/V (6 KiB a token, 192 MiB at 32K) for
# the cost of the quadratic prefill, about a minute and a half for 32K tokens on one core.
DENSE_MODEL = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 6,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 64,
}
VOCAB = 1024
TARGETS = {"memory_ratio_max": 1.10, "speedup_min": 3.0}


def _status_kib(field: str) -> int:
    """A ``/proc/self/status`` memory field (``VmRSS``, ``VmHWM``) in KiB."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak() -> bool:
    """Reset the peak RSS (VmHWM) to the current RSS; False where the kernel refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
    except OSError:
        return False
    return True


def measure(args: argparse.Namespace, prompt_tokens: int) -> dict:
    """Prefill, then batched and one-by-one rollouts, in this process."""
    import torch

    torch.set_num_threads(args.threads)
    import longstraw_core as ls
    from longstraw_core.models.tiny import tiny_model

    shape = DENSE_MODEL if bench_families.full_attention_only(args.model_type) else {}
    model = tiny_model(
        args.model_type,
        vocab_size=VOCAB,
        max_position_embeddings=prompt_tokens + args.max_new_tokens,
        **shape,
    )
    adapter = ls.adapt(model)
    prompt = torch.randint(0, VOCAB, (prompt_tokens,), generator=torch.Generator().manual_seed(0))
    started = time.perf_counter()
    state = adapter.prefill(prompt, chunk_size=args.chunk_size, progress=False)
    prefill_seconds = time.perf_counter() - started
    ls.rollout(adapter, state, num_generations=1, max_new_tokens=2, progress=False)  # warm-up

    rss_before = _status_kib("VmRSS") * 1024
    reset = _reset_peak()
    options = {"max_new_tokens": args.max_new_tokens, "progress": False}
    group = args.num_generations
    batched = ls.rollout(adapter, state, num_generations=group, seed=0, **options)
    rollout_peak = _status_kib("VmHWM") * 1024
    row = {
        "prompt_tokens": prompt_tokens,
        "prefill_seconds": prefill_seconds,
        "state_bytes": state.nbytes(),
        "branch_cache_bytes": batched.stats["branch_cache_bytes"],
        "rss_before_rollout_bytes": rss_before,
        "rollout_peak_rss_bytes": rollout_peak,
        "peak_was_reset_after_prefill": reset,
        "process_peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "batched": batched.stats,
    }
    if args.skip_sequential:
        return row
    batched_seconds = [batched.stats["decode_seconds"]]
    sequential_seconds = []
    for repeat in range(args.repeats):
        if repeat:
            again = ls.rollout(adapter, state, num_generations=group, seed=0, **options)
            batched_seconds.append(again.stats["decode_seconds"])
        singles = [
            ls.rollout(adapter, state, num_generations=1, seed=seed, **options)
            for seed in range(group)
        ]
        sequential_seconds.append(sum(single.stats["decode_seconds"] for single in singles))
    tokens = sum(single.stats["generated_tokens"] for single in singles)
    row["batched"]["seconds_per_repeat"] = batched_seconds
    row["batched"]["tokens_per_second"] = batched.stats["generated_tokens"] / min(batched_seconds)
    row["sequential"] = {
        "seconds_per_repeat": sequential_seconds,
        "generated_tokens": tokens,
        "tokens_per_second": tokens / min(sequential_seconds),
    }
    return row


def run_worker(args: argparse.Namespace, prompt_tokens: int, **overrides: object) -> dict:
    command = [sys.executable, __file__, "--worker", str(prompt_tokens)]
    names = ("model_type", "num_generations", "max_new_tokens", "chunk_size", "threads", "repeats")
    for name in names:
        command += [f"--{name.replace('_', '-')}", str(overrides.get(name, getattr(args, name)))]
    if overrides.get("skip_sequential"):
        command.append("--skip-sequential")
    # NOTE: glibc's dynamic mmap threshold keeps freed large blocks in the heap, so RSS would
    # measure the allocator's history rather than live memory; a fixed threshold returns them.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "1000000"}
    output = subprocess.run(command, check=True, capture_output=True, text=True, env=env).stdout
    return json.loads(output.strip().splitlines()[-1])


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    row = report["row"]
    mib = 2**20
    figure, (memory, speed) = plt.subplots(1, 2, figsize=(9, 4))
    labels = ["prefix state", "state +\nbranches", "peak above\nfixed cost"]
    values = [
        row["state_bytes"] / mib,
        (row["state_bytes"] + row["branch_cache_bytes"]) / mib,
        report["peak_above_fixed_bytes"] / mib,
    ]
    memory.bar(labels, values, color=["#888", "#555", "#c44"])
    target = values[1] * TARGETS["memory_ratio_max"]
    memory.axhline(target, ls="--", c="k", label="target: state + branches + 10%")
    memory.set_ylabel("MiB")
    memory.set_title(f"rollout memory, G={report['num_generations']}")
    memory.legend(loc="lower right")
    speed.bar(
        ["one by one", "batched"],
        [row["sequential"]["tokens_per_second"], row["batched"]["tokens_per_second"]],
        color=["#888", "#46c"],
    )
    speed.set_ylabel("generated tokens / s")
    speed.set_title(f"decoding speed-up {report['speedup']:.1f}x")
    figure.suptitle(
        f"tiny {report['model_type']}, {row['prompt_tokens']:,}-token prompt, "
        f"{report['max_new_tokens']} new tokens, CPU"
    )
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt-tokens", type=int, default=32768)
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--chunk-size", type=int, default=4096)
    parser.add_argument("--model-type", default="qwen3")
    parser.add_argument("--output", type=Path, default=RESULTS, help="where JSON/PNG go")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=2, help="timings per mode (best kept)")
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--skip-sequential", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        print(json.dumps(measure(args, args.worker)))
        return

    # The fixed cost: a 2-token prompt and 2 new tokens (no state, branch caches of 2 positions).
    fixed = run_worker(args, 2, max_new_tokens=2, skip_sequential=True)["rollout_peak_rss_bytes"]
    row = run_worker(args, args.prompt_tokens)
    held = row["state_bytes"] + row["branch_cache_bytes"]
    above = row["rollout_peak_rss_bytes"] - fixed
    ratio = above / held
    speedup = row["batched"]["tokens_per_second"] / row["sequential"]["tokens_per_second"]
    report = {
        "model_type": args.model_type,
        "model_shape": DENSE_MODEL if bench_families.full_attention_only(args.model_type) else {},
        "num_generations": args.num_generations,
        "max_new_tokens": args.max_new_tokens,
        "threads": args.threads,
        "repeats": args.repeats,
        "fixed_rss_bytes": fixed,
        "row": row,
        "peak_above_fixed_bytes": above,
        "state_plus_branches_bytes": held,
        "memory_ratio": ratio,
        # The rollout's own growth, in the same process: branches + transients (diagnostic).
        "rollout_growth_bytes": row["rollout_peak_rss_bytes"] - row["rss_before_rollout_bytes"],
        "speedup": speedup,
        "targets": TARGETS,
        "verdicts": {
            "memory": ratio <= TARGETS["memory_ratio_max"],
            "speed": speedup >= TARGETS["speedup_min"],
        },
    }
    mib = 2**20
    print(
        f"prompt {row['prompt_tokens']:,} tokens (prefill {row['prefill_seconds']:.0f} s), "
        f"G={args.num_generations} x {args.max_new_tokens} new tokens, tiny {args.model_type}\n"
        f"  prefix state       {row['state_bytes'] / mib:8.1f} MiB\n"
        f"  branches' own      {row['branch_cache_bytes'] / mib:8.1f} MiB\n"
        f"  peak above fixed   {above / mib:8.1f} MiB  -> {ratio:.3f} x (state + branches), "
        f"target <= {TARGETS['memory_ratio_max']:.2f}: "
        f"{'ok' if report['verdicts']['memory'] else 'MISSED'}\n"
        f"  batched            {row['batched']['tokens_per_second']:8.1f} tokens/s\n"
        f"  one by one         {row['sequential']['tokens_per_second']:8.1f} tokens/s  -> "
        f"{speedup:.1f}x, target >= {TARGETS['speedup_min']:.0f}x: "
        f"{'ok' if report['verdicts']['speed'] else 'MISSED'}",
        flush=True,
    )
    args.output.mkdir(parents=True, exist_ok=True)
    stem = "rollout_speed" if args.model_type == "qwen3" else f"rollout_speed_{args.model_type}"
    (args.output / f"{stem}.json").write_text(json.dumps(report, indent=2))
    plot(report, args.output / f"{stem}.png")
    print(f"wrote {args.output / stem}.json and .png")


if __name__ == "__main__":
    main()
