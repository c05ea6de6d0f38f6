"""GRPO on long prompts for Qwen3.6 (hybrid Gated DeltaNet + gated attention), LongStraw style.

Why this recipe: trainers that push G copies of prompt + response through autograd stop at
a few hundred thousand tokens. Each step here

1. prefills the prompt once, without autograd, into a prefix state (attention K/V that grows
   with the prompt, DeltaNet states that do not);
2. samples G responses in one batch that shares that state (never copied per branch);
3. scores them with the configured reward functions (TRL's weights and NaN semantics);
4. replays each response alone with autograd (memory: the state + one branch's graph),
   then, with ``grpo.gradient=exact``, sweeps back over the prompt's chunks so the gradient
   equals the full-graph one.

Steps 1-4 run for each of the ``train.prompts_per_step`` prompts in turn (one prefix state
at a time); then the optimizer steps once, the loss TRL's over all their groups.
``grpo.num_iterations`` > 1 takes that many optimizer steps on the same rollouts, each
prompt prefilled again with the new weights.

Sharded (``torchrun ... distributed.fsdp=true``): each rank takes its own groups every step
(samples ``data_position + rank * prompts_per_step + k``, each its own rollout seed), FSDP2
averages the gradients so the step's loss is TRL's over every rank's responses as one batch,
metrics are averaged over the ranks, and rank 0 logs and writes the checkpoints.

accelerate launch settings are honoured or refused at start (``launch_settings``): its
``mixed_precision: bf16`` becomes ``distributed.mixed_precision=bf16`` (bf16 compute over float32
master weights, on one device too) and ``gradient_accumulation_steps: N``
``train.prompts_per_step=N``; its FSDP, DeepSpeed or dynamo settings stop the run before any
weight loads, naming the run config keys to use instead.

Evaluation (``eval.every`` > 0): after the optimizer step, greedy accuracy and pass@k on
``eval.data`` under the same reward functions, logged as ``eval/...`` (TRL's ``eval_`` names
where TRL has the metric; ``longstraw_core.evaluation``); it leaves the training untouched.

Faults lose nothing: SIGTERM/SIGINT (preemption) saves the last finished step at once, then
finishes the rollout's steps if the launcher allows, saves and exits 128+signal; a step with
a non-finite loss, gradient or logits is skipped (the guard stops the run after
``train.max_skipped_steps`` in a row);
``train.resume_from=latest`` continues from the newest complete checkpoint, applying changed
optimizer settings.

Run it:
    python recipes/grpo_qwen36.py                                  # tiny CPU default
    python recipes/grpo_qwen36.py --config configs/qwen36/tiny_lora_grpo_cpu.yaml train.steps=2
    accelerate launch --config_file configs/accelerate/8xgpu_fsdp2.yaml \\
        recipes/grpo_qwen36.py --config configs/qwen36/27b_lora_grpo_8xgpu.yaml
    torchrun --nproc_per_node 2 recipes/grpo_qwen36.py distributed.fsdp=true   # sharded CPU run

Serve a checkpoint: ``python -m longstraw_core.export <output_dir>/step-NNNNNN <dir>`` writes a
plain transformers model (LoRA merged). Copy this file and edit it: every mechanism is a
``longstraw_core`` call.
"""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import NamedTuple

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed

import longstraw_core as ls
from longstraw_core import (
    checkpoint,
    config,
    data,
    distributed,
    evaluation,
    exits,
    generation,
    guard,
    launch_settings,
    loading,
    mixed_precision,
    models,
    output_dir,
    plan,
    resume,
    same_run,
    tokenizer,
    tracking,
)
from longstraw_core import metrics as names
from longstraw_core.pipeline.topology import RunTopology
from longstraw_core.progress import StepProgress
from longstraw_core.rewards import RewardError, RewardResult, RewardSet, TrainerState
from longstraw_core.stop import GracefulStop, exit_after_stop

DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "configs/qwen36/tiny_grpo_cpu.yaml"


class Rollout(NamedTuple):
    """One group of a step, as rolled out and scored (its prompt state is not kept)."""

    sample: data.Sample
    out: ls.RolloutOutput
    completions: list[str]
    scored: RewardResult
    state_bytes: dict[str, int]  # the prompt's prefix state by layer type


