"""``make gpu-check``'s rollout probes, one per process (``--probe``), each one JSON row.

The policy: the tiny Qwen3.6 (``qwen3_5_text``: Gated DeltaNet and full attention layers) at
the GPU head dims the recipes use, bfloat16 on CUDA, with PEFT LoRA on every linear map
(float32 adapters: peft's default over a bfloat16 base), a prompt prefilled once.

- ``fsdp``: one rank (NCCL on CUDA, gloo on CPU), the model sharded by ``shard_model``
  (bf16 mixed precision on CUDA); FSDP's all-gathers (the profiler's ``FSDP::all_gather``
  ranges) counted over rollouts of 3 and 9 new tokens: the difference over 6 is the
  all-gathers per decode step after the first token, which must be 0 (issue #34, item 4).
  A world of one gathers nothing, so the explicit ``unshard``/``reshard`` calls per token
  are counted too (must be 0), with the FSDP units (one per layer expected), each layer's
  LoRA weights' dtypes and the dtypes its LoRA maps compute in (one of each expected).
- ``host_syncs``: ``torch.cuda.set_sync_debug_mode("warn")`` over rollouts of 3 and 9
  tokens: each synchronising call warns, and its innermost LongStraw frame is counted; the
  difference over 6 is the host synchronisations per decode step, listed by where.
- ``profile``: ``torch.profiler`` over a rollout of 20 decode steps (after one to warm up):
  the costliest ops, kernel launches and device and host time per step; the Chrome trace in
  the work folder.

Why counts over two lengths: what runs once per rollout (the first token's gathers, the
prompt's syncs) cancels, leaving what every further token costs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "benchmarks"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from bench_families import gpu_shapes  # noqa: E402
from gpu_check_probes import free_port  # noqa: E402

FAMILY = "qwen3_5_text"
SHORT, LONG = 3, 9
PROFILED_STEPS = 20
_OURS = (str(ROOT / "longstraw_core"), str(ROOT / "model_adapters"))


def policy(device: Any, quick: bool) -> tuple[Any, Any, Any]:
    """``(model, adapter, prompt)``: the tiny Qwen3.6 with LoRA, on ``device``."""
    import torch
    from peft import LoraConfig, get_peft_model

    import longstraw_core as ls
    from longstraw_core.models.tiny import tiny_model

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    # The recipes' GPU head dims (its family's ``probe.gpu.recipe_dims``): fla's minimum is 64.
    dims = {} if device.type != "cuda" else dict(gpu_shapes(FAMILY).recipe_dims)
    model = tiny_model(FAMILY, dtype=dtype, **dims).to(device)
    model = get_peft_model(model, LoraConfig(r=8, target_modules="all-linear"))
    tokens = 64 if quick else 2048
    prompt = torch.randint(0, model.config.vocab_size, (tokens,), device=device)
    return model, ls.adapt(model), prompt


def rollout(adapter: Any, state: Any, tokens: int) -> Any:
    import longstraw_core as ls

    return ls.rollout(adapter, state, num_generations=2, max_new_tokens=tokens, seed=0,
                      progress=False)  # fmt: skip


def lora_dtypes(model: Any) -> dict[str, list[str]]:
    """Per decoder layer, the dtypes its LoRA weights hold (one expected everywhere)."""
    found: dict[str, set[str]] = {}
    for name, parameter in model.named_parameters():
        if "lora_" in name and ".layers." in name:
            layer = name.split(".layers.")[1].split(".")[0]
            found.setdefault(layer, set()).add(str(parameter.dtype).removeprefix("torch."))
    return {
        layer: sorted(dtypes) for layer, dtypes in sorted(found.items(), key=lambda x: int(x[0]))
    }


@contextmanager
def counting_unshards() -> Iterator[Counter[str]]:
    """Calls of ``FSDPModule.unshard``/``reshard`` (the public methods LongStraw's FSDP run
    calls for the modules it shards on their own) while the block runs. Why: a world of one
    rank all-gathers nothing (FSDP skips it), so these calls are what shows, on one GPU, a
    layer's weights freed and gathered again at every token."""
    from torch.distributed.fsdp import FSDPModule

    calls: Counter[str] = Counter(unshard=0, reshard=0)
    originals = {name: getattr(FSDPModule, name) for name in ("unshard", "reshard")}

    def counted(name: str) -> Callable[..., Any]:
        def method(self: Any, *args: Any, **kwargs: Any) -> Any:
            calls[name] += 1
            return originals[name](self, *args, **kwargs)

        return method

    for name in originals:
        setattr(FSDPModule, name, counted(name))
    try:
        yield calls
    finally:
        for name, original in originals.items():
            setattr(FSDPModule, name, original)


