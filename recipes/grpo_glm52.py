"""GRPO on long prompts for GLM-5.2 (MLA + DSA sparse attention + MoE), LongStraw style.

Why this recipe: GLM-5.2 keeps per prompt token only a compressed latent (``c_kv`` + roped
``k_pe``, ~50x smaller than per-head K/V) and DSA indexer keys: the smallest prefix state here.
Each step

1. prefills the prompt once, without autograd, into that latent state (never expanded per
   head: attention runs in latent space by absorbing ``kv_b_proj``);
2. samples G responses in one batch that shares the state (DSA picks each query's top-k
   positions from the prompt and the branch);
3. scores them with the configured reward functions (TRL's weights and NaN semantics)
   and turns the group's rewards into advantages (``grpo.scale_rewards``);
4. replays each response alone with autograd, then, with ``grpo.gradient=exact``, sweeps
   back over the prompt's chunks so the gradient equals the full-graph one (the indexer
   stays frozen, as in transformers).

Steps 1-4 run for each of the ``train.prompts_per_step`` prompts in turn (one prefix state
at a time), then the optimizer steps once on TRL's loss over all their groups, and
``grpo.num_iterations`` - 1 more times on the same rollouts (prefilled again). That loop,
``Recipe.train_rollout``, is the part to edit; the rest (setup, FSDP and pipeline stages, eval,
checkpoints and resume, W&B, stop signals, skipped steps, exit codes) is
``longstraw_core.training``'s.

GLM-5.2's own settings: DSA's top-k is the model's ``index_topk`` (a toy's
``model.tiny_overrides.index_topk``), the positions each query attends to. Experts:
``n_routed_experts`` routed (fused 3-D weights: frozen under LoRA, whose default targets are
the MLA projections, dense MLPs and shared experts), ``num_experts_per_tok`` per token,
``n_shared_experts`` always on. ``offload.latent``: the MLA latent and DSA index keys in host
memory, streamed per layer (``offload.resident_layers`` at once).

Run it:
    python recipes/grpo_glm52.py train.steps=2 grpo.gradient=detached   # tiny CPU default
    accelerate launch --config_file configs/accelerate/32xgpu_fsdp2.yaml \\
        recipes/grpo_glm52.py --config configs/glm52/lora_grpo_32xgpu.yaml
    torchrun --nproc_per_node 2 recipes/grpo_glm52.py distributed.fsdp=true   # sharded CPU run
    python -m longstraw_core.models.export OUTPUT_DIR/step-NNNNNN DIR  # serve: transformers, LoRA merged
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import longstraw_core as ls
from longstraw_core import training

DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "configs/glm52/tiny_grpo_cpu.yaml"


class Recipe(training.Session):
    """The GRPO loop; ``training.Session`` runs everything around it."""

    def train_rollout(
        self, samples: list[training.Sample], indices: list[int]
    ) -> Iterator[dict[str, float]]:
        """prefill -> rollout -> rewards -> advantages -> grpo_step per sample, optimizer step;
        then ``grpo.num_iterations - 1`` more steps on the same rollouts (``docs/design.md``)."""
        self.start_step()
        batch = ls.GenerationBatch(self.grpo, len(samples), group=self.topology.replica_group())
        rollouts: list[training.Rollout] = []
        results: dict[int, ls.GRPOStepResult] = {}
        with self.precision.step():  # bf16 working weights until the optimizer step
            for k, (sample, index) in enumerate(zip(samples, indices, strict=True)):
                group = self.group(sample)  # prompt ids; an agent run's tools (rollout.tools)
                state = self.prefill(group.prompt_ids)  # once, without autograd
                turns = group.tool_turns()  # each branch's tool loop (None without tools)
                try:
                    out = self.rollout(state, index, turns)  # G responses sharing the state
                except training.NonFiniteError as error:  # raised on every rank at once
                    yield from self.skip_rollout(str(error))
                    return
                rollout = self.score(group, out, turns, state)  # the reward functions
                failed = self.rewards_failed(rollout.scored)  # the same on every rank
                if failed:
                    yield from self.skip_rollout(failed, rewards=True)
                    return
                rollouts.append(rollout)
                rewards = rollout.scored.rewards  # one per response (NaN: none could score it)
                # the group joins the step's batch; None: its replay waits for finish
                share = batch.add(
                    group.prompt_ids, out.responses, rewards, out.truncated, out.loss_masks
                )
                if share is not None:
                    results[k] = self.replay(batch, k, state)
                if k < len(samples) - 1:
                    state = None  # one prefix state at a time
            # the step's normaliser: corrects what the replays accumulated so far
            batch.finish(self.model.parameters(), scale=self.precision.scale_gradients)
            for k in batch.waiting():  # scale_rewards="batch" with beta > 0: after the step's std
                live, state = (state if k == len(samples) - 1 else None), None
                results[k] = self.replay(batch, k, live)  # the last group's state, then prefills
            state = None
            grad_norm, skipped = self.optimizer_step(batch.step_loss())  # not finite: skipped
            metrics = self.step_metrics(
                batch, rollouts, [*results.values()], grad_norm, skipped, first=True
            )
        yield metrics  # training.Session logs it, evaluates and saves when due
        for _ in range(1, self.grpo.num_iterations):  # the same rollouts with the new weights
            self.start_step()
            with self.precision.step():
                results = {k: self.replay(batch, k, None) for k in range(len(samples))}
                grad_norm, skipped = self.optimizer_step(batch.step_loss())
                metrics = self.step_metrics(
                    batch, rollouts, [*results.values()], grad_norm, skipped, first=False
                )
            yield metrics

    def replay(
        self, batch: ls.GenerationBatch, k: int, state: ls.PrefixState | None
    ) -> ls.GRPOStepResult:
        """Group ``k``'s rewards -> advantages, then its grpo_step with its share of the
        step; ``state=None``: prefilled again (the weights changed since its rollout, or its
        replay waited)."""
        group = batch.groups[k]
        # Each reward minus the group's mean, divided by the std grpo.scale_rewards names:
        # "group" the group's, "batch" every reward of the step's (batch.reward_std), "none" 1.
        advantages = ls.group_advantages(
            group.rewards, self.grpo.scale_rewards, std=batch.reward_std
        )
        if state is None:
            state = self.prefill(group.prompt_ids)
        self.note_peak()
        with self.progress.phase("replay"):
            result = ls.grpo_step(
                self.adapter,
                group.prompt_ids,
                group.responses,
                group.rewards,  # reported as the group's reward mean and std
                config=self.grpo,
                ref_adapter=self.reference,
                state=state,
                chunk_size=self.cfg.train.chunk_size,
                offload=self.offload,
                progress=self.bars,  # branches replayed, sweep tokens
                **batch.replay_kwargs(k, advantages),  # + loss share, old/ref log-probs, masks
            )
        batch.record(k, result)
        self.note_peak(result.peak_memory_bytes)
        return result


def main(argv: list[str] | None = None) -> Recipe:
    return training.main(Recipe, argv, default_config=DEFAULT_CONFIG, description=__doc__)


if __name__ == "__main__":
    main()
