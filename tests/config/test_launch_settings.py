"""accelerate launch settings: honoured (mapped onto the run config) or refused at start.

The environment each test sets is the one accelerate 1.15 itself derives from an accelerate
config file (``accelerate_env``: its own launch parser, validation and env preparation, as
``accelerate launch --config_file`` runs them), so the tests follow what really reaches a
recipe. Two ``multiprocess`` tests launch a recipe through ``accelerate launch`` for real.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import launch
import pytest
import yaml
from accelerate.commands.launch import _validate_launch_command, launch_command_parser
from accelerate.utils.launch import (
    prepare_deepspeed_cmd_env,
    prepare_multi_gpu_env,
    prepare_simple_launcher_cmd_env,
)
from safetensors.torch import load_file

from longstraw_core.config import ConfigError, load_config
from longstraw_core.launch import settings as launch_settings

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "qwen36" / "tiny_grpo_cpu.yaml"
QLORA = ROOT / "configs" / "qwen36" / "tiny_qlora_grpo_cpu.yaml"
BASE = {
    "compute_environment": "LOCAL_MACHINE",
    "distributed_type": "NO",
    "mixed_precision": "no",
    "num_machines": 1,
    "num_processes": 1,
    "machine_rank": 0,
    "use_cpu": False,
    "debug": False,
}


def accelerate_env(tmp_path: Path, settings: dict) -> dict[str, str]:
    """The ACCELERATE_* / FSDP_* variables ``accelerate launch --config_file`` passes a
    process for an accelerate config of ``BASE | settings`` (dispatch as ``launch_command``)."""
    path = tmp_path / "accelerate.yaml"
    path.write_text(yaml.safe_dump(BASE | settings))
    args = launch_command_parser().parse_args(["--config_file", str(path), "recipe.py"])
    args, _, _ = _validate_launch_command(args)
    if args.use_deepspeed:
        args.deepspeed_fields_from_accelerate_config = ""
        _, env = prepare_deepspeed_cmd_env(args)
    elif args.use_fsdp or args.use_megatron_lm or args.multi_gpu:
        env = prepare_multi_gpu_env(args)
    else:
        _, env = prepare_simple_launcher_cmd_env(args)
    return {k: v for k, v in env.items() if k.startswith(("ACCELERATE_", "FSDP_"))}


@pytest.fixture
def launched(monkeypatch, tmp_path):
    """Set the environment accelerate would set for an accelerate config (none of this
    process's own ACCELERATE_* / FSDP_* variables kept)."""
    for name in list(os.environ):
        if name.startswith(("ACCELERATE_", "FSDP_")):
            monkeypatch.delenv(name)

    def launch(settings: dict) -> None:
        for name, value in accelerate_env(tmp_path, settings).items():
            monkeypatch.setenv(name, value)

    return launch


def _refusals(cfg, launched, settings: dict) -> str:
    launched(settings)
    with pytest.raises(launch_settings.LaunchSettingsError) as info:
        launch_settings.honour(cfg)
    assert isinstance(info.value, ConfigError) and info.value.key == "accelerate"
    return str(info.value)


# --- honoured ----------------------------------------------------------------------------------


def test_bf16_becomes_bf16_compute_over_float32_masters(launched, capsys):
    launched({"mixed_precision": "bf16"})
    cfg = launch_settings.honour(load_config(TINY))
    assert cfg.distributed.mixed_precision == "bf16" and cfg.model.dtype == "float32"
    assert "bf16 working weights" in capsys.readouterr().err
    sharded = launch_settings.honour(load_config(TINY, ["distributed.fsdp=true"]))
    assert sharded.distributed.mixed_precision == "bf16"
    assert "FSDP2's bf16 policy" in capsys.readouterr().err


def test_bf16_over_a_bf16_model_is_already_honoured(launched, capsys):
    launched({"mixed_precision": "bf16"})
    cfg = load_config(TINY, ["model.dtype=bfloat16"])
    assert launch_settings.honour(cfg) is cfg
    assert "computes in bf16 already" in capsys.readouterr().err


@pytest.mark.parametrize("path", sorted((ROOT / "configs" / "accelerate").glob("*.yaml")))
def test_the_shipped_accelerate_configs_change_nothing(launched, capsys, path):
    launched(yaml.safe_load(path.read_text()))
    cfg = load_config(TINY)
    assert launch_settings.honour(cfg) is cfg
    assert capsys.readouterr().err == ""


# --- refused, each naming the setting, why, and the LongStraw key ---------------------------------


def test_distributed_type_fsdp_is_refused_with_the_run_config_keys(launched):
    fsdp = {"fsdp_version": 2, "fsdp_reshard_after_forward": False}
    fsdp |= {"fsdp_activation_checkpointing": True, "fsdp_offload_params": True}
    settings = {"distributed_type": "FSDP", "num_processes": 2, "fsdp_config": fsdp}
    message = _refusals(load_config(TINY), launched, settings)
    assert "distributed_type: FSDP" in message and "shards the model itself" in message
    assert "distributed.fsdp=true" in message and "distributed_type: MULTI_GPU" in message
    assert "distributed.reshard_after_forward=false" in message
    assert "train.activation_checkpointing=true" in message
    assert "fsdp_offload_params: true" in message


def test_deepspeed_is_refused_naming_its_equivalents(launched):
    deepspeed = {"zero_stage": 3, "gradient_accumulation_steps": 4, "gradient_clipping": 1.0}
    settings = {"distributed_type": "DEEPSPEED", "num_processes": 2}
    message = _refusals(load_config(TINY), launched, settings | {"deepspeed_config": deepspeed})
    assert "distributed_type: DEEPSPEED" in message and "distributed.fsdp=true" in message
    assert "optim.max_grad_norm" in message
    assert "gradient_accumulation_steps" not in message  # it maps (train.prompts_per_step)


def test_gradient_accumulation_becomes_prompts_per_step(launched, monkeypatch):
    launched({})
    monkeypatch.setenv("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "4")  # read by Accelerator()
    assert launch_settings.honour(load_config(TINY)).train.prompts_per_step == 4
    # the run config's own setting wins only when the two agree
    agreeing = load_config(TINY, ["train.prompts_per_step=4"])
    assert launch_settings.honour(agreeing).train.prompts_per_step == 4
    with pytest.raises(launch_settings.LaunchSettingsError, match=r"train\.prompts_per_step=2"):
        launch_settings.honour(load_config(TINY, ["train.prompts_per_step=2"]))
    monkeypatch.setenv("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "1")
    assert launch_settings.honour(load_config(TINY)).train.prompts_per_step == 1


def test_megatron_lm_is_refused_for_pipeline_stages(launched):
    settings = {"distributed_type": "MEGATRON_LM", "num_processes": 2}
    message = _refusals(load_config(TINY), launched, settings)
    assert "MEGATRON_LM" in message and "distributed.pipeline_stages" in message


def test_parallelism_config_is_refused(launched):
    settings = {"distributed_type": "FSDP", "num_processes": 2, "fsdp_config": {"fsdp_version": 2}}
    settings["parallelism_config"] = {"parallelism_config_tp_size": 2}
    message = _refusals(load_config(TINY), launched, settings)
    assert "parallelism_config" in message and "distributed.pipeline_stages" in message


def test_a_dynamo_backend_is_refused(launched):
    message = _refusals(
        load_config(TINY), launched, {"dynamo_config": {"dynamo_backend": "INDUCTOR"}}
    )
    assert "dynamo_backend: INDUCTOR" in message and "dynamo_backend: 'no'" in message


def test_fp16_and_fp8_are_refused_for_bf16(launched, monkeypatch):
    message = _refusals(load_config(TINY), launched, {"mixed_precision": "fp16"})
    assert "mixed_precision: fp16" in message and "use mixed_precision: bf16" in message
    # fp8 needs Transformer Engine, MS-AMP or torchao to launch; this is what reaches the recipe.
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp8")
    with pytest.raises(launch_settings.LaunchSettingsError, match="mixed_precision: fp8"):
        launch_settings.honour(load_config(TINY))


def test_bf16_that_the_run_config_cannot_take_is_refused_naming_the_key(launched):
    message = _refusals(load_config(QLORA), launched, {"mixed_precision": "bf16"})
    assert "distributed.mixed_precision" in message and "model.dtype=bfloat16" in message


# --- accelerate asked for N processes that starts one -----------------------------------------


def simple_launch(tmp_path: Path, *flags: str) -> tuple[dict[str, str], list[str]]:
    """The environment accelerate's launcher gives the one process it starts for
    ``accelerate launch --config_file <BASE> FLAGS recipe.py`` (its own parser, validation and
    env preparation), and that command line as the process's parent has it."""
    path = tmp_path / "accelerate.yaml"
    path.write_text(yaml.safe_dump(BASE))
    argv = ["--config_file", str(path), *flags, "recipe.py"]
    args, _, _ = _validate_launch_command(launch_command_parser().parse_args(argv))
    assert not (args.multi_gpu or args.use_fsdp or args.use_deepspeed)  # the simple launcher
    _, env = prepare_simple_launcher_cmd_env(args)
    return env, ["/usr/bin/python", "/usr/bin/accelerate", "launch", *argv]


def test_accelerate_asked_for_two_processes_that_starts_one_is_named_with_the_way_to_two(
    tmp_path,
):
    env, argv = simple_launch(tmp_path, "--num_processes", "2")
    message = launch_settings.one_process_of_many(env, argv)
    assert message.startswith("accelerate launch was asked for 2 processes (--num_processes 2)")
    assert "configs/accelerate/cpu_2proc.yaml --num_processes 2 (CPU)" in message
    assert "--multi_gpu --num_processes 2 (GPUs)" in message
    assert "torchrun --nproc_per_node 2" in message
    # Without the command line (unreadable): still named, without the count.
    assert "asked for several processes" in launch_settings.one_process_of_many(env, [])
    # One process asked for; or the processes a launcher of several started (torchrun's).
    env_one, argv_one = simple_launch(tmp_path, "--num_processes", "1")
    assert launch_settings.one_process_of_many(env_one, argv_one) is None
    assert launch_settings.one_process_of_many(env | {"WORLD_SIZE": "2"}, argv) is None
    assert launch_settings.one_process_of_many({}, argv) is None  # python, not accelerate


# --- through accelerate launch, for real ----------------------------------------------------------


def _accelerate_launch(tmp_path: Path, settings: dict, *overrides: str):
    path = tmp_path / "accelerate.yaml"
    path.write_text(yaml.safe_dump(BASE | settings))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "FSDP_"))}
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(path)]
    # Under the NCCL-rules harness, as every launch of the tests (accelerate starts the
    # "script", here the harness's runner, with the recipe as its first argument).
    command += [*launch.under_nccl_rules(ROOT / "recipes" / "grpo_qwen36.py"), *overrides]
    env |= {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)


