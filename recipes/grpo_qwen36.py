"""GRPO on long prompts for Qwen3.6 (hybrid Gated DeltaNet + gated attention), LongStraw style.

Why this recipe: trainers that push G copies of prompt + response through autograd stop at
a few hundred thousand tokens. Each step here

1. prefills the prompt once, without autograd, into a prefix state (attention K/V that grows
   with the prompt, DeltaNet states that do not);
2. samples G responses in one batch that shares that state (never copied per branch);
3. scores them with the configured reward functions (TRL's weights and NaN semantics);
4. replays each response alone with autograd (memory: the state + one branch's graph),
   then, with ``grpo.gradient=exact``, sweeps back over the prompt's chunks so the gradient
   equals the full-graph one; the optimizer steps once per group.

Sharded (``torchrun ... distributed.fsdp=true``): each rank takes its own group every step
(sample ``data_position + rank``, its own rollout seed), FSDP2 averages the gradients so the
step's loss is TRL's over every rank's responses as one batch, metrics are averaged over the
ranks, and rank 0 logs and writes the checkpoints.

Faults lose nothing: SIGTERM/SIGINT (preemption) finishes the step, saves a checkpoint and
exits 128+signal; a step with a non-finite loss, gradient or logits is skipped (the guard
stops the run after ``train.max_skipped_steps`` in a row); ``train.resume_from=latest``
continues from the newest complete checkpoint, applying changed optimizer settings.

Run it:
    python recipes/grpo_qwen36.py                                  # tiny CPU default
    python recipes/grpo_qwen36.py --config configs/qwen36/tiny_lora_grpo_cpu.yaml train.steps=2
    accelerate launch --config_file configs/accelerate/8xgpu_fsdp2.yaml \\
        recipes/grpo_qwen36.py --config configs/qwen36/27b_lora_grpo_8xgpu.yaml
    torchrun --nproc_per_node 2 recipes/grpo_qwen36.py distributed.fsdp=true   # sharded CPU run

Copy this file and edit it: every mechanism is a ``longstraw_core`` call.
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from transformers import TrainerState

import longstraw_core as ls
from longstraw_core import (
    checkpoint,
    config,
    data,
    distributed,
    guard,
    loading,
    models,
    plan,
    resume,
    tokenizer,
    tracking,
)
from longstraw_core import metrics as names
from longstraw_core.pipeline.topology import RunTopology
from longstraw_core.progress import StepProgress
from longstraw_core.rewards import RewardError, RewardSet
from longstraw_core.stop import GracefulStop, exit_after_stop

DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "configs/qwen36/tiny_grpo_cpu.yaml"


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
        self.topology = RunTopology.from_config(
            cfg.distributed, self.world_size, self.rank, gradient=cfg.grpo.gradient
        )
        self.bars = None if self.accelerator.is_main_process else False  # progress bars
        set_seed(cfg.train.seed)  # the same on every rank: the same initial weights
        self.tokenizer = tokenizer.load_tokenizer(cfg.tokenizer.path)
        # Before any weight loads: every record checked, a changed model/lora refused.
        self.sample_at = data.sample_source(cfg.data, self.tokenizer, progress=self.bars)
        if self.accelerator.is_main_process and self.sample_at.skipped:
            print(f"warning: data: {self.sample_at.summary()}", file=sys.stderr)
        self.resume_path, self.resume_changes = resume.checkpoint_to_resume(cfg)
        # Only this rank's share: its stage's layers, read straight from the checkpoint.
        self.adapter = loading.load_policy(cfg, self.topology, self.accelerator.device)
        self.model = self.adapter.model
        self.adapter.activation_checkpointing = cfg.train.activation_checkpointing
        self.reference = self._reference_policy()
        self.grpo = config.grpo_config(cfg)
        self.offload = config.offload_policy(cfg)  # prefix state on CPU, streamed per layer
        # FSDP: gather the layers once per rollout, unless the planner says that won't fit.
        self.rollout_once, why_not = plan.rollout_gathers_once(cfg)
        if why_not and self.accelerator.is_main_process:
            print(f"note: {why_not}", file=sys.stderr)
        self.rewards = RewardSet(
            [r.name for r in cfg.rewards],
            [r.weight for r in cfg.rewards],
            raise_errors=cfg.train.raise_reward_errors,
        )
        self.trainer_state = TrainerState(max_steps=cfg.train.steps)  # what TRL's rewards get
        self.optimizer = models.build_optimizer(self.model, cfg.optim)
        self.scheduler = models.build_scheduler(self.optimizer, cfg.optim, cfg.train.steps)
        self.guard = guard.NonFiniteGuard(cfg.train.max_skipped_steps)
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
        """Train to ``train.steps``; on SIGTERM/SIGINT, stop after the step with a checkpoint
        and return the signal."""
        cfg = self.cfg
        with GracefulStop() as stop:
            while self.step < cfg.train.steps:
                index = self.data_position + self.topology.replica
                metrics = self.topology.reduce(self.train_step(self.sample_at(index), index))
                self.step += 1
                self.data_position += self.topology.replicas
                metrics |= self.progress.step_done()
                self.logger.log(self.step, metrics)
                stopping = stop.requested()
                if stopping or (
                    cfg.train.save_every
                    and (self.step % cfg.train.save_every == 0 or self.step == cfg.train.steps)
                ):
                    with self.progress.phase("checkpoint"):
                        self.save_checkpoint()
                if stopping:
                    return stopping
        return None

    def train_step(self, sample: data.Sample, index: int) -> dict[str, float]:
        """prefill -> rollout -> rewards -> grpo_step -> optimizer step; this rank's metrics.

        ``index``: the sample's position in the data, which seeds the rollout.
        """
        cfg, progress = self.cfg, self.progress
        # Plain text as it is, messages through the chat template (TRL's rules).
        prompt_ids = torch.tensor(
            tokenizer.encode_prompt(self.tokenizer, sample.prompt, cfg.data.chat_template_kwargs)
        )
        device = self.accelerator.device
        names.reset_peak_memory(device)  # this step's peak: prefill to optimizer step
        with progress.phase("prefill"):
            state = self.adapter.prefill(
                prompt_ids,
                chunk_size=cfg.train.chunk_size,
                progress=self.bars,
                offload=self.offload,
                **self.grpo.prefill_options(),  # exact mode's checkpoints, kept outputs
            )
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
            return self._skip(str(error))
        # This group's share of the step's loss over every rank's responses (TRL's one batch).
        (loss_scale,) = distributed.group_loss_scales(
            [[len(r) for r in out.responses]], self.grpo, [out.truncated],
            group=self.topology.replica_group(),
        )  # fmt: skip
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
            return self._skip("every reward function failed on every completion (errors above)")
        peak_before_replay = names.peak_memory_bytes(device)  # grpo_step measures its own
        with progress.phase("replay"):
            result = ls.grpo_step(
                self.adapter,
                prompt_ids,
                out.responses,
                scored.rewards,
                config=self.grpo,
                ref_adapter=self.reference,
                state=state,
                truncated=out.truncated,
                chunk_size=cfg.train.chunk_size,
                loss_scale=loss_scale,
                offload=self.offload,
            )
        with progress.phase("optimizer"):
            grad_norm, skip_reason = self._optimizer_step(result.loss)
        if cfg.train.completions_every and (self.step + 1) % cfg.train.completions_every == 0:
            rows = tracking.completion_rows(
                scored, result.advantages, sample=sample.id, answer=sample.answer
            )
            rows = distributed.gather_rows(self.topology.rows_to_log(rows))  # one per replica
            self.logger.log_completions(self.step + 1, rows)
        state_bytes = {
            names.STATE_BYTES_BY_TYPE.format(k): v["bytes"] for k, v in state.summary().items()
        }
        # grpo_step's metrics (no prefill_seconds: the prefill is the recipe's, time/prefill);
        # the reward set's reward and reward_std (TRL's) are their own names.
        return {
            **result.metrics(),
            names.LOSS: result.loss * loss_scale,  # averaged over ranks: the step's loss
            **scored.metrics(),
            **state_bytes,
            names.ADVANTAGE_ABS_MEAN: sum(map(abs, result.advantages)) / len(out.responses),
            names.GRAD_NORM: grad_norm,
            names.LR: self.scheduler.get_last_lr()[0],
            names.ROLLOUT_TOKENS_PER_SECOND: out.stats["tokens_per_second"],
            names.TRUNCATED_FRACTION: sum(out.truncated) / len(out.truncated),
            names.STEP_PEAK_MEMORY_BYTES: max(peak_before_replay, names.peak_memory_bytes(device)),
            **(self._skip(skip_reason) if skip_reason else self._passed()),
        }

    def _optimizer_step(self, loss: float) -> tuple[float, str | None]:
        """Clip and step; a non-finite loss or gradient norm (on any rank) skips the update.
        Returns the gradient norm and why the update was skipped (None: it was not)."""
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

    def _skip(self, reason: str) -> dict[str, float]:
        """This step changes nothing (no update, no scheduler step): count it, say why."""
        self.optimizer.zero_grad(set_to_none=True)
        write = self.progress.write if self.accelerator.is_main_process else lambda line: None
        self.guard.skip(self.step + 1, reason, write=write)  # raises past the limit
        return {names.SKIPPED: 1.0, names.SKIPPED_STEPS: float(self.guard.skipped)}

    def save_checkpoint(self) -> None:
        """Every rank calls it (a sharded model is gathered); rank 0 writes."""
        extra = {
            "logger": self.logger.state_dict(),
            "wandb_run_id": self.logger.run_id,
            "schedule_steps": self.cfg.train.steps,  # the length the LR schedule was built for
            "config": config.to_dict(self.cfg),  # what a resume compares its settings with
            "guard": self.guard.state_dict(),
        }
        bad = guard.first_non_finite(
            [*self.model.named_parameters(), *guard.optimizer_tensors(self.optimizer)]
        )
        if distributed.any_rank(bad is not None):  # never save a diverged run
            raise guard.TrainingDiverged(
                f"not saving step {self.step}: {bad or 'a tensor on another rank'} holds "
                "inf/NaN; resume from the last checkpoint with a lower optim.lr"
            )
        path = checkpoint.save_checkpoint(
            self.cfg.train.output_dir,
            self.step,
            self.model,
            self.optimizer,
            self.scheduler,
            data_position=self.data_position,
            extra=extra,
            keep_last=self.cfg.train.keep_last,
        )
        if self.accelerator.is_main_process:
            self.progress.write(f"saved {path}")

    def cleanup(self, *, together: bool = False) -> None:
        """``together``: every rank got here at the same step (done, stopped, diverged), so
        they wait for rank 0 to finish W&B before any exits (torchrun ends the others then)."""
        self.progress.close()
        self.logger.finish()
        if together:
            self.accelerator.wait_for_everyone()
        self.accelerator.end_training()  # also destroys the process group


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(DEFAULT_CONFIG), help="a YAML under configs/")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. train.steps=2")
    args = parser.parse_args(argv)
    try:
        cfg = config.load_config(args.config, args.overrides)
    except (config.ConfigError, FileNotFoundError) as error:
        sys.exit(f"config error: {error}")
    try:  # before any weight is loaded: refuse a step the GPUs cannot hold
        plan.check_fits(cfg)
    except plan.MemoryPlanError as error:
        table = f"python -m longstraw_core.plan --config {args.config} prints the full table"
        sys.exit(f"memory plan: {error}\n({table})")
    recipe = Recipe(cfg)
    try:
        recipe.setup()
    except config.ConfigError as error:
        sys.exit(f"config error: {error}")
    except data.DataError as error:
        sys.exit(f"data error: {error}")
    except checkpoint.CheckpointError as error:
        sys.exit(f"checkpoint error: {error}")
    stopped, failure, together = None, None, False
    try:
        stopped = recipe.train()
        together = True
    except guard.TrainingDiverged as error:  # the ranks agree on every skip: all raise it
        failure, together = f"training stopped: {error}", True
    except RewardError as error:  # this rank's reward function alone
        failure = f"training stopped: {error}"
    finally:
        recipe.cleanup(together=together)
    if failure:
        sys.exit(failure)
    if stopped:  # SIGTERM/SIGINT: the step finished and was saved
        exit_after_stop(
            stopped,
            f"stopped by {stopped.name} after step {recipe.step}/{cfg.train.steps}; "
            f"resume: the same command with train.resume_from=latest "
            f"(train.output_dir={cfg.train.output_dir})",
        )
    if recipe.world_size > 1:  # a distributed run is done on every rank: skip gloo's teardown
        distributed.exit_ranks()


if __name__ == "__main__":
    main()
