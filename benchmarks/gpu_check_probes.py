"""``make gpu-check``'s probes, one per process (``--probe``), each writing one JSON row.

- ``warmup``: fla's Triton kernels (forward, backward, decode) at the shapes the later steps
  use, compiled into ``TRITON_CACHE_DIR`` (the parent sets it, under ``outputs/``), so a
  later step loads them instead of compiling inside its own limit;
- ``collectives``: a one-rank process group (NCCL on CUDA, gloo on CPU) through every
  collective helper, each tensor handed to a collective recorded with its device: on NCCL a
  CPU tensor is a failure (NCCL refuses them; one rank skips many collectives, so the
  record says which helpers issued any);
- ``pinned``: pinned host memory: the time to pin, and copies against pageable ones;
- ``fla``: fla's chunked and recurrent Gated DeltaNet kernels at head dim 128 (Qwen3.6's
  16 key and 48 value heads), timed, the chunked output checked against the recurrent one;
- ``layers``: a real-width layer's attention (``segmented_attention``, chunk 8192 over a
  prefix of 128K and 512K positions, forward and backward) and its matmuls, timed against
  the planner's FLOPs at the GPU's datasheet rate x the planner's MFU.

The rollout probes (``fsdp``, ``host_syncs``, ``profile``) are in ``gpu_check_rollout``.
A probe that cannot run here (no fla) writes ``{"skipped": reason}``; ``problems`` lists what
failed (the step fails on any).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

from gpu_check_bench import timed  # a script beside this one

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# Real widths. Qwen3.6-27B's full-attention layer comes from the planner's preset; a dense
# Qwen3 layer of the same width with head dim 128 (Qwen3-32B's: 64 query and 8 key heads).
QWEN3_REAL = {
    "hidden_size": 5120, "intermediate_size": 25600, "num_attention_heads": 64,
    "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 1024,
}  # fmt: skip
CHUNK = 8192
PREFIXES = (128 * 1024, 512 * 1024)
# fla at Qwen3.6's Gated DeltaNet widths; the tiny recipes' and the benchmark's for warm-up.
FLA_SHAPES = {"qwen36": (16, 48, 128), "benchmark": (16, 32, 128), "recipes": (2, 4, 64)}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# --- warm-up --------------------------------------------------------------------------------


def fla_rules() -> tuple[Callable, Callable] | None:
    try:
        from fla.ops.gated_delta_rule import (
            chunk_gated_delta_rule,
            fused_recurrent_gated_delta_rule,
        )
    except Exception:  # ImportError, or Triton failing to load
        return None
    return chunk_gated_delta_rule, fused_recurrent_gated_delta_rule


def delta_inputs(heads_k: int, heads_v: int, dim: int, length: int, device: Any) -> dict:
    """Inputs as LongStraw's wrapper passes them (q/k repeated to the value heads), bf16."""
    import torch

    def rand(*shape: int, dtype: Any = torch.bfloat16) -> Any:
        return torch.randn(*shape, device=device, dtype=dtype).requires_grad_()

    del heads_k  # the wrapper repeats q and k to the value heads before the kernel
    return {
        "q": rand(1, length, heads_v, dim), "k": rand(1, length, heads_v, dim),
        "v": rand(1, length, heads_v, dim),
        "g": (-torch.rand(1, length, heads_v, device=device)).requires_grad_(),
        "beta": torch.rand(1, length, heads_v, device=device, dtype=torch.bfloat16),
        "initial_state": torch.zeros(1, heads_v, dim, dim, device=device),
    }  # fmt: skip


def run_delta(rule: Callable, inputs: dict, backward: bool) -> Any:
    import torch

    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    options = {name: inputs[name] for name in ("g", "beta", "initial_state")}
    out, final = rule(q, k, v, output_final_state=True, use_qk_l2norm_in_kernel=True, **options)
    if backward:
        torch.autograd.backward((out, final), (torch.ones_like(out), torch.ones_like(final)))
    return out


def warmup(device: Any, quick: bool, work: Path) -> dict[str, Any]:
    import torch

    rules = fla_rules()
    if rules is None:
        return {"skipped": "fla is not importable here: nothing to compile"}
    cache = Path(os.environ.get("TRITON_CACHE_DIR", "~/.triton/cache")).expanduser()
    before = sum(1 for _ in cache.rglob("*")) if cache.exists() else 0
    seconds = {}
    for name, (heads_k, heads_v, dim) in FLA_SHAPES.items():
        start = time.perf_counter()
        run_delta(rules[0], delta_inputs(heads_k, heads_v, dim, 512, device), backward=True)
        step = delta_inputs(heads_k, heads_v, dim, 1, device)
        with torch.no_grad():
            run_delta(rules[1], step, backward=False)
        torch.cuda.synchronize(device)
        seconds[name] = round(time.perf_counter() - start, 2)
        print(f"warmup {name} {heads_k}/{heads_v} heads, dim {dim}: {seconds[name]} s")
    after = sum(1 for _ in cache.rglob("*")) if cache.exists() else 0
    return {"cache_dir": str(cache), "cache_files_before": before, "cache_files_after": after,
            "seconds": seconds}  # fmt: skip


