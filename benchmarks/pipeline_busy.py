"""Rollout and replay on two pipeline stages against one process, as ratios in one run.

    python benchmarks/pipeline_busy.py            # G=8 x 64 tokens, S = 1 and 2 (a few minutes)
    make pipeline-busy                            # the same, results under docs/benchmarks/

Each S runs under torchrun on S CPU ranks (gloo), one torch thread per rank, the same model
(``MODEL``: Qwen3.6's layers, 8 of them, float32, random weights) and the same prompt.
Every rank times, between barriers:

- ``rollout``: ``G`` branches of ``--new-tokens`` tokens (no end of sequence): on stages,
  ``min(G, S)`` micro-groups go around the ring of stages, each stage busy with one;
- ``replay``: a replay-only GRPO step (``grpo_step`` on the prefilled state, detached; no
  optimizer step) over ``G`` responses of that length: on stages, the schedule of
  ``Stage.pieces_for`` (1F1B over the branches at S=2, G=8).

Beside the measured ratios it prints the schedules' own figures (``simulate``, unit costs):
the busy stages of the rollout's ring and the replay's idle share. Writes
``pipeline_busy.json`` under ``--output`` (``benchmarks/results/``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
# Qwen3.6's architecture (three Gated DeltaNet layers to one of full attention) at toy width,
# with wide DeltaNet heads (16 key, 64 value heads of 128 x 128): every branch carries its own
# recurrent state (4 MiB a layer here; Qwen3.6-27B's 48 DeltaNet layers hold about 150 MiB a
# branch), which each decode step reads and writes, so a step's work grows with the branches
# it decodes: the regime of the planner's rollout at 2.1M positions, where those states bound
# it. What does not grow with the branches (weights, the shared prefix, Python) is read once per
# micro-group: with ``F`` of it and ``V`` that does, S=2 can gain at most
# ``(F + V) / (F + V / 2)``.
MODEL = {
    "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 8,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
    "linear_num_key_heads": 16, "linear_num_value_heads": 64, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "vocab_size": 1024, "max_position_embeddings": 65536,
}  # fmt: skip


def worker(args: argparse.Namespace) -> None:
    """One rank of one S: time the phases; rank 0 writes them."""
    import torch
    import torch.distributed as dist

    import longstraw_core as ls
    from longstraw_core.config import DistributedSection
    from longstraw_core.pipeline.topology import RunTopology
    from longstraw_core.tiny_models import tiny_model

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    model = tiny_model(
        "qwen3_5_text", seed=0, **MODEL | {"linear_num_value_heads": args.value_heads}
    ).train()
    adapter = ls.adapt(model)
    if world > 1:
        RunTopology.from_config(DistributedSection(pipeline_stages=world), world, rank).place(
            adapter
        )
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, MODEL["vocab_size"], (args.prompt_tokens,), generator=generator)
    responses = [
        torch.randint(0, MODEL["vocab_size"], (args.new_tokens,), generator=generator)
        for _ in range(args.group)
    ]
    rewards = [float(i % 2) for i in range(args.group)]
    config = ls.GRPOConfig(gradient="detached")
    state = adapter.prefill(prompt, chunk_size=args.chunk_size, progress=False)

    def timed(fn) -> float:
        dist.barrier()
        started = time.perf_counter()
        fn()
        dist.barrier()
        return time.perf_counter() - started

    def rollout() -> None:
        ls.rollout(adapter, state, args.group, args.new_tokens, seed=0, progress=False)

    def replay() -> None:
        ls.grpo_step(adapter, prompt, responses, rewards, config=config, state=state)
        model.zero_grad(set_to_none=True)

    rollout()  # warm-up: the first passes allocate
    result = {
        "stages": world,
        "rollout_seconds": min(timed(rollout) for _ in range(args.repeats)),
        "replay_seconds": min(timed(replay) for _ in range(args.repeats)),
    }
    if rank == 0:
        Path(args.result).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # skip gloo's teardown (tests/distributed_worker.py says why)


def schedules(stages: int, group: int) -> dict[str, float]:
    """The schedules' figures with unit costs: the ring's busy stages, replay's idle share."""
    from longstraw_core.pipeline.schedule import (
        Ring,
        micro_groups,
        programs,
        replay_orders,
        ring_program,
    )
    from longstraw_core.pipeline.simulate import replay_pieces, simulate

    ring = Ring(stages, len(micro_groups(group, stages)), 64)
    pieces = replay_pieces(stages, group)
    replay = simulate(programs(replay_orders(stages, [pieces] * group)))
    return {
        "rollout_busy_stages": simulate(ring_program(ring)).busy_stages,
        "replay_pieces": pieces,
        "replay_idle_share": replay.idle_share,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--chunk-size", type=int, default=1024)
    parser.add_argument("--group", type=int, default=8, help="G: branches per group")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--value-heads", type=int, default=64, help="DeltaNet value heads (per-branch state)"
    )
    parser.add_argument("--stages", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--output", type=Path, default=HERE / "results")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    args.output.mkdir(parents=True, exist_ok=True)
    runs = []
    for stages in args.stages:
        result = args.output / f"pipeline_busy_S{stages}.json"
        command = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
            str(stages), __file__, "--worker", "--result", str(result),
            "--prompt-tokens", str(args.prompt_tokens), "--chunk-size", str(args.chunk_size),
            "--group", str(args.group), "--new-tokens", str(args.new_tokens),
            "--repeats", str(args.repeats), "--value-heads", str(args.value_heads),
        ]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        subprocess.run(command, check=True, cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
        run = json.loads(result.read_text()) | schedules(stages, args.group)
        runs.append(run)
        print(f"S={stages}: rollout {run['rollout_seconds']:.2f} s, "
              f"replay {run['replay_seconds']:.2f} s", flush=True)  # fmt: skip
    base = next(run for run in runs if run["stages"] == 1)
    for run in runs:
        run["rollout_speedup"] = base["rollout_seconds"] / run["rollout_seconds"]
        run["replay_speedup"] = base["replay_seconds"] / run["replay_seconds"]
        print(f"S={run['stages']}: rollout x{run['rollout_speedup']:.2f} "
              f"(ring: {run['rollout_busy_stages']:.2f} stages busy), replay "
              f"x{run['replay_speedup']:.2f} ({run['replay_pieces']} piece(s) a branch, "
              f"schedule idle {run['replay_idle_share']:.1%}) over one process")  # fmt: skip
    summary = {"settings": {**vars(args), "output": str(args.output), "model": MODEL,
                            "cores": os.cpu_count()}, "runs": runs}  # fmt: skip
    (args.output / "pipeline_busy.json").write_text(json.dumps(summary, indent=2, default=str))


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
