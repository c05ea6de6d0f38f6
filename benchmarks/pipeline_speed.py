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
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
MODEL = {
    "hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 16,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
    "vocab_size": 1024, "max_position_embeddings": 65536,
}  # fmt: skip


def worker(args: argparse.Namespace) -> None:
    """One rank of one S: time the phases, rank 0 writes them."""
    import torch
    import torch.distributed as dist

    import longstraw_core as ls
    from longstraw_core.config import DistributedSection
    from longstraw_core.pipeline.topology import RunTopology
    from longstraw_core.tiny_models import tiny_model

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    topology = RunTopology.from_config(
        DistributedSection(pipeline_stages=world), world, rank
    ) if world > 1 else None  # fmt: skip
    model = tiny_model("qwen3", seed=0, **MODEL).train()
    adapter = ls.adapt(model)
    if topology is not None:
        topology.place(adapter)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    prompt = torch.randint(0, MODEL["vocab_size"], (args.prompt_tokens,),
                           generator=torch.Generator().manual_seed(0))  # fmt: skip
    config = ls.GRPOConfig(gradient="detached")

    def timed(fn) -> float:
        dist.barrier()
        started = time.perf_counter()
        fn()
        dist.barrier()
        return time.perf_counter() - started

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

    timed(lambda: adapter.prefill(prompt[: 2 * args.chunk_size], chunk_size=args.chunk_size))
    result = {
        "stages": world,
        "prefill_seconds": min(timed(prefill) for _ in range(args.repeats)),
        "step_seconds": min(timed(step) for _ in range(args.repeats)),
    }
    if rank == 0:
        Path(args.result).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # skip gloo's teardown (tests/distributed_worker.py says why)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt-tokens", type=int, default=32768)
    parser.add_argument("--chunk-size", type=int, default=1024)
    parser.add_argument("--group", type=int, default=4, help="G: branches per group")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--stages", type=int, nargs="+", default=[1, 2, 4])
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
        result = args.output / f"pipeline_speed_S{stages}.json"
        command = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
            str(stages), __file__, "--worker", "--result", str(result),
            "--prompt-tokens", str(args.prompt_tokens), "--chunk-size", str(args.chunk_size),
            "--group", str(args.group), "--new-tokens", str(args.new_tokens),
            "--repeats", str(args.repeats),
        ]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        subprocess.run(command, check=True, cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
        runs.append(json.loads(result.read_text()))
        print(f"S={stages}: prefill {runs[-1]['prefill_seconds']:.2f} s, "
              f"detached step {runs[-1]['step_seconds']:.2f} s", flush=True)  # fmt: skip
    base = next(run for run in runs if run["stages"] == 1)
    for run in runs:
        run["prefill_speedup"] = base["prefill_seconds"] / run["prefill_seconds"]
        run["step_speedup"] = base["step_seconds"] / run["step_seconds"]
    summary = {"settings": {**vars(args), "output": str(args.output), "model": MODEL,
                            "cores": os.cpu_count()}, "runs": runs}  # fmt: skip
    (args.output / "pipeline_speed.json").write_text(json.dumps(summary, indent=2, default=str))
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
    sys.path.insert(0, str(ROOT))
    main()