@pytest.mark.multiprocess
def test_the_recipe_stops_on_a_refused_setting_before_any_weight_loads(tmp_path):
    """The GLM recipe, given the environment an FSDP accelerate config launches it with
    (``accelerate launch`` would start it under torchrun: the same variables)."""
    settings = {"distributed_type": "FSDP", "num_processes": 2, "fsdp_config": {"fsdp_version": 2}}
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "FSDP_"))}
    env |= accelerate_env(tmp_path, settings) | {"PYTHONPATH": str(ROOT)}
    out = tmp_path / "run"
    command = [sys.executable, str(ROOT / "recipes" / "grpo_glm52.py"), f"train.output_dir={out}"]
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert result.returncode != 0
    assert "config error: accelerate:" in result.stderr
    assert "distributed_type: FSDP" in result.stderr and "distributed.fsdp=true" in result.stderr
    assert not out.exists()  # nothing built, nothing written


@pytest.mark.multiprocess
def test_accelerate_launch_with_bf16_trains_on_float32_masters(tmp_path):
    out = tmp_path / "run"
    fast = ["data.prompt_tokens=512", "rollout.num_generations=4", "rollout.max_new_tokens=4"]
    fast += ["train.chunk_size=256", "train.steps=1", "train.save_every=1"]
    # num_processes: 2 with distributed_type NO: accelerate starts one process all the same,
    # which the run's shape names (the count read from the launcher's config file).
    result = _accelerate_launch(
        tmp_path, {"mixed_precision": "bf16", "num_processes": 2}, *fast, f"train.output_dir={out}"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "distributed.mixed_precision=bf16 (bf16 working weights" in result.stderr
    assert "  processes  1 (accelerate launch), 1 on this node;" in result.stderr
    config_file = tmp_path / "accelerate.yaml"
    asked = f"2 processes (num_processes: 2 in {config_file}) and started one"
    assert f"\nwarning: accelerate launch was asked for {asked}" in result.stderr
    checkpoint = out / "step-000001"
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    assert state["extra"]["config"]["distributed"]["mixed_precision"] == "bf16"
    weights = load_file(checkpoint / "model" / "model.safetensors")
    assert {str(t.dtype) for t in weights.values()} == {"torch.float32"}