@contextmanager
def lora_compute_dtypes(model: Any) -> Iterator[dict[str, set[str]]]:
    """Per decoder layer, the dtypes its LoRA ``A`` maps compute in (their inputs' and
    weights' as they run, after FSDP's casts) while the block runs: one expected."""
    seen: dict[str, set[str]] = {}
    handles = []
    for name, module in model.named_modules():
        if name.endswith("lora_A.default") and ".layers." in name:
            layer = name.split(".layers.")[1].split(".")[0]

            def hook(module: Any, inputs: Any, output: Any, layer: str = layer) -> None:
                dtype = f"{inputs[0].dtype}->{output.dtype}".replace("torch.", "")
                seen.setdefault(layer, set()).add(dtype)

            handles.append(module.register_forward_hook(hook))
    try:
        yield seen
    finally:
        for handle in handles:
            handle.remove()


def fsdp_probe(device: Any, quick: bool, work: Path) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    from longstraw_core.parallel.fsdp import shard_model

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    backend = "nccl" if device.type == "cuda" else "gloo"
    options: dict[str, Any] = {"timeout": timedelta(seconds=30)}
    if device.type == "cuda":
        torch.cuda.set_device(device)
        options["device_id"] = device
    dist.init_process_group(backend, rank=0, world_size=1, **options)
    model, adapter, prompt = policy(device, quick)
    shard_model(adapter, mixed_precision="bf16" if device.type == "cuda" else "fp32")
    units = Counter(type(m).__name__ for m in model.modules() if isinstance(m, FSDPModule))
    with torch.no_grad():
        state = adapter.prefill(prompt, chunk_size=1024, progress=False)
    counts, explicit = {}, {}
    for tokens in (SHORT, LONG):
        adapter.release_parameters()  # every rollout starts from the shards
        with counting_unshards() as calls, lora_compute_dtypes(model) as computed:
            activities = [torch.profiler.ProfilerActivity.CPU]
            with torch.profiler.profile(activities=activities) as profiler:
                rollout(adapter, state, tokens)
        names = [event.name.split(" (")[0] for event in profiler.events()]
        counts[tokens], explicit[tokens] = names.count("FSDP::all_gather"), dict(calls)
    per_token = (counts[LONG] - counts[SHORT]) / (LONG - SHORT)
    reshards = (explicit[LONG]["reshard"] - explicit[SHORT]["reshard"]) / (LONG - SHORT)
    dtypes = lora_dtypes(model)
    problems = []
    if per_token > 0:
        problems.append(f"{per_token:g} FSDP all-gathers per decode step after the first token")
    if reshards > 0:
        problems.append(f"{reshards:g} explicit FSDP reshards per decode step (kept_gathered)")
    if len({dtype for layer in dtypes.values() for dtype in layer}) > 1:
        problems.append(f"LoRA weights in several dtypes across layers: {dtypes}")
    computed = {layer: sorted(kinds) for layer, kinds in sorted(computed.items())}
    if len({kind for kinds in computed.values() for kind in kinds}) > 1:
        problems.append(f"LoRA computes in several dtypes across layers: {computed}")
    dist.destroy_process_group()
    return {"backend": backend, "all_gathers": {str(k): v for k, v in counts.items()},
            "all_gathers_per_token": per_token, "fsdp_units": dict(units),
            "explicit_unshard_reshard": {str(k): v for k, v in explicit.items()},
            "explicit_reshards_per_token": reshards,
            "lora_dtypes": dtypes, "lora_compute_dtypes": computed, "problems": problems}  # fmt: skip


