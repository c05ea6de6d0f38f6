"""LongStraw's GRPO against TRL 1.16's own ``GRPOTrainer``, on a tiny model.

A real ``trl.GRPOTrainer`` is built around a tiny qwen3 (float64, LoRA, the built-in byte
tokenizer), and its own ``_compute_loss`` and ``_generate_and_score_completions`` run
unchanged; LongStraw replays the same completions and the losses, advantages and parameter
gradients are compared.

- Every loss type (``sapo``, ``vespo``, ``luspo`` over a full grid of KL, importance level,
  truncation masking and off-policy ratios): the per-branch losses of ``losses.branch_loss``
  on TRL's own per-token log-probs equal TRL's loss over the padded group, gradients
  included, to float64 round-off.
- ``GenerationBatch`` (``train.prompts_per_step``, ``scale_rewards``): two prompts' groups
  rolled out by TRL, each replayed by ``grpo_step`` (exact mode: TRL backpropagates through
  the prompt) right after its rollout with the provisional shares, then corrected by
  ``finish``, equal TRL's one ``_compute_loss`` over the concatenated batch, with its
  advantages (``"batch"``: the std of both groups' rewards).
- ``num_iterations=2``: TRL's two updates on one generation (old log-probs from before the
  first, clipping in the second) equal LongStraw's, after the same SGD step.
- ``temperature`` (TRL's sampling temperature, which its fused LM head divides every
  log-prob's logits by: the policy's, the old and the reference's): cases of both tests
  above sample and train at 0.7, LongStraw's ``GRPOConfig.temperature`` the same.

TRL computes log-probs in float32 whatever the model's dtype (its chunked log-softmax
kernel), so where LongStraw computes its own (float64) the tolerances are float32's.
"""

from __future__ import annotations

import dataclasses
import itertools
import warnings

import pytest
import torch
from reference import assert_grads_close, float32_sum_rtol, full_sequence_logps, with_lora
from trl import GRPOConfig as TRLConfig
from trl import GRPOTrainer
from trl_trainer import grpo_args, grpo_trainer, trl_loss_and_logps

import longstraw_core as ls
from longstraw_core.grpo.losses import TOKEN_NORMALISED, branch_loss, group_advantages, loss_weights
from longstraw_core.models.tiny import tiny_model

F64 = torch.float64
G = 4
PROMPTS = ["The cat sat on", "A dog ran past"]  # equal token counts: TRL pads prompts left
TARGETS = ["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"]
CHUNK = 4  # prefill chunks of the 14-token prompts: the exact sweep crosses several
VOCAB = 260
HEAD_RTOL = float32_sum_rtol(VOCAB)  # TRL's float32 head: its sums run over the vocabulary


def lora_model(eos_id: int | None = None) -> torch.nn.Module:
    """The tiny policy (the same weights on every call). ``eos_id``: make that token likely
    after about half the contexts, so sampled completions end at different lengths."""
    model = tiny_model("qwen3", dtype=F64, seed=0, vocab_size=VOCAB)
    if eos_id is not None:
        with torch.no_grad():
            model.lm_head.weight[eos_id] *= 8.0
    return with_lora(model, TARGETS, seed=1)


def trl_trainer(model, tokenizer, tmp_path, rewards=None, **args) -> GRPOTrainer:
    """TRL's trainer as a user builds it; ``rewards``: what its reward function returns for
    the completions, in order."""

    def preset_reward(completions, **_):
        return list(rewards[: len(completions)])

    return grpo_trainer(
        model, tokenizer, tmp_path, preset_reward, PROMPTS, num_generations=G,
        per_device_train_batch_size=G * len(PROMPTS), **args,
    )  # fmt: skip


def grads_of(model) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    return out


def test_config_defaults_are_trls(tmp_path):
    """Every field LongStraw's GRPOConfig shares with TRL's has TRL's default."""
    trl_config = TRLConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True)
    shared = [f for f in dataclasses.fields(ls.GRPOConfig) if hasattr(trl_config, f.name)]
    assert {f.name for f in dataclasses.fields(ls.GRPOConfig)} - {f.name for f in shared} == {
        "gradient", "recurrent_checkpoints", "keep_attention_outputs",  # LongStraw's own
    }  # fmt: skip
    for f in shared:
        assert f.default == getattr(trl_config, f.name), f.name


# --- every loss type: branch_loss on the model's log-probs == TRL's _compute_loss -------------

LENGTHS = [5, 3, 7, 2]
TRUNC = [False, True, False, False]
REWARDS = [1.0, 0.25, -0.5, -1.0]


