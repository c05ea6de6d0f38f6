"""Reward models in ``rewards`` (TRL's ``reward_funcs`` strings): a tiny sequence classifier
built here from a config class, saved with the built-in byte tokenizer beside it, scores as
its own forward does on TRL's texts (prompt + completion; a chat through the template), under
TRL's name; a path that is no classifier is refused in one line at config load; and a
training step runs with it."""

from __future__ import annotations

import pytest
import torch
from recipe_runs import QWEN, ROOT, recipe_in_process
from transformers import LlamaConfig, LlamaForSequenceClassification

from longstraw_core.config import ConfigError, load_config
from longstraw_core.data.samples import record_to_sample
from longstraw_core.data.tokenizer import builtin_tokenizer
from longstraw_core.rewards import RewardNameError, RewardSet
from longstraw_core.rewards.reward_models import RewardModel


@pytest.fixture(scope="module")
def classifier_dir(tmp_path_factory):
    """A 2-layer Llama classifier (num_labels=1) and the byte tokenizer, saved together.
    Its config's pad_token_id is not the tokenizer's: loading must set it, as TRL does."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=260, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        num_labels=1, pad_token_id=0,
    )  # fmt: skip
    path = tmp_path_factory.mktemp("models") / "tiny_rm"
    LlamaForSequenceClassification(config).save_pretrained(path)
    builtin_tokenizer().save_pretrained(path)
    return path


def own_scores(path, texts):
    """The classifier's forward on each text alone (no padding): what its reward must be."""
    model = LlamaForSequenceClassification.from_pretrained(path).eval()
    tokenizer = builtin_tokenizer()
    out = []
    for text in texts:
        ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)
        with torch.no_grad():
            out.append(model(**ids).logits[0, 0].item())
    return out


def score(rewards, prompt, completions):
    sample = record_to_sample({"prompt": prompt, "answer": "x"}, 0)
    ids = [[1]] * len(completions)
    return rewards(completions, [sample] * len(completions), completion_ids=ids)


def test_text_prompts_score_as_the_classifiers_own_forward(classifier_dir):
    completions = ["a short one", "a much longer completion than that", "mid size"]
    rewards = RewardSet([str(classifier_dir)])
    assert rewards.names == ["tiny_rm"]  # TRL's name: the path's last part
    result = score(rewards, "Question: ", completions)
    expected = own_scores(classifier_dir, [f"Question: {c}" for c in completions])
    assert [row[0] for row in result.rewards_per_func] == pytest.approx(expected, abs=1e-5)
    assert len(set(expected)) == 3  # the texts differ in score: a wrong text would show
    one_at_a_time = RewardSet([RewardModel(str(classifier_dir), batch_size=1)])
    assert score(one_at_a_time, "Question: ", completions).rewards == pytest.approx(
        result.rewards, abs=1e-5
    )


def test_chat_prompts_go_through_the_chat_template(classifier_dir):
    prompt = [{"role": "user", "content": "Say something."}]
    completions = ["hello", "goodbye there"]
    result = score(RewardSet([str(classifier_dir)]), prompt, completions)
    tokenizer = builtin_tokenizer()
    texts = [
        tokenizer.apply_chat_template(
            [*prompt, {"role": "assistant", "content": c}], tokenize=False
        )
        for c in completions
    ]
    assert texts[0].startswith("<|im_start|>user\nSay something.<|im_end|>")
    assert result.rewards == pytest.approx(own_scores(classifier_dir, texts), abs=1e-5)


def test_a_path_that_is_no_classifier_is_refused_in_one_line(tmp_path, classifier_dir):
    (tmp_path / "empty").mkdir()
    with pytest.raises(RewardNameError, match="nor a model transformers can load") as info:
        RewardModel(str(tmp_path / "empty"))
    assert "\n" not in str(info.value)
    config = ROOT / QWEN
    with pytest.raises(ConfigError, match=r"rewards\[0\]\.name: reward .*empty") as info:
        load_config(config, [f"rewards=[{{name: '{tmp_path / 'empty'}'}}]"])
    assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match=r"unknown reward 'no_such_reward'.*Hub id"):
        load_config(config, ["rewards=[{name: no_such_reward}]"])
    with pytest.raises(ConfigError, match=r"rewards\[0\]\.device: device applies to a reward"):
        load_config(config, ["rewards=[{name: answer_char_recall, device: cpu}]"])
    with pytest.raises(ConfigError, match=r"rewards\[0\]\.batch_size"):
        load_config(config, [f"rewards=[{{name: '{classifier_dir}', batch_size: 0}}]"])


def test_a_training_step_runs_with_a_reward_model(tmp_path, classifier_dir):
    entry = f"rewards=[{{name: '{classifier_dir}', device: cpu, batch_size: 2}}]"
    run = recipe_in_process("grpo_qwen36.py", QWEN, tmp_path / "run", entry, "train.steps=1",
                            "tracking.wandb=false")  # fmt: skip
    model = run.rewards.funcs[0]
    assert isinstance(model, RewardModel) and model.model is not None
    assert model.model.device.type == "cpu"
    assert not any(p.requires_grad for p in model.model.parameters())
    assert run.step == 1 and run.updates == 1


def test_a_stage_that_does_not_score_loads_its_reward_model_only_if_called(classifier_dir):
    """``load_models=False`` (a pipeline stage other than the last, which never scores): no weights at setup; a call still loads them and scores as the classifier."""
    # batch_size 3: settings no other test uses (a process makes one RewardModel per settings)
    entry = f"rewards=[{{name: '{classifier_dir}', device: cpu, batch_size: 3}}]"
    cfg = load_config(ROOT / QWEN, [entry])
    rewards = RewardSet.from_config(cfg, load_models=False)
    model = rewards.funcs[0]
    assert isinstance(model, RewardModel) and model.model is None
    texts = ["the answer is 4", "no idea"]
    scored = score(rewards, "2 + 2? ", texts)
    assert model.model is not None
    assert scored.rewards == pytest.approx(
        own_scores(classifier_dir, [f"2 + 2? {t}" for t in texts])
    )
