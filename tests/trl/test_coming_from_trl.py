"""What a TRL user brings: reward modules beside the config or in the working directory,
reward factories with arguments (TRL's own), Hub ids for models, a Python API taking
callables and ``datasets`` objects, and docs/coming_from_trl.md's table of the defaults that
differ from TRL's.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import datasets
import huggingface_hub
import pytest
import torch
import trl
from safetensors.torch import load_file
from trl.rewards import get_soft_overlong_punishment

from longstraw_core import checkpoint
from longstraw_core.config import ConfigError, RunConfig, hub, load_config, to_dict
from longstraw_core.data.tasks import Sample
from longstraw_core.data.tokenizer import builtin_tokenizer, encode_prompt, load_tokenizer
from longstraw_core.models import build as models
from longstraw_core.models.export import export
from longstraw_core.models.tiny import tiny_model
from longstraw_core.rewards import RewardSet, completion_text
from longstraw_core.schema.grpo import GRPOConfig
from longstraw_core.training.trainer import RunError, dataset_directory, reward_entries, train

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs/qwen36/tiny_grpo_cpu.yaml"
RECIPE = "recipes/grpo_qwen36.py"
QUICK = [  # a step in seconds on the tiny config
    "data.prompt_tokens=256",
    "rollout.num_generations=4",
    "rollout.max_new_tokens=6",
    "train.chunk_size=256",
    "train.completions_every=0",
    "grpo.gradient=detached",
    "tracking.wandb=false",
]
SOLVED = [  # many distinct characters: even a random toy's groups have reward variance
    {"prompt": "Name the colours of the rainbow.", "solution": "red, orange, yellow, green"},
    {"prompt": "Count to twelve.", "solution": "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12"},
    {"prompt": "Spell the alphabet backwards.", "solution": "zyxwvutsrqponmlkjihgfedcba"},
]
RECALL = """
from longstraw_core.rewards import completion_text


def recall(completions, solution, **kwargs):
    out = []
    for completion, wanted in zip(completions, solution):
        text = completion_text(completion)
        out.append(sum(c in text for c in set(wanted)) / len(set(wanted)))
    return out
"""


@pytest.fixture
def clean_imports(monkeypatch):
    """``sys.path`` as it was after the test: the reward lookup appends the directory it found
    a module in."""
    monkeypatch.setattr(sys, "path", list(sys.path))


def _config_with_rewards(directory: Path, rewards: str) -> Path:
    """``directory/run.yaml``: the tiny config on ``SOLVED`` (``directory/train.jsonl``)
    with these rewards."""
    directory.mkdir(parents=True, exist_ok=True)
    datasets.Dataset.from_list(SOLVED).to_json(directory / "train.jsonl")
    path = directory / "run.yaml"
    path.write_text(
        f"defaults: {TINY}\n"
        f"data: {{task: null, path: {directory / 'train.jsonl'}, prompt_tokens: 256}}\n"
        f"rewards: {rewards}\n"
    )
    return path


# --------------------------------------------------------------------------- reward modules


def test_a_reward_module_beside_the_config_imports(tmp_path, monkeypatch, clean_imports):
    """``python recipes/grpo_qwen36.py --config exp/run.yaml`` from anywhere: the module
    beside ``run.yaml`` is found (the recipe's folder alone is on the import path)."""
    config = _config_with_rewards(tmp_path / "exp", "[{name: 'beside_cfg_rewards:recall'}]")
    (tmp_path / "exp" / "beside_cfg_rewards.py").write_text(RECALL)
    monkeypatch.chdir(ROOT)
    cfg = load_config(config)
    rewards = RewardSet.from_config(cfg)
    sample = Sample(id="s", prompt="p", answer="", columns={"prompt": "p", "solution": "ab"})
    scored = rewards(["a", "xy"], [sample] * 2, completion_ids=[[1], [2]])
    assert rewards.names == ["recall"] and scored.rewards == [0.5, 0.0]


def test_a_reward_module_in_the_working_directory_imports(tmp_path, monkeypatch, clean_imports):
    config = _config_with_rewards(tmp_path / "exp", "[{name: 'cwd_rewards:recall'}]")
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "cwd_rewards.py").write_text(RECALL)
    monkeypatch.chdir(tmp_path / "work")
    assert RewardSet.from_config(load_config(config)).names == ["recall"]


