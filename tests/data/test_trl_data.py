"""TRL-format datasets read as a TRL script reads them.

References are TRL's own functions: ``maybe_apply_chat_template`` for the prompt text,
``GRPOTrainer``'s prompt tokenization for the token ids, and ``RepeatSampler`` (TRL's
``shuffle_dataset``) for the order of the rows. The data files are written by ``datasets``
itself (``to_parquet``, ``to_csv``, ``save_to_disk``...), in every format ``data.path`` takes.
"""

from __future__ import annotations

import json
import re
import shutil
import tracemalloc
from pathlib import Path

import datasets
import pytest
from trl import GRPOConfig, GRPOTrainer
from trl.data_utils import maybe_apply_chat_template
from trl.trainer.utils import RepeatSampler

from longstraw_core.config import ConfigError, DataSection, load_config
from longstraw_core.data.order import DataOrder
from longstraw_core.data.samples import DataError, load_samples, sample_source, scan_samples
from longstraw_core.data.tokenizer import (
    CHATML_TEMPLATE,
    encode_prompt,
    load_tokenizer,
    render_prompt,
)
from longstraw_core.models.tiny import tiny_model

TINY = Path(__file__).resolve().parents[2] / "configs" / "qwen36" / "tiny_grpo_cpu.yaml"

# TRL's two prompt formats, with a `solution` column as TRL's math examples have.
STANDARD = [
    {"prompt": "What is 2+2?", "solution": "4"},
    {"prompt": "Name a colour.", "solution": "red"},
    {"prompt": "Spell cat, héhé.", "solution": "c-a-t"},
]
CONVERSATIONAL = [
    {
        "prompt": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What is 2+2?"},
        ],
        "solution": "4",
    },
    {"prompt": [{"role": "user", "content": "Name a colour."}], "solution": "red"},
    {
        "prompt": [
            {"role": "user", "content": "Spell cat."},
            {"role": "assistant", "content": "c-a-t"},
            {"role": "user", "content": "Backwards?"},
        ],
        "solution": "t-a-c",
    },
]
# Qwen3's switch: with enable_thinking=false the generation prompt holds an empty think block.
THINKING_TEMPLATE = CHATML_TEMPLATE.replace(
    "{{ '<|im_start|>assistant\n' }}",
    "{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is defined and not enable_thinking %}"
    "{{ '<think>\n\n</think>\n\n' }}{% endif %}",
)


@pytest.fixture(scope="module")
def tok():
    tokenizer = load_tokenizer(None)
    tokenizer.chat_template = THINKING_TEMPLATE
    return tokenizer


def write(tmp_path: Path, rows: list[dict], fmt: str) -> tuple[Path, str]:
    """``rows`` written by ``datasets`` in format ``fmt``; the path and the split to read."""
    data = datasets.Dataset.from_list(rows)
    other = datasets.Dataset.from_list(rows[:1])
    if fmt == "jsonl":
        path = tmp_path / "d.jsonl"
        data.to_json(path)
    elif fmt == "json-array":
        path = tmp_path / "d.json"
        path.write_text(json.dumps(rows))
    elif fmt == "parquet":
        path = tmp_path / "d.parquet"
        data.to_parquet(path)
    elif fmt == "csv":
        path = tmp_path / "d.csv"
        data.to_csv(path, index=False)
    elif fmt == "arrow":
        data.save_to_disk(tmp_path / "saved")
        path = tmp_path / "d.arrow"
        shutil.copy(next((tmp_path / "saved").glob("*.arrow")), path)
    elif fmt == "save_to_disk":
        path = tmp_path / "saved"
        data.save_to_disk(path)
    elif fmt == "dataset_dict":
        path = tmp_path / "splits"
        datasets.DatasetDict({"train": other, "test": data}).save_to_disk(path)
        return path, "test"
    elif fmt == "data_files_dir":  # a dataset repository on local disk
        path = tmp_path / "repo"
        (path / "data").mkdir(parents=True)
        data.to_parquet(path / "data" / "test-00000-of-00001.parquet")
        other.to_parquet(path / "data" / "train-00000-of-00001.parquet")
        return path, "test"
    else:
        raise ValueError(fmt)
    return path, "train"


