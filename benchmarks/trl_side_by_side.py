"""TRL 1.16's own ``GRPOTrainer`` against LongStraw on one run config: learning, time, memory.

Same everything: both sides read one run config (the learn-real run by default, + ``key=value``
overrides) and take from it the model and dtype, LoRA (r, alpha, dropout, targets: the config's
or the family's default), the data (samples 0, 1, ... in LongStraw's order; TRL with
``shuffle_dataset=False``), the reward functions and weights, G, max_new_tokens, temperature,
top-p/k, min-p, repetition penalty, every ``grpo.*`` setting TRL has (loss_type, beta, epsilon,
scale_rewards, num_iterations...), AdamW (lr, betas, weight decay), schedule, warmup,
max_grad_norm, steps, and ``train.prompts_per_step`` groups of G per optimizer step (TRL:
per_device_train_batch_size = G x that, steps_per_generation=1, no accumulation). The seed is
train.seed on one side, TRL's seed on the other (their sampling streams differ).

Held-out accuracy, one method on both sides: the first ``eval.samples`` prompts of ``eval.data``,
one greedy completion each (LongStraw: its evaluation; TRL: a TrainerCallback calling
``generate(do_sample=False)``), correct when the run's weighted reward is at least
``eval.correct_reward``; at step 0 (eval.on_start), every eval.every steps and after the last.
Eval time is left out of the step times. Steps to target: the first eval step at which the mean
over seeds reaches 0.9 x the lower final mean of the two sides (seconds: training time to it).
Agreement: at each eval step the two sides' mean accuracies, their difference and the seeds'
spread (each side's std over seeds, pooled); and over the seeds' final accuracies and their
whole curves (the mean over eval steps), an exact permutation test of "one side is as good as
the other": the share of all ways to split the pooled seeds into two sides of these sizes
whose means differ at least as much (two-sided p; small p: the sides differ beyond sampling).
What both cannot take is set to what both can do and printed with the results (``FORCED``:
no stop strings, greedy-only eval; TRL's gradient checkpointing only where an estimate of its
activations would not fit, ``--trl-checkpointing``; timing lengths capped to the positions).

Each side runs in its own process (this script with ``--side``), so peak memory is its own:
ru_maxrss, LongStraw's step_peak_memory_bytes, on CUDA the device's peak. Time per step: the
mean over the steps after the first (a warm-up), or the one step there is.

    python benchmarks/trl_side_by_side.py --seeds 0 1           # the learn-real race, both sides
    python benchmarks/trl_side_by_side.py CONFIG.yaml train.steps=50 --seeds 0
    python benchmarks/trl_side_by_side.py --timing-lengths 2048 8192 --timing-steps 2

Each finished side and seed is kept under ``OUT/runs/`` and reused by a later command with the
same config and overrides: run ``--seeds 0`` and ``--seeds 1`` side by side (one thread each),
then ``--seeds 0 1`` combines them.

``--paired-sampling`` takes the sampling noise out of the comparison: TRL's ``generate`` draws
from the global generator seeded as LongStraw seeds the same sample's rollout, so both sides
sample the same completions for as long as their policies agree (a float-level difference
flips a near-tie token now and then, and that branch goes its own way from there on).

Overrides go before the options. Output: ``benchmarks/results/trl_side_by_side.{json,csv,png}``
(``--out``); the timing mode writes ``trl_side_by_side_timing.json``.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import itertools
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import longstraw_core.config as lsc
from longstraw_core.data.samples import sample_source
from longstraw_core.data.tokenizer import encode_prompt, load_tokenizer
from longstraw_core.metrics import names
from longstraw_core.rewards import RewardSet, trainer_state_at
from longstraw_core.rewards.inputs import sample_columns
from longstraw_core.training.evaluation import is_correct
from longstraw_core.training.session import rollout_seed
from longstraw_core.training.trainer import load_recipe

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = "configs/smollm2/learn_real_cpu.yaml"
SIDES = ("trl", "longstraw")
# Both sides: what TRL cannot take (stop strings; eval samples beyond the greedy one), and no
# logging, checkpoints or completions tables that only one side would spend time on.
FORCED = ["rollout.stop=[]", "eval.num_generations=0", "tracking.wandb=false",
          "tracking.curves_png=false", "train.completions_every=0",
          "train.save_every=0"]  # fmt: skip
SCHEDULERS = {"constant": "constant_with_warmup", "cosine": "cosine", "linear": "linear"}


def read_config(config: str, overrides: list[str], seed: int) -> lsc.RunConfig:
    """The run config both sides take (``train.output_dir`` a throwaway one unless given)."""
    with tempfile.TemporaryDirectory() as tmp:
        extra = [f"train.seed={seed}", f"train.output_dir={tmp}", *overrides]
        return lsc.load_config(ROOT / config, [*FORCED, *extra])


def run_longstraw(cfg: lsc.RunConfig) -> dict[str, Any]:
    """The recipe in this process (setup, train, cleanup); its logged metrics per step."""
    module = load_recipe(ROOT / "recipes/grpo_qwen36.py")
    run = module.Recipe(cfg)
    run.setup()
    try:
        run.train()
    finally:
        run.cleanup()
    out: dict[str, Any] = {"step_seconds": [], "reward": [], "eval": [], "step_peak": 0}
    for step, m in run.logger.history:
        if names.EVAL_GREEDY_ACCURACY in m:
            out["eval"].append([step, m[names.EVAL_GREEDY_ACCURACY]])
        if step:  # step 0: the eval before the first step only
            out["step_seconds"].append(m[names.STEP_SECONDS] - m.get("time/eval", 0.0))
            out["reward"].append(m[names.REWARD])
            out["step_peak"] = max(out["step_peak"], int(m[names.STEP_PEAK_MEMORY_BYTES]))
    return out


def run_trl(cfg: lsc.RunConfig, checkpointing: bool, paired: bool = False) -> dict[str, Any]:
    """TRL's GRPOTrainer with the run's settings, timed and evaluated by a callback.
    ``paired``: its ``generate`` draws from the global generator seeded as LongStraw seeds
    the same sample's rollout, so both sides sample the same completions while their
    policies agree (one prompt per step: TRL generates a step's prompts in one batch)."""
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, GenerationConfig, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    tok = load_tokenizer(cfg.tokenizer.path, model_path=cfg.model.path)
    rewards, group = RewardSet.from_config(cfg), cfg.rollout.num_generations
    per_step = cfg.train.prompts_per_step
    held_out = sample_source(lsc.eval_data(cfg), tok)  # LongStraw's eval prompts: the first N
    eval_samples = [held_out(i) for i in range(cfg.eval.samples or held_out.size)]
    source = sample_source(cfg.data, tok)  # the training prompts, in LongStraw's order
    rollouts = -(-cfg.train.steps // cfg.grpo.num_iterations) * per_step
    rows = [{"prompt": s.prompt, **sample_columns(s)} for s in map(source, range(rollouts))]
    model = AutoModelForCausalLM.from_pretrained(
        cfg.model.path, dtype=getattr(torch, cfg.model.dtype), local_files_only=True,
        attn_implementation=cfg.model.attn_implementation,
    )  # fmt: skip
    targets = lsc.lora_targets(cfg.lora, model.config.model_type)  # LongStraw's default if unset
    lora = LoraConfig(r=cfg.lora.r, lora_alpha=cfg.lora.alpha, lora_dropout=cfg.lora.dropout,
                      target_modules=targets)  # fmt: skip
    trl_fields = {f.name for f in dataclasses.fields(GRPOConfig)}
    grpo = {k: v for k, v in dataclasses.asdict(cfg.grpo).items() if k in trl_fields}
    r, o = cfg.rollout, cfg.optim
    args = GRPOConfig(
        output_dir=cfg.train.output_dir, report_to="none", save_strategy="no", logging_steps=1,
        disable_tqdm=True, seed=cfg.train.seed, use_cpu=not torch.cuda.is_available(),
        bf16=cfg.distributed.mixed_precision == "bf16", gradient_checkpointing=checkpointing,
        max_steps=cfg.train.steps, per_device_train_batch_size=group * per_step,
        gradient_accumulation_steps=1, steps_per_generation=1, shuffle_dataset=False,
        num_generations=group, max_completion_length=r.max_new_tokens, temperature=r.temperature,
        top_p=r.top_p, top_k=r.top_k, min_p=r.min_p or None,
        repetition_penalty=r.repetition_penalty,
        chat_template_kwargs=cfg.data.chat_template_kwargs or None, reward_weights=rewards.weights,
        optim="adamw_torch", learning_rate=o.lr, weight_decay=o.weight_decay,
        adam_beta1=o.betas[0], adam_beta2=o.betas[1], max_grad_norm=o.max_grad_norm or 0.0,
        lr_scheduler_type=SCHEDULERS[o.scheduler], warmup_steps=o.warmup_steps, **grpo,
    )  # fmt: skip
    out: dict[str, Any] = {"step_seconds": [], "reward": [], "eval": []}

    def accuracy(policy: torch.nn.Module, step: int) -> float:
        """LongStraw's greedy accuracy, with transformers' generate(do_sample=False)."""
        device, training = next(policy.parameters()).device, policy.training
        greedy = GenerationConfig(
            do_sample=False, max_new_tokens=lsc.eval_max_new_tokens(cfg),
            pad_token_id=tok.pad_token_id, eos_token_id=trainer.eos_token_ids,
            repetition_penalty=r.repetition_penalty,
        )  # fmt: skip
        policy.eval()
        hits = []
        kept = [device] if device.type == "cuda" else []  # RNG states restored afterwards
        with torch.no_grad(), torch.random.fork_rng(devices=kept):
            for sample in eval_samples:
                ids = encode_prompt(tok, sample.prompt, cfg.data.chat_template_kwargs)
                ids = torch.tensor([ids], device=device)
                new = policy.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                      generation_config=greedy)  # fmt: skip
                new = new[0, ids.shape[1] :].tolist()
                text = tok.decode(new, skip_special_tokens=True)
                scored = rewards([text], [sample], completion_ids=[new],
                                 trainer_state=trainer_state_at(step, cfg.train.steps))  # fmt: skip
                hits.append(is_correct(scored.rewards[0], cfg.eval.correct_reward))
        policy.train(training)
        return sum(hits) / len(hits)

    class Timed(TrainerCallback):
        """Step times (from the end of the last step or eval to this step's end) and evals."""

        mark = 0.0

        def on_train_begin(self, args, state, control, model=None, **kwargs) -> None:
            if cfg.eval.every and cfg.eval.on_start:
                out["eval"].append([0, accuracy(model, 0)])
            self.mark = time.perf_counter()

        def on_step_end(self, args, state, control, model=None, **kwargs) -> None:
            out["step_seconds"].append(time.perf_counter() - self.mark)
            print(f"trl step {state.global_step}/{cfg.train.steps}  "
                  f"{out['step_seconds'][-1]:.1f}s", flush=True)  # fmt: skip
            step, every = state.global_step, cfg.eval.every
            if every and (step % every == 0 or step == cfg.train.steps):
                out["eval"].append([step, accuracy(model, step)])
            self.mark = time.perf_counter()

        def on_log(self, args, state, control, logs=None, **kwargs) -> None:
            if logs and "reward" in logs:
                out["reward"].append(logs["reward"])

    trainer = GRPOTrainer(
        model=model, reward_funcs=list(rewards.funcs), args=args, processing_class=tok,
        train_dataset=Dataset.from_list(rows), callbacks=[Timed()],
        peft_config=lora if cfg.lora.enabled else None,
    )  # fmt: skip
    if paired:
        generate = trainer.model.generate

        def seeded_generate(*args: Any, **kwargs: Any) -> Any:
            rounds = trainer.state.global_step // cfg.grpo.num_iterations
            index = rounds * per_step  # the sample LongStraw rolls out now
            torch.manual_seed(rollout_seed(cfg.train.seed, index))
            return generate(*args, **kwargs)

        trainer.model.generate = seeded_generate
    trainer.train()
    return out


def trl_checkpointing(cfg: lsc.RunConfig, mode: str) -> tuple[bool, str | None]:
    """Whether TRL's policy gets gradient checkpointing: ``mode`` on/off, or (auto) when an
    estimate of what its forward keeps for backward is over half the memory (the device's, or
    the machine's RAM): all G x (prompt + response) tokens, 28 x hidden + 6 x intermediate
    values per token and layer (fitted to TRL's peak RSS, SmolLM2 + LoRA, CPU, 512-1K tokens)."""
    if mode != "auto":
        return mode == "on", f"TRL gradient_checkpointing={mode == 'on'} (--trl-checkpointing)"
    from transformers import AutoConfig

    text = AutoConfig.from_pretrained(cfg.model.path, local_files_only=True).get_text_config()
    tokens = cfg.rollout.num_generations * cfg.train.prompts_per_step
    tokens *= cfg.data.prompt_tokens + cfg.rollout.max_new_tokens
    per_token = text.num_hidden_layers * (28 * text.hidden_size + 6 * text.intermediate_size)
    width = 2 if cfg.distributed.mixed_precision == "bf16" or cfg.model.dtype != "float32" else 4
    need = tokens * per_token * width
    if torch.cuda.is_available():
        have = torch.cuda.get_device_properties(0).total_memory
    else:
        have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if need <= have / 2:
        return False, None
    return True, (f"TRL gradient_checkpointing=True at {cfg.data.prompt_tokens} prompt tokens: "
                  f"~{need / 2**30:.0f} GiB of activations estimated without it, "
                  f"{have / 2**30:.0f} GiB here")  # fmt: skip


def run_side(
    side: str,
    config: str,
    overrides: list[str],
    seed: int,
    ckpt: bool,
    *,
    may_fail: bool = False,
    paired: bool = False,
) -> dict:
    """One side in a fresh process: its JSON record (the child's output goes to ours).
    ``may_fail``: a side that dies (killed out of memory) gives ``{"failed": why}``."""
    with tempfile.TemporaryDirectory() as tmp:
        record = Path(tmp) / "side.json"
        command = [sys.executable, __file__, config, *overrides, f"train.output_dir={tmp}/run",
                   "--side", side, "--seed", str(seed), "--side-json", str(record),
                   "--trl-checkpointing", "on" if ckpt else "off"]  # fmt: skip
        command += ["--paired-sampling"] if paired else []
        started = time.perf_counter()
        code = subprocess.run(command, cwd=ROOT).returncode
        if code and may_fail:
            killed = " (SIGKILL: out of memory?)" if code == -9 else ""
            return {"failed": f"exit code {code}{killed}", "wall_s": time.perf_counter() - started}
        if code:
            raise SystemExit(f"the {side} side failed (seed {seed}): see its output above")
        return json.loads(record.read_text()) | {"wall_s": time.perf_counter() - started}


def kept_run(
    out: Path, side: str, config: str, overrides: list[str], seed: int, ckpt: bool, paired: bool
) -> dict:
    """One side's run for one seed, kept under ``out/runs`` once finished: an interrupted race
    resumes where it stopped, and seeds can run as separate commands (then one to combine)."""
    key = json.dumps([config, overrides, ckpt, paired])  # a changed setting: another run
    path = out / "runs" / f"{side}_seed{seed}{'_paired' if paired else ''}.json"
    if path.exists() and (kept := json.loads(path.read_text())).get("key") == key:
        print(f"{side}, seed {seed}: kept from {path}")
        return kept["run"]
    run = run_side(side, config, overrides, seed, ckpt, paired=paired) | {"seed": seed}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"key": key, "run": run}))
    tmp.replace(path)
    return run