def test_a_reward_module_nowhere_is_refused_naming_where_it_looked(
    tmp_path, monkeypatch, clean_imports
):
    config = _config_with_rewards(tmp_path / "exp", "[{name: 'nowhere_rewards:recall'}]")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as error:
        load_config(config)
    message = str(error.value)
    assert message.startswith("rewards[0].name: cannot import reward 'nowhere_rewards:recall'")
    assert str(tmp_path / "exp") in message and f"{tmp_path}," not in message
    assert "\n" not in message


def test_export_does_not_import_the_runs_reward_functions(tmp_path, monkeypatch, clean_imports):
    """A checkpoint whose run named a reward module that is not importable where the export
    runs (beside a config elsewhere) exports: the export scores nothing."""
    cfg = load_config(TINY, QUICK)
    saved = to_dict(cfg) | {"rewards": [{"name": "gone_rewards:recall", "weight": 1.0}]}
    model = models.build_model(cfg.model, seed=0)
    optimizer = models.build_optimizer(model, cfg.optim)
    scheduler = models.build_scheduler(optimizer, cfg.optim, cfg.train.steps)
    checkpoint.save_checkpoint(
        tmp_path / "run", 1, model, optimizer, scheduler, extra={"config": saved}
    )
    monkeypatch.chdir(tmp_path)
    done = export(tmp_path / "run", tmp_path / "exported")
    assert done.step == 1 and (tmp_path / "exported" / "config.json").is_file()


# --------------------------------------------------------------------------- factories


def test_trl_factory_with_kwargs_gives_trls_reward(tmp_path):
    """``{name: trl.rewards:get_soft_overlong_punishment, kwargs: {...}}``: the factory is
    called with the kwargs and its product scores as TRL's own call of it does."""
    entry = (
        "[{name: 'trl.rewards:get_soft_overlong_punishment', "
        "kwargs: {max_completion_len: 64, soft_punish_cache: 16}}]"
    )
    cfg = load_config(_config_with_rewards(tmp_path, entry))
    assert cfg.rewards[0].kwargs == {"max_completion_len": 64, "soft_punish_cache": 16}
    rewards = RewardSet.from_config(cfg)
    ids = [[1] * 40, [1] * 56, [1] * 80]
    expected = get_soft_overlong_punishment(max_completion_len=64, soft_punish_cache=16)(ids)
    scored = rewards(
        ["a", "b", "c"], [Sample(id="s", prompt="p", answer="")] * 3, completion_ids=ids
    )
    assert scored.rewards == expected == [0.0, -0.5, -1.0]
    assert rewards.names == ["soft_overlong_punishment_reward"]  # TRL's metric name


@pytest.mark.parametrize(
    ("entry", "key", "phrase"),
    [
        ("{name: 'trl.rewards:get_soft_overlong_punishment', kwargs: {max_completion_len: 64, "
         "soft_punish_cache: 16, max_len: 64}}",
         "rewards[0].kwargs", "unexpected keyword argument 'max_len'"),
        ("{name: 'trl.rewards:think_format_reward', kwargs: {tag: x}}",
         "rewards[0].kwargs", "args/kwargs are a factory's"),
        ("{name: 'trl.rewards:get_soft_overlong_punishment', args: [64]}",
         "rewards[0].args", "missing a required argument: 'soft_punish_cache'"),
    ],
)  # fmt: skip
def test_a_factory_entry_that_cannot_be_built_is_refused_at_load(tmp_path, entry, key, phrase):
    with pytest.raises(ConfigError) as error:
        load_config(_config_with_rewards(tmp_path, f"[{entry}]"))
    assert error.value.key == key and phrase in str(error.value)