def loss_grid():
    for loss_type, beta, level, mask, on_policy in itertools.product(
        ["sapo", "vespo", "luspo"], [0.0, 0.04], ["token", "sequence"], [False, True], [False, True]
    ):
        yield loss_type, beta, level, mask, on_policy
    # The older types once each, off-policy, with KL and masking (test_losses holds their grid).
    for loss_type in ["grpo", "bnpo", "dr_grpo", "dapo", "cispo"]:
        yield loss_type, 0.04, "token", True, False


@pytest.mark.filterwarnings("ignore:loss_type=")
@pytest.mark.filterwarnings("ignore:importance_sampling_level=")
@pytest.mark.parametrize(("loss_type", "beta", "level", "mask", "on_policy"), list(loss_grid()))
def test_loss_types_equal_trl_compute_loss(
    float64_default, tokenizer, tmp_path, loss_type, beta, level, mask, on_policy
):
    extra = {"beta": beta, "importance_sampling_level": level, "mask_truncated_completions": mask}
    trainer = trl_trainer(lora_model(), tokenizer, tmp_path, **grpo_args(loss_type, **extra))
    config = ls.GRPOConfig(**grpo_args(loss_type, **extra), num_generations=G)
    model = trainer.model
    gen = torch.Generator().manual_seed(3)
    prompt = torch.tensor(tokenizer(PROMPTS[0])["input_ids"])
    responses = [torch.randint(0, 256, (n,), generator=gen) for n in LENGTHS]
    with torch.no_grad():  # behaviour and reference log-probs: the policy's, drifted per branch
        own = [full_sequence_logps(model, prompt, r) for r in responses]
    drift = [0.35, -0.3, 0.25, -0.2]
    old = [
        lp + d + 0.3 * torch.randn(lp.shape, generator=gen)
        for lp, d in zip(own, drift, strict=True)
    ]
    ref = [lp + 0.4 * torch.randn(lp.shape, generator=gen) for lp in own]
    advantages = group_advantages(torch.tensor(REWARDS))

    width = max(LENGTHS)
    completion_mask = torch.tensor([[int(t < n) for t in range(width)] for n in LENGTHS])
    if mask:  # TRL zeroes a truncated completion's mask when it is generated
        completion_mask = completion_mask * torch.tensor([[0 if t else 1] for t in TRUNC])

    def padded(rows):
        return torch.stack([torch.cat([r, r.new_zeros(width - len(r))]) for r in rows])

    inputs = {
        "prompt_ids": prompt.expand(G, -1),
        "prompt_mask": torch.ones(G, len(prompt), dtype=torch.long),
        "completion_ids": padded(responses),
        "completion_mask": completion_mask,
        "advantages": advantages,
        "num_items_in_batch": completion_mask.sum(),
        "ref_per_token_logps": padded(ref),
    }
    if not on_policy:
        inputs["old_per_token_logps"] = padded(old)
    # The same per-token log-probs, from TRL's own function (its float32 log-softmax kernel),
    # cut into branches: what differs is the loss's decomposition alone.
    expected_loss, logps = trl_loss_and_logps(trainer, model, inputs)
    expected = grads_of(model)
    weights = loss_weights(LENGTHS, TRUNC, config)
    total = 0
    for i, n in enumerate(LENGTHS):
        loss, _ = branch_loss(
            logps[i, :n], None if on_policy else old[i], ref[i], advantages[i], weights[i], config
        )
        total = total + loss
    total.backward()
    assert total.item() == pytest.approx(expected_loss.item(), rel=1e-10, abs=1e-13)
    assert_grads_close(grads_of(model), expected, rtol=1e-10)


# --- several prompts per step, scale_rewards: GenerationBatch == TRL's one batch --------------