def _our_frame() -> str:
    """The innermost LongStraw frame of the current stack (where a sync was asked for)."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if frame.filename.startswith(_OURS):
            return f"{Path(frame.filename).relative_to(ROOT)}:{frame.lineno} {frame.name}"
    return "outside LongStraw"


def count_syncs(work: Callable[[], Any]) -> Counter[str]:
    """``work()`` under ``set_sync_debug_mode("warn")``: each synchronising call, by site."""
    import torch

    sites: Counter[str] = Counter()

    def show(message: Any, category: Any, filename: str, lineno: int, *rest: Any) -> None:
        if "synchroniz" in str(message):
            sites[_our_frame()] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        try:
            work()
            torch.cuda.synchronize()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sites


def host_syncs_probe(device: Any, quick: bool, work: Path) -> dict[str, Any]:
    import torch

    _, adapter, prompt = policy(device, quick)
    with torch.no_grad():
        state = adapter.prefill(prompt, chunk_size=1024, progress=False)
    rollout(adapter, state, 2)  # kernels loaded, caches warm: not counted
    counts = {tokens: count_syncs(lambda t=tokens: rollout(adapter, state, t))
              for tokens in (SHORT, LONG)}  # fmt: skip
    extra = counts[LONG] - counts[SHORT]  # Counter subtraction keeps the positive
    total = sum(counts[LONG].values()) - sum(counts[SHORT].values())
    per_token = total / (LONG - SHORT)
    return {"syncs": {str(k): sum(v.values()) for k, v in counts.items()},
            "syncs_per_token": per_token,
            "per_token_by_site": {site: n / (LONG - SHORT) for site, n in extra.most_common()},
            "all_sites_long_rollout": dict(counts[LONG].most_common()),
            "problems": [] if per_token <= 1 else
            [f"{per_token:g} host synchronisations per decode step (target <= 1 per k)"]}  # fmt: skip


def profile_probe(device: Any, quick: bool, work: Path) -> dict[str, Any]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    _, adapter, prompt = policy(device, quick)
    with torch.no_grad():
        state = adapter.prefill(prompt, chunk_size=1024, progress=False)
    rollout(adapter, state, 2)
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    start = time.perf_counter()
    with profile(activities=activities) as profiler:
        out = rollout(adapter, state, PROFILED_STEPS)
        if cuda:
            torch.cuda.synchronize()
    wall = time.perf_counter() - start
    steps = int(out.stats.get("steps", PROFILED_STEPS)) or PROFILED_STEPS
    trace = work / "profile_decode_trace.json"
    trace.parent.mkdir(parents=True, exist_ok=True)
    profiler.export_chrome_trace(str(trace))
    averages = profiler.key_averages()
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    top = sorted(averages, key=lambda e: getattr(e, key, 0), reverse=True)[:15]
    kernels = sum(e.count for e in averages if getattr(e, "device_type", None) is not None
                  and str(e.device_type).endswith("CUDA"))  # fmt: skip
    launches = sum(e.count for e in averages if e.key.startswith(("cudaLaunch", "cuLaunch")))
    device_us = sum(getattr(e, "self_device_time_total", 0) for e in averages)
    return {"steps": steps, "wall_s_per_step": wall / steps,
            "device_s_per_step": device_us / 1e6 / steps if cuda else None,
            "kernel_launches_per_step": launches / steps, "device_events": kernels,
            "top": [{"name": e.key, "count": e.count, "self_us": getattr(e, key, 0)}
                    for e in top],
            "trace": str(trace), "problems": []}  # fmt: skip


PROBES: dict[str, Callable[..., dict[str, Any]]] = {
    "fsdp": fsdp_probe,
    "host_syncs": host_syncs_probe,
    "profile": profile_probe,
}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--probe", required=True, choices=tuple(PROBES))
    parser.add_argument("--step")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--work", type=Path, default=Path("."))
    args = parser.parse_args(argv)
    import torch

    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    row = PROBES[args.probe](device, args.quick, args.work)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(row, indent=2, default=str))
    print(json.dumps(row, default=str)[:2000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
