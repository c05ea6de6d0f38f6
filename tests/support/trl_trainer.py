"""TRL 1.16's own ``GRPOTrainer``, built as the tests that compare LongStraw with it need it:
on CPU in float, in train mode, its loop's state set so that ``_compute_loss`` and
``_generate_and_score_completions`` run outside its training loop."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from datasets import Dataset
from trl import GRPOConfig as TRLConfig
from trl import GRPOTrainer


def grpo_trainer(
    model: torch.nn.Module,
    tokenizer,
    output_dir: Path,
    reward: Callable[..., list[float]],
    prompts: Sequence[str],
    **args,
) -> GRPOTrainer:
    """TRL's trainer around ``model`` with one reward function over ``prompts``; ``args``:
    its ``GRPOConfig`` settings."""
    config = TRLConfig(
        output_dir=str(output_dir), report_to="none", use_cpu=True, bf16=False, seed=0, **args
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = GRPOTrainer(
            model=model, reward_funcs=reward, args=config, processing_class=tokenizer,
            train_dataset=Dataset.from_dict({"prompt": list(prompts)}),
        )  # fmt: skip
    trainer.model.train()  # _compute_loss's "train" mode (no dropout in the tiny model)
    trainer.current_gradient_accumulation_steps = 1  # the Trainer sets it in its loop
    return trainer


def grpo_args(loss_type: str, **extra) -> dict:
    """Settings both configs take: cispo needs its cap, dr_grpo its length constant."""
    args = {"loss_type": loss_type, "max_completion_length": 8, **extra}
    if loss_type == "cispo":
        args["epsilon_high"] = 1.2
    elif loss_type not in ("sapo", "vespo"):
        args["epsilon_high"] = 0.28
    return args


def trl_loss_and_logps(
    trainer: GRPOTrainer, model: torch.nn.Module, inputs: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """TRL's own ``_compute_loss`` on ``inputs``, backpropagated (its gradients are left in
    ``model``), and the per-token log-probs its own function (its float32 log-softmax
    kernel) gives the same completions, ``[G, width]``: what LongStraw's branches replay."""
    loss = trainer._compute_loss(model, inputs)
    loss.backward()
    logps, _, _ = trainer._get_per_token_logps_and_entropies(
        model,
        torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1),
        torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1),
        inputs["completion_ids"].shape[1],
    )
    return loss, logps