class Recipe:
    """setup -> train -> cleanup; ``save_checkpoint`` every ``train.save_every`` steps."""

    def __init__(self, cfg: config.RunConfig) -> None:
        self.cfg = cfg

    def setup(self) -> None:
        cfg = self.cfg
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
        self.topology = RunTopology.from_config(
            cfg.distributed, self.world_size, self.rank, gradient=cfg.grpo.gradient
        )
        self.bars = None if self.accelerator.is_main_process else False  # progress bars
        set_seed(cfg.train.seed)  # the same on every rank: the same initial weights
        self.tokenizer = tokenizer.load_tokenizer(cfg.tokenizer.path, model_path=cfg.model.path)
        # Before any weight loads: every record checked, a changed model/lora refused.
        self.sample_at = data.sample_source(cfg.data, self.tokenizer, progress=self.bars)
        if self.accelerator.is_main_process and self.sample_at.skipped:
            print(f"warning: data: {self.sample_at.summary()}", file=sys.stderr)
        # eval.every > 0: eval.data is scanned now too (greedy accuracy, pass@k; eval/...).
        self.evaluation = evaluation.Evaluation.from_config(
            cfg, self.tokenizer, self.topology, progress=self.bars
        )
        output_dir.claim(cfg.train)  # writable, locked, no other run's checkpoints (one line)
        self.resume_path, self.resume_changes = resume.checkpoint_to_resume(cfg)
        # Only this rank's share: its stage's layers, read straight from the checkpoint.
        self.adapter = loading.load_policy(cfg, self.topology, self.accelerator.device)
        self.model = self.adapter.model
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
        self.rewards = RewardSet.from_config(cfg)  # names, weights, factories' arguments
        self.trainer_state = TrainerState(max_steps=cfg.train.steps)  # what TRL's rewards get
        self.optimizer = models.build_optimizer(self.model, cfg.optim)
        self.scheduler = models.build_scheduler(self.optimizer, cfg.optim, cfg.train.steps)
        self.guard = guard.NonFiniteGuard(cfg.train.max_skipped_steps)
        self.checkpoints = checkpoint.StepCheckpoints.from_config(cfg.train)  # + at a stop
        self.step, self.data_position, resumed = 0, 0, None
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
        self.progress = StepProgress(cfg.train.steps, initial=self.step, enabled=self.bars)

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
        """Train to ``train.steps``; on SIGTERM/SIGINT, stop after the rollout's steps with a
        checkpoint and return the signal."""
        cfg = self.cfg
        per_step = cfg.train.prompts_per_step
        with GracefulStop(on_signal=self.checkpoints.write_kept) as stop:
            while self.step < cfg.train.steps:
                # Replica r of n takes samples data_position + r * per_step + k, as TRL
                # slices a generation batch across processes.
                first = self.data_position + self.topology.replica * per_step
                indices = list(range(first, first + per_step))
                for metrics in self.train_rollout([self.sample_at(i) for i in indices], indices):
                    self.step += 1
                    metrics = self.topology.reduce(metrics)
                    if self.evaluation.due(self.step):  # the updated policy, before a checkpoint
                        with self.progress.phase("eval"), self.precision.step():
                            metrics |= self.evaluation.run(
                                self.adapter, self.rewards, self.step,
                                offload=self.offload, gather_parameters=self.rollout_once,
                            )  # fmt: skip
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
        return None

    def train_rollout(
        self, samples: list[data.Sample], indices: list[int]
    ) -> Iterator[dict[str, float]]:
        """prefill -> rollout -> rewards -> grpo_step for each sample, optimizer step; then
        ``grpo.num_iterations - 1`` more steps on the same rollouts. Yields this rank's
        metrics of each optimizer step. ``indices``: the samples' positions, which seed the
        rollouts. ``GenerationBatch`` makes each step's loss TRL's over every replica's groups
        (``docs/design.md``, "Several prompts and updates per step")."""
        names.reset_peak_memory(self.accelerator.device)  # this step's peak: prefill to optimizer
        self.step_peak = 0
        batch = ls.GenerationBatch(self.grpo, len(samples), group=self.topology.replica_group())
        rollouts: list[Rollout] = []
        results: dict[int, ls.GRPOStepResult] = {}
        with self.precision.step():  # bf16 working weights until the optimizer step
            metrics = yield from self._first_update(batch, samples, indices, rollouts, results)
        if metrics is None:  # the rollout was skipped
            return
        yield metrics
        for _ in range(1, self.grpo.num_iterations):  # the same rollouts with the new weights
            names.reset_peak_memory(self.accelerator.device)
            self.step_peak = 0
            with self.precision.step():
                results = {k: self._replay(batch, k, None) for k in range(len(samples))}
                metrics = self._update(batch, rollouts, list(results.values()), first=False)
            yield metrics

    def _first_update(
        self,
        batch: ls.GenerationBatch,
        samples: list[data.Sample],
        indices: list[int],
        rollouts: list[Rollout],
        results: dict[int, ls.GRPOStepResult],
    ) -> Generator[dict[str, float], None, dict[str, float] | None]:
        """Each sample's prefill, rollout, rewards and (when its share is known) replay, then
        the step's correction and the optimizer step; returns its metrics (None: the rollout
        was skipped, its steps yielded)."""
        cfg, progress = self.cfg, self.progress
        for k, (sample, index) in enumerate(zip(samples, indices, strict=True)):
            # Plain text as it is, messages through the chat template (TRL's rules).
            chat_options = cfg.data.chat_template_kwargs
            prompt_ids = torch.tensor(
                tokenizer.encode_prompt(self.tokenizer, sample.prompt, chat_options)
            )
            state = self._prefill(prompt_ids)
            try:
                with progress.phase("rollout"):
                    out = ls.rollout(
                        self.adapter,
                        state,
                        cfg.rollout.num_generations,
                        cfg.rollout.max_new_tokens,
                        temperature=cfg.rollout.temperature,
                        top_p=cfg.rollout.top_p,
                        top_k=cfg.rollout.top_k,
                        min_p=cfg.rollout.min_p,
                        repetition_penalty=cfg.rollout.repetition_penalty,
                        eos_token_ids=[self.tokenizer.eos_token_id],
                        stop_strings=cfg.rollout.stop,
                        tokenizer=self.tokenizer,
                        seed=cfg.train.seed * 1_000_003 + index,  # differs between ranks
                        progress=self.bars,
                        gather_parameters=self.rollout_once,
                    )
            except guard.NonFiniteError as error:  # raised on every rank at once
                yield from self._skip_rollout(str(error))
                return None
            completions = self.tokenizer.batch_decode(out.responses, skip_special_tokens=True)
            with progress.phase("reward"):  # TRL's call: prompts, completions, ids, columns
                self.trainer_state.global_step = self.step
                scored = self.rewards(
                    completions,
                    [sample] * len(completions),
                    completion_ids=[response.tolist() for response in out.responses],
                    trainer_state=self.trainer_state,
                )
            if distributed.any_rank(scored.all_failed):
                yield from self._skip_rollout("every reward function failed on every completion")
                return None
            state_bytes = {names.STATE_BYTES_BY_TYPE.format(kind): v["bytes"]
                           for kind, v in state.summary().items()}  # fmt: skip
            rollouts.append(Rollout(sample, out, completions, scored, state_bytes))
            # This group's share of the step's loss (a collective); None: its replay waits.
            if batch.add(prompt_ids, out.responses, scored.rewards, out.truncated) is not None:
                results[k] = self._replay(batch, k, state)
            if k < len(samples) - 1:
                state = None  # one prefix state at a time
        # the step's normaliser: corrects what the replays accumulated so far
        batch.finish(self.model.parameters(), scale=self.precision.scale_gradients)
        for k in batch.waiting():  # scale_rewards="batch" with beta > 0: after the step's std
            live, state = (state if k == len(samples) - 1 else None), None
            results[k] = self._replay(batch, k, live)  # the last group's state, then prefills
        state = None
        return self._update(batch, rollouts, list(results.values()), first=True)

    def _prefill(self, prompt_ids: torch.Tensor) -> ls.PrefixState:
        with self.progress.phase("prefill"):
            return self.adapter.prefill(
                prompt_ids,
                chunk_size=self.cfg.train.chunk_size,
                progress=self.bars,
                offload=self.offload,
                **self.grpo.prefill_options(),  # exact mode's checkpoints, kept outputs
            )

    def _replay(
        self, batch: ls.GenerationBatch, k: int, state: ls.PrefixState | None
    ) -> ls.GRPOStepResult:
        """grpo_step of group ``k`` with its share of the step; ``state=None``: prefilled
        again (the weights changed since its rollout, or its replay waited)."""
        group = batch.groups[k]
        if state is None:
            state = self._prefill(group.prompt_ids)
        self.step_peak = max(self.step_peak, names.peak_memory_bytes(self.accelerator.device))
        with self.progress.phase("replay"):
            result = ls.grpo_step(
                self.adapter,
                group.prompt_ids,
                group.responses,
                group.rewards,
                config=self.grpo,
                ref_adapter=self.reference,
                state=state,
                chunk_size=self.cfg.train.chunk_size,
                offload=self.offload,
                **batch.replay_kwargs(k),  # loss_scale, reward_std, old/ref log-probs
            )
        batch.record(k, result)
        self.step_peak = max(self.step_peak, result.peak_memory_bytes)
        return result

    def _update(
        self,
        batch: ls.GenerationBatch,
        rollouts: list[Rollout],
        results: list[ls.GRPOStepResult],
        *,
        first: bool,
    ) -> dict[str, float]:
        """The optimizer step on what the replays accumulated; this rank's metrics of it
        (``first``: the rollouts' first update, which counts their tokens)."""
        cfg = self.cfg
        with self.progress.phase("optimizer"):
            grad_norm, skip_reason = self._optimizer_step(batch.step_loss())
        every = cfg.train.completions_every
        if every and (self.step + 1) % every == 0:
            rows = [
                row
                for k, ro in enumerate(rollouts)
                for row in tracking.completion_rows(
                    ro.scored, batch.advantages(k), sample=ro.sample.id, answer=ro.sample.answer
                )
            ]
            rows = distributed.gather_rows(self.topology.rows_to_log(rows))  # one per replica
            self.logger.log_completions(self.step + 1, rows)
        # grpo_step's metrics (no prefill_seconds: the prefill is the recipe's, time/prefill)
        # and the reward set's (TRL's reward and reward_std), over this rank's groups.
        groups = generation.combine_group_metrics(
            [r.metrics() for r in results]
            + [ro.scored.metrics() | ro.state_bytes for ro in rollouts]
        )
        advantages = [abs(a) for k in range(len(rollouts)) for a in batch.advantages(k)]
        speed = [ro.out.stats["tokens_per_second"] for ro in rollouts]
        # TRL's reward and completions/* metrics over every replica's groups (collectives);
        # num_tokens once per rollout
        scale = self.grpo.scale_rewards
        batch_rewards = self.topology.reward_metrics([ro.scored for ro in rollouts], scale)
        completions = self.topology.completion_metrics(
            [(len(g.prompt_ids), [len(r) for r in g.responses], g.truncated) for g in batch.groups]
        )
        if not first:
            completions[names.NUM_TOKENS] = 0.0
        return {
            **groups,
            names.LOSS: batch.step_loss(),  # averaged over ranks: the step's loss
            names.ADVANTAGE_ABS_MEAN: sum(advantages) / len(advantages),
            names.GRAD_NORM: grad_norm,
            names.LEARNING_RATE: self.scheduler.get_last_lr()[0],
            names.ROLLOUT_TOKENS_PER_SECOND: sum(speed) / len(speed),
            **batch_rewards,
            **completions,
            names.STEP_PEAK_MEMORY_BYTES: max(
                self.step_peak, names.peak_memory_bytes(self.accelerator.device)
            ),
            **(self._skip(skip_reason) if skip_reason else self._passed()),
        }

    def _optimizer_step(self, loss: float) -> tuple[float, str | None]:
        """Clip and step; a non-finite loss or gradient norm (on any rank) skips the update.
        Returns the gradient norm and why the update was skipped (None: it was not)."""
        self.precision.to_masters()  # float32 weights and gradients for the clip and AdamW
        parameters = [p for p in self.model.parameters() if p.requires_grad]
        # Replicas of a stage average their gradients; the clip uses the whole model's norm.
        norm = self.topology.finish_gradients(parameters, self.cfg.optim.max_grad_norm)
        reason = guard.non_finite_reason(loss, norm)
        if distributed.any_rank(reason is not None):
            self.optimizer.zero_grad(set_to_none=True)
            return norm, reason or "another rank's loss is not finite"
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.guard.passed()
        return norm, None

    def _passed(self) -> dict[str, float]:
        return {names.SKIPPED: 0.0, names.SKIPPED_STEPS: float(self.guard.skipped)}

    def _skip_rollout(self, reason: str) -> Iterator[dict[str, float]]:
        """A rollout that cannot be trained on: each of its optimizer steps is skipped."""
        for _ in range(self.grpo.num_iterations):
            yield self._skip(reason)

    def _skip(self, reason: str) -> dict[str, float]:
        """This step changes nothing (no update, no scheduler step): count it, say why."""
        self.precision.to_masters()
        self.optimizer.zero_grad(set_to_none=True)
        write = self.progress.write if self.accelerator.is_main_process else lambda line: None
        self.guard.skip(self.step + 1, reason, write=write)  # raises past the limit
        return {names.SKIPPED: 1.0, names.SKIPPED_STEPS: float(self.guard.skipped)}

    def save_checkpoint(self, write: bool = True) -> None:
        """Every rank calls it after each rollout's steps (a sharded model is gathered): rank
        0 writes it when ``write``; with ``train.save_on_signal`` it is also kept in host
        memory, for a stop signal to write at once (``checkpoint.kept``)."""
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
        self.logger.finish()
        if together:
            self.accelerator.wait_for_everyone()
        self.accelerator.end_training()  # also destroys the process group


