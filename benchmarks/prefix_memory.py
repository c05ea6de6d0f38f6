"""Memory check: does the peak of prefill + score grow no faster than the prefix state?

Each prompt length runs in a fresh subprocess that reports its own peak RSS, so runs do not
see each other's allocations. A run with a 2-token prompt measures the fixed cost (Python,
torch, the model), which is subtracted. Output: a table, ``prefix_memory.json`` and
``prefix_memory.png`` under ``benchmarks/results/``.

    python benchmarks/prefix_memory.py                       # 8K, 32K, 128K tokens, qwen3
    python benchmarks/prefix_memory.py --lengths 8192 16384  # quicker
    python benchmarks/prefix_memory.py --model-type qwen3_5_text  # hybrid: per layer type
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
# Cheap in attention (the prefill is quadratic on CPU), with K/V large enough to measure.
DENSE_MODEL = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 32,
}
VOCAB = 1024


def measure(
    model_type: str, prompt_tokens: int, response_tokens: int, chunk_size: int
) -> dict[str, float]:
    """Prefill + score + backward in this process; returns state bytes and peak RSS."""
    import torch

    import longstraw_core as ls
    from longstraw_core.models.tiny import tiny_model

    shape = DENSE_MODEL if bench_families.full_attention_only(model_type) else {}
    model = tiny_model(
        model_type,
        vocab_size=VOCAB,
        max_position_embeddings=prompt_tokens + response_tokens,
        **shape,
    )
    adapter = ls.adapt(model)
    ids = torch.randint(0, VOCAB, (prompt_tokens + response_tokens,))
    started = time.perf_counter()
    state = adapter.prefill(ids[:prompt_tokens], chunk_size=chunk_size, progress=False)
    adapter.score(state, ids[prompt_tokens:]).sum().backward()
    return {
        "prompt_tokens": prompt_tokens,
        "state_bytes": state.nbytes(),
        "state_bytes_by_layer_type": {k: row["bytes"] for k, row in state.summary().items()},
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "seconds": time.perf_counter() - started,
    }


def run_worker(prompt_tokens: int, args: argparse.Namespace) -> dict[str, float]:
    command = [
        sys.executable,
        __file__,
        "--worker",
        str(prompt_tokens),
        "--model-type",
        args.model_type,
        "--response-tokens",
        str(args.response_tokens),
        "--chunk-size",
        str(args.chunk_size),
    ]
    # NOTE: glibc's dynamic mmap threshold keeps freed large blocks in the heap, so RSS would
    # measure the allocator's history rather than live memory; a fixed threshold returns them.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "1000000"}
    output = subprocess.run(command, check=True, capture_output=True, text=True, env=env).stdout
    return json.loads(output.strip().splitlines()[-1])


def plot(rows: list[dict[str, float]], path: Path, model_type: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tokens = [row["prompt_tokens"] for row in rows]
    figure, axis = plt.subplots(figsize=(6, 4))
    axis.plot(tokens, [row["state_bytes"] / 2**20 for row in rows], "o-", label="prefix state")
    axis.plot(
        tokens, [row["peak_above_fixed_bytes"] / 2**20 for row in rows], "s-", label="peak RSS"
    )
    axis.set_xscale("log", base=2)
    axis.set_xlabel("prompt tokens")
    axis.set_ylabel("MiB above the fixed cost")
    axis.set_title(f"prefill + score: peak memory vs prefix state (tiny {model_type}, CPU)")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768, 131072])
    parser.add_argument("--response-tokens", type=int, default=256)
    parser.add_argument("--chunk-size", type=int, default=4096)
    parser.add_argument("--model-type", default="qwen3")
    parser.add_argument("--output", type=Path, default=RESULTS, help="where JSON/PNG go")
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        row = measure(args.model_type, args.worker, args.response_tokens, args.chunk_size)
        print(json.dumps(row))
        return

    fixed = run_worker(2, args)["peak_rss_bytes"]
    rows = []
    for length in args.lengths:
        row = run_worker(length, args)
        row["peak_above_fixed_bytes"] = row["peak_rss_bytes"] - fixed
        # What prefill + score hold besides the state: bounded by the chunk and block sizes.
        row["transient_bytes"] = row["peak_above_fixed_bytes"] - row["state_bytes"]
        rows.append(row)
        kinds = ", ".join(
            f"{kind} {size / 2**20:.3f} MiB"
            for kind, size in row["state_bytes_by_layer_type"].items()
        )
        print(
            f"{length:>8} tokens: state {row['state_bytes'] / 2**20:8.1f} MiB ({kinds}) | "
            f"peak above fixed {row['peak_above_fixed_bytes'] / 2**20:8.1f} MiB | "
            f"transient {row['transient_bytes'] / 2**20:6.1f} MiB | "
            f"{row['seconds']:.1f} s",
            flush=True,
        )
    first, last = rows[0], rows[-1]
    growth = (last["peak_above_fixed_bytes"] - first["peak_above_fixed_bytes"]) / max(
        last["state_bytes"] - first["state_bytes"], 1
    )
    print(
        f"peak growth / state growth from {first['prompt_tokens']} to {last['prompt_tokens']} "
        f"tokens: {growth:.2f} (at most 1 means the peak grows no faster than the state)"
    )
    if len(rows) > 2:  # the transient saturates once the prompt spans several chunks
        before = rows[-2]
        tail_growth = (last["peak_above_fixed_bytes"] - before["peak_above_fixed_bytes"]) / max(
            last["state_bytes"] - before["state_bytes"], 1
        )
        print(
            f"between the two longest prompts ({before['prompt_tokens']} -> "
            f"{last['prompt_tokens']}): {tail_growth:.2f}"
        )
    args.output.mkdir(parents=True, exist_ok=True)
    report = {
        "model_type": args.model_type,
        "fixed_rss_bytes": fixed,
        "rows": rows,
        "peak_growth_over_state_growth": growth,
    }
    stem = f"prefix_memory_{args.model_type}"
    (args.output / f"{stem}.json").write_text(json.dumps(report, indent=2))
    plot(rows, args.output / f"{stem}.png", args.model_type)
    print(f"wrote {args.output / stem}.json and .png")


if __name__ == "__main__":
    main()
