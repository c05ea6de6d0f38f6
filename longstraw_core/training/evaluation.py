"""Evaluation during training: greedy accuracy and pass@k under the training's rewards.

Every ``eval.every`` optimizer steps, and after the last one, the recipes call
``Evaluation.run`` once the optimizer has stepped (before the checkpoint, so a resumed run
never repeats or skips an eval: the schedule is a function of the step alone). For each of
the first ``eval.samples`` prompts of ``eval.data`` (the same prompts at every eval):

1. the prompt is prefilled (``adapter.prefill`` with the run's chunk size and offload; no
   exact-mode extras, nothing is replayed);
2. one greedy completion: ``ls.rollout(temperature=0)``, the argmax after the repetition
   penalty, as ``generate(do_sample=False)``; EOS and ``rollout.stop`` end it as in training;
3. k = ``eval.num_generations`` completions sampled with the rollout's settings (temperature,
   top-k, top-p, min-p, repetition penalty), seeded by the prompt's position alone
   (``eval_seed``): every eval draws with the same seeds, and a run on stages or replicas
   draws what one process draws;
4. the training's ``RewardSet`` scores all k + 1 in one TRL-convention call
   (``trainer_state.global_step`` = the step just taken).

A completion is **correct** when its weighted reward (the reward set's weighted sum, NaN for
an unscorable one) is at least ``eval.correct_reward`` (default 1.0: a full score of
``exact_match``-style rewards; with partial-credit rewards choose what counts as solved).
Metrics (``longstraw_core.metrics.names``; TRL has no accuracy metric, so these are LongStraw's):

- ``eval/greedy_accuracy``: the share of prompts whose greedy completion is correct;
  ``eval/greedy_reward``: their mean weighted reward;
- ``eval/pass@<k>``: the share of prompts with at least one correct completion among the k
  sampled (with n = k samples the unbiased estimator 1 - C(n-c, k)/C(n, k) is exactly this);
  ``eval/pass@1`` (k > 1): the mean share of correct samples per prompt, its unbiased
  estimate from the same k;
- TRL's metrics of the k sampled completions under ``eval/`` (TRL's ``eval_`` names, which
  transformers' W&B callback shows as ``eval/...``): ``eval/reward``, ``eval/reward_std``,
  ``eval/rewards/<func>/mean|std``, ``eval/frac_reward_zero_std`` (a prompt's k completions
  are its group) and ``eval/completions/*``, over all eval completions at once (TRL averages
  its eval batches' values), and in an agent run ``eval/tools/*``; absent with
  ``eval.num_generations=0``.

It changes nothing of the training: the model runs in eval mode (dropout off, as TRL's
``evaluate``) under ``no_grad`` and goes back to train mode; the global RNG states (torch CPU
and CUDA, Python's, NumPy's) are restored afterwards, sampling uses its own generators, and
no data position is read or moved. A run with eval trains exactly as one without (tested).

Distributed runs evaluate as they train. Replica r of D takes prompts r, r + D, ...; the
stages of a replica make every pass together (the prompt's chunks through the stages, the
last stage samples and every stage receives the tokens, rewards on every rank as in
training). With FSDP the replicas' ranks gather layers together, so every replica runs the
same number of prompts (one short of a prompt evaluates one again and drops it). The
per-prompt results (rewards, lengths, completion texts) are gathered from every replica (one
stage each) and the metrics computed from all of them, the same on every rank: the numbers
one process computes.
"""

from __future__ import annotations

import functools
import math
import random
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist

from longstraw_core.config import RunConfig, eval_data, eval_generations, eval_max_new_tokens
from longstraw_core.data.samples import DataError, SampleSource, sample_source
from longstraw_core.metrics import names
from longstraw_core.process.guard import NonFiniteError
from longstraw_core.rewards import RewardResult, RewardSet, reward_metrics, trainer_state_at
from longstraw_core.rollout.decode import rollout
from longstraw_core.training.prompt_group import PromptGroup, score_once, template_kwargs

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from longstraw_core.adapters.base import ModelAdapter
    from longstraw_core.offload import OffloadPolicy
    from longstraw_core.parallel.topology import RunTopology
    from longstraw_core.rewards.inputs import Completion
    from longstraw_core.tools import Agents