# --- collectives ----------------------------------------------------------------------------

_RECORDED = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast",
    "all_gather_object", "broadcast_object_list", "batch_isend_irecv", "isend", "irecv",
    "send", "recv", "barrier",
)  # fmt: skip


def record_collectives(calls: list[dict[str, Any]]) -> None:
    """Wrap ``torch.distributed``'s collectives (the helpers call them as ``dist.x``): each
    call appends its name, backend and the devices of the tensors it was handed."""
    import torch
    import torch.distributed as dist

    def devices(values: Sequence[Any]) -> list[str]:
        found = []
        for value in values:
            items = value if isinstance(value, (list, tuple)) else [value]
            for item in items:
                tensor = getattr(item, "tensor", item)  # a P2POp's tensor
                if isinstance(tensor, torch.Tensor):
                    found.append(tensor.device.type)
        return found

    for name in _RECORDED:
        original = getattr(dist, name)

        def wrapper(*args: Any, _name: str = name, _original: Any = original, **kwargs: Any):
            group = kwargs.get("group")
            calls.append({"op": _name, "backend": str(dist.get_backend(group)),
                          "devices": devices([*args, *kwargs.values()])})  # fmt: skip
            return _original(*args, **kwargs)

        setattr(dist, name, wrapper)


def helper_calls(device: Any) -> dict[str, Callable[[], Any]]:
    """Every collective helper, called as a run calls it (one rank)."""
    import torch
    import torch.distributed as dist

    from longstraw_core.checkpoint import ranks
    from longstraw_core.distributed import collectives
    from longstraw_core.parallel import mesh
    from longstraw_core.pipeline import gradients

    def params(with_grad: bool) -> list[torch.nn.Parameter]:
        parameter = torch.nn.Parameter(torch.ones(3, device=device))
        parameter.grad = torch.full((3,), 2.0, device=device) if with_grad else None
        return [parameter]

    world = dist.group.WORLD
    link = {}

    def stage_link() -> Any:
        if "link" not in link:
            link["link"] = mesh.stage_link(mesh.pipeline_mesh(1, device.type), device)
        return link["link"]

    flags = lambda: torch.tensor([0, 1], device=device)  # noqa: E731
    return {
        "max_over_ranks": lambda: collectives.max_over_ranks(3),
        "any_rank(True)": lambda: collectives.any_rank(True),
        "any_rank(False)": lambda: collectives.any_rank(False),
        "sum_over_ranks": lambda: collectives.sum_over_ranks([1.0, 2.0]),
        "gather_rows (objects)": lambda: collectives.gather_rows([{"a": 1}]),
        "reduce_metrics (objects)": lambda: collectives.reduce_metrics({"loss": 1.0}),
        "clip_grad_norm (no grads)": lambda: gradients.clip_grad_norm(params(False), 1.0, world),
        "clip_grad_norm": lambda: gradients.clip_grad_norm(params(True), 1.0, world),
        "average_over_replicas": lambda: gradients.average_over_replicas(params(True), world),
        "stage_link.signal_any (bools)": lambda: stage_link().signal_any(flags()),
        "stage_link.objects_from_last": lambda: stage_link().objects_from_last({"score": 1}),
        "stage_link.from_last": lambda: stage_link().from_last(flags(), flags()),
        "stage_link.exchange (empty)": lambda: stage_link().exchange([], []).wait(),
        "checkpoint.ranks.gather (objects)": lambda: ranks.gather({"step": 1}),
        "checkpoint.ranks.agree": lambda: ranks.agree(None),
        "checkpoint.ranks.on_rank0": lambda: ranks.on_rank0(lambda: 1),
    }


