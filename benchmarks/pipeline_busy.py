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
import sys

import stage_runs

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

    import longstraw_core as ls
    from longstraw_core.models.tiny import tiny_model

    model, adapter, world, rank = stage_runs.on_stages(
        lambda: tiny_model(
            "qwen3_5_text", seed=0, **MODEL | {"linear_num_value_heads": args.value_heads}
        ).train()
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

    def rollout() -> None:
        ls.rollout(adapter, state, args.group, args.new_tokens, seed=0, progress=False)

    def replay() -> None:
        ls.grpo_step(adapter, prompt, responses, rewards, config=config, state=state)
        model.zero_grad(set_to_none=True)

    rollout()  # warm-up: the first passes allocate
    timed = stage_runs.timed
    stage_runs.finish(args, rank, {
        "stages": world,
        "rollout_seconds": min(timed(rollout) for _ in range(args.repeats)),
        "replay_seconds": min(timed(replay) for _ in range(args.repeats)),
    })  # fmt: skip


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
    from longstraw_core.rollout.decode import STOP_CHECK_EVERY

    ring = Ring(stages, len(micro_groups(group, stages)), 64, check_every=STOP_CHECK_EVERY)
    pieces = replay_pieces(stages, group)
    replay = simulate(programs(replay_orders(stages, [pieces] * group)))
    return {
        "rollout_busy_stages": simulate(ring_program(ring)).busy_stages,
        "replay_pieces": pieces,
        "replay_idle_share": replay.idle_share,
    }


def main() -> None:
    parser = stage_runs.parser(
        __doc__, prompt_tokens=2048, group=8, new_tokens=64, repeats=2, stages=[1, 2]
    )
    parser.add_argument(
        "--value-heads", type=int, default=64, help="DeltaNet value heads (per-branch state)"
    )
    args = parser.parse_args()
    keys = MODEL["linear_num_key_heads"]
    if args.value_heads < keys or args.value_heads % keys:
        parser.error(
            f"--value-heads {args.value_heads}: Gated DeltaNet needs a multiple of the "
            f"{keys} key heads (each key head serves a whole group of value heads)"
        )
    if args.worker:
        worker(args)
        return
    runs = []
    extra = ["--value-heads", str(args.value_heads)]
    for stages, run in stage_runs.runs(__file__, "pipeline_busy", args, extra):
        runs.append(run | schedules(stages, args.group))
        print(f"S={stages}: rollout {run['rollout_seconds']:.2f} s, "
              f"replay {run['replay_seconds']:.2f} s", flush=True)  # fmt: skip
    stage_runs.add_speedups(runs, ("rollout", "replay"))
    for run in runs:
        print(f"S={run['stages']}: rollout x{run['rollout_speedup']:.2f} "
              f"(ring: {run['rollout_busy_stages']:.2f} stages busy), replay "
              f"x{run['replay_speedup']:.2f} ({run['replay_pieces']} piece(s) a branch, "
              f"schedule idle {run['replay_idle_share']:.1%}) over one process")  # fmt: skip
    stage_runs.write_summary("pipeline_busy", args, MODEL, runs)


if __name__ == "__main__":
    sys.path.insert(0, str(stage_runs.ROOT))
    main()