FORMATS = ["jsonl", "json-array", "parquet", "csv", "arrow", "save_to_disk", "dataset_dict",
           "data_files_dir"]  # fmt: skip


# A CSV cell holds text, not a list of messages: conversational rows are not written as CSV.
CASES = [(fmt, kind) for fmt in FORMATS for kind in ("standard", "conversational")
         if not (fmt == "csv" and kind == "conversational")]  # fmt: skip


@pytest.mark.parametrize(("fmt", "kind"), CASES)
def test_every_format_gives_the_rows_with_every_column(tmp_path, fmt, kind):
    rows = STANDARD if kind == "standard" else CONVERSATIONAL
    path, split = write(tmp_path, rows, fmt)
    samples = load_samples(path, split=split)
    assert [s.columns for s in samples] == rows  # what TRL passes its reward functions
    assert [s.prompt for s in samples] == [r["prompt"] for r in rows]
    assert [s.meta for s in samples] == [{"solution": r["solution"]} for r in rows]
    assert all(s.answer == "" for s in samples)  # no `answer` column: none required
    first = {"jsonl": f"{path}:1", "csv": f"{path}:2", "dataset_dict": f"{path}[test]:row 0",
             "data_files_dir": f"{path}[test]:row 0"}  # fmt: skip
    assert samples[0].id == first.get(fmt, f"{path}:row 0")  # by line, or by row


def _trl_prompt_ids(tokenizer, prompts: list, template_kwargs: dict, tmp_path: Path) -> list:
    """The prompt ids TRL's GRPOTrainer generates from (its own tokenization)."""
    args = GRPOConfig(
        output_dir=str(tmp_path / "trl"),
        report_to=[],
        use_cpu=True,
        per_device_train_batch_size=2,
        num_generations=2,
        chat_template_kwargs=template_kwargs,
    )
    trainer = GRPOTrainer(
        model=tiny_model("qwen3", vocab_size=260),
        reward_funcs=[lambda completions, **kwargs: [0.0] * len(completions)],
        args=args,
        train_dataset=datasets.Dataset.from_list(STANDARD),
        processing_class=tokenizer,
    )
    return [trainer._tokenize_prompts([prompt])[0][0] for prompt in prompts]


