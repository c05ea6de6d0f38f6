"""CPU offload of the prefix state: offloaded runs equal device-resident ones, and never hold
more than ``resident_layers`` layers' state on the device.

On a machine without CUDA both sides are CPU memory; the streamed "device" copies are still
real copies, counted by ``state.residency``: ``held`` is the stream's own bookkeeping,
``live`` is observed from finalizers on the copies' storages (whoever keeps them alive).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import longstraw_core as ls
from longstraw_core.adapters import registry
from longstraw_core.adapters.base import Span
from longstraw_core.adapters.matrix import probe_types
from longstraw_core.adapters.probe import OFFLOAD
from longstraw_core.kinds import registry as kinds
from longstraw_core.kinds.attention import AttentionKV
from longstraw_core.kinds.recurrent import RecurrentState
from longstraw_core.models.tiny import tiny_model
from longstraw_core.offload import OffloadPolicy
from longstraw_core.offload.policy import placement_fields

VOCAB = 512
LENGTHS = [5, 3, 7]
REWARDS = [1.0, -0.5, 0.25]
MODEL_TYPES = probe_types(OFFLOAD)


def _policies(model_type: str) -> list[OffloadPolicy]:
    """Every placement in CPU memory, half the tiny model's layers resident; with more than
    one layer kind, each kind alone in CPU memory, one layer resident. glm_moe_dsa: its
    index_topk (16) is below the prompt length, so later chunks and the branches take the
    sparse DSA path and the first chunks the dense one."""
    layers = registry.tiny_configs()[model_type]["num_hidden_layers"]
    policies = [OffloadPolicy.cpu(resident_layers=max(1, layers // 2))]
    placed = set(kinds.offload_fields()[k] for k in registry.family_of(model_type).layer_kinds)
    if len(placed) > 1:
        alone = [name for name in placement_fields() if name in placed]
        policies += [OffloadPolicy(**{name: "cpu"}, resident_layers=1) for name in alone]
    return policies


CASES = [(model_type, policy) for model_type in MODEL_TYPES for policy in _policies(model_type)]

_MODELS: dict[tuple, torch.nn.Module] = {}


def _model(model_type: str, dtype: torch.dtype = torch.float64) -> torch.nn.Module:
    key = (model_type, dtype)
    if key not in _MODELS:
        _MODELS[key] = tiny_model(model_type, dtype=dtype, seed=3)
    return _MODELS[key]


def _ids(length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(seed))


def _group(prompt_length: int = 29, seed: int = 0) -> tuple[torch.Tensor, list[torch.Tensor]]:
    return _ids(prompt_length, seed), [_ids(n, seed + 1 + i) for i, n in enumerate(LENGTHS)]


def _step(adapter, state, prompt, responses, gradient: str) -> tuple[ls.GRPOStepResult, dict]:
    """``grpo_step`` from ``state``: its metrics and the gradients it left (then cleared)."""
    model = adapter.model
    model.zero_grad(set_to_none=True)
    config = ls.GRPOConfig(gradient=gradient)
    metrics = ls.grpo_step(adapter, prompt, responses, REWARDS, config=config, state=state)
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return metrics, grads


def _case_id(case: tuple) -> str:
    model_type, policy = case
    placed = policy.offloaded_fields()
    return f"{model_type}-{'+'.join(placed)}-r{policy.resident_layers}"


# --- equivalence ----------------------------------------------------------------------------


@pytest.mark.parametrize("gradient", ["detached", "exact"])
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_offloaded_runs_equal_device_resident_runs(case, gradient: str) -> None:
    """Bit-identical log-probs and parameter gradients: the same computation on copies."""
    model_type, policy = case
    adapter = ls.adapt(_model(model_type))
    prompt, responses = _group()
    results = []
    for offload in (None, policy):
        state = adapter.prefill(prompt, chunk_size=6, checkpoints="device", offload=offload)
        with torch.no_grad():
            logps = [adapter.score(state, response) for response in responses]
        metrics, grads = _step(adapter, state, prompt, responses, gradient)
        results.append((state, logps, metrics, grads))
    (plain, logps, metrics, grads), (offloaded, off_logps, off_metrics, off_grads) = results

    assert plain.residency.copies == 0  # nothing offloaded: nothing streamed
    assert offloaded.residency.copies > 0
    for want, got in zip(logps, off_logps, strict=True):
        assert torch.equal(want, got)
    assert off_metrics.loss == metrics.loss
    assert grads.keys() == off_grads.keys() and grads
    for name, want in grads.items():
        assert torch.equal(want, off_grads[name]), name
    if gradient == "exact":  # the sweep ran and dS was kept like the state
        assert off_metrics.sweep_seconds > 0
        assert off_metrics.state_grad_bytes == metrics.state_grad_bytes > 0


def _recording_prefills(adapter, states: list) -> None:
    """Make ``adapter.prefill`` also append each state it returns to ``states``."""
    prefill = adapter.prefill

    def recorded(*args, **kwargs):
        states.append(prefill(*args, **kwargs))
        return states[-1]

    adapter.prefill = recorded


def test_grpo_step_prefills_the_policy_and_the_reference_with_the_policy() -> None:
    """``grpo_step(offload=...)`` without a state: its own prefills (the reference's too)."""
    adapter = ls.adapt(_model("qwen3"))
    ref_adapter = ls.adapt(tiny_model("qwen3", dtype=torch.float64, seed=4))
    states: list[ls.PrefixState] = []
    _recording_prefills(adapter, states)
    _recording_prefills(ref_adapter, states)
    prompt, responses = _group()
    config = ls.GRPOConfig(gradient="exact", beta=0.04)
    results = []
    for offload in (None, {"attention": "cpu", "resident_layers": 1}):
        adapter.model.zero_grad(set_to_none=True)
        metrics = ls.grpo_step(
            adapter, prompt, responses, REWARDS, config=config, ref_adapter=ref_adapter,
            chunk_size=6, offload=offload,
        )  # fmt: skip
        grads = {name: p.grad.clone() for name, p in adapter.model.named_parameters()}
        results.append((metrics, grads))
    (metrics, grads), (off_metrics, off_grads) = results
    assert [state.offload is not None for state in states] == [False, False, True, True]
    assert all(state.residency.copies > 0 for state in states[2:])
    assert off_metrics.loss == metrics.loss
    assert off_metrics.branch_stats["kl"] == metrics.branch_stats["kl"]
    for name, want in grads.items():
        assert torch.equal(want, off_grads[name]), name
    adapter.model.zero_grad(set_to_none=True)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_rollout_reads_an_offloaded_state(model_type: str) -> None:
    adapter = ls.adapt(_model(model_type, torch.float32))
    prompt = _ids(40, 5)
    outputs = []
    for offload in (None, OffloadPolicy.cpu(resident_layers=1)):
        state = adapter.prefill(prompt, chunk_size=16, offload=offload)
        outputs.append(ls.rollout(adapter, state, num_generations=3, max_new_tokens=5, seed=1))
    plain, offloaded = outputs
    for want, got in zip(plain.responses, offloaded.responses, strict=True):
        assert torch.equal(want, got)
    for want, got in zip(plain.logps, offloaded.logps, strict=True):
        assert torch.equal(want, got)
    assert state.residency.peak_live == state.residency.peak_held == 1


# --- residency ------------------------------------------------------------------------------


class ResidencyProbe:
    """Samples how many layers' streamed state is on the device, from inside the passes:
    before every module's forward and as every parameter's gradient is computed."""

    def __init__(self, model: torch.nn.Module, state: ls.PrefixState) -> None:
        self.model, self.state = model, state
        self.samples = 0
        self.most_live = self.most_held = 0

    def sample(self, *_: object) -> None:
        residency = self.state.residency
        self.samples += 1
        self.most_live = max(self.most_live, len(residency.live_layers()))
        self.most_held = max(self.most_held, len(residency.held_layers()))

    @contextlib.contextmanager
    def watching(self):
        handles = [m.register_forward_pre_hook(self.sample) for m in self.model.modules()]
        handles += [
            p.register_hook(lambda grad: self.sample() or grad)
            for p in self.model.parameters()
            if p.requires_grad
        ]
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()


@pytest.mark.parametrize("resident_layers", [1, 2])
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_at_most_resident_layers_on_the_device(model_type: str, resident_layers: int) -> None:
    """Prefill, detached and exact replay, the sweep and rollout: whatever the prompt length,
    at most ``resident_layers`` layers' state is on the device at any sampled moment."""
    model = _model(model_type)
    adapter = ls.adapt(model)
    policy = OffloadPolicy.cpu(resident_layers=resident_layers)
    peaks = []
    for prompt_length in (9, 61):
        prompt, responses = _group(prompt_length, seed=prompt_length)
        state = adapter.prefill(prompt, chunk_size=8, checkpoints="cpu", offload=policy)
        probe = ResidencyProbe(model, state)
        with probe.watching():
            _step(adapter, state, prompt, responses, "detached")
            _step(adapter, state, prompt, responses, "exact")
            ls.rollout(adapter, state, num_generations=2, max_new_tokens=3)
        residency = state.residency
        assert probe.samples > 100
        assert 1 <= probe.most_live <= resident_layers
        assert 1 <= probe.most_held <= resident_layers
        assert residency.peak_live <= resident_layers and residency.peak_held <= resident_layers
        assert residency.live_layers() == set() == residency.held_layers()  # all released
        peaks.append((residency.peak_live, residency.peak_held))
    # The next layer is copied while the current one computes whenever the budget allows.
    assert peaks == [(resident_layers, resident_layers)] * 2


def test_the_graph_keeps_handles_not_copies() -> None:
    """Between a branch's forward and its backward no streamed copy stays alive: the graph
    saved handles, and backward fetches each layer again."""
    model = _model("qwen3_5_text")
    adapter = ls.adapt(model)
    prompt, responses = _group()
    state = adapter.prefill(prompt, chunk_size=6, offload=OffloadPolicy.cpu(resident_layers=2))
    logps = adapter.score(state, responses[0])
    assert state.residency.live_layers() == set()
    copies = state.residency.copies
    logps.sum().backward()
    assert state.residency.copies > copies  # fetched again for backward
    assert state.residency.live_layers() == set() == state.residency.held_layers()
    model.zero_grad(set_to_none=True)


# --- placement and reporting ----------------------------------------------------------------


def test_placement_summary_and_moves() -> None:
    adapter = ls.adapt(_model("qwen3_5_text", torch.float32))
    policy = OffloadPolicy(attention="cpu")
    state = adapter.prefill(_ids(30, 8), chunk_size=8, offload={"attention": "cpu"})
    assert state.offload == policy
    summary = state.summary()
    full, linear = summary["full_attention"], summary["linear_attention"]
    assert full["cpu_bytes"] == full["bytes"] > 0 and full["device_bytes"] == 0
    assert linear["device_bytes"] == linear["bytes"] > 0 and linear["cpu_bytes"] == 0
    moved = state.to("cpu")
    assert moved.offload == policy and moved.summary() == summary
    for record in state.layers:
        assert state.offloaded(record) == isinstance(record, AttentionKV)
    plain = adapter.prefill(_ids(30, 8), chunk_size=8)
    assert plain.offload is None
    assert all(row["cpu_bytes"] == 0 for row in plain.summary().values())
    with adapter.layer_records(plain, Span(start=0, length=3, write=False)) as records:
        assert records is plain.layers  # nothing offloaded: the records themselves


def test_offloaded_recurrent_layers_keep_checkpoints_in_cpu_memory() -> None:
    adapter = ls.adapt(_model("qwen3_5_text", torch.float32))
    state = adapter.prefill(
        _ids(30, 9), chunk_size=8, checkpoints="device", offload={"recurrent": "cpu"}
    )
    recurrent = [record for record in state.layers if isinstance(record, RecurrentState)]
    assert recurrent and all(record.checkpoint_device.type == "cpu" for record in recurrent)
    assert all(len(record.checkpoints) == 4 for record in recurrent)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_cuda_streams_equal_the_device_resident_run(model_type: str) -> None:
    """On CUDA: pinned homes, side-stream copies; results as without offload."""
    model = tiny_model(model_type, dtype=torch.float32, seed=3).cuda()
    adapter = ls.adapt(model)
    prompt, responses = _group(200)
    results = []
    for offload in (None, OffloadPolicy.cpu(resident_layers=2)):
        state = adapter.prefill(prompt, chunk_size=32, checkpoints="device", offload=offload)
        if offload is not None:
            for record in state.layers:
                tensor = next(t for t in vars(record).values() if isinstance(t, torch.Tensor))
                assert tensor.device.type == "cpu" and tensor.is_pinned()
        results.append(_step(adapter, state, prompt, responses, "exact"))
        assert state.residency.peak_live <= 2
    (metrics, grads), (off_metrics, off_grads) = results
    assert off_metrics.loss == pytest.approx(metrics.loss, rel=1e-5)
    for name, want in grads.items():
        torch.testing.assert_close(off_grads[name], want, rtol=1e-4, atol=1e-6)


# --- bad input ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"resident_layers": 0}, "resident_layers=0"),
        ({"resident_layers": -2}, "resident_layers=-2"),
        ({"resident_layers": True}, "resident_layers=True"),
        ({"resident_layers": 1.5}, "resident_layers=1.5"),
        ({"attention": "gpu"}, "attention='gpu'"),
        ({"latent": None}, "latent=None"),
        ({"pin_memory": "yes"}, "pin_memory"),
        ({"attn": "cpu"}, "unknown keys \\['attn'\\]"),
        ("disk", "offload='disk'"),
        (3, "offload must be"),
    ],
)
def test_bad_policies_are_refused(value, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        OffloadPolicy.parse(value)
    adapter = ls.adapt(_model("qwen3", torch.float32))
    with pytest.raises(ValueError, match=message):
        adapter.prefill(_ids(10, 1), offload=value)


def test_unknown_layer_types_are_refused() -> None:
    policy = OffloadPolicy.cpu()
    assert policy.placement("attention") == policy.placement("full_attention") == "cpu"
    assert policy.placement("sliding_attention") == "cpu"  # a window's K/V: ``attention``
    with pytest.raises(ValueError, match="unknown layer type 'paged_attention'"):
        policy.placement("paged_attention")
    with pytest.raises(ValueError, match="resident_layers=0"):
        OffloadPolicy(resident_layers=0)