def trl_generation(trainer, seed: int = 0):
    """TRL samples the two prompts' groups and scores them (its own advantages)."""
    torch.manual_seed(seed)  # TRL samples with the global generator
    batch = [{"prompt": p} for p in PROMPTS for _ in range(G)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return trainer._generate_and_score_completions(batch)


def as_groups(output, rewards, eos_id):
    """TRL's padded batch as LongStraw's groups: prompt ids, responses, rewards, truncated."""
    groups = []
    for k in range(len(PROMPTS)):
        rows = range(k * G, (k + 1) * G)
        prompt = output["prompt_ids"][k * G]
        responses = [_first_eos(output["completion_ids"][i], eos_id) for i in rows]
        truncated = [int(r[-1]) != eos_id for r in responses]
        groups.append((prompt, responses, [rewards[i] for i in rows], truncated))
    return groups


def _first_eos(ids: torch.Tensor, eos_id: int) -> torch.Tensor:
    """The tokens up to and including the first EOS (TRL's completion mask), else all."""
    hits = (ids == eos_id).nonzero()
    return ids[: int(hits[0]) + 1 if len(hits) else len(ids)].clone()


def longstraw_generation(model, config, groups, *, updates_before=(), reference_model=None):
    """What the recipes do with one generation: each group replayed after its rollout (here
    after its prefill), ``finish``, the waiting groups, then a later update after each of
    ``updates_before`` (a callable that changes the weights, as an optimizer step). Returns
    the batch and each update's (gradients, loss, grpo_step results)."""
    adapter = ls.adapt(model)
    # TRL's reference for a PeftModel handed to it: a frozen copy of its adapters as they are
    # (LongStraw's lora_reference, adapters off, is the same only for freshly zeroed ones).
    ref = ls.adapt(reference_model) if config.beta else None
    batch = ls.GenerationBatch(config, len(groups))

    def replay(k, state=None):
        prompt, responses, rewards, _ = groups[k]
        result = ls.grpo_step(
            adapter, prompt, responses, rewards, config=config, ref_adapter=ref, state=state,
            chunk_size=CHUNK, **batch.replay_kwargs(k, batch.advantages(k)),
        )  # fmt: skip
        batch.record(k, result)
        return result

    results = []
    for prompt, responses, rewards, truncated in groups:
        state = adapter.prefill(prompt, chunk_size=CHUNK, **config.prefill_options())
        if batch.add(prompt, responses, rewards, truncated) is not None:
            results.append(replay(len(batch.groups) - 1, state))
    batch.finish(model.parameters())
    results += [replay(k) for k in batch.waiting()]
    updates = [(grads_of(model), batch.step_loss(), results)]
    for update in updates_before:
        update(model)
        results = [replay(k) for k in range(len(groups))]
        updates.append((grads_of(model), batch.step_loss(), results))
    return batch, updates


def sgd_step(model, grads, lr):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in grads:
                p -= lr * grads[name]


GENERATION_REWARDS = [0.0, 1.0, 0.0, 1.0, 0.0, 3.0, 1.0, 5.0]
GENERATION_CASES = [
    # loss type, scale_rewards, beta, temperature: dapo's token normaliser needs finish's
    # correction; "batch" with beta > 0 makes the replays wait (a second prefill). At 0.7
    # TRL samples and scores the policy and the reference at that temperature.
    ("dapo", "batch", 0.0, 1.0),
    ("dapo", "batch", 0.04, 1.0),
    ("grpo", "group", 0.04, 1.0),
    ("vespo", "batch", 0.0, 1.0),
    ("sapo", "none", 0.0, 1.0),
    ("luspo", "batch", 0.0, 1.0),
    ("dapo", "batch", 0.04, 0.7),
    ("grpo", "group", 0.0, 0.7),
    ("sapo", "none", 0.0, 0.7),
    ("vespo", "batch", 0.0, 0.7),
]


@pytest.mark.threads
@pytest.mark.filterwarnings("ignore:loss_type=")
@pytest.mark.parametrize(("loss_type", "scale", "beta", "temperature"), GENERATION_CASES)
def test_prompts_of_a_step_equal_trl_over_their_concatenated_batch(
    float64_default, tokenizer, tmp_path, loss_type, scale, beta, temperature
):
    eos = tokenizer.eos_token_id
    args = grpo_args(
        loss_type, beta=beta, scale_rewards=scale, max_completion_length=6, temperature=temperature
    )
    trainer = trl_trainer(lora_model(eos), tokenizer, tmp_path, GENERATION_REWARDS, **args)
    output = trl_generation(trainer)
    expected_loss = trainer._compute_loss(trainer.model, output)
    expected_loss.backward()
    expected = grads_of(trainer.model)

    groups = as_groups(output, GENERATION_REWARDS, eos)
    lengths = [len(r) for _, responses, _, _ in groups for r in responses]
    assert len(set(lengths)) > 2, lengths  # the token normaliser differs between the groups
    config = ls.GRPOConfig(**args, num_generations=G, gradient="exact")
    batch, [(grads, loss, _)] = longstraw_generation(
        lora_model(eos), config, groups, reference_model=lora_model(eos)
    )

    # The provisional shares were corrected (token-normalised losses; "batch" std), or the
    # replays waited ("batch" with KL), or the shares were exact from the start.
    corrected = loss_type in TOKEN_NORMALISED or scale == "batch"
    assert batch.defers_replay == (scale == "batch" and beta != 0.0)
    assert (batch.gradient_factor != 1.0) == (corrected and not batch.defers_replay)
    advantages = [a for k in range(len(groups)) for a in batch.advantages(k)]
    torch.testing.assert_close(torch.tensor(advantages), output["advantages"], rtol=1e-12, atol=0)
    assert loss == pytest.approx(expected_loss.item(), rel=HEAD_RTOL)
    # TRL's log-probs and their backward run in float32: float32's bound for its
    # vocabulary-long sums (HEAD_RTOL, of the largest gradient entry; measured <= 3e-7) at
    # 1.0; at 0.7 the sharper distribution's logits are larger (measured <= 1.4e-6), so 5e-6.
    # Scoring at the wrong temperature is off by ~10%.
    assert_grads_close(grads, expected, rtol=HEAD_RTOL if temperature == 1.0 else 5e-6)


@pytest.mark.parametrize("temperature", [0.7, 1.6])
def test_scores_equal_trls_log_probs_and_entropy_at_its_temperature(
    float64_default, tokenizer, tmp_path, temperature
):
    """``adapter.score`` at ``GRPOConfig.temperature`` is TRL's
    ``_get_per_token_logps_and_entropies`` (its fused LM head at ``self.temperature``):
    log-probs and entropy alike, for the completions TRL sampled at that temperature."""
    eos = tokenizer.eos_token_id
    args = grpo_args("dapo", max_completion_length=6, temperature=temperature)
    trainer = trl_trainer(lora_model(eos), tokenizer, tmp_path, GENERATION_REWARDS, **args)
    output = trl_generation(trainer)
    width = output["completion_ids"].shape[1]
    with torch.no_grad():
        logps, entropy, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model,
            torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1),
            torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1),
            width,
            compute_entropy=True,
        )
    adapter = ls.adapt(trainer.model)
    config = ls.GRPOConfig(**args, num_generations=G)
    for k, (prompt, responses, _, _) in enumerate(as_groups(output, GENERATION_REWARDS, eos)):
        state = adapter.prefill(prompt, chunk_size=CHUNK)
        for j, response in enumerate(responses):
            with torch.no_grad():
                ours, our_entropy = adapter.score(
                    state, response, return_entropy=True, temperature=config.temperature
                )
                plain = adapter.score(state, response)
            row, n = k * G + j, len(response)
            # float32's round-off in TRL's kernel: its vocabulary-long sums' bound times the
            # log-probs' size (~1e-5; measured <= 5.9e-7); temperature 1 would be 1e-2 off
            atol = HEAD_RTOL * float(ours.abs().max())
            torch.testing.assert_close(ours, logps[row, :n].to(F64), rtol=0, atol=atol)
            torch.testing.assert_close(our_entropy, entropy[row, :n].to(F64), rtol=0, atol=1e-5)
            assert (plain - ours).abs().max() > 1e-2


