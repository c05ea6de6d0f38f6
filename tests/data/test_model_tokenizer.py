"""A real model brings its tokenizer: with ``model.path`` set and ``tokenizer.path`` null the
run tokenizes with the model directory's own tokenizer (as TRL loads it from the model id),
and a model directory without one is refused unless the byte tokenizer is asked for by name.

The model directory is built here, as a user's checkpoint is laid out: a tiny ``qwen3``
saved with ``save_pretrained`` and, beside it, a real (word-level) tokenizer with a ChatML
chat template saved the same way. No download is involved.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from recipe_runs import recipe_in_process
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from longstraw_core.config import ConfigError, load_config
from longstraw_core.data.tokenizer import (
    BUILTIN_NAME,
    CHATML_TEMPLATE,
    encode_prompt,
    load_tokenizer,
)
from longstraw_core.models.tiny import tiny_model

ROOT = Path(__file__).resolve().parents[2]
CONFIG = "configs/qwen36/tiny_grpo_cpu.yaml"
PROMPT = [{"role": "user", "content": "what is the capital of france ?"}]
WORDS = ["user", "assistant", "what", "is", "the", "capital", "of", "france", "?", "paris"]
SPECIALS = ["<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _word_tokenizer() -> PreTrainedTokenizerFast:
    """A real tokenizer whose ids are not bytes: one id per word, ChatML turn markers."""
    vocab = {token: i for i, token in enumerate([*SPECIALS, *WORDS])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        unk_token="<unk>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
    )
    tok.chat_template = CHATML_TEMPLATE
    return tok


def _model_dir(path: Path, *, with_tokenizer: bool) -> Path:
    tiny_model("qwen3").save_pretrained(path)
    if with_tokenizer:
        _word_tokenizer().save_pretrained(path)
    return path


def _from_path(model_dir: Path) -> list[str]:
    return ["model.tiny=null", "model.tiny_overrides={}", f"model.path={model_dir}"]


def test_a_model_directory_without_a_tokenizer_is_refused_unless_bytes_are_asked_for(tmp_path):
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    # config.json is all the check reads: no weights are loaded at config time.
    (model_dir / "config.json").write_text(json.dumps({"model_type": "qwen3", "vocab_size": 512}))
    with pytest.raises(ConfigError) as caught:
        load_config(ROOT / CONFIG, _from_path(model_dir))
    error = caught.value
    assert error.key == "tokenizer.path" and str(model_dir) in str(error)
    assert "tokenizer_config.json" in str(error) and f"tokenizer.path={BUILTIN_NAME}" in str(error)
    assert "\n" not in str(error)
    cfg = load_config(ROOT / CONFIG, [*_from_path(model_dir), f"tokenizer.path={BUILTIN_NAME}"])
    assert load_tokenizer(cfg.tokenizer.path, model_path=cfg.model.path).name_or_path == (
        BUILTIN_NAME
    )
    # A toy (model.tiny) still gets the byte tokenizer with tokenizer.path null.
    toy = load_config(ROOT / CONFIG)
    assert toy.tokenizer.path is None
    assert load_tokenizer(toy.tokenizer.path, model_path=toy.model.path).name_or_path == (
        BUILTIN_NAME
    )


def test_a_real_models_prompt_is_tokenized_by_its_own_tokenizer(tmp_path):
    """One training step from a model directory that holds a tokenizer: the step's
    ``prompt_tokens`` is the chat prompt's length under that tokenizer, not in bytes."""
    model_dir = _model_dir(tmp_path / "model", with_tokenizer=True)
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"prompt": PROMPT, "answer": "paris"}) + "\n")
    own = AutoTokenizer.from_pretrained(model_dir)
    expected = len(encode_prompt(own, PROMPT))
    in_bytes = len(encode_prompt(load_tokenizer(BUILTIN_NAME), PROMPT))
    assert expected == 12 and in_bytes == 50  # the two tokenizers must disagree to tell
    run = recipe_in_process(
        "grpo_qwen36.py", CONFIG, tmp_path / "run", *_from_path(model_dir),
        "data.task=null", f"data.path={data}", "data.prompt_tokens=64",
        "rollout.num_generations=2", "rollout.max_new_tokens=2", "grpo.gradient=detached",
        "tracking.wandb=false", "train.steps=1", "train.save_every=0",
    )  # fmt: skip
    ((step, metrics),) = run.logger.history
    assert step == 1 and metrics["prompt_tokens"] == expected
    assert run.tokenizer.get_vocab() == own.get_vocab()