# Eval seeds sit far above the training rollouts' (train.seed * 1_000_003 + sample index).
EVAL_SEED_OFFSET = 1 << 40


def eval_seed(train_seed: int, index: int) -> int:
    """The sampling seed of eval prompt ``index``: the same at every eval and on any layout."""
    return train_seed * 1_000_003 + EVAL_SEED_OFFSET + index


@dataclass
class PromptEval:
    """One eval prompt's completions and rewards: what the metrics are computed from.

    ``greedy``: the greedy completion (text, or an agent's messages), ``greedy_reward`` its
    weighted reward. ``samples``: the k sampled completions; ``scored`` their rewards (a
    ``RewardResult`` without prompts and completions, which may be long); ``lengths`` (the
    policy's tokens: an agent's tool results left out, as TRL counts) and ``truncated``.
    """

    index: int
    sample_id: str
    greedy: Completion  # text, or with tools the branch's messages (TRL's completion)
    greedy_reward: float
    samples: list[Completion] = field(default_factory=list)
    scored: RewardResult | None = None
    lengths: list[int] = field(default_factory=list)
    truncated: list[bool] = field(default_factory=list)
    tool_counts: tuple[int, int] | None = None  # an agent run's: the k samples' calls, failures


@dataclass
class EvalReport:
    """One evaluation: the step it followed, every prompt's results (all replicas', in prompt
    order) and the metrics logged."""

    step: int
    prompts: list[PromptEval]
    metrics: dict[str, float]


def is_correct(reward: float, correct_reward: float) -> bool:
    """A completion is correct when its weighted reward reaches ``correct_reward`` (NaN, an
    unscorable completion, never does)."""
    return not math.isnan(reward) and reward >= correct_reward


def eval_metrics(prompts: Sequence[PromptEval], correct_reward: float) -> dict[str, float]:
    """The ``eval/...`` metrics of a whole evaluation (see the module docstring)."""
    if not prompts:
        raise ValueError("no eval prompts to compute metrics from")
    greedy = [p.greedy_reward for p in prompts]
    scorable = [r for r in greedy if not math.isnan(r)]
    out = {
        names.EVAL_GREEDY_ACCURACY: _mean([is_correct(r, correct_reward) for r in greedy]),
        names.EVAL_GREEDY_REWARD: _mean(scorable) if scorable else math.nan,
    }
    k = len(prompts[0].samples)
    if not k:
        return out
    hits = [[is_correct(r, correct_reward) for r in p.scored.rewards] for p in prompts]
    out[names.EVAL_PASS_AT_K.format(k)] = _mean([any(h) for h in hits])
    if k > 1:
        out[names.EVAL_PASS_AT_K.format(1)] = _mean([sum(h) / k for h in hits])
    lengths = [n for p in prompts for n in p.lengths]
    truncated = [cut for p in prompts for cut in p.truncated]
    trl = reward_metrics([p.scored for p in prompts])
    trl |= names.completion_metrics(lengths, truncated)
    counts = [p.tool_counts for p in prompts if p.tool_counts is not None]
    if counts:  # TRL's tools/* of its eval completions
        calls, failures = sum(c[0] for c in counts), sum(c[1] for c in counts)
        trl |= names.tool_metrics(calls, failures, len(lengths))
    logged: dict[str, list[float]] = {}
    for p in prompts:  # what reward functions logged with log_metric
        for name, values in p.scored.logged_metrics.items():
            logged.setdefault(name, []).extend(values)
    trl |= {name: _mean(values) for name, values in logged.items()}
    return out | {names.EVAL_PREFIX + key: value for key, value in trl.items()}


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


