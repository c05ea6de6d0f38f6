"""The prefix-state demo (``make state-demo``): one long prompt, prefilled once, scored once.

Builds a tiny random-init model (no downloads), prefills a synthetic prompt of 32K tokens in
chunks without autograd, scores a response with autograd through the branch, checks the
log-probabilities against the transformers model's own full-sequence forward, and prints
what the prefix state holds and what it costs.

    python -m longstraw_core.training.state_demo --prompt-tokens 32768 --model-type qwen3
"""

from __future__ import annotations

import argparse
import time

import torch
from rich.console import Console
from rich.table import Table

import longstraw_core as ls
from longstraw_core.adapters import registry
from longstraw_core.models.tiny import tiny_model


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-type", default="qwen3", choices=sorted(registry.tiny_configs()))
    parser.add_argument("--prompt-tokens", type=int, default=32_768)
    parser.add_argument("--response-tokens", type=int, default=128)
    parser.add_argument("--chunk-size", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--no-check",
        action="store_true",
        help="skip the comparison with the transformers model's full-sequence forward",
    )
    return parser.parse_args(argv)


def state_table(state: ls.PrefixState) -> Table:
    """Bytes by layer type; fixed-size records show no per-token figure."""
    summary = state.summary()
    expanded = any("expanded_bytes_per_token" in row for row in summary.values())
    table = Table(title=f"Prefix state of a {state.prompt_length:,}-token prompt")
    columns = ["layer type", "layers", "bytes", "bytes / token", "grows with prompt"]
    if expanded:
        columns.append("expanded K/V / token")
    for column in columns:
        table.add_column(column, justify="left" if column == "layer type" else "right")
    for kind, row in summary.items():
        cells = [
            kind,
            str(row["layers"]),
            ls.format_bytes(row["bytes"]),
            ls.format_bytes(row["bytes_per_token"]) if row["grows_with_prompt"] else "fixed",
            "yes" if row["grows_with_prompt"] else "no",
        ]
        if expanded:
            per_token = row.get("expanded_bytes_per_token")
            cells.append(ls.format_bytes(per_token) if per_token is not None else "")
        table.add_row(*cells)
    return table


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    console = Console()
    total = args.prompt_tokens + args.response_tokens
    model = tiny_model(
        args.model_type,
        seed=args.seed,
        vocab_size=2048,
        max_position_embeddings=total,
    )
    adapter = ls.adapt(model)
    generator = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(0, 2048, (total,), generator=generator)
    prompt, response = ids[: args.prompt_tokens], ids[args.prompt_tokens :]
    parameters = sum(p.numel() * p.element_size() for p in model.parameters())
    console.print(
        f"[bold]LongStraw demo[/]: tiny random-init {args.model_type} "
        f"({ls.format_bytes(parameters)} of parameters), prompt {len(prompt):,} tokens, "
        f"response {len(response)} tokens, chunk size {args.chunk_size}"
    )

    started = time.perf_counter()
    state = adapter.prefill(prompt, chunk_size=args.chunk_size, progress=True)
    prefill_seconds = time.perf_counter() - started

    started = time.perf_counter()
    logps = adapter.score(state, response)
    logps.sum().backward()  # the branch runs with autograd; the prompt state is detached
    score_seconds = time.perf_counter() - started
    grad_norm = torch.linalg.vector_norm(
        torch.stack([p.grad.norm() for p in model.parameters() if p.grad is not None])
    )

    console.print(state_table(state))
    console.print(
        f"prefill: {prefill_seconds:.1f} s ({len(prompt) / prefill_seconds:,.0f} tokens/s) | "
        f"score + backward of {len(response)} tokens: {score_seconds:.2f} s | "
        f"mean log-prob {logps.mean().item():.4f} | parameter grad norm {grad_norm:.4f}"
    )
    console.print(
        f"The state is {ls.format_bytes(state.nbytes())}; every branch of a GRPO group reads "
        "this one copy, so the group size adds only one branch's graph at a time."
    )
    if not args.no_check:
        with torch.no_grad():
            sequence = torch.cat([prompt, response])[None]
            logits = model(input_ids=sequence, logits_to_keep=len(response) + 1).logits[0, :-1]
            expected = torch.log_softmax(logits.float(), -1).gather(-1, response[:, None])[:, 0]
        error = (logps.detach() - expected).abs().max().item()
        console.print(
            f"check against the transformers model's full-sequence forward: "
            f"max |Δ log-prob| = {error:.2e}"
        )
        if error > 1e-4:
            raise SystemExit(f"log-probabilities differ from the reference by {error:.2e}")


if __name__ == "__main__":
    main()
