"""``make gpu-check``: what a machine with one CUDA GPU checks that no CPU test can.

Three phases, each recorded in one JSON file (``--out``), and a non-zero exit when any fails:

1. ``tests``: the suite's ``gpu``-marked tests (offload streams and pinned arenas, the
   flash-attn / SDPA attention backends against the torch one, flash-linear-attention
   against transformers' torch Gated DeltaNet, the fused recurrent decode kernel included).
   A missing kernel package fails the phase: skipped GPU tests would hide it.
2. ``recipes``: one GRPO step of each family's recipe (qwen3 dense, Qwen3.6 = ``qwen3_5_text``,
   GLM-5.x = ``glm_moe_dsa``) in bfloat16 with GPU-sized head dims (the GPU kernels' minimum
   is above the CPU toys' 8/12), the prefix state offloaded to pinned host memory, exact
   gradients and a checkpoint written.
3. ``benchmark``: prefill tokens/s of the adapter against the transformers model's own
   no-grad forward on the same prompt, and the TFLOP/s each achieves.

``--device cpu --quick`` builds the same configs and commands and runs a shortened version
of phases 2 and 3 on CPU in float32 (what ``tests/test_gpu_check.py`` checks); phase 1 needs
CUDA. It was written without a GPU: it has not run on one yet.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
FAMILIES = ("qwen3", "qwen3_5_text", "glm_moe_dsa")
# The test files holding ``gpu``-marked tests: collecting only these keeps the packages other
# test files import (wandb, datasets) off the GPU machine. ``test_gpu_check`` keeps it whole.
GPU_TEST_FILES = (
    "tests/test_attention.py",
    "tests/test_gpu_emulation.py",
    "tests/test_offload.py",
    "tests/test_pinned.py",
    "tests/test_qwen36_adapter.py",
)
# Head dims the GPU kernels take (fla's Gated DeltaNet kernels want 64 and up; flash/SDPA
# need multiples of 8), on the tiny configs' few layers and small widths.
GPU_DIMS: dict[str, dict[str, int]] = {
    "qwen3": {"head_dim": 64},
    "qwen3_5_text": {"head_dim": 64, "linear_key_head_dim": 64, "linear_value_head_dim": 64},
    "glm_moe_dsa": {
        "kv_lora_rank": 64,
        "qk_nope_head_dim": 64,
        "qk_rope_head_dim": 32,
        "v_head_dim": 64,
        "index_head_dim": 64,
    },
}
_RECIPES = {
    "qwen3": ("recipes/grpo_qwen36.py", "configs/qwen36/tiny_grpo_cpu.yaml"),
    "qwen3_5_text": ("recipes/grpo_qwen36.py", "configs/qwen36/tiny_grpo_cpu.yaml"),
    "glm_moe_dsa": ("recipes/grpo_glm52.py", "configs/glm52/tiny_grpo_cpu.yaml"),
}
# Benchmark models: wide enough for the GPU to be busy, a few layers (random weights).
_WIDE = {
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "num_hidden_layers": 8,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "vocab_size": 32000,
}
_DELTANET = {
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
}
BENCH_MODELS: dict[str, dict[str, int]] = {"qwen3": _WIDE, "qwen3_5_text": _WIDE | _DELTANET}
# --quick (CPU): the same layer types at toy widths.
_QUICK = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 64,
    "linear_value_head_dim": 64,
}


@dataclass
class Phase:
    """One phase's outcome as the JSON records it."""

    name: str
    ok: bool = False
    seconds: float = 0.0
    details: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Settings:
    device: str
    quick: bool
    out: Path
    phases: tuple[str, ...]
    families: tuple[str, ...]
    prompt_tokens: int
    bench_tokens: int

    @property
    def dtype_name(self) -> str:
        return "bfloat16" if self.device == "cuda" else "float32"


