"""Pipeline stages against one process: prefill and a whole detached GRPO step, as ratios.

    python benchmarks/pipeline_speed.py                      # 32K prompt, S = 1, 2, 4
    python benchmarks/pipeline_speed.py --prompt-tokens 4096 --stages 1 2   # a quick look

Each S runs under torchrun on S CPU ranks (gloo), one torch thread per rank, the same model
(a dense qwen3 of 16 layers, float32, random weights; with fewer layers the last stage is
visibly lighter in prefill, whose last layer only writes its keys and values) and the same prompt. Every rank times
the same phases between barriers:

- ``prefill``: the prompt in chunks through the stages (stage s on chunk k while stage
  s - 1 is on chunk k + 1);
- ``step``: prefill, a rollout of G branches, the detached replay (``grpo_step``, its
  branches in pieces through the stages) and the optimizer step.

Writes ``pipeline_speed.json`` and ``pipeline_speed.png`` under ``--output``
(``benchmarks/results/``) and prints each S's seconds and speed-up over S=1. On a machine
with fewer cores than S ranks the stages share cores and the ratio says so.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import stage_runs

MODEL = {
    "hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 16,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
    "vocab_size": 1024, "max_position_embeddings": 65536,
}  # fmt: skip


def worker(args: argparse.Namespace) -> None:
    """One rank of one S: time the phases, rank 0 writes them."""
    import torch

    import longstraw_core as ls
    from longstraw_core.models.tiny import tiny_model

    model, adapter, world, rank = stage_runs.on_stages(
        lambda: tiny_model("qwen3", seed=0, **MODEL).train()
    )
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    prompt = torch.randint(0, MODEL["vocab_size"], (args.prompt_tokens,),
                           generator=torch.Generator().manual_seed(0))  # fmt: skip
    config = ls.GRPOConfig(gradient="detached")

    def prefill() -> None:
        adapter.prefill(prompt, chunk_size=args.chunk_size, progress=False)

    def step() -> None:
        state = adapter.prefill(prompt, chunk_size=args.chunk_size, progress=False)
        out = ls.rollout(adapter, state, args.group, args.new_tokens, seed=0, progress=False)
        rewards = [float(i % 2) for i in range(args.group)]
        ls.grpo_step(adapter, prompt, out.responses, rewards, config=config, state=state,
                     old_logps=out.logps, truncated=out.truncated)  # fmt: skip
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    timed = stage_runs.timed
    timed(lambda: adapter.prefill(prompt[: 2 * args.chunk_size], chunk_size=args.chunk_size))
    stage_runs.finish(args, rank, {
        "stages": world,
        "prefill_seconds": min(timed(prefill) for _ in range(args.repeats)),
        "step_seconds": min(timed(step) for _ in range(args.repeats)),
    })  # fmt: skip


def main() -> None:
    parser = stage_runs.parser(
        __doc__, prompt_tokens=32768, group=4, new_tokens=16, repeats=1, stages=[1, 2, 4]
    )
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    runs = []
    for stages, run in stage_runs.runs(__file__, "pipeline_speed", args):
        runs.append(run)
        print(f"S={stages}: prefill {run['prefill_seconds']:.2f} s, "
              f"detached step {run['step_seconds']:.2f} s", flush=True)  # fmt: skip
    stage_runs.add_speedups(runs, ("prefill", "step"))
    stage_runs.write_summary("pipeline_speed", args, MODEL, runs)
    for run in runs:
        print(f"S={run['stages']}: prefill x{run['prefill_speedup']:.2f}, "
              f"step x{run['step_speedup']:.2f} over one process")  # fmt: skip
    plot(runs, args.output / "pipeline_speed.png", args.prompt_tokens)


def plot(runs: list[dict], path: Path, prompt_tokens: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(5, 3.5))
    stages = [run["stages"] for run in runs]
    axis.plot(stages, [run["prefill_speedup"] for run in runs], "o-", label="prefill")
    axis.plot(stages, [run["step_speedup"] for run in runs], "s-", label="detached GRPO step")
    axis.plot(stages, stages, ":", color="grey", label="ideal")
    axis.set_xlabel("pipeline stages S (CPU ranks)")
    axis.set_ylabel("speed-up over one process")
    axis.set_title(f"{prompt_tokens:,}-token prompt, {os.cpu_count()} cores")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.path.insert(0, str(stage_runs.ROOT))
    main()