@pytest.mark.parametrize("template_kwargs", [{}, {"enable_thinking": False}])
def test_prompts_are_templated_and_tokenized_as_trl_does(tmp_path, tok, template_kwargs):
    """A plain-text prompt is used as it is; messages go through the chat template with the
    generation prompt and data.chat_template_kwargs: TRL's text and TRL's token ids."""
    prefilled = [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi"}]
    rows = [*STANDARD, *CONVERSATIONAL, {"prompt": prefilled, "solution": ""}]
    path = tmp_path / "d.jsonl"  # both formats in one file: datasets keeps each row's type
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    samples = load_samples(path)
    ours = [encode_prompt(tok, s.prompt, template_kwargs) for s in samples]
    assert ours == _trl_prompt_ids(tok, [r["prompt"] for r in rows], template_kwargs, tmp_path)
    for sample, row in zip(samples, rows, strict=True):
        text = render_prompt(tok, sample.prompt, template_kwargs)
        if isinstance(row["prompt"], str) or row["prompt"][-1]["role"] == "user":
            expected = maybe_apply_chat_template({"prompt": row["prompt"]}, tok, **template_kwargs)
            assert text == expected["prompt"]
        else:
            # A prompt ending with an assistant turn: GRPOTrainer (matched above) appends the
            # generation prompt; maybe_apply_chat_template would continue that turn instead.
            assert text.endswith("Hi<|im_end|>\n<|im_start|>assistant\n" + (
                "<think>\n\n</think>\n\n" if template_kwargs else ""
            ))  # fmt: skip
    assert [render_prompt(tok, s.prompt) for s in samples[:3]] == [r["prompt"] for r in STANDARD]
    thinking_off = "<think>" in render_prompt(tok, samples[3].prompt, template_kwargs)
    assert thinking_off == bool(template_kwargs)  # the kwargs reached the template


def test_the_scan_measures_prompts_with_the_template_kwargs(tmp_path, tok):
    path, _ = write(tmp_path, CONVERSATIONAL, "parquet")
    off = {"enable_thinking": False}
    lengths = [len(encode_prompt(tok, r["prompt"], off)) for r in CONVERSATIONAL]
    data = DataSection(path=str(path), prompt_tokens=max(lengths), chat_template_kwargs=off)
    source = sample_source(data, tok, progress=False)
    assert source.longest == max(lengths) and source.size == 3
    # the longest prompt fits without the kwargs' think block, and not with it
    assert len(encode_prompt(tok, CONVERSATIONAL[2]["prompt"])) < max(lengths)
    shorter = DataSection(path=str(path), prompt_tokens=max(lengths) - 1, chat_template_kwargs=off)
    with pytest.raises(DataError, match=re.escape("longer than data.prompt_tokens")):
        sample_source(shorter, tok, progress=False)


# --------------------------------------------------------------------------- order


@pytest.mark.parametrize("seed", [0, 7])
def test_shuffled_order_is_trls_repeat_sampler_epoch_after_epoch(seed):
    size = 7
    sampler = RepeatSampler(range(size), mini_repeat_count=1, shuffle=True, seed=seed)
    expected = [*sampler, *sampler, *sampler]  # three passes, a permutation each
    order = DataOrder(size, shuffle=True, seed=seed)
    assert [order(i) for i in range(3 * size)] == expected
    assert expected[:size] != list(range(size)) and expected[:size] != expected[size : 2 * size]
    fresh = DataOrder(size, shuffle=True, seed=seed)  # a resumed run: any index, any order
    assert [fresh(i) for i in (20, 3, 15, 9)] == [expected[i] for i in (20, 3, 15, 9)]
    assert [DataOrder(size, shuffle=False, seed=seed)(i) for i in range(9)] == [
        *range(size),
        0,
        1,
    ]


def test_a_source_shuffles_its_kept_rows_and_resumes_at_any_position(tmp_path, tok):
    rows = [{"prompt": "x" * n, "solution": str(i)} for i, n in enumerate([5, 500, 6, 7, 8, 9])]
    path, _ = write(tmp_path, rows, "jsonl")
    data = DataSection(path=str(path), prompt_tokens=100, on_overlong="skip", seed=3)
    source = sample_source(data, tok, progress=False)
    kept = ["0", "2", "3", "4", "5"]  # row 1 is too long
    sampler = RepeatSampler(range(len(kept)), mini_repeat_count=1, seed=3)
    expected = [kept[i] for i in [*sampler, *sampler]]
    assert [source(i).columns["solution"] for i in range(10)] == expected
    assert source.shuffled and expected[:5] != kept
    resumed = sample_source(data, tok, progress=False)  # what a resumed run builds
    assert [resumed(i) for i in range(7, 10)] == [source(i) for i in range(7, 10)]
    in_order = sample_source(DataSection(**{**vars(data), "shuffle": False}), tok)
    assert [in_order(i).columns["solution"] for i in range(6)] == [*kept, "0"]


def test_the_scan_holds_no_prompt_or_token_ids(tmp_path, tok):
    """A dataset of 30 prompts of 100K characters: the scan tokenizes one at a time and the
    source keeps only the kept rows' indices (samples are read when asked for)."""
    rows = [{"prompt": chr(97 + i % 26) * 100_000, "solution": str(i)} for i in range(30)]
    path, _ = write(tmp_path, rows, "parquet")
    tracemalloc.start()
    try:
        source = scan_samples(path, tok, prompt_tokens=100_000, progress=False)
        current, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    ids_of_one = 100_000 * 8  # a list of 100K token ids
    assert source.size == 30 and source.longest == 100_000
    assert peak < 5 * ids_of_one  # all the ids would be 30 x, all the prompts 3.75 x
    assert current < ids_of_one
    assert sorted(int(source(i).columns["solution"]) for i in range(30)) == list(range(30))


# --------------------------------------------------------------------------- faults, config


def test_split_and_format_errors_name_the_path_and_the_fix(tmp_path, tok):
    path, _ = write(tmp_path, STANDARD, "dataset_dict")
    with pytest.raises(DataError, match=re.escape("no split 'validation'; its splits are")):
        load_samples(path, split="validation")
    file, _ = write(tmp_path, STANDARD, "parquet")
    with pytest.raises(
        DataError, match=re.escape("a data file is one split, 'train'; data.split='test'")
    ):
        load_samples(file, split="test")
    saved, _ = write(tmp_path, STANDARD, "save_to_disk")
    with pytest.raises(DataError, match="has no splits"):
        load_samples(saved, split="test")
    txt = tmp_path / "d.txt"
    txt.write_text("hello\n")
    with pytest.raises(ConfigError, match=r"must end in \.json, \.jsonl, \.parquet") as info:
        load_config(TINY, ["data.task=null", f"data.path={txt}"])
    assert info.value.key == "data.path"


def test_data_and_rollout_keys_and_their_defaults(tmp_path):
    path, _ = write(tmp_path, STANDARD, "parquet")
    # a reward that reads the data's own column (the tiny config's built-ins read `answer`)
    reward = "rewards=[{name: tests.support.trl_rewards:solution_char_recall}]"
    cfg = load_config(TINY, ["data.task=null", f"data.path={path}", reward])
    assert (cfg.data.split, cfg.data.shuffle, cfg.data.chat_template_kwargs) == ("train", True, {})
    assert (cfg.rollout.min_p, cfg.rollout.repetition_penalty, cfg.rollout.stop) == (0.0, 1.0, [])
    cfg = load_config(TINY, ["data.chat_template_kwargs={enable_thinking: false}",
                             "rollout.stop=['</answer>']", "rollout.min_p=0.1"])  # fmt: skip
    assert cfg.data.chat_template_kwargs == {"enable_thinking": False}
    assert cfg.rollout.stop == ["</answer>"] and cfg.rollout.min_p == 0.1
    for override, key in [
        ("rollout.min_p=1.5", "rollout.min_p"),
        ("rollout.repetition_penalty=0", "rollout.repetition_penalty"),
        ("rollout.stop=['']", "rollout.stop[0]"),
        ("data.split=''", "data.split"),
        ("data.task_kwargs={chat_template_kwargs: {}}", "data.task_kwargs.chat_template_kwargs"),
    ]:
        with pytest.raises(ConfigError) as info:
            load_config(TINY, [override])
        assert info.value.key == key


def test_a_task_fits_its_prompt_with_the_template_kwargs(tok):
    """data.chat_template_kwargs reach the task's length fitting: a generated prompt has the
    tokens the recipe will encode it to, think block included."""
    off = {"enable_thinking": False}
    data = DataSection(task="passkey_retrieval", prompt_tokens=400, chat_template_kwargs=off)
    sample = sample_source(data, tok)(2)
    encoded = len(encode_prompt(tok, sample.prompt, off))
    assert encoded == sample.meta["prompt_tokens"] and abs(encoded - 400) <= 4
    assert len(encode_prompt(tok, sample.prompt)) == encoded - len("<think>\n\n</think>\n\n")