def parse_args(argv: Sequence[str] | None = None) -> Settings:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--quick", action="store_true", help="short prompts (CPU self-test)")
    parser.add_argument("--out", type=Path, default=ROOT / "outputs/gpu_check/gpu_check.json")
    parser.add_argument("--phases", default="tests,recipes,benchmark")
    parser.add_argument("--families", default=",".join(FAMILIES))
    args = parser.parse_args(argv)
    phases = tuple(p for p in args.phases.split(",") if p)
    families = tuple(f for f in args.families.split(",") if f)
    unknown = sorted(set(phases) - {"tests", "recipes", "benchmark"}) + sorted(
        set(families) - set(FAMILIES)
    )
    if unknown:
        parser.error(f"unknown phases/families {unknown}")
    if args.device == "cpu" and "tests" in phases:
        phases = tuple(p for p in phases if p != "tests")  # the gpu tests need CUDA
    return Settings(
        device=args.device,
        quick=args.quick,
        out=args.out,
        phases=phases,
        families=families,
        prompt_tokens=512 if args.quick else 8192,
        bench_tokens=1024 if args.quick else 32768,
    )


# --- phase 1: the gpu-marked tests ------------------------------------------------------------


def run_gpu_tests(settings: Settings) -> Phase:
    phase = Phase("tests")
    missing = [name for name in ("fla", "triton") if not _importable(name)]
    junit = settings.out.with_name("gpu_tests.xml")
    command = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-rs", f"--junitxml={junit}"]
    command += [*GPU_TEST_FILES, "-p", "no:cacheprovider"]
    result = _run(command, timeout=240)
    counts = _junit_counts(junit)
    phase.details = {"missing_packages": missing, **counts, "tail": result["tail"]}
    phase.details["returncode"] = result["returncode"]
    phase.ok = result["returncode"] == 0 and counts.get("passed", 0) > 0 and not missing
    return phase


def _junit_counts(path: Path) -> dict[str, int]:
    if not path.exists():
        return {}
    suite = ElementTree.parse(path).getroot()
    suite = suite if suite.tag == "testsuite" else suite[0]
    tests, failures = int(suite.get("tests", 0)), int(suite.get("failures", 0))
    errors, skipped = int(suite.get("errors", 0)), int(suite.get("skipped", 0))
    passed = tests - failures - errors - skipped
    return {"passed": passed, "failed": failures, "errors": errors, "skipped": skipped}


# --- phase 2: one recipe step per family -------------------------------------------------------


def recipe_overrides(family: str, settings: Settings, output_dir: Path) -> list[str]:
    """The recipe's key=value overrides for one bf16 (CPU: float32) GRPO step of ``family``:
    GPU head dims on CUDA, the state offloaded (pinned on CUDA), exact gradients, one save."""
    overrides = [
        f"model.tiny={family}",
        f"model.dtype={settings.dtype_name}",
        f"data.prompt_tokens={settings.prompt_tokens}",
        f"train.chunk_size={max(256, settings.prompt_tokens // 4)}",
        "train.steps=1",
        "train.save_every=1",
        f"train.output_dir={output_dir}",
        "tracking.wandb=false",
        "rollout.num_generations=4",
        "rollout.max_new_tokens=8",
        "grpo.gradient=exact",
        "offload.attention=cpu",
        "offload.recurrent=cpu",
        "offload.latent=cpu",
    ]
    if settings.device == "cuda":
        overrides += [f"model.tiny_overrides.{k}={v}" for k, v in GPU_DIMS[family].items()]
    return overrides


def recipe_command(family: str, settings: Settings, output_dir: Path) -> list[str]:
    script, config = _RECIPES[family]
    return [
        sys.executable, str(ROOT / script), "--config", str(ROOT / config),
        *recipe_overrides(family, settings, output_dir),
    ]  # fmt: skip


def run_recipes(settings: Settings) -> Phase:
    phase = Phase("recipes", ok=True)
    for family in settings.families:
        output_dir = settings.out.parent / f"recipe_{family}"
        result = _run(recipe_command(family, settings, output_dir), timeout=150)
        saved = (output_dir / "latest").exists()
        ok = result["returncode"] == 0 and saved
        phase.details[family] = {**result, "checkpoint_saved": saved, "ok": ok}
        phase.ok &= ok
        print(f"recipe {family}: {'ok' if ok else 'FAILED'} ({result['seconds']:.0f} s)")
    return phase


# --- phase 3: prefill speed against the transformers forward ------------------------------------


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


def run_benchmark(settings: Settings) -> Phase:
    phase = Phase("benchmark", ok=True)
    for family, dims in BENCH_MODELS.items():
        if family in settings.families:
            quick = {k: v for k, v in _QUICK.items() if k in dims}
            phase.details[family] = bench_family(
                family, dims | quick if settings.quick else dims, settings
            )
    return phase