def mean_step(run: dict) -> float:
    seconds = run["step_seconds"]
    return statistics.mean(seconds[1:] if len(seconds) > 1 else seconds)


def gib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f} GiB"


def seconds(n: float | None) -> str:
    return "failed" if n is None else f"{n:.2f}"


def ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or b is None or not b else f"{a / b:.2f}x"


def summarize(runs: dict[str, list[dict]]) -> dict[str, dict]:
    """Per side: time per step, peak memory, final accuracy over seeds, mean curves, and the
    first eval step (and training seconds) at which the mean accuracy reaches the target."""
    out: dict[str, dict] = {}
    for side, seeds in runs.items():
        finals = [run["eval"][-1][1] for run in seeds]
        steps = [step for step, _ in seeds[0]["eval"]]
        curve = [statistics.mean(run["eval"][i][1] for run in seeds) for i in range(len(steps))]
        spent = [statistics.mean(sum(run["step_seconds"][:s]) for run in seeds) for s in steps]
        out[side] = {"s_per_step": statistics.mean(map(mean_step, seeds)),
                     "peak_rss_bytes": max(r["peak_rss_bytes"] for r in seeds),
                     "peak_device_bytes": max(r["peak_device_bytes"] or 0 for r in seeds) or None,
                     "step_peak_memory_bytes": max(r.get("step_peak", 0) for r in seeds) or None,
                     "final_mean": statistics.mean(finals), "final_std": statistics.pstdev(finals),
                     "eval_steps": steps, "mean_accuracy": curve,
                     "train_seconds": spent}  # fmt: skip
    target = 0.9 * min(s["final_mean"] for s in out.values())
    for s in out.values():
        hit = next((i for i, a in enumerate(s["mean_accuracy"]) if a >= target), None)
        ok = target > 0 and hit is not None
        s["target"] = target
        s["steps_to_target"] = s["eval_steps"][hit] if ok else None
        s["seconds_to_target"] = s["train_seconds"][hit] if ok else None
    return out