# --- num_iterations: TRL's two updates on one generation -------------------------------------


@pytest.mark.threads
@pytest.mark.parametrize(
    ("loss_type", "temperature"), [("dapo", 1.0), ("vespo", 1.0), ("sapo", 1.0), ("dapo", 0.7)]
)
def test_two_iterations_equal_trl_two_updates(
    float64_default, tokenizer, tmp_path, loss_type, temperature
):
    """TRL's two updates on one generation, and LongStraw's: the first on-policy, the second
    with the log-probs from before the first (TRL's ``old_per_token_logps``, LongStraw's
    first replay; both at ``temperature``) after the same SGD step (TRL's first gradient,
    applied to both)."""
    eos, lr = tokenizer.eos_token_id, 0.3
    args = grpo_args(
        loss_type, num_iterations=2, scale_rewards="batch", max_completion_length=6,
        temperature=temperature,
    )  # fmt: skip
    trainer = trl_trainer(lora_model(eos), tokenizer, tmp_path, GENERATION_REWARDS, **args)
    output = trl_generation(trainer)
    assert "old_per_token_logps" in output  # TRL scores the behaviour policy for mu > 1
    trl_updates = []
    for _ in range(2):
        loss = trainer._compute_loss(trainer.model, output)
        loss.backward()
        trl_updates.append((grads_of(trainer.model), loss.item()))
        sgd_step(trainer.model, trl_updates[-1][0], lr)

    config = ls.GRPOConfig(**args, num_generations=G, gradient="exact")
    groups = as_groups(output, GENERATION_REWARDS, eos)
    step = lambda model: sgd_step(model, trl_updates[0][0], lr)  # noqa: E731
    _, updates = longstraw_generation(lora_model(eos), config, groups, updates_before=[step])
    for (grads, loss, _), (expected, expected_loss) in zip(updates, trl_updates, strict=True):
        assert loss == pytest.approx(expected_loss, rel=HEAD_RTOL)
        assert_grads_close(grads, expected, rtol=5e-6)  # as above: measured <= 8.9e-7
    # The second update is off-policy enough to mean something: its loss moved, and the
    # clipped surrogate clipped tokens.
    (_, first, _), (_, second, results) = updates
    assert abs(second - first) > 0.05 * abs(first)
    if loss_type == "dapo":
        assert max(r.branch_stats["clip_ratio/region_mean"] for r in results) > 0.1
