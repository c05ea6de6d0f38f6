"""``python -m longstraw_core.models.export``: a checkpoint as a plain transformers model directory.

A tiny recipe run (in this process, its model kept) saves a checkpoint; the exported directory
loads with ``AutoModelForCausalLM.from_pretrained`` / ``AutoTokenizer.from_pretrained`` and its
logits equal the trained policy's: bit for bit for a full fine-tune, to float32 round-off for
LoRA merged into its base (Qwen3.6 and GLM-5.x, whose MLA ``kv_b_proj`` is adapted) and for QLoRA (NF4 base dequantized, then merged). Incomplete or
damaged checkpoints, a missing run config, a moved base and a non-empty target are refused.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from longstraw_core.checkpoint import CheckpointError
from longstraw_core.checkpoint.files import write_manifest
from longstraw_core.config import load_config
from longstraw_core.data.tokenizer import encode_prompt
from longstraw_core.models.export import ExportError, export, main
from longstraw_core.training.trainer import load_recipe

ROOT = Path(__file__).resolve().parents[2]
RUNS = {  # kind: (recipe, config, overrides)
    "full": ("grpo_qwen36.py", "configs/qwen36/tiny_grpo_cpu.yaml", []),
    "lora": ("grpo_qwen36.py", "configs/qwen36/tiny_lora_grpo_cpu.yaml", []),
    "qlora": ("grpo_qwen36.py", "configs/qwen36/tiny_qlora_grpo_cpu.yaml", []),
    "glm-lora": ("grpo_glm52.py", "configs/glm52/tiny_grpo_cpu.yaml", ["lora.enabled=true"]),
}
SMALL = [  # the configs' own rewards and group of 8: every group has reward variance
    "data.prompt_tokens=512",
    "train.chunk_size=256",
    "train.steps=1",
    "train.save_every=1",
    "train.completions_every=0",
    "tracking.wandb=false",
    "optim.lr=1e-2",  # weights that visibly move in one step
]


def _recipe_module(recipe: str):
    return load_recipe(ROOT / "recipes" / recipe)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """``kind -> (checkpoint directory, the trained policy, the run's tokenizer)``, each run
    once for the module."""
    runs = {}

    def run(kind: str):
        if kind not in runs:
            recipe_file, config, overrides = RUNS[kind]
            out = tmp_path_factory.mktemp(kind) / "run"
            cfg = load_config(ROOT / config, [*SMALL, *overrides, f"train.output_dir={out}"])
            recipe = _recipe_module(recipe_file).Recipe(cfg)
            recipe.setup()
            try:
                assert recipe.train() is None
            finally:
                recipe.cleanup()
            runs[kind] = (out / "step-000001", recipe.model.eval(), recipe.tokenizer)
        return runs[kind]

    return run


def _ids() -> torch.Tensor:
    return torch.randint(0, 256, (1, 48), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("kind", list(RUNS))
def test_the_exported_model_gives_the_trained_policys_logits(trained, tmp_path, kind):
    checkpoint, policy, tokenizer = trained(kind)
    done = export(checkpoint, tmp_path / "exported")
    assert (done.step, done.merged_lora, done.dequantized) == (1, kind != "full", kind == "qlora")
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "exported").eval()
    assert not hasattr(exported, "peft_config")
    assert not any("lora_" in name for name, _ in exported.named_parameters())
    with torch.no_grad():
        want = policy(input_ids=_ids()).logits
        got = exported(input_ids=_ids()).logits
    if kind == "full":
        assert torch.equal(got, want)
    else:
        # merged (W + BA) x against W x + B(A x): the same model up to float32 rounding
        # (observed up to 2e-5 on logits of order 1, through 4 layers)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=5e-5)
        with torch.no_grad(), policy.disable_adapter():  # the adapters changed the logits
            base = policy(input_ids=_ids()).logits
        assert (got - base).abs().max() > 100 * (got - want).abs().max()
    served = AutoTokenizer.from_pretrained(tmp_path / "exported")
    prompt = [{"role": "user", "content": "What is the passkey?"}]
    assert encode_prompt(served, prompt) == encode_prompt(tokenizer, prompt)
    assert served.eos_token == tokenizer.eos_token


def test_a_non_empty_target_is_replaced_only_with_force(trained, tmp_path):
    checkpoint, _, _ = trained("full")
    target = tmp_path / "exported"
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    with pytest.raises(ExportError, match="not empty; pass --force"):
        export(checkpoint, target)
    assert (target / "keep.txt").read_text() == "mine"
    with pytest.raises(SystemExit, match="not empty"):  # the command: one line, non-zero
        main([str(checkpoint), str(target)])
    main([str(checkpoint), str(target), "--force"])
    assert not (target / "keep.txt").exists() and (target / "model.safetensors").is_file()
    with pytest.raises(ExportError, match="overlaps the checkpoint"):
        export(checkpoint, checkpoint / "model", force=True)


def _copy(checkpoint: Path, tmp_path: Path) -> Path:
    import shutil

    copy = tmp_path / "run" / checkpoint.name
    shutil.copytree(checkpoint, copy)
    return copy


def test_a_damaged_or_incomplete_checkpoint_is_refused(trained, tmp_path):
    checkpoint, _, _ = trained("lora")
    target = tmp_path / "exported"
    corrupt = _copy(checkpoint, tmp_path / "corrupt")
    weights = corrupt / "model" / "adapter_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="sha256 differs"):
        export(corrupt, target)
    incomplete = _copy(checkpoint, tmp_path / "incomplete")
    (incomplete / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="the save did not finish"):
        export(incomplete, target)
    with pytest.raises(ExportError, match="neither a checkpoint"):
        export(tmp_path / "incomplete", target)  # no complete checkpoint in that directory
    assert not target.exists()


def _with_config(checkpoint: Path, tmp_path: Path, edit) -> Path:
    """A copy of ``checkpoint`` whose recorded run config ``edit`` changed (manifest rewritten)."""
    copy = _copy(checkpoint, tmp_path)
    state_file = copy / "trainer_state.json"
    state = json.loads(state_file.read_text())
    edit(state["extra"])
    state_file.write_text(json.dumps(state))
    (copy / "manifest.json").unlink()
    write_manifest(copy, state["step"])
    return copy


def test_a_missing_run_config_or_moved_base_is_refused_naming_the_fix(trained, tmp_path):
    checkpoint, _, _ = trained("lora")
    target = tmp_path / "exported"
    no_config = _with_config(checkpoint, tmp_path / "a", lambda extra: extra.pop("config"))
    with pytest.raises(ExportError, match="records no run config"):
        export(no_config, target)

    def moved(extra):
        extra["config"]["model"] |= {"tiny": None, "tiny_overrides": {}, "path": "/gone/base"}

    moved_base = _with_config(checkpoint, tmp_path / "b", moved)
    with pytest.raises(ExportError, match=r"model\.path '/gone/base' .* pass --model-path"):
        export(moved_base, target)
    assert not target.exists()