def permutation_p(first: list[float], second: list[float]) -> float:
    """Exact two-sided permutation p-value of the difference of means: the share of all
    splits of the pooled values into groups of these sizes whose means differ at least as
    much as the observed (1.0 when the sides cannot be told apart at all)."""
    pooled, n = first + second, len(first)
    observed = abs(statistics.mean(first) - statistics.mean(second))
    total = sum(pooled)
    splits = hits = 0
    for chosen in itertools.combinations(range(len(pooled)), n):
        picked = sum(pooled[i] for i in chosen)
        gap = abs(picked / n - (total - picked) / (len(pooled) - n))
        hits += gap >= observed - 1e-12
        splits += 1
    return hits / splits


def agreement(runs: dict[str, list[dict]]) -> dict[str, Any]:
    """Do the held-out curves agree within the seeds' spread? Per eval step: each side's
    mean, LongStraw minus TRL, and the pooled std over seeds; over seeds: the permutation
    p-values of the final accuracies and of each seed's mean over the eval steps."""
    ls, trl = runs["longstraw"], runs["trl"]
    steps = [step for step, _ in ls[0]["eval"]]
    rows = []
    for i, step in enumerate(steps):
        a, b = [run["eval"][i][1] for run in ls], [run["eval"][i][1] for run in trl]
        spread = math.sqrt((statistics.pstdev(a) ** 2 + statistics.pstdev(b) ** 2) / 2)
        rows.append({"step": step, "longstraw": statistics.mean(a), "trl": statistics.mean(b),
                     "difference": statistics.mean(a) - statistics.mean(b),
                     "pooled_std": spread})  # fmt: skip

    def curve_means(seeds: list[dict]) -> list[float]:
        return [statistics.mean(acc for _, acc in run["eval"]) for run in seeds]

    finals = [run["eval"][-1][1] for run in ls], [run["eval"][-1][1] for run in trl]
    return {"per_eval_step": rows, "final_p": permutation_p(*finals),
            "curve_mean_p": permutation_p(curve_means(ls), curve_means(trl)),
            "seeds": [len(ls), len(trl)]}  # fmt: skip