def collectives_probe(device: Any, quick: bool, work: Path) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    backend = "nccl" if device.type == "cuda" else "gloo"
    options: dict[str, Any] = {"timeout": timedelta(seconds=30)}
    if device.type == "cuda":
        torch.cuda.set_device(device)
        options["device_id"] = device
    dist.init_process_group(backend, rank=0, world_size=1, **options)
    calls: list[dict[str, Any]] = []
    record_collectives(calls)
    helpers, problems = {}, []
    for name, call in helper_calls(device).items():
        first = len(calls)
        try:
            value = call()
            if isinstance(value, torch.Tensor):
                if value.device.type != device.type:
                    problems.append(f"{name} returned a {value.device.type} tensor")
                value = value.tolist()
            entry: dict[str, Any] = {"ok": True, "value": repr(value)[:80]}
        except Exception as error:  # recorded: one helper's failure must not hide the others
            entry = {"ok": False, "error": f"{type(error).__name__}: {error}"[:300]}
            problems.append(f"{name}: {entry['error']}")
        entry["collectives"] = calls[first:]
        for call_ in entry["collectives"]:
            if call_["backend"] == "nccl" and "cpu" in call_["devices"]:
                problems.append(f"{name}: a CPU tensor on NCCL's {call_['op']}")
        helpers[name] = entry
    dist.destroy_process_group()
    silent = [name for name, entry in helpers.items() if entry["ok"] and not entry["collectives"]]
    return {"backend": backend, "helpers": helpers, "problems": problems,
            "no_collective_at_one_rank": silent}  # fmt: skip


# --- pinned memory --------------------------------------------------------------------------


def pinned_probe(device: Any, quick: bool, work: Path) -> dict[str, Any]:
    import torch

    row: dict[str, Any] = {"pin_seconds": {}, "copies_gbps": {}}
    for size in (1 << 28, 1 << 30, 4 << 30):
        start = time.perf_counter()
        buffer = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        row["pin_seconds"][f"{size >> 20} MiB"] = round(time.perf_counter() - start, 4)
        del buffer
    size = 1 << 30
    device_buffer = torch.empty(size, dtype=torch.uint8, device=device)
    for kind, pinned in (("pinned", True), ("pageable", False)):
        host = torch.empty(size, dtype=torch.uint8, pin_memory=pinned)
        up = timed(lambda h=host: device_buffer.copy_(h, non_blocking=True), device)
        down = timed(lambda h=host: h.copy_(device_buffer, non_blocking=True), device)
        row["copies_gbps"][kind] = {"host_to_device": size / up / 1e9,
                                    "device_to_host": size / down / 1e9}  # fmt: skip
    pinned, pageable = row["copies_gbps"]["pinned"], row["copies_gbps"]["pageable"]
    row["pinned_over_pageable"] = pinned["host_to_device"] / pageable["host_to_device"]
    row["problems"] = [] if row["pinned_over_pageable"] > 1 else ["pinned copies are no faster"]
    return row


# --- fla at head dim 128 --------------------------------------------------------------------


def fla_probe(device: Any, quick: bool, work: Path) -> dict[str, Any]:
    import torch

    rules = fla_rules()
    if rules is None:
        return {"skipped": "fla (flash-linear-attention) is not importable here"}
    heads_k, heads_v, dim = FLA_SHAPES["qwen36"]
    inputs = delta_inputs(heads_k, heads_v, dim, CHUNK, device)
    forward = timed(lambda: run_delta(rules[0], inputs, backward=False), device)
    both = timed(lambda: run_delta(rules[0], inputs, backward=True), device)
    step = delta_inputs(heads_k, heads_v, dim, 1, device)
    with torch.no_grad():
        decode = timed(lambda: run_delta(rules[1], step, backward=False), device, repeats=5)
        # The chunked kernel against the recurrent one on the same 256 tokens (bf16 inputs,
        # float32 states: agreement to a few bf16 ulps of the output's scale).
        short = {k: v[:, :256] if k != "initial_state" else v for k, v in inputs.items()}
        chunked = run_delta(rules[0], short, backward=False).float()
        recurrent = run_delta(rules[1], short, backward=False).float()
    error = ((chunked - recurrent).abs().max() / recurrent.abs().max()).item()
    problems = [] if error < 2e-2 else [f"chunked vs recurrent relative error {error:.3g}"]
    return {"shape": {"heads_k": heads_k, "heads_v": heads_v, "head_dim": dim, "tokens": CHUNK},
            "chunk_forward_s": forward, "chunk_forward_backward_s": both,
            "decode_step_s": decode, "chunked_vs_recurrent": error, "problems": problems}  # fmt: skip


# --- real-width layers against the planner --------------------------------------------------


def real_config(family: str, quick: bool) -> dict[str, Any]:
    """One full-attention layer at real width (``--quick``: a toy width, same code)."""
    from longstraw_core.adapters import registry

    if family == "qwen3":
        config = dict(QWEN3_REAL)
    else:
        config = dict(registry.presets()["Qwen3.6-27B"].config, vocab_size=1024)
        config["layer_types"] = ["full_attention"]
    config["num_hidden_layers"] = 1
    if quick:
        config.update(hidden_size=256, intermediate_size=512, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=64)  # fmt: skip
    return config


