"""The SFT warm start (``longstraw_core.models.warm_start``): what it teaches is token for token what a
rollout sees, and on the real model it makes a run call tools.

On the built-in byte tokenizer (the tiny agent config): each example is the rendered prompt,
the call turn (trained), the tool's result and the next header (``tool_suffix``: not trained)
and the answer turn (trained); each trained turn parses back, through the run's own parser,
to the transcript's call or answer. On SmolLM2-135M-Instruct (skipped with the reason where
the wheel cannot be had): a short warm start turns a model that never calls a tool into one
whose greedy completions call ``lookup``, and a GRPO step of the shipped agent config on it
logs ``tools/call_frequency`` > 0 and shows the calls in the completions table.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from real_model import smollm2_dir
from wandb_records import wandb_history, wandb_records

from longstraw_core import config as lsc
from longstraw_core.data.tokenizer import encode_prompt, load_tokenizer
from longstraw_core.models import warm_start as ws
from longstraw_core.tools.agents import Agents
from longstraw_core.tools.parsing import parse_turn
from longstraw_core.tools.rendering import resume_ids, tool_suffix

ROOT = Path(__file__).resolve().parents[2]
TINY_AGENT = ROOT / "configs/qwen36/tiny_agent_cpu.yaml"
AGENT = ROOT / "configs/smollm2/agent_cpu.yaml"


@pytest.fixture(scope="module")
def byte_agents():
    cfg = lsc.load_config(TINY_AGENT, ["data.prompt_tokens=2048"])
    tok = load_tokenizer(cfg.tokenizer.path, model_path=cfg.model.path)
    agents = Agents.from_config(cfg, tok)
    yield cfg, agents
    agents.close()


def runs(labels: list[int]) -> list[tuple[int, int]]:
    """The [start, end) spans of trained positions."""
    spans, start = [], None
    for i, label in enumerate([*labels, -100]):
        if label != -100 and start is None:
            start = i
        elif label == -100 and start is not None:
            spans.append((start, i))
            start = None
    return spans


def test_an_example_is_the_rollouts_tokens_with_only_the_models_turns_trained(byte_agents):
    cfg, agents = byte_agents
    tok = agents.tokenizer
    examples, samples = ws.build_examples(cfg, agents, 3)
    for example, sample in zip(examples, samples, strict=True):
        assert len(example.ids) == len(example.labels)
        call_span, answer_span = runs(example.labels)  # two trained turns, nothing else
        assert all(example.labels[i] == example.ids[i] for i in range(*call_span))
        assert all(example.labels[i] == example.ids[i] for i in range(*answer_span))
        call = example.ids[slice(*call_span)]
        answer = example.ids[slice(*answer_span)]
        assert call[-1] == answer[-1] == tok.eos_token_id
        prefix = resume_ids(tok, agents.template_kwargs)
        parsed = parse_turn(tok, call, prefix, agents.toolset.schemas)
        (made,) = parsed["tool_calls"]
        assert made["function"] == {"name": "lookup", "arguments": {"key": sample.meta["key"]}}
        assert parse_turn(tok, answer, prefix)["content"] == f"<answer>{sample.answer}</answer>"
        # between the turns: the environment's result rendered as the rollout renders it
        code = sample.meta["vault"][sample.meta["key"]]
        result = [{"role": "tool", "name": "lookup", "content": code}]
        suffix = tool_suffix(tok, result, agents.template_kwargs).ids
        assert example.ids[call_span[1] : answer_span[0]] == suffix
        # before the call: the prompt exactly as a run encodes it (tools' system prompt first)
        prompt = encode_prompt(tok, sample.prompt, agents.template_kwargs)
        assert example.ids[: call_span[0]] == prompt
        assert '"name": "lookup"' in tok.decode(prompt)  # the tool's schema is shown


def test_examples_come_from_other_samples_than_the_runs(byte_agents):
    cfg, agents = byte_agents
    from longstraw_core.data.samples import sample_source

    run = sample_source(cfg.data, agents.tokenizer, template_kwargs=agents.template_kwargs)
    _, taught = ws.build_examples(cfg, agents, 4)
    run_keys = {run(i).meta["key"] for i in range(4)}
    assert run_keys.isdisjoint(s.meta["key"] for s in taught)


def test_a_task_without_a_transcript_is_refused_by_name():
    cfg = lsc.load_config(ROOT / "configs/smollm2/learn_real_cpu.yaml", [])
    with pytest.raises(ws.WarmStartError, match=r"data.task .doc_lookup. has no transcript"):
        ws.task_script(cfg)


def test_an_existing_output_directory_is_kept(tmp_path, capsys):
    out = tmp_path / "sft"
    out.mkdir()
    (out / "mine.txt").write_text("a user's file")
    ws.main(["--config", str(TINY_AGENT), "--out", str(out)])
    assert "exists: kept" in capsys.readouterr().out
    assert (out / "mine.txt").read_text() == "a user's file"
    with pytest.raises(ws.WarmStartError, match="--force"):
        ws.warm_start(lsc.load_config(TINY_AGENT, []), out, ws.WarmStartSettings())


@pytest.fixture(scope="module")
def warm_started(tmp_path_factory):
    """SmolLM2 warm-started briefly (8 transcripts at 512-token prompts)."""
    base = smollm2_dir()
    out = tmp_path_factory.mktemp("warm") / "sft"
    cfg = lsc.load_config(AGENT, [f"model.path={base}"])
    settings = ws.WarmStartSettings(examples=8, epochs=1, check=2, prompt_tokens=512)
    record = ws.warm_start(cfg, out, settings)
    return out, record


def test_the_warm_start_makes_the_real_model_call_the_tool(warm_started):
    out, record = warm_started
    assert record["check_before"]["called_tool"] == 0.0  # SmolLM2 never does by itself
    assert record["check_after"]["called_tool"] == 1.0
    assert json.loads((out / ws.RECORD).read_text()) == record
    assert not list(out.parent.glob(".sft.*"))  # no staging directory left behind
    tok = load_tokenizer(None, model_path=str(out))
    assert tok.chat_template == ws.TOOL_CHATML_TEMPLATE  # the tool template travels with it


def test_grpo_on_the_warm_started_model_logs_its_tool_calls(warm_started, tmp_path):
    out, _ = warm_started
    run = tmp_path / "run"
    command = [
        sys.executable, str(ROOT / "recipes/grpo_qwen36.py"), "--config", str(AGENT),
        f"model.path={out}", "data.prompt_tokens=512", "rollout.num_generations=4",
        "train.steps=1", "train.completions_every=1", "train.save_every=0",
        "tracking.mode=offline", "tracking.curves_png=false", f"train.output_dir={run}",
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = list((run / "metrics.csv").read_text().splitlines())
    header, values = rows[0].split(","), rows[1].split(",")
    frequency = float(values[header.index("tools/call_frequency")])
    assert frequency > 0
    (run_file,) = run.glob("**/run-*.wandb")
    assert wandb_history(wandb_records(run_file))[1]["train/tools/call_frequency"] == frequency
    (table,) = run.glob("**/files/media/table/completions_*.table.json")
    cells = json.loads(table.read_text())
    completions = [row[cells["columns"].index("completion")] for row in cells["data"]]
    calls = sum(c.count('  -> lookup({"key": ') for c in completions)  # the table's calls
    assert calls == round(frequency * len(completions))  # every call the metric counts
    results = sum(c.count("tool (lookup): ") for c in completions)  # a result past the
    assert 0 < results <= calls  # budget is dropped, its call still counted (TRL's rule)