def plot(runs: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (acc, rew) = plt.subplots(1, 2, figsize=(12, 4.5))
    for side, color in zip(SIDES, ("tab:orange", "tab:blue"), strict=True):
        for key, ax in (("eval", acc), ("reward", rew)):
            curves = [run["eval"] if key == "eval" else list(enumerate(run["reward"], 1))
                      for run in runs[side]]  # fmt: skip
            for curve in curves:
                ax.plot(*zip(*curve, strict=True), color=color, lw=0.8, alpha=0.45)
            mean = [statistics.mean(c[i][1] for c in curves) for i in range(len(curves[0]))]
            ax.plot([s for s, _ in curves[0]], mean, color=color, lw=2.5, label=side)
    acc.set(xlabel="optimizer step", ylabel="held-out greedy accuracy", ylim=(-0.02, 1.02))
    rew.set(xlabel="optimizer step", ylabel="training reward (group mean)")
    for ax in (acc, rew):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("TRL GRPOTrainer vs LongStraw (thin: a seed; thick: mean over seeds)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def learning(args: argparse.Namespace, config: str, overrides: list[str], notes: list[str]) -> None:
    per_step = read_config(config, overrides, 0).train.prompts_per_step
    if args.paired_sampling and per_step != 1:
        raise SystemExit(
            f"--paired-sampling needs train.prompts_per_step=1, got {per_step}: TRL generates "
            "a step's prompts in one batch, LongStraw each prompt from its own seed"
        )
    ckpt, why = trl_checkpointing(read_config(config, overrides, 0), args.trl_checkpointing)
    notes += [why] if why else []
    runs: dict[str, list[dict]] = {side: [] for side in SIDES}
    args.out.mkdir(parents=True, exist_ok=True)
    for seed in args.seeds:
        for side in SIDES:
            runs[side].append(
                kept_run(args.out, side, config, overrides, seed, ckpt, args.paired_sampling)
            )
    summary, agree = summarize(runs), agreement(runs)
    stem = args.out / "trl_side_by_side"
    record = {"config": config, "overrides": overrides, "seeds": args.seeds, "notes": notes,
              "summary": summary, "agreement": agree, "runs": runs}  # fmt: skip
    stem.with_suffix(".json").write_text(json.dumps(record, indent=1))
    with stem.with_suffix(".csv").open("w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["side", "seed", "step", "step_seconds", "reward", "greedy_accuracy"])
        for side, seeds in runs.items():
            for run in seeds:
                evals, steps = (
                    dict(run["eval"]),
                    zip(run["step_seconds"], run["reward"], strict=False),
                )
                out.writerow([side, run["seed"], 0, "", "", evals.get(0, "")])
                for step, (seconds, reward) in enumerate(steps, 1):
                    out.writerow([side, run["seed"], step, seconds, reward, evals.get(step, "")])
    plot(runs, stem.with_suffix(".png"))
    print(f"\n{'side':10} {'s/step':>8} {'peak RSS':>11} {'peak dev':>11} "
          f"{'final acc':>14} {'steps→target':>13} {'s→target':>9}")  # fmt: skip
    for side, s in summary.items():
        steps, seconds = s["steps_to_target"], s["seconds_to_target"]
        steps, seconds = (
            "-" if steps is None else steps,
            "-" if seconds is None else f"{seconds:.0f}",
        )
        print(f"{side:10} {s['s_per_step']:8.2f} {gib(s['peak_rss_bytes']):>11} "
              f"{gib(s['peak_device_bytes']):>11} {s['final_mean']:7.3f} ± {s['final_std']:.3f} "
              f"{steps:>13} {seconds:>9}")  # fmt: skip
    ls, trl = summary["longstraw"], summary["trl"]
    print(f"target accuracy: {ls['target']:.3f} (0.9 x the lower final mean; ± is the std over "
          f"seeds)\nLongStraw/TRL: time per step {ratio(ls['s_per_step'], trl['s_per_step'])}, "
          f"peak RSS {ratio(ls['peak_rss_bytes'], trl['peak_rss_bytes'])}, peak device "
          f"{ratio(ls['peak_device_bytes'], trl['peak_device_bytes'])}, steps to target "
          f"{ratio(ls['steps_to_target'], trl['steps_to_target'])}, seconds to target "
          f"{ratio(ls['seconds_to_target'], trl['seconds_to_target'])}")  # fmt: skip
    print("\nheld-out accuracy, mean over seeds (LongStraw - TRL; pooled std over seeds):")
    for row in agree["per_eval_step"]:
        print(f"  step {row['step']:>4}: {row['longstraw']:.3f} vs {row['trl']:.3f} "
              f"({row['difference']:+.3f}; {row['pooled_std']:.3f})")  # fmt: skip
    print(
        f"permutation test over {agree['seeds'][0]} and {agree['seeds'][1]} seeds: final "
        f"accuracy p={agree['final_p']:.3f}, mean over the curve p={agree['curve_mean_p']:.3f}"
    )
    print("\n".join(f"note: {n}" for n in notes) + f"\nwrote {stem}.{{json,csv,png}}")


def timing(args: argparse.Namespace, config: str, overrides: list[str], notes: list[str]) -> None:
    rows = []
    base = read_config(config, [*overrides, "eval.every=0", "eval.on_start=false"], 0)
    limit = lsc.model_facts(base.model).max_positions  # prompt + response within its positions
    tolerance = float(base.data.task_kwargs.get("tolerance", 0.01)) if base.data.task else 0
    fits = math.floor(((limit or math.inf) - base.rollout.max_new_tokens) / (1 + tolerance))
    for length in args.timing_lengths:
        tokens = min(length, fits)
        if tokens < length:
            notes.append(f"{length} prompt tokens -> {tokens}: the model has {limit} positions")
        extra = [f"data.prompt_tokens={tokens}", f"train.steps={args.timing_steps}",
                 "eval.every=0", "eval.on_start=false", "optim.warmup_steps=0"]  # fmt: skip
        cfg = read_config(config, [*overrides, *extra], 0)
        ckpt, why = trl_checkpointing(cfg, args.trl_checkpointing)
        notes += [why] if why else []
        row: dict[str, Any] = {"prompt_tokens": tokens, "trl_checkpointing": ckpt}
        for side in SIDES:
            run = run_side(side, config, [*overrides, *extra], args.seeds[0], ckpt, may_fail=True)
            row[f"{side}_failed"] = run.get("failed")
            row[f"{side}_s_per_step"] = None if run.get("failed") else mean_step(run)
            row |= {
                f"{side}_{k}": run.get(k)
                for k in ("peak_rss_bytes", "peak_device_bytes", "step_peak")
            }
        rows.append(row)
        args.out.mkdir(parents=True, exist_ok=True)  # written after each length: kept if cut
        path = args.out / "trl_side_by_side_timing.json"
        record = {"config": config, "overrides": overrides, "notes": notes, "rows": rows}
        path.write_text(json.dumps(record, indent=1))
    print(f"\n{'tokens':>7} {'TRL s/step':>11} {'LS s/step':>10} {'LS/TRL':>7} {'TRL peak':>11} "
          f"{'LS peak':>11} {'LS/TRL':>7}  (peak: RSS, or the device's on CUDA)")  # fmt: skip
    for row in rows:
        on_device = row["trl_peak_device_bytes"] or row["longstraw_peak_device_bytes"]
        key = "peak_device_bytes" if on_device else "peak_rss_bytes"
        trl, ls = row[f"trl_{key}"], row[f"longstraw_{key}"]
        speed = ratio(row["longstraw_s_per_step"], row["trl_s_per_step"])
        print(f"{row['prompt_tokens']:7} {seconds(row['trl_s_per_step']):>11} "
              f"{seconds(row['longstraw_s_per_step']):>10} {speed:>7} {gib(trl):>11} "
              f"{gib(ls):>11} {ratio(ls, trl):>7}")  # fmt: skip
        for side in SIDES:
            if row[f"{side}_failed"]:
                print(f"        {side} at {row['prompt_tokens']} tokens: {row[f'{side}_failed']}")
    print("\n".join(f"note: {n}" for n in notes) + f"\nwrote {path}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("items", nargs="*", help=f"[CONFIG] key=value ... ({DEFAULT_CONFIG})")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--timing-lengths", type=int, nargs="+")
    parser.add_argument("--timing-steps", type=int, default=2)
    parser.add_argument("--trl-checkpointing", choices=("auto", "on", "off"), default="auto")
    parser.add_argument(
        "--paired-sampling",
        action="store_true",
        help="TRL's generate draws from the seeds LongStraw's rollouts use: both sides sample "
        "the same completions while their policies agree (train.prompts_per_step=1)",
    )
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results")
    parser.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--side-json", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    has_config = args.items and "=" not in args.items[0]
    config = args.items[0] if has_config else DEFAULT_CONFIG
    overrides = args.items[1:] if has_config else args.items
    if args.side:  # a child: one side, one seed (train.output_dir is among the overrides)
        cfg = lsc.load_config(ROOT / config, [*FORCED, *overrides, f"train.seed={args.seed}"])
        trl = args.side == "trl"
        checkpointing = args.trl_checkpointing == "on"
        record = run_trl(cfg, checkpointing, args.paired_sampling) if trl else run_longstraw(cfg)
        device = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
        record |= {"peak_rss_bytes": rss, "peak_device_bytes": device}
        args.side_json.write_text(json.dumps(record))
        return
    notes = [f"forced on both sides: {' '.join(FORCED)} (TRL's generate takes no stop strings; "
             "its eval is greedy only)"]  # fmt: skip
    (timing if args.timing_lengths else learning)(args, config, overrides, notes)


if __name__ == "__main__":
    main()
