"""Agents: a slow tool in one branch against the group's decode time.

One process prefills a prompt and samples ``G`` branches whose turns end often; each
branch's first two ended turns are answered by a "tool" that sleeps (branch 0's for
``--slow-seconds``, the others' for ``--fast-seconds``) and returns a fixed reply, the next
ends the branch. Two runs from the same state and seed:

- **waiting**: the tools run in threads (``begin_turns`` returns at once): the rollout's
  ragged steps go on decoding the other branches while a tool sleeps;
- **lock step** (the baseline, as the rollout ran before issue 27's last item): the handler
  runs the tools in ``begin_turns`` itself, so every decode step waits on the tools of the
  branches whose turns ended at it.

Reported: each run's wall seconds and decode steps, the ratio, and whether the responses
are the same (they must be: a branch's draws depend on its position, not on when answers
come). Then one step in which a branch takes an ``--answer-tokens`` answer while the other
``G - 1`` take one token: the answer prefilled for its branch alone (``BranchCache.narrow``,
what the rollout does) against one batch padded to the answer's length (best of 3 each).
Output: a table and ``benchmarks/results/agent_waits.json``.

    python benchmarks/agent_waits.py                     # ~1 minute on 2 cores
"""

from __future__ import annotations

import argparse
import json
import queue
import threading
import time
from pathlib import Path

import torch

import longstraw_core as ls
from longstraw_core.models.tiny import tiny_model

RESULTS = Path(__file__).resolve().parent / "results"
REPLY = [300, 301, 302, 303, 5]


class SleepingTools:
    """Answers each branch's first two ended turns with ``REPLY`` after its tool's sleep,
    and ends the branch at the third. ``threaded``: tools run in threads; else in
    ``begin_turns`` (the caller waits)."""

    def __init__(self, sleeps: list[float], threaded: bool) -> None:
        self.sleeps, self.threaded = sleeps, threaded
        self.turns: dict[int, int] = {}
        self.answers: queue.Queue[tuple[int, list[int]]] = queue.Queue()
        self.pending = 0

    def _tool(self, row: int, answer: list[int]) -> None:
        time.sleep(self.sleeps[row] if answer else 0.0)
        self.answers.put((row, answer))

    def begin_turns(self, turns: dict[int, list[int]]) -> None:
        for row in turns:
            count = self.turns.get(row, 0)
            self.turns[row] = count + 1
            answer = REPLY if count < 2 else []
            self.pending += 1
            if self.threaded:
                threading.Thread(target=self._tool, args=(row, answer), daemon=True).start()
            else:
                self._tool(row, answer)

    def ended_turns(self, wait: bool) -> dict[int, list[int]]:
        ready: dict[int, list[int]] = {}
        if wait and self.pending:
            row, answer = self.answers.get()
            ready[row] = answer
        while True:
            try:
                row, answer = self.answers.get_nowait()
            except queue.Empty:
                break
            ready[row] = answer
        self.pending -= len(ready)
        return ready


def answer_step(adapter, state, group: int, answer: int) -> dict[str, float]:
    """One decode step with an ``answer``-token prefill in branch 0: padded into one batch
    against branch 0 alone plus the others' one-token batch (the best of 3 each)."""
    ids = torch.randint(0, 512, (group, answer), generator=torch.Generator().manual_seed(1))
    counts = [answer] + [1] * (group - 1)
    timings: dict[str, list[float]] = {"padded": [], "alone": []}
    with torch.no_grad():
        for _ in range(3):
            cache = adapter.new_branch_cache(state, group, answer + 1)
            started = time.perf_counter()
            adapter.decode(state, cache, ids, counts=counts)
            timings["padded"].append(time.perf_counter() - started)
            cache = adapter.new_branch_cache(state, group, answer + 1)
            started = time.perf_counter()
            adapter.decode(state, cache.narrow(0, 1), ids[:1], counts=[answer])
            adapter.decode(state, cache, ids[:, :1], counts=[0] + [1] * (group - 1))
            timings["alone"].append(time.perf_counter() - started)
    padded, alone = min(timings["padded"]), min(timings["alone"])
    return {"padded_seconds": padded, "alone_seconds": alone, "ratio": padded / alone}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--slow-seconds", type=float, default=1.0)
    parser.add_argument("--fast-seconds", type=float, default=0.05)
    parser.add_argument("--answer-tokens", type=int, default=256)
    args = parser.parse_args()
    torch.set_num_threads(1)
    adapter = ls.adapt(tiny_model("qwen3", vocab_size=512, hidden_size=128, num_hidden_layers=4))
    prompt = torch.randint(
        0, 512, (args.prompt_tokens,), generator=torch.Generator().manual_seed(0)
    )
    state = adapter.prefill(prompt)
    sleeps = [args.slow_seconds] + [args.fast_seconds] * (args.group - 1)
    options = {
        "num_generations": args.group, "max_new_tokens": args.max_new_tokens, "seed": 3,
        "eos_token_ids": list(range(0, 512, 8)),  # a turn ends every ~8 tokens
    }  # fmt: skip
    runs = {}
    for name, threaded in (("waiting", True), ("lock_step", False)):
        started = time.perf_counter()
        out = ls.rollout(adapter, state, turns=SleepingTools(sleeps, threaded), **options)
        runs[name] = {
            "seconds": time.perf_counter() - started,
            "steps": out.stats["steps"],
            "tokens": out.stats["generated_tokens"],
            "responses": [r.tolist() for r in out.responses],
        }
    same = runs["waiting"]["responses"] == runs["lock_step"]["responses"]
    ratio = runs["lock_step"]["seconds"] / runs["waiting"]["seconds"]
    print(f"{'run':<10} {'seconds':>8} {'steps':>6} {'tokens':>7}")
    for name, run in runs.items():
        print(f"{name:<10} {run['seconds']:8.2f} {run['steps']:6d} {run['tokens']:7d}")
    print(f"lock step / waiting: {ratio:.2f}x; same responses: {same}")
    prefill = answer_step(adapter, state, args.group, args.answer_tokens)
    print(
        f"a {args.answer_tokens}-token answer beside {args.group - 1} one-token branches: "
        f"padded {prefill['padded_seconds']:.3f} s, alone {prefill['alone_seconds']:.3f} s "
        f"({prefill['ratio']:.2f}x)"
    )
    RESULTS.mkdir(exist_ok=True)
    record = {
        "answer_step": prefill,
        "args": vars(args),
        "runs": {k: {f: v for f, v in r.items() if f != "responses"} for k, r in runs.items()},
        "ratio": ratio,
        "same_responses": same,
    }
    (RESULTS / "agent_waits.json").write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
