"""``benchmarks/gpu_check.py`` on CPU: its arguments, the bf16 GPU-dim recipe configs it runs
(validated, and their models built and run here), its FLOP count, its JSON and exit code."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest
import torch

import longstraw_core as ls
from longstraw_core import config, models

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks/gpu_check.py")
gpu_check = importlib.util.module_from_spec(_spec)
sys.modules["gpu_check"] = gpu_check  # its dataclasses look their module up
_spec.loader.exec_module(gpu_check)


def test_arguments(tmp_path):
    settings = gpu_check.parse_args(["--out", str(tmp_path / "r.json")])
    assert settings.device == "cuda" and settings.dtype_name == "bfloat16"
    assert settings.phases == ("tests", "recipes", "benchmark")
    assert settings.families == gpu_check.FAMILIES
    cpu = gpu_check.parse_args(["--device", "cpu", "--quick"])
    assert cpu.phases == ("recipes", "benchmark") and cpu.dtype_name == "float32"
    assert cpu.prompt_tokens < settings.prompt_tokens
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--families", "llama4"])


def test_every_file_with_gpu_tests_is_collected():
    marked = {
        f"tests/{path.name}"
        for path in (ROOT / "tests").glob("test_*.py")
        if re.search(r"pytest\.mark\.gpu\b", path.read_text())
    }
    assert marked == set(gpu_check.GPU_TEST_FILES)


@pytest.mark.parametrize("family", gpu_check.FAMILIES)
def test_the_cuda_recipe_configs_validate_and_their_models_run(family, tmp_path):
    """What the GPU machine's recipe step gets: bfloat16, GPU head dims, the state offloaded;
    the model is built from that config and scores a short prompt here (CPU, bf16)."""
    settings = gpu_check.parse_args(["--out", str(tmp_path / "r.json")])
    overrides = gpu_check.recipe_overrides(family, settings, tmp_path / "run")
    script, path = gpu_check._RECIPES[family]
    cfg = config.load_config(ROOT / path, overrides)
    assert cfg.model.tiny == family and cfg.model.dtype == "bfloat16"
    assert cfg.offload.attention == "cpu" and cfg.train.steps == 1
    assert cfg.model.tiny_overrides.items() >= gpu_check.GPU_DIMS[family].items()
    command = gpu_check.recipe_command(family, settings, tmp_path / "run")
    assert command[1].endswith(script) and command[-len(overrides) :] == overrides
    model = models.build_model(cfg.model, seed=0)
    assert next(model.parameters()).dtype == torch.bfloat16
    adapter = ls.adapt(model)
    prompt = torch.randint(0, model.config.get_text_config().vocab_size, (40,))
    with torch.no_grad():
        state = adapter.prefill(prompt, chunk_size=16, offload=config.offload_policy(cfg))
        logprobs = adapter.score(state, prompt[:5])
    assert logprobs.shape == (5,) and torch.isfinite(logprobs).all()


def test_forward_flops_count_the_decoder_weights():
    model = ls.tiny_models.tiny_model("qwen3", head_dim=16)
    text = model.config
    weights = sum(
        module.weight.numel()
        for name, module in model.model.layers.named_modules()
        if isinstance(module, torch.nn.Linear)
    )
    tokens = 100
    attention = 2 * text.num_hidden_layers * text.num_attention_heads * 16 * tokens**2
    want = 2 * weights * tokens + attention
    assert gpu_check.forward_flops(text, tokens, lm_head=False) == pytest.approx(want)
    head = 2 * text.hidden_size * text.vocab_size * tokens
    assert gpu_check.forward_flops(text, tokens) == pytest.approx(want + head)


def test_a_quick_cpu_run_writes_its_json_and_a_failure_exits_non_zero(tmp_path, monkeypatch):
    out = tmp_path / "gpu_check.json"
    args = ["--device", "cpu", "--quick", "--families", "qwen3", "--out", str(out)]
    assert gpu_check.main([*args, "--phases", "benchmark"]) == 0
    record = json.loads(out.read_text())
    row = record["phases"]["benchmark"]["details"]["qwen3"]
    assert record["ok"] and row["prefill_tokens_per_s"] > 0 and row["forward_tflop"] > 0

    failed = {"command": "x", "returncode": 1, "seconds": 0.0, "tail": "boom"}
    monkeypatch.setattr(gpu_check, "_run", lambda command, timeout: failed)
    assert gpu_check.main([*args, "--phases", "recipes"]) == 1
    record = json.loads(out.read_text())
    assert not record["ok"] and not record["phases"]["recipes"]["details"]["qwen3"]["ok"]