class Evaluation:
    """A run's evaluation: ``due(step)``, then ``run`` after that step's optimizer step.

    Build it with ``from_config`` before the model loads: it scans ``eval.data`` then, so a
    bad eval row fails before any weight is read. ``last``: the latest ``EvalReport``.
    """

    def __init__(
        self,
        cfg: RunConfig,
        source: SampleSource | None,
        tokenizer: PreTrainedTokenizerBase,
        topology: RunTopology,
        *,
        count: int = 0,
        progress: bool | None = None,
        agents: Agents | None = None,
    ) -> None:
        self.cfg = cfg
        self.source = source
        self.tokenizer = tokenizer
        self.topology = topology
        self.count = count  # prompts per eval
        self.progress = progress
        self.agents = agents  # an agent run's tools: eval's branches call them as training's
        self.template_kwargs = template_kwargs(cfg.data.chat_template_kwargs, agents)
        self.last: EvalReport | None = None

    @classmethod
    def from_config(
        cls,
        cfg: RunConfig,
        tokenizer: PreTrainedTokenizerBase,
        topology: RunTopology,
        *,
        progress: bool | None = None,
        agents: Agents | None = None,
    ) -> Evaluation:
        """With ``eval.every > 0``: ``eval.data`` scanned as ``data`` is (every row converted
        and tokenized, overlong prompts refused or skipped), and ``eval.samples`` checked
        against what it holds. Raises ``DataError`` naming ``eval.data`` or ``eval.samples``."""
        if not cfg.eval.every:
            return cls(cfg, None, tokenizer, topology, agents=agents)
        kwargs = agents.template_kwargs if agents else None
        try:
            source = sample_source(
                eval_data(cfg), tokenizer, progress=progress, template_kwargs=kwargs
            )
        except DataError as error:
            raise DataError(f"eval.data: {error}") from None
        count = cfg.eval.samples if cfg.eval.samples is not None else source.size
        if source.size is not None and count > source.size:
            raise DataError(
                f"eval.samples={count} but eval.data ({source.origin}) holds {source.size} "
                f"prompts: set eval.samples to at most {source.size}, or null for all of them"
            )
        return cls(cfg, source, tokenizer, topology, count=count, progress=progress, agents=agents)

    @functools.cached_property
    def chunk_size(self) -> int:
        """The training's prefill chunk: ``train.chunk_size`` as the session set it (null
        became the planner's choice at setup), or the planner's choice for an evaluation
        built outside a session."""
        if self.cfg.train.chunk_size is not None:
            return self.cfg.train.chunk_size
        from longstraw_core.plan import chunk_for_config

        return chunk_for_config(self.cfg).chunk

    def due(self, step: int) -> bool:
        """Whether to evaluate after optimizer step ``step``: every ``eval.every`` steps and
        after the last."""
        every = self.cfg.eval.every
        return bool(every) and (step % every == 0 or step == self.cfg.train.steps)

    def run(
        self,
        adapter: ModelAdapter,
        rewards: RewardSet,
        step: int,
        *,
        offload: OffloadPolicy | None = None,
        gather_parameters: bool = True,
    ) -> dict[str, float]:
        """Evaluate the policy as it is after optimizer step ``step``; the ``eval/...`` metrics
        (the same on every rank), or none when a non-finite logit stopped it (said on
        stderr). Collective: every rank calls it at the same step."""
        model = adapter.model
        training = model.training
        model.eval()  # dropout off, as TRL's evaluate
        results: list[PromptEval] = []
        error = None
        try:
            with torch.no_grad(), _rng_kept(adapter.device):
                for index, keep in self._share():
                    result = self._prompt(adapter, rewards, index, step, offload, gather_parameters)
                    if keep:
                        results.append(result)
        except NonFiniteError as err:  # on every rank that shares the passes, at once
            error = str(err)
        finally:
            model.train(training)
        parts = self.topology.gather_replicas([(results if error is None else [], error)])
        errors = [e for _, e in parts if e is not None]
        if errors:
            if not (dist.is_initialized() and dist.get_rank()):  # rank 0 says it
                print(f"warning: eval after step {step} skipped: {errors[0]}", file=sys.stderr)
            return {}
        prompts = sorted((p for part, _ in parts for p in part), key=lambda p: p.index)
        metrics = eval_metrics(prompts, self.cfg.eval.correct_reward)
        self.last = EvalReport(step, prompts, metrics)
        return metrics

    def _share(self) -> Iterator[tuple[int, bool]]:
        """This replica's prompts (index, keep): r, r + D, ...; with FSDP over several
        replicas, as many as the replica with the most (a repeated prompt, not kept), since
        their ranks gather the layers together."""
        replicas, replica = self.topology.replicas, self.topology.replica
        share = list(range(replica, self.count, replicas))
        yield from ((index, True) for index in share)
        if self.topology.fsdp and replicas > 1:
            rounds = -(-self.count // replicas)
            yield from ((share[0] if share else 0, False) for _ in range(rounds - len(share)))

    def _prompt(
        self,
        adapter: ModelAdapter,
        rewards: RewardSet,
        index: int,
        step: int,
        offload: OffloadPolicy | None,
        gather_parameters: bool,
    ) -> PromptEval:
        """Prefill eval prompt ``index``, decode greedily and sample k, score all k + 1."""
        cfg, r = self.cfg, self.cfg.rollout
        k, new = eval_generations(cfg), eval_max_new_tokens(cfg)
        group = PromptGroup.build(
            self.source(index), 1 + k, self.tokenizer, self.template_kwargs, self.agents
        )
        sample = group.sample
        state = adapter.prefill(
            group.prompt_ids, chunk_size=self.chunk_size, progress=self.progress,
            offload=offload,
        )  # fmt: skip
        common = {
            "repetition_penalty": r.repetition_penalty,
            "eos_token_ids": [self.tokenizer.eos_token_id],
            "stop_strings": r.stop,
            "tokenizer": self.tokenizer,
            "seed": eval_seed(cfg.train.seed, index),
            "progress": self.progress,
            "gather_parameters": gather_parameters,
            "stop_check_every": r.stop_check_every,
        }
        # the greedy branch, then k sampled: with tools, branch 0's tool loop, then 1..k's
        turns = group.tool_turns(slice(0, 1))
        outs = [rollout(adapter, state, 1, new, temperature=0.0, turns=turns, **common)]
        texts = group.completions(outs[0], turns, adapter)
        if k:
            turns = group.tool_turns(slice(1, None))
            outs.append(
                rollout(
                    adapter, state, k, new, temperature=r.temperature, top_p=r.top_p,
                    top_k=r.top_k, min_p=r.min_p, turns=turns, **common,
                )
            )  # fmt: skip
            texts += group.completions(outs[1], turns, adapter)
        del state
        loops = group.outcomes[-1] if group.outcomes else None  # the k samples' tool loops
        responses = [response for out in outs for response in out.responses]
        scored = score_once(  # on stages: once, on the last stage
            adapter,
            lambda: rewards(
                texts,
                [sample] * len(texts),
                completion_ids=[response.tolist() for response in responses],
                trainer_state=trainer_state_at(step, cfg.train.steps),
                **group.reward_kwargs,
            ),
        )
        sampled = RewardResult(
            scored.names,
            scored.rewards[1:],
            scored.rewards_per_func[1:],
            logged_metrics=scored.logged_metrics,
        )
        return PromptEval(
            index=index,
            sample_id=sample.id,
            greedy=texts[0],
            greedy_reward=scored.rewards[0],
            samples=texts[1:],
            scored=sampled,
            lengths=[int(m.sum()) for m in outs[1].loss_masks] if k else [],  # policy's tokens
            truncated=outs[1].truncated if k else [],
            tool_counts=(loops.calls, loops.failures) if k and loops else None,
        )


@contextmanager
def _rng_kept(device: torch.device) -> Iterator[None]:
    """Every global random stream as it was before the block (torch's CPU and, on CUDA, the
    device's; Python's; NumPy's): a reward function or module that draws from them during
    eval must not shift the training's draws."""
    python_state, numpy_state = random.getstate(), np.random.get_state()
    devices = [device] if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        random.setstate(python_state)
        np.random.set_state(numpy_state)
