"""A training run's mechanics, around the GRPO loop a recipe writes: ``Session``.

Why a base class: every recipe needs the same setup (accelerator, sharding and pipeline
topology, data scan, output directory claim, loading, optimizer, resume), the same step loop
(data positions per replica, eval, logging, checkpoints, stop signals) and the same cleanup,
and none of it is what a user edits. A recipe subclasses ``Session`` and writes
``train_rollout``: prefill, rollout, rewards, advantages, replay and the optimizer step of
one rollout, yielding each optimizer step's metrics.

- Sharded (``torchrun ... distributed.fsdp=true``): each replica takes its own groups every
  step (samples ``data_position + replica * prompts_per_step + k``, each its own rollout
  seed), gradients are averaged, metrics reduced over the ranks, and rank 0 logs and writes
  the checkpoints. ``distributed.pipeline_stages=S``: a replica is S ranks, each holding
  its stage's layers.
- ``train.chunk_size: null`` (the default) becomes the planner's chunk at setup, printed
  with its reason (``longstraw_core.plan.chunking``); then, before anything loads, the run's
  shape (``run_shape``), with the threads per process it set (``threads``).
- Inside a step the passes report their progress on rank 0 (``self.bars``): bars on a
  terminal, plain lines every ``train.progress_every_seconds`` elsewhere (``progress``).
- Evaluation (``eval.every`` > 0) runs after the optimizer step, before a checkpoint, and
  leaves the training untouched (``longstraw_core.training.evaluation``).
- Faults lose nothing: SIGTERM/SIGINT/SIGHUP saves the last finished step at once
  (``checkpoint.kept``), then finishes the rollout's steps, saves and returns the signal; a non-finite step is
  skipped (``StepBookkeeping``); ``train.resume_from=latest`` continues from the newest
  complete checkpoint, applying changed optimizer settings.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Iterator

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed

import longstraw_core as ls
from longstraw_core import checkpoint, config, distributed, plan
from longstraw_core.data import samples as data
from longstraw_core.data import tokenizer
from longstraw_core.launch import output_dir, resume, run_shape, same_run
from longstraw_core.launch.preemption import GracefulStop
from longstraw_core.models import build as models
from longstraw_core.models import mixed_precision
from longstraw_core.models import sharded_loading as loading
from longstraw_core.parallel.topology import RunTopology
from longstraw_core.process import guard, threads
from longstraw_core.process.progress import StepProgress
from longstraw_core.rewards import RewardSet, trainer_state_at
from longstraw_core.tools import Agents
from longstraw_core.tools.turns import ToolTurns
from longstraw_core.training import evaluation, tracking
from longstraw_core.training.prompt_group import (
    PromptGroup,
    score_once,
    scores_here,
    template_kwargs,
)
from longstraw_core.training.step import Rollout, StepBookkeeping, state_bytes


def rollout_seed(run_seed: int, index: int) -> int:
    """The seed of the rollout of the sample at ``index`` (its position in the run's data
    order): from the run's seed, and different for every sample, so ranks (each taking its
    own samples) never share draws. A comparison that wants another sampler to draw what
    LongStraw draws seeds it with this (``benchmarks/trl_side_by_side.py --paired-sampling``)."""
    return run_seed * 1_000_003 + index


class Session(StepBookkeeping):
    """setup -> train -> cleanup; ``save_checkpoint`` every ``train.save_every`` steps.

    After ``setup``: ``cfg``, ``tokenizer``, ``adapter`` (the policy; ``model`` its module),
    ``reference`` (None with ``grpo.beta == 0``), ``grpo`` (the GRPO settings), ``offload``,
    ``rewards``, ``optimizer``, ``scheduler``, ``guard``, ``logger``, ``progress``,
    ``topology``, ``step`` and ``data_position``, ``sampling`` (``ls.rollout``'s options),
    ``agents`` (the tools of ``rollout.tools`` / ``rollout.environment``; None without) and
    ``template_kwargs`` (how prompts are rendered: the data's keywords, the tools' schemas).
    """

    def __init__(self, cfg: config.RunConfig) -> None:
        self.cfg = cfg

    def train_rollout(
        self, samples: list[data.Sample], indices: list[int]
    ) -> Iterator[dict[str, float]]:
        """One rollout of ``samples`` (``indices``: their positions, which seed the rollouts)
        and its ``grpo.num_iterations`` optimizer steps; yields each step's metrics."""
        raise NotImplementedError("a recipe writes its GRPO loop here")

    def setup(self) -> None:
        cfg = self.cfg
        # Threads per process before any work: OMP_NUM_THREADS, else this node's cores
        # shared by its processes (process/threads.py); restored at cleanup.
        self._threads_before = torch.get_num_threads()
        self.threads = threads.apply()
        # The process group's timeout also bounds the other ranks' wait while rank 0
        # writes a checkpoint (distributed.timeout_minutes; NCCL's default is 10 minutes).
        self.accelerator = Accelerator(
            cpu=not torch.cuda.is_available(),
            log_with=tracking.log_with(cfg.tracking),
            kwargs_handlers=[distributed.process_group_kwargs(cfg.distributed.timeout_minutes)],
        )
        # One group per replica and step: replica r of n takes sample data_position + r (a
        # replica is one rank, or with distributed.pipeline_stages=S the S ranks of a pipeline).
        self.rank, self.world_size = self.accelerator.process_index, self.accelerator.num_processes
        distributed.require_sharding(
            self.world_size, cfg.distributed.fsdp, cfg.distributed.pipeline_stages
        )
        same_run.require_same_run(cfg)  # every rank's config and data equal rank 0's
        self._choose_chunk()  # train.chunk_size: null -> the planner's chunk, said once
        self.topology = RunTopology.from_config(
            cfg.distributed, self.world_size, self.rank, gradient=cfg.grpo.gradient
        )
        if self.accelerator.is_main_process:  # before anything loads: what runs where
            print(run_shape.block(cfg, self.topology, self.accelerator.device, self.threads),
                  file=sys.stderr, flush=True)  # fmt: skip
        self.bars = None if self.accelerator.is_main_process else False  # progress bars
        set_seed(cfg.train.seed)  # the same on every rank: the same initial weights
        self.tokenizer = tokenizer.load_tokenizer(cfg.tokenizer.path, model_path=cfg.model.path)
        # Agents: tools imported once; their schemas rendered into every prompt (and counted
        # by the data scan against data.prompt_tokens).
        self.agents = Agents.from_config(cfg, self.tokenizer)
        self.template_kwargs = template_kwargs(cfg.data.chat_template_kwargs, self.agents)
        # Before any weight loads: every record checked, a changed model/lora refused.
        self.sample_at = data.sample_source(
            cfg.data, self.tokenizer, progress=self.bars, template_kwargs=self.template_kwargs
        )
        if self.accelerator.is_main_process and self.sample_at.skipped:
            print(f"warning: data: {self.sample_at.summary()}", file=sys.stderr)
        # eval.every > 0: eval.data is scanned now too (greedy accuracy, pass@k; eval/...).
        self.evaluation = evaluation.Evaluation.from_config(
            cfg, self.tokenizer, self.topology, progress=self.bars, agents=self.agents
        )
        output_dir.claim(cfg.train)  # writable, locked, no other run's checkpoints (one line)
        self.resume_path, self.resume_changes = resume.checkpoint_to_resume(cfg)
        # Only this rank's share: its stage's layers, read straight from the checkpoint.
        self.adapter = loading.load_policy(cfg, self.topology, self.accelerator.device)
        self.model = self.adapter.model
        if self.agents:  # TRL drops tool results that would reach the model's last position
            self.agents.max_positions = self.adapter.max_positions
        self.adapter.activation_checkpointing = cfg.train.activation_checkpointing
        self.reference = self._reference_policy()
        # distributed.mixed_precision=bf16 without FSDP: bf16 working weights for each step
        # over the float32 masters the optimizer holds (FSDP2 applies its own policy).
        self.precision = mixed_precision.step_precision(cfg, self.model, self.reference)
        self.grpo = config.grpo_config(cfg)
        self.offload = config.offload_policy(cfg)  # prefix state on CPU, streamed per layer
        # FSDP: gather the layers once per rollout, unless the planner says that won't fit.
        self.rollout_once, why_not = plan.rollout_gathers_once(cfg)
        if why_not and self.accelerator.is_main_process:
            print(f"note: {why_not}", file=sys.stderr)
        self.sampling = self._sampling_options()
        # names, weights, factories' arguments; an environment's get_reward (TRL's extra source)
        extra = self.agents.reward_functions() if self.agents else []
        # Failures said once per function and step (``report_failures``), not per group;
        # reward models' weights only where the rewards are scored (on stages: the last).
        self.rewards = RewardSet.from_config(
            cfg, extra, report_each_call=False, load_models=scores_here(self.adapter)
        )
        self.trainer_state = trainer_state_at(0, cfg.train.steps)  # what TRL's rewards get
        self.optimizer = models.build_optimizer(self.model, cfg.optim)
        self.scheduler = models.build_scheduler(self.optimizer, cfg.optim, cfg.train.steps)
        self.guard = guard.NonFiniteGuard(cfg.train.max_skipped_steps)
        self.checkpoints = checkpoint.StepCheckpoints.from_config(cfg.train)  # + at a stop
        self.step, self.data_position, resumed = 0, 0, None
        self.updates = 0  # steps of this run that changed the weights: none, no checkpoint
        if self.resume_path is not None:
            resumed = self._resume()
        self.logger = tracking.RunLogger.from_config(
            self.accelerator,
            cfg,
            run_id=resumed.extra.get("wandb_run_id") if resumed else None,
            config=config.to_dict(cfg) | self._resume_record(),  # what actually runs
        )
        if resumed:
            self.logger.load_state_dict(resumed.extra.get("logger", {}))
        # Inside a step: each pass's counts, live bars on a terminal, else plain lines
        # every train.progress_every_seconds (rank 0 only: self.bars).
        self.progress = StepProgress(
            cfg.train.steps,
            initial=self.step,
            enabled=self.bars,
            every_seconds=cfg.train.progress_every_seconds,
        )

    def _choose_chunk(self) -> None:
        """``train.chunk_size: null``: the planner's chunk for this model and prompt
        (``plan.chunking``), written into the config, so that every reader of
        ``train.chunk_size`` (prefill, the sweep, eval, W&B's config, checkpoints) has the
        number, and printed with its reason. From the config alone: every rank chooses the
        same. The kernels modelled are this run's (CUDA or the CPU's)."""
        cfg = self.cfg
        if cfg.train.chunk_size is not None:
            return
        device = "cuda" if self.accelerator.device.type == "cuda" else "cpu"
        choice = plan.chunk_for_config(cfg, device=device)
        cfg.train.chunk_size = choice.chunk
        if self.accelerator.is_main_process:
            print(f"note: {choice.note()}", file=sys.stderr)

    def group(self, sample: data.Sample) -> PromptGroup:
        """The sample's ``rollout.num_generations`` branches: its prompt as token ids (plain
        text as it is, messages through the chat template with ``data.chat_template_kwargs``,
        TRL's rules) and, in an agent run, their tools (``PromptGroup``)."""
        size = self.cfg.rollout.num_generations
        return PromptGroup.build(sample, size, self.tokenizer, self.template_kwargs, self.agents)

    def prefill(self, prompt_ids: torch.Tensor) -> ls.PrefixState:
        """The prompt's prefix state, without autograd, chunk by chunk (``train.chunk_size``),
        offloaded per ``offload.*``, with exact mode's checkpoints and kept outputs."""
        with self.progress.phase("prefill"):
            return self.adapter.prefill(
                prompt_ids,
                chunk_size=self.cfg.train.chunk_size,
                progress=self.bars,
                offload=self.offload,
                **self.grpo.prefill_options(),
            )

    def rollout_seed(self, index: int) -> int:
        """The rollout seed of the sample at ``index`` (``rollout_seed``)."""
        return rollout_seed(self.cfg.train.seed, index)

    def rollout(
        self, state: ls.PrefixState, index: int, turns: ToolTurns | None = None
    ) -> ls.RolloutOutput:
        """``rollout.num_generations`` responses of up to ``rollout.max_new_tokens`` tokens to
        the prompt ``state`` holds, sampled in one batch that shares it (TRL's settings,
        ``rollout.*``), seeded by the sample's ``index``; ``turns``: each branch's tool loop.
        A non-finite rollout raises ``NonFiniteError``, on every rank at once."""
        with self.progress.phase("rollout"):
            return ls.rollout(
                self.adapter,
                state,
                self.cfg.rollout.num_generations,
                self.cfg.rollout.max_new_tokens,
                turns=turns,
                seed=self.rollout_seed(index),
                **self.sampling,
            )

    def score(
        self,
        group: PromptGroup,
        out: ls.RolloutOutput,
        turns: ToolTurns | None,
        state: ls.PrefixState,
    ) -> Rollout:
        """The reward functions on the rollout ``out`` (which ran with ``turns``), as TRL calls
        them: the completions (text; an agent's messages), the samples, the completion ids,
        ``trainer_state`` and an environment's keywords. Returns the scored group as
        ``step_metrics`` reads it (``state``: the prompt's, for its size)."""
        completions = group.completions(out, turns, self.adapter)
        with self.progress.phase("reward"):
            self.trainer_state.global_step = self.step
            ids = [response.tolist() for response in out.responses]
            # On stages: scored on the last stage, shared with the others.
            scored = score_once(
                self.adapter,
                lambda: self.rewards(
                    completions,
                    [group.sample] * len(ids),
                    completion_ids=ids,
                    trainer_state=self.trainer_state,
                    **group.reward_kwargs,
                ),
            )
        return Rollout(
            group.sample, out, completions, scored, state_bytes(state), group.tool_counts
        )

    def _sampling_options(self) -> dict:
        """``ls.rollout``'s keyword options from ``rollout.*`` (TRL's sampling settings)."""
        r = self.cfg.rollout
        return {
            "temperature": r.temperature,
            "top_p": r.top_p,
            "top_k": r.top_k,
            "min_p": r.min_p,
            "repetition_penalty": r.repetition_penalty,
            "eos_token_ids": [self.tokenizer.eos_token_id],
            "stop_strings": r.stop,
            "tokenizer": self.tokenizer,
            "progress": self.bars,
            "gather_parameters": self.rollout_once,
            "stop_check_every": r.stop_check_every,
        }

    def _reference_policy(self) -> ls.ModelAdapter | None:
        """With ``beta > 0``: LoRA's base weights (adapters off), else a frozen copy placed
        and sharded like the policy."""
        if self.cfg.grpo.beta == 0.0:
            return None
        if self.cfg.lora.enabled:
            return ls.lora_reference(self.adapter)
        return loading.load_reference(self.cfg, self.topology, self.accelerator.device)

    def _resume(self) -> checkpoint.ResumeInfo:
        """Restore the checkpoint; the config's optimizer settings win over the saved ones."""
        info = checkpoint.load_checkpoint(
            self.resume_path, self.model, self.optimizer, self.scheduler
        )
        # Later checkpoints of this directory go to superseded-*/: this run saves those steps.
        moved = checkpoint.prepare_resume(self.cfg.train.output_dir, info.path)
        self.step, self.data_position = info.step, info.data_position
        self.guard.load_state_dict(info.extra.get("guard", {}))
        applied = resume.apply_optimizer_settings(self.optimizer, self.scheduler, self.cfg.optim)
        self.resume_changes = resume.merge_changes(applied, self.resume_changes)
        saved_steps = info.extra.get("schedule_steps")
        notes = [
            f"moved later checkpoints aside: {', '.join(map(str, moved))}" if moved else None,
            resume.describe(self.resume_changes, info.path),
            models.schedule_change(self.cfg.optim, self.cfg.train.steps, saved_steps),
        ]
        for note in filter(None, notes):
            if self.accelerator.is_main_process:
                print(f"warning: {note}", file=sys.stderr)
        return info

    def _resume_record(self) -> dict:
        """The W&B config's ``resume`` entry: where from, and each setting changed since."""
        if self.resume_path is None:
            return {}
        changed = {c.key: {"checkpoint": c.saved, "now": c.now} for c in self.resume_changes}
        return {"resume": {"from": str(self.resume_path), "step": self.step, "changed": changed}}

    def train(self) -> signal.Signals | None:
        """Train to ``train.steps``; on SIGTERM/SIGINT/SIGHUP, stop after the rollout's steps with a
        checkpoint and return the signal."""
        cfg = self.cfg
        per_step = cfg.train.prompts_per_step
        first_step = self.step
        with GracefulStop(on_signal=self.checkpoints.write_kept) as stop:
            if self.step == 0 and cfg.eval.on_start:  # the untrained policy: the curve's start
                self.logger.log(0, self._evaluate() | self.progress.take_timings())
            while self.step < cfg.train.steps:
                # Replica r of n takes samples data_position + r * per_step + k, as TRL
                # slices a generation batch across processes.
                first = self.data_position + self.topology.replica * per_step
                indices = list(range(first, first + per_step))
                for metrics in self.train_rollout([self.sample_at(i) for i in indices], indices):
                    self.step += 1
                    metrics = self.topology.reduce(metrics)
                    if self.evaluation.due(self.step):  # the updated policy, before a checkpoint
                        metrics |= self._evaluate()
                    metrics |= self.progress.step_done()
                    self.logger.log(self.step, metrics)
                self.data_position += self.topology.replicas * per_step
                stopping = stop.requested()
                due = stopping or (
                    cfg.train.save_every
                    and (self.step % cfg.train.save_every == 0 or self.step == cfg.train.steps)
                )
                with self.progress.phase("checkpoint"):
                    self.save_checkpoint(write=bool(due))
                if stopping:
                    return stopping
        if self.updates == 0 and self.step > first_step:  # every step skipped: a failure
            self.guard.nothing_trained(self.step - first_step)
        return None

    def _evaluate(self) -> dict[str, float]:
        """The ``eval/...`` metrics of the policy as it is after ``self.step`` steps."""
        with self.progress.phase("eval"), self.precision.step():
            metrics = self.evaluation.run(
                self.adapter, self.rewards, self.step,
                offload=self.offload, gather_parameters=self.rollout_once,
            )  # fmt: skip
        self.rewards.report_failures(f"eval after step {self.step}")
        return metrics

    def save_checkpoint(self, write: bool = True) -> None:
        """Every rank calls it after each rollout's steps (a sharded model is gathered): rank
        0 writes it when ``write``; with ``train.save_on_signal`` it is also kept in host
        memory, for a stop signal to write at once (``checkpoint.kept``). Never written
        before a step of this run changed the weights (``updates``, the same on every rank):
        it would hold the weights the run started from, e.g. when every reward failed."""
        write = write and self.updates > 0
        extra = {
            "logger": self.logger.state_dict(),
            "wandb_run_id": self.logger.run_id,
            "schedule_steps": self.cfg.train.steps,  # the length the LR schedule was built for
            "config": config.to_dict(self.cfg),  # what a resume compares its settings with
            "guard": self.guard.state_dict(),
            "data": data.fingerprint(self.cfg.data),  # a resume refuses other data
        }
        path = self.checkpoints.step_done(  # never a diverged state: TrainingDiverged
            self.step, self.model, self.optimizer, self.scheduler,
            data_position=self.data_position, extra=extra, write=write,
        )  # fmt: skip
        if path is not None and self.accelerator.is_main_process:
            self.progress.write(f"saved {path}")

    def cleanup(self, *, together: bool = False) -> None:
        """``together``: every rank got here at the same step (done, stopped, diverged), so
        they wait for rank 0 to finish W&B before any exits (torchrun ends the others then)."""
        self.progress.close()
        if self.agents:
            self.agents.close()
        self.logger.finish()
        if together:
            self.accelerator.wait_for_everyone()
        self.accelerator.end_training()  # also destroys the process group
        torch.set_num_threads(self._threads_before)  # an in-process run leaves them as found