def main(argv: list[str] | None = None) -> Recipe:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(DEFAULT_CONFIG), help="a YAML under configs/")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. train.steps=2")
    args = parser.parse_args(argv)
    try:
        cfg = config.load_config(args.config, args.overrides)
        # accelerate launch's settings (mixed_precision, FSDP, DeepSpeed, ...): each mapped
        # onto the run config or refused here, never silently ignored.
        cfg = launch_settings.honour(cfg)
    except (config.ConfigError, FileNotFoundError) as error:
        exits.fail(f"config error: {error}")
    try:  # before any weight is loaded: refuse a step the GPUs cannot hold
        plan.check_fits(cfg)
    except plan.MemoryPlanError as error:
        table = f"python -m longstraw_core.plan --config {args.config} prints the full table"
        exits.fail(f"memory plan: {error}\n({table})")
    recipe = Recipe(cfg)
    try:
        recipe.setup()
    except config.ConfigError as error:
        exits.fail(f"config error: {error}")
    except data.DataError as error:
        exits.fail(f"data error: {error}")
    except checkpoint.CheckpointError as error:
        exits.fail(f"checkpoint error: {error}")
    stopped, failure, together = None, None, False
    try:
        stopped = recipe.train()
        together = True
    except (guard.TrainingDiverged, checkpoint.CheckpointError) as error:  # raised on all ranks
        failure, together = f"training stopped: {error}", True
    except RewardError as error:  # this rank's reward function alone
        failure = f"training stopped: {error}"
    finally:
        recipe.cleanup(together=together)
    if failure:
        exits.fail(failure, local=not together)
    if stopped:  # SIGTERM/SIGINT: the step finished and was saved
        exit_after_stop(
            stopped,
            f"stopped by {stopped.name} after step {recipe.step}/{cfg.train.steps}; "
            f"resume: the same command with train.resume_from=latest "
            f"(train.output_dir={cfg.train.output_dir})",
        )
    if recipe.world_size > 1:  # a distributed run is done on every rank: skip gloo's teardown
        distributed.exit_ranks()
    return recipe  # the trained run (longstraw_core.trainer.train returns it)


if __name__ == "__main__":
    main()
