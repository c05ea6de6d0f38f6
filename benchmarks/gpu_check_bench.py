"""One benchmark step of ``make gpu-check``, in its own process: writes one JSON row.

- ``--peaks``: what the device reaches on its own: a dense matmul's TFLOP/s, a device copy's
  bandwidth (read + write) and a pinned host-to-device copy's (CUDA) — the references the
  prefill's MFU and the planner's bandwidth efficiency are measured against.
- ``--family F``: the adapter's prefill (the state kept, no logits) against the transformers
  model's own no-grad forward on the same prompt, tokens/s and TFLOP/s, with the kernels the
  prefill chose (``kernel_trace``).

Why a process per step: a kernel that hangs or crashes the process (a CUDA fault, a Triton
compile that never ends) costs that step and its time limit, not the whole check.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import kernel_trace
from bench_families import gpu_shapes, prefill_bench_models

# Benchmark models: each family's declared widths (``GpuShapes.bench_dims``: wide enough for
# the GPU to be busy, a few layers, random weights), for the families declaring
# ``prefill_benchmark`` (``bench_families.prefill_bench_models``).
# --quick (CPU): the same layer types at toy widths.
_QUICK = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 8,  # Qwen3.6's 4th and 8th are full attention (the last only writes)
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 64,
    "linear_value_head_dim": 64,
}


def forward_flops(config: Any, tokens: int, lm_head: bool = True) -> float:
    """FLOPs of one causal forward over ``tokens``: 2 per weight per token for the decoder's
    matmuls (embeddings excluded; the LM head on every token as transformers computes it,
    none for the adapter's prefill, which keeps the state instead) plus
    causal attention's two ``T^2/2`` products per full-attention layer. Gated DeltaNet's
    chunked recurrence (linear in ``T``, a few percent here) is not counted."""
    hidden, layers = config.hidden_size, config.num_hidden_layers
    heads, head_dim = config.num_attention_heads, getattr(config, "head_dim", None)
    head_dim = head_dim or hidden // heads
    kv = config.num_key_value_heads * head_dim
    attention_weights = hidden * heads * head_dim * 2 + 2 * hidden * kv
    mlp_weights = 3 * hidden * config.intermediate_size
    types = getattr(config, "layer_types", None) or ["full_attention"] * layers
    full = sum(kind == "full_attention" for kind in types[:layers])
    head = hidden * config.vocab_size if lm_head else 0  # prefill keeps the state, no logits
    per_token = 2 * (layers * (attention_weights + mlp_weights) + head)
    attention = 2 * 2 * full * heads * head_dim * tokens * tokens / 2
    return per_token * tokens + attention


def bench_family(family: str, device_name: str, quick: bool) -> dict[str, Any]:
    """Prefill (K/V on the device) against ``model(prompt)`` under no_grad, one prompt."""
    import torch

    import longstraw_core as ls
    from longstraw_core.models.tiny import tiny_model

    device = torch.device(device_name)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tokens = 512 if quick else 32768
    chunk = min(8192, tokens)
    dims = dict(gpu_shapes(family).bench_dims or {})
    if quick:
        dims = dims | {k: v for k, v in _QUICK.items() if k in dims}
    model = tiny_model(family, dtype=dtype, **dims, max_position_embeddings=2 * tokens)
    model = model.to(device)
    prompt = torch.randint(0, model.config.vocab_size, (tokens,), device=device)
    adapter = ls.adapt(model)
    with torch.no_grad(), kernel_trace.tracing() as trace:
        ours = timed(lambda: adapter.prefill(prompt, chunk_size=chunk, progress=False), device)
    with torch.no_grad():
        theirs = timed(lambda: model(prompt[None]).logits.sum(), device)
    text = model.config.get_text_config()
    flops, prefill_flops = forward_flops(text, tokens), forward_flops(text, tokens, lm_head=False)
    row = {
        "tokens": tokens,
        "chunk_size": chunk,
        "dtype": str(dtype).removeprefix("torch."),
        "prefill_tokens_per_s": tokens / ours,
        "transformers_forward_tokens_per_s": tokens / theirs,
        "prefill_over_forward": theirs / ours,
        "forward_tflop": flops / 1e12,
        "prefill_tflop": prefill_flops / 1e12,
        "prefill_tflop_per_s": prefill_flops / ours / 1e12,
        "transformers_tflop_per_s": flops / theirs / 1e12,
        "kernels": trace.as_dict(),
    }
    if device.type == "cuda":
        row["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    print(
        f"benchmark {family}: prefill {row['prefill_tokens_per_s']:,.0f} tok/s "
        f"({row['prefill_tflop_per_s']:.2f} TFLOP/s), transformers forward "
        f"{row['transformers_forward_tokens_per_s']:,.0f} tok/s "
        f"({row['transformers_tflop_per_s']:.2f} TFLOP/s), {tokens} tokens; kernels "
        f"{trace.as_dict()}"
    )
    return row


def peaks(device_name: str, quick: bool) -> dict[str, Any]:
    """The device's own reach: a square matmul (bf16 on CUDA, float32 on CPU), a device copy,
    and on CUDA a pinned host-to-device copy; each the best of a few after a warm-up."""
    import torch

    device = torch.device(device_name)
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    n = 8192 if cuda and not quick else 1024
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    matmul = timed(lambda: a @ b, device, repeats=5)
    size = (1 << 30) if cuda and not quick else (1 << 26)  # bytes
    source = torch.empty(size, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    copy = timed(lambda: target.copy_(source), device, repeats=5)
    row: dict[str, Any] = {
        "device_name": torch.cuda.get_device_name(device) if cuda else "cpu",
        "matmul_size": n,
        "matmul_dtype": str(dtype).removeprefix("torch."),
        "matmul_tflop_per_s": 2 * n**3 / matmul / 1e12,
        "copy_bytes": size,
        "copy_tbps": 2 * size / copy / 1e12,  # read and written
    }
    if cuda:
        host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        upload = timed(lambda: source.copy_(host, non_blocking=True), device, repeats=3)
        row["host_to_device_gbps"] = size / upload / 1e9
    print(f"peaks: {row}")
    return row


def timed(work: Callable[[], Any], device: Any, repeats: int = 2) -> float:
    """Seconds of the fastest of ``repeats`` runs after one warm-up (kernels compile then)."""
    import torch

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    work()
    best = float("inf")
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        work()
        sync()
        best = min(best, time.perf_counter() - start)
    return best


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--family", help="a model type of prefill_bench_models()")
    what.add_argument("--peaks", action="store_true")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, required=True, help="the row's JSON")
    args = parser.parse_args(argv)
    if args.family and args.family not in prefill_bench_models():
        parser.error(f"--family {args.family}: not one of {list(prefill_bench_models())}")
    if args.peaks:
        row = peaks(args.device, args.quick)
    else:
        row = bench_family(args.family, args.device, args.quick)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(row, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
