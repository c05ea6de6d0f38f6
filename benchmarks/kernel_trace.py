"""Which kernels a run chose: attention backends and Gated DeltaNet kernels, counted.

Why: on CUDA the library falls back to its pure-torch paths when a fused kernel is missing
or cannot take the inputs (a user's GPU without flash-linear-attention still trains, only
slower). ``make gpu-check`` must not pass on such a fallback, so it runs each recipe and
benchmark with the two functions that choose wrapped (``attention._choose_backend``, called
for every attention call, and ``qwen36.deltanet_kernels``, for every Gated DeltaNet layer
call) and counts what they return; what runs is unchanged. ``failures`` says which of
the counted choices a CUDA run must not make.

    python benchmarks/kernel_trace.py --record kernels.json SCRIPT [ARGS...]

runs SCRIPT as ``__main__`` with the counting installed. The record is written each time a
new kind of choice appears and at exit; under torchrun ``{rank}`` in the path becomes the
rank. A distributed recipe ends its ranks with ``os._exit`` (no exit hook runs), so there
the counts may stop short of the end, but every kind of choice made is in the file.
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import sys
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

# MLA's absorbed latent attention: keys [c_kv, k_pe] wider than values c_kv. No fused kernel
# takes unequal head dims, so GLM-5.x attends in the torch loop by design, on CUDA too.
MLA_LATENT = "keys wider than values (MLA's latent attention: torch by design)"


class KernelTrace:
    """Counts of the kernels chosen, keyed ``device/kernel``; written to ``path`` (if any)
    when a new key appears and by ``write``."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path
        self.attention: Counter[str] = Counter()
        self.torch_reasons: Counter[str] = Counter()  # why the torch path ran on CUDA
        self.deltanet: Counter[str] = Counter()
        self.deltanet_conv: Counter[str] = Counter()

    def count(self, counter: Counter[str], key: str) -> None:
        new = key not in counter
        counter[key] += 1
        if new:
            self.write()

    def as_dict(self) -> dict[str, dict[str, int]]:
        return {
            "attention": dict(self.attention),
            "attention_torch_reasons": dict(self.torch_reasons),
            "deltanet": dict(self.deltanet),
            "deltanet_conv": dict(self.deltanet_conv),
        }

    def write(self) -> None:
        if self.path is not None:
            temporary = self.path.with_name(self.path.name + ".tmp")
            temporary.write_text(json.dumps(self.as_dict(), indent=1))
            os.replace(temporary, self.path)


@contextmanager
def tracing(path: Path | None = None) -> Iterator[KernelTrace]:
    """Count the kernels chosen inside the block (written to ``path``, if given): the two
    choosing functions are wrapped, and restored after."""
    from longstraw_core import attention
    from longstraw_core.tensors import gpu_emulation
    from model_adapters import qwen36

    trace = KernelTrace(path)
    choose_backend, deltanet_kernels = attention._choose_backend, qwen36.deltanet_kernels
    # Wherever it is called from: the package's name and the adapter's (which calls it).
    deltanet_homes = (qwen36, qwen36.adapter)

    def counted_backend(backend: str, q: Any, k: Any, v: Any, segments: Any) -> str:
        chosen = choose_backend(backend, q, k, v, segments)
        device = "cuda" if gpu_emulation.takes_gpu_path(q) else q.device.type
        trace.count(trace.attention, f"{device}/{chosen}")
        if chosen == "torch" and device == "cuda":
            if v.shape[-1] < q.shape[-1]:
                reason = MLA_LATENT
            else:
                reason = attention.choice.unsupported_reason("sdpa", q, k, v, segments)
            trace.count(trace.torch_reasons, reason or f"backend={backend!r} asked for")
        return chosen

    def counted_deltanet(deltanet: Any, device: Any, dtype: Any, *, emulated: bool = False) -> Any:
        kernels = deltanet_kernels(deltanet, device, dtype, emulated=emulated)
        where = "cuda" if emulated else device.type
        conv, rule = kernels.names
        trace.count(trace.deltanet, f"{where}/{rule}")
        trace.count(trace.deltanet_conv, f"{where}/{conv}")
        return kernels

    attention._choose_backend = counted_backend
    for home in deltanet_homes:
        home.deltanet_kernels = counted_deltanet
    try:
        yield trace
    finally:
        attention._choose_backend = choose_backend
        for home in deltanet_homes:
            home.deltanet_kernels = deltanet_kernels
        trace.write()


def expected(family: str) -> tuple[str, ...]:
    """What a run of ``family`` (a model type) must record on its device, as its family
    declares (``FamilyProbe.expected_kernels``): attention calls for the families whose
    attention goes through ``segmented_attention``, Gated DeltaNet calls for Qwen3.6."""
    import bench_families

    return bench_families.probe(family).expected_kernels


def failures(record: dict[str, dict[str, int]], device: str, family: str) -> list[str]:
    """What a run of ``family``'s ``record`` must not hold, in words (empty: clean). Any
    device: none of the calls ``expected`` (the trace did not see the run). CUDA: the torch
    attention path for any reason but MLA's unequal head dims, or the torch Gated DeltaNet
    rule. causal-conv1d is optional: transformers' torch conv is a small depthwise
    convolution, so its absence is recorded, not failed."""
    prefix = f"{device}/"
    found = [
        f"no {device} {kind} call recorded ({record.get(kind, {})})"
        for kind in expected(family)
        if not any(key.startswith(prefix) for key in record.get(kind, {}))
    ]
    if device != "cuda":
        return found
    for reason, calls in record.get("attention_torch_reasons", {}).items():
        if reason != MLA_LATENT:
            found.append(f"attention ran the torch path on CUDA in {calls} call(s): {reason}")
    torch_rule = record.get("deltanet", {}).get("cuda/torch")
    if torch_rule:
        found.append(
            f"Gated DeltaNet ran the torch rule on CUDA in {torch_rule} call(s): "
            "flash-linear-attention is missing or refused the dtype (make gpu-wheels)"
        )
    return found


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--record", required=True, help="JSON path; {rank} becomes the rank")
    parser.add_argument("script")
    parser.add_argument("arguments", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    path = Path(args.record.replace("{rank}", os.environ.get("RANK", "0")))
    path.parent.mkdir(parents=True, exist_ok=True)
    sys.argv = [args.script, *args.arguments]
    sys.path.insert(0, str(Path(args.script).resolve().parent))
    with tracing(path) as trace:
        trace.write()  # an empty record: the run started
        runpy.run_path(args.script, run_name="__main__")


if __name__ == "__main__":
    main()