@pytest.mark.multiprocess
def test_the_recipe_trains_with_a_module_beside_its_config_and_a_trl_factory(tmp_path):
    """The recipe's own entry point, run from the repository: the reward module beside the
    user's config and TRL's factory with its kwargs both score every step."""
    config = _config_with_rewards(
        tmp_path / "exp",
        "[{name: 'recipe_beside_rewards:recall'}, {name: 'trl.rewards:"
        "get_soft_overlong_punishment', kwargs: {max_completion_len: 6, soft_punish_cache: 4}}]",
    )
    (tmp_path / "exp" / "recipe_beside_rewards.py").write_text(RECALL)
    command = [
        sys.executable, str(ROOT / RECIPE), "--config", str(config), *QUICK, "train.steps=1",
        "train.save_every=1", f"train.output_dir={tmp_path / 'run'}",
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    state = json.loads((tmp_path / "run/step-000001/trainer_state.json").read_text())
    (_, metrics), *_ = state["extra"]["logger"]["history"]
    assert math.isfinite(metrics["rewards/recall/mean"])
    assert math.isfinite(metrics["rewards/soft_overlong_punishment_reward/mean"])


# --------------------------------------------------------------------------- Hub ids

COMMIT = "0123456789abcdef0123456789abcdef01234567"
HUB_MODEL = [
    "model.tiny=null",
    "model.tiny_overrides={}",
    "model.path=tiny-org/tiny-qwen3",
    "tokenizer.path=tiny-org/tiny-qwen3",
]


def _hub_cache(cache: Path, *, weights: bool = True) -> Path:
    """A Hugging Face cache as ``huggingface_hub`` lays it out (``refs/main`` holding the
    commit, the files under ``snapshots/<commit>/``) with a tiny Qwen3 and the byte
    tokenizer, as ``hf download tiny-org/tiny-qwen3`` would leave it."""
    repo = cache / "models--tiny-org--tiny-qwen3"
    snapshot = repo / "snapshots" / COMMIT
    tiny_model("qwen3", vocab_size=260, seed=1).save_pretrained(snapshot)
    builtin_tokenizer().save_pretrained(snapshot)
    if not weights:
        (snapshot / "model.safetensors").unlink()
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return snapshot


@pytest.fixture
def offline_cache(tmp_path, monkeypatch):
    """``HF_HUB_CACHE`` at an empty directory and ``HF_HUB_OFFLINE=1``, for this process
    (huggingface_hub reads them at import: its constants too) and any child."""
    cache = tmp_path / "hf-cache"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return cache


def test_a_hub_id_resolves_to_its_cached_snapshot(offline_cache):
    snapshot = _hub_cache(offline_cache)
    cfg = load_config(TINY, [*QUICK, *HUB_MODEL])
    assert Path(cfg.model.path) == Path(cfg.tokenizer.path) == snapshot
    hub.fetch_weights(cfg.model.path)  # present: nothing to do, offline
    prompt = encode_prompt(load_tokenizer(cfg.tokenizer.path), "hello")
    assert prompt == list(b"hello")


def test_a_hub_id_not_in_the_offline_cache_is_refused_in_one_line(offline_cache):
    with pytest.raises(ConfigError) as error:
        load_config(TINY, [*QUICK, *HUB_MODEL[:2], "model.path=Qwen/Qwen3-0.6B"])
    message = str(error.value)
    assert message.startswith("model.path: 'Qwen/Qwen3-0.6B' is not a local directory, nor")
    assert str(offline_cache) in message and "hf download Qwen/Qwen3-0.6B" in message
    assert "HF_HUB_OFFLINE=1" in message and "\n" not in message


def test_a_cached_hub_model_without_weights_is_refused_naming_them(offline_cache):
    _hub_cache(offline_cache, weights=False)
    cfg = load_config(TINY, [*QUICK, *HUB_MODEL])  # config and tokenizer are there
    with pytest.raises(ConfigError, match=r"model\.path: tiny-org/tiny-qwen3 .* no \*\.safet"):
        hub.fetch_weights(cfg.model.path)


def test_local_paths_are_never_taken_for_hub_ids(tmp_path):
    assert not hub.is_hub_id("/models/Qwen3.6-27B")  # the shipped placeholders
    assert not hub.is_hub_id("./org/name") and not hub.is_hub_id("a/b/c")
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert not hub.is_hub_id(str(tmp_path / "org" / "name"))
    assert hub.is_hub_id("Qwen/Qwen3-0.6B")
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(TINY, [*HUB_MODEL[:2], "model.path=/models/Qwen3.6-27B"])


@pytest.mark.multiprocess
def test_the_recipe_trains_a_hub_id_from_the_offline_cache(tmp_path, offline_cache):
    _hub_cache(offline_cache)
    command = [
        sys.executable, str(ROOT / RECIPE), "--config", str(TINY), *QUICK,
        *HUB_MODEL, "data.prompt_tokens=512", "train.steps=1", "train.save_every=1",
        f"train.output_dir={tmp_path / 'run'}",
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "step 1/1" in result.stdout + result.stderr
    assert (tmp_path / "run" / "step-000001" / "trainer_state.json").is_file()


# --------------------------------------------------------------------------- the Python API


def _weights(step: Path) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(step.rglob("*.safetensors")) for k, v in load_file(f).items()}


def test_the_python_api_trains_as_the_recipe_does_on_the_same_data(
    tmp_path, monkeypatch, clean_imports
):
    """``train(config, reward_funcs=[a lambda], train_dataset=a Dataset in memory,
    eval_dataset=another)`` for two steps equals the recipe's own ``main`` on the same rows
    written to JSON Lines files with the same reward as a module function: the same weights
    bit for bit, the same rewards and eval metrics."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "ds-cache"))
    common = [*QUICK, "rollout.num_generations=8", "rollout.max_new_tokens=12",
              "train.steps=2", "train.save_every=2", "optim.lr=1e-2", "eval.every=2",
              "eval.samples=null", "eval.num_generations=2"]  # fmt: skip
    (tmp_path / "file_recall.py").write_text(RECALL)
    monkeypatch.syspath_prepend(str(tmp_path))
    data, held_out = tmp_path / "train.jsonl", tmp_path / "test.jsonl"
    datasets.Dataset.from_list(SOLVED).to_json(data)
    datasets.Dataset.from_list(SOLVED[:1]).to_json(held_out)
    spec = importlib.util.spec_from_file_location("api_reference_recipe", ROOT / RECIPE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(
        ["--config", str(TINY), *common, "data.task=null", f"data.path={data}",
         "eval.data.task=null", f"eval.data.path={held_out}",
         "rewards=[{name: 'file_recall:recall'}]", f"train.output_dir={tmp_path / 'file'}"]
    )  # fmt: skip

    api = train(
        TINY,
        reward_funcs=[
            lambda completions, solution, **kwargs: [
                sum(c in completion_text(t) for c in set(s)) / len(set(s))
                for t, s in zip(completions, solution, strict=True)
            ]
        ],
        train_dataset=datasets.Dataset.from_list(SOLVED),
        eval_dataset=datasets.Dataset.from_list(SOLVED[:1]),
        overrides=[*common, f"train.output_dir={tmp_path / 'api'}"],
    )
    assert api.step == 2 and api.rewards.names == ["<lambda>"]
    first, second = _weights(tmp_path / "file/step-000002"), _weights(tmp_path / "api/step-000002")
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)
    initial = models.build_model(load_config(TINY, QUICK).model, seed=0).state_dict()
    assert any(not torch.equal(initial[k], first[k]) for k in first if k in initial)
    histories = [
        json.loads((tmp_path / run / "step-000002/trainer_state.json").read_text())["extra"]
        for run in ("file", "api")
    ]
    rewards = [[m["reward"] for _, m in h["logger"]["history"]] for h in histories]
    assert rewards[0] == rewards[1] and len(rewards[0]) == 2
    evals = [[m.get("eval/reward") for _, m in h["logger"]["history"]] for h in histories]
    assert evals[0] == evals[1] and evals[0][0] is None and math.isfinite(evals[0][1])
    assert histories[1]["config"]["rewards"][0]["name"] == "callable:<lambda>"
    assert Path(histories[1]["config"]["data"]["path"]).parent == tmp_path / "ds-cache/longstraw"


def test_the_python_api_raises_the_command_lines_one_line_error(tmp_path, capfd):
    """Where the command line prints one line and exits 1, ``train`` raises ``RunError``
    with that line, and prints nothing: the caller decides (catch it, show it, retry)."""
    out = tmp_path / "run"
    with pytest.raises(RunError) as raised:
        train(TINY, overrides=["train.stepz=3", f"train.output_dir={out}"])
    assert str(raised.value).startswith("config error: train.stepz: unknown key")
    assert raised.value.code == 1 and "\n" not in str(raised.value)
    with pytest.raises(RunError, match=r"^config error: rewards\[0\]\.name: unknown reward"):
        train(TINY, reward_funcs=["exact_macth"], overrides=[f"train.output_dir={out}"])
    out_text, err_text = capfd.readouterr()
    assert "config error" not in out_text + err_text
    assert not out.exists(), "refused before anything was written"


def test_reward_entries_name_callables_uniquely_and_check_the_weights():
    def judge(completions, **kwargs):
        return [1.0] * len(completions)

    entries = reward_entries(
        [judge, lambda completions, **kw: [0.0], lambda completions, **kw: [1.0], "contains"],
        [1, 2, 3, 4],
    )
    assert [e["name"] for e in entries] == [
        "callable:judge", "callable:<lambda>", "callable:<lambda>_2", "contains"
    ]  # fmt: skip
    assert [e["weight"] for e in entries] == [1.0, 2.0, 3.0, 4.0]
    rewards = RewardSet([dataclasses.make_dataclass("E", ["name", "args", "kwargs"])(
        entries[2]["name"], [], {})])  # fmt: skip
    assert rewards.names == ["<lambda>_2"]
    with pytest.raises(ValueError, match="Number of reward weights"):
        reward_entries([judge], [1.0, 2.0])


def test_a_dataset_is_saved_once_by_its_rows(tmp_path, monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path))
    first = dataset_directory(datasets.Dataset.from_list(SOLVED), "train_dataset")
    again = dataset_directory(datasets.Dataset.from_list(SOLVED), "train_dataset")
    other = dataset_directory(datasets.Dataset.from_list(SOLVED[:1]), "train_dataset")
    assert first == again != other and len(datasets.load_from_disk(first)) == 3
    with pytest.raises(TypeError, match=r"DatasetDict: pass one split"):
        dataset_directory(datasets.DatasetDict({"train": datasets.Dataset.from_list(SOLVED)}), "x")
    iterable = datasets.Dataset.from_list(SOLVED).to_iterable_dataset()
    with pytest.raises(TypeError, match="needs a Dataset"):
        dataset_directory(iterable, "train_dataset")


# --------------------------------------------------------------------------- TRL's defaults

# Each TRL setting LongStraw has too: TRL field -> its value in a default LongStraw config,
# in TRL's terms. A key reads a RunConfig field; a function maps several onto TRL's one.
SAME_SETTING = {
    "learning_rate": "optim.lr",
    "weight_decay": "optim.weight_decay",
    "adam_beta1": lambda c: c.optim.betas[0],
    "adam_beta2": lambda c: c.optim.betas[1],
    "max_grad_norm": "optim.max_grad_norm",
    "lr_scheduler_type": "optim.scheduler",
    "warmup_steps": "optim.warmup_steps",
    "max_steps": "train.steps",
    "gradient_checkpointing": "train.activation_checkpointing",
    "bf16": lambda c: c.model.dtype == "bfloat16" or c.distributed.mixed_precision == "bf16",
    "seed": "train.seed",
    "data_seed": "data.seed",
    "logging_steps": "train.log_every",
    "save_steps": "train.save_every",
    "save_total_limit": lambda c: c.train.keep_last or None,  # TRL's None: keep all
    "report_to": lambda c: "wandb" if c.tracking.wandb else "none",
    "log_completions": "train.completions_every",  # 10: a table every 10 steps (TRL: false)
    "eval_strategy": lambda c: "steps" if c.eval.every else "no",
    "shuffle_dataset": "data.shuffle",
    "num_generations": "rollout.num_generations",
    "num_generations_eval": "eval.num_generations",
    "max_completion_length": "rollout.max_new_tokens",
    "temperature": "rollout.temperature",
    "top_p": "rollout.top_p",
    "top_k": "rollout.top_k",
    "min_p": lambda c: c.rollout.min_p or None,  # TRL's None: off
    "repetition_penalty": "rollout.repetition_penalty",
    "per_device_train_batch_size": lambda c: c.rollout.num_generations,  # x prompts_per_step
    "gradient_accumulation_steps": "train.prompts_per_step",
    **{f.name: f"grpo.{f.name}" for f in dataclasses.fields(GRPOConfig)
       if f.name not in ("num_generations", "max_completion_length", "temperature")
       and f.name in {t.name for t in dataclasses.fields(trl.GRPOConfig)}},
}  # fmt: skip


def _trl_default(name: str) -> object:
    field = {f.name: f for f in dataclasses.fields(trl.GRPOConfig)}[name]
    value = field.default
    if name == "bf16" and value is None:  # GRPOConfig: bf16 unless fp16, where supported
        return True
    if name == "data_seed" and value is None:  # follows seed
        return _trl_default("seed")
    return value


def _shown(value: object) -> str:
    return (
        "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
    )


def test_the_docs_state_each_default_that_differs_from_trls():
    """docs/coming_from_trl.md's table: the row of every TRL setting whose default LongStraw
    does not share says ``default `ours` ... (TRL: `theirs`...``, with why; no row claims a
    difference that is not there. ``num_train_epochs`` (LongStraw counts steps only) is named."""
    page = (ROOT / "docs" / "coming_from_trl.md").read_text()
    section = page.split("## Every `trl.GRPOConfig` field", 1)[1]
    section = section.split("\n## ", 1)[0]
    rows = {
        name: line
        for line in section.splitlines()
        if line.startswith("| `")
        for name in re.findall(r"`([a-z0-9_]+)`", line.split(" | ")[0])
    }
    assert "num_train_epochs" in rows
    ours_all = RunConfig()
    differing = {}
    for name, ours in SAME_SETTING.items():
        if isinstance(ours, str):
            section_name, key = ours.split(".")
            ours = getattr(getattr(ours_all, section_name), key)
        else:
            ours = ours(ours_all)
        if ours != _trl_default(name):
            differing[name] = (_shown(ours), _shown(_trl_default(name)))
    assert {"lr_scheduler_type", "gradient_checkpointing", "bf16", "seed"} <= set(differing)
    for name, (ours, theirs) in differing.items():
        stated = rf"default `{re.escape(ours)}`[^|]*?\(TRL: `{re.escape(theirs)}`"
        assert re.search(stated, rows[name]), f"{name}: {rows[name]}"
    for name, row in rows.items():
        if "(TRL: `" in row:
            fields = re.findall(r"`([a-z0-9_]+)`", row.split(" | ")[0])
            assert set(fields) & set(differing), f"{name}: a default it shares with TRL: {row}"