def bench_family(family: str, dims: dict[str, int], settings: Settings) -> dict[str, float]:
    """Prefill (K/V on the device) against ``model(prompt)`` under no_grad, one prompt."""
    import torch

    import longstraw_core as ls
    from longstraw_core.tiny_models import tiny_model

    device, dtype = torch.device(settings.device), getattr(torch, settings.dtype_name)
    tokens, chunk = settings.bench_tokens, min(8192, settings.bench_tokens)
    model = tiny_model(family, dtype=dtype, **dims, max_position_embeddings=2 * tokens)
    model = model.to(device)
    prompt = torch.randint(0, model.config.vocab_size, (tokens,), device=device)
    adapter = ls.adapt(model)
    with torch.no_grad():
        ours = _timed(lambda: adapter.prefill(prompt, chunk_size=chunk, progress=False), device)
        theirs = _timed(lambda: model(prompt[None]).logits.sum(), device)
    text = model.config.get_text_config()
    flops, prefill_flops = forward_flops(text, tokens), forward_flops(text, tokens, lm_head=False)
    row = {
        "tokens": tokens,
        "chunk_size": chunk,
        "prefill_tokens_per_s": tokens / ours,
        "transformers_forward_tokens_per_s": tokens / theirs,
        "prefill_over_forward": theirs / ours,
        "forward_tflop": flops / 1e12,
        "prefill_tflop": prefill_flops / 1e12,
        "prefill_tflop_per_s": prefill_flops / ours / 1e12,
        "transformers_tflop_per_s": flops / theirs / 1e12,
    }
    print(
        f"benchmark {family}: prefill {row['prefill_tokens_per_s']:,.0f} tok/s "
        f"({row['prefill_tflop_per_s']:.2f} TFLOP/s), transformers forward "
        f"{row['transformers_forward_tokens_per_s']:,.0f} tok/s "
        f"({row['transformers_tflop_per_s']:.2f} TFLOP/s), {tokens} tokens"
    )
    if device.type == "cuda":
        row["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return row


def _timed(work: Any, device: Any, repeats: int = 2) -> float:
    """Seconds of the fastest of ``repeats`` runs after one warm-up (kernels compile then)."""
    import torch

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    work()
    best = float("inf")
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        work()
        sync()
        best = min(best, time.perf_counter() - start)
    return best


# --- running ------------------------------------------------------------------------------------


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def _run(command: list[str], timeout: int) -> dict[str, Any]:
    start = time.perf_counter()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    try:
        done = subprocess.run(
            command, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env
        )
        returncode, log = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as expired:
        returncode, log = 124, f"timed out after {timeout} s\n{expired.stdout or ''}"
    return {
        "command": " ".join(command[1:]),
        "returncode": returncode,
        "seconds": round(time.perf_counter() - start, 1),
        "tail": log[-3000:] if isinstance(log, str) else str(log)[-3000:],
    }


def environment() -> dict[str, Any]:
    import torch
    import transformers

    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }
    for name in ("fla", "flash_attn", "triton"):
        try:
            info[name] = __import__(name).__version__
        except Exception:
            info[name] = None
    return info


def main(argv: Sequence[str] | None = None) -> int:
    settings = parse_args(argv)
    settings.out.parent.mkdir(parents=True, exist_ok=True)
    if settings.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("gpu-check: CUDA is not available", file=sys.stderr)
            return 2
    runners = {"tests": run_gpu_tests, "recipes": run_recipes, "benchmark": run_benchmark}
    phases = []
    for name in settings.phases:
        start = time.perf_counter()
        try:
            phase = runners[name](settings)
        except Exception as error:  # recorded, and the check fails
            phase = Phase(name, ok=False, details={"error": f"{type(error).__name__}: {error}"})
        phase.seconds = round(time.perf_counter() - start, 1)
        phases.append(phase)
        print(f"gpu-check {name}: {'ok' if phase.ok else 'FAILED'} ({phase.seconds:.0f} s)")
    ok = all(phase.ok for phase in phases)
    record = {
        "ok": ok,
        "settings": {**asdict(settings), "out": str(settings.out)},
        "environment": environment(),
        "phases": {phase.name: asdict(phase) for phase in phases},
    }
    settings.out.write_text(json.dumps(record, indent=2, default=str))
    print(f"gpu-check: {'passed' if ok else 'FAILED'}; results in {settings.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