def layers_probe(family: str, device: Any, quick: bool, work: Path) -> dict[str, Any]:
    import torch

    from longstraw_core.models.tiny import tiny_model
    from longstraw_core.plan.calibration import datasheet
    from longstraw_core.plan.flops import layer_flops
    from longstraw_core.plan.model import ModelSpec
    from longstraw_core.plan.roofline import Hardware

    config = real_config(family, quick)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with torch.device("meta"):
        meta = tiny_model(family, dtype=dtype, **config)
    spec = ModelSpec.from_model(meta, family)
    chunk, prefixes = (256, (1024, 4096)) if quick else (CHUNK, PREFIXES)
    sheet = datasheet(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    rate = sheet.tflops * 1e12 * Hardware().mfu if sheet else None
    matmul_s = time_matmuls(meta, chunk, device, dtype)
    rows, problems = [], []
    for prefix in prefixes:
        row = time_attention(config, chunk, prefix, device, dtype)
        if row is None:
            problems.append(f"prefix {prefix}: no fused attention kernel here (torch chosen)")
            break
        flops = layer_flops(spec, spec.layers[0], chunk, prefix)
        row["matmul_forward_s"] = matmul_s
        row["planner_flops"] = {"matmul": flops.matmul, "mixing": flops.mixing}
        row["attention_tflop_per_s"] = flops.mixing / row["attention_forward_s"] / 1e12
        if rate:
            planned = (flops.matmul + flops.mixing) / rate
            row["planner_forward_s"] = planned
            row["measured_over_planner"] = (row["attention_forward_s"] + matmul_s) / planned
        rows.append(row)
        print(f"layers {family} prefix {prefix}: {row}")
    return {"config": {k: config[k] for k in ("hidden_size", "num_attention_heads",
                                              "num_key_value_heads", "head_dim")},
            "planner_rate_tflop_per_s": rate and rate / 1e12, "rows": rows,
            "problems": problems}  # fmt: skip


def time_attention(
    config: dict[str, Any], chunk: int, prefix: int, device: Any, dtype: Any
) -> dict[str, Any] | None:
    """``segmented_attention`` of a ``chunk`` of queries (the chunk causal) over a prefix of
    ``prefix`` positions, forward and backward (into q, k, v; the prefix detached, as in
    replay); None when CUDA falls back to the torch backend (too slow to time here)."""
    import torch

    from longstraw_core import attention

    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    dim = config["head_dim"]
    q = torch.randn(1, heads, chunk, dim, device=device, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(1, kv_heads, chunk, dim, device=device, dtype=dtype, requires_grad=True)
            for _ in range(2))  # fmt: skip
    segment = [tuple(torch.randn(kv_heads, prefix, dim, device=device, dtype=dtype)
                     for _ in range(2))]  # fmt: skip
    backend = attention._choose_backend("auto", q, k, v, segment)
    if device.type == "cuda" and backend == "torch":
        return None

    def run() -> Any:
        return attention.segmented_attention(q, k, v, segment, scale=dim**-0.5)

    with torch.no_grad():
        forward = timed(run, device)
    both = timed(lambda: run().sum().backward(), device)
    return {"prefix": prefix, "chunk": chunk, "backend": backend,
            "attention_forward_s": forward, "attention_backward_s": both - forward}  # fmt: skip


def time_matmuls(meta: Any, tokens: int, device: Any, dtype: Any) -> float:
    """Seconds of the layer's linear maps over ``tokens`` rows (its weights' shapes, random
    values): the planner's ``matmul`` FLOPs."""
    import torch

    shapes = [m.weight.shape for m in meta.model.layers[0].modules()
              if isinstance(m, torch.nn.Linear)]  # fmt: skip
    weights = [torch.randn(*shape, device=device, dtype=dtype) for shape in shapes]
    inputs = {s[1]: torch.randn(tokens, s[1], device=device, dtype=dtype) for s in shapes}

    def work() -> None:
        for weight in weights:
            torch.nn.functional.linear(inputs[weight.shape[1]], weight)

    return timed(work, device)


PROBES: dict[str, Callable[..., dict[str, Any]]] = {
    "warmup": warmup,
    "collectives": collectives_probe,
    "pinned": pinned_probe,
    "fla": fla_probe,
}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--probe", required=True, choices=(*PROBES, "layers"))
    parser.add_argument("--step", help="the layers' family")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--work", type=Path, default=Path("."))
    args = parser.parse_args(argv)
    import torch

    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    if args.probe == "layers":
        row = layers_probe(args.step, device, args.quick, args.work)
    else:
        row = PROBES[args.probe](device, args.quick, args.work)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(row, indent=2, default=str))
    print(json.dumps(row, default=str)[:2000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
