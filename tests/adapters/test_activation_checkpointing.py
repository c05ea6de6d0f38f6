"""Per-decoder-layer activation checkpointing (``adapter.activation_checkpointing``).

- Equivalence: ``grpo_step``'s parameter gradients and loss are bit-identical with and
  without checkpointing, for every adapter, detached and exact, with and without LoRA, with
  the prefix state on the device or offloaded to CPU memory; the recompute ran (and, when
  offloaded, read copies fetched again), and never double-adds into exact mode's ``dS``.
- Memory: ``LiveTensorMemory`` shows the branch graph and the replay peak (and the exact
  sweep's) shrinking on an 8-layer model with a few hundred response tokens.
- Offload: at most ``resident_layers`` layers' state on the device, recompute included.
- FSDP2: a world of one rank in this process; two ranks under torchrun (``multiprocess``):
  this file is also the ranks' script (``__main__``), running ``distributed_worker``'s cases
  with checkpointing on, compared with one unsharded process without it.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import distributed_worker as worker
import pytest
import torch
from launch import torchrun_ok
from peft import LoraConfig, get_peft_model
from reference import assert_grads_close, step_grads, with_lora

import longstraw_core as ls
import longstraw_core.adapters.base as base
from longstraw_core.adapters import registry
from longstraw_core.adapters.matrix import probe_types
from longstraw_core.kinds.attention import AttentionKVExactView
from longstraw_core.kinds.latent import LatentKVExactView
from longstraw_core.kinds.recurrent import RecurrentExactView
from longstraw_core.kinds.window import WindowExactView
from longstraw_core.models.tiny import tiny_model
from longstraw_core.offload import OffloadPolicy
from longstraw_core.state.exact import new_state_grad
from longstraw_core.tensors.memory import LiveTensorMemory

ROOT = Path(__file__).resolve().parents[2]
VOCAB = 512
LENGTHS = [5, 3, 7]
REWARDS = [1.0, -0.5, 0.1]  # none at the mean: every branch replays
MODEL_TYPES = probe_types()
# A few modules per shipped family; another family: its default LoRA targets.
LORA_TARGETS = {
    "qwen3": ["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"],
    "qwen3_5_text": ["q_proj", "v_proj", "in_proj_qkv", "in_proj_z", "out_proj", "down_proj"],
    "glm_moe_dsa": ["q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "down_proj"],
}
# Two ranks under torchrun, checkpointing on (compared with one process without it).
SHARDED_CASES = ["qwen3-lora-exact", "qwen3_5_text-exact", "glm_moe_dsa-exact"]


def _ids(length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(seed))


def _model(model_type: str, lora: bool, dtype: torch.dtype = torch.float64, **overrides):
    model = tiny_model(model_type, dtype=dtype, seed=3, **overrides)
    targets = LORA_TARGETS.get(model_type) or registry.default_lora_targets()[model_type]
    return with_lora(model, targets, seed=1) if lora else model


@contextlib.contextmanager
def counting_replays(monkeypatch):
    """Count backward's recomputes of a layer, and those that read a streamed record."""
    counts = {"replays": 0, "streamed": 0}
    replaying = base.LayerRecord.replaying

    @contextlib.contextmanager
    def counted(self, tensors):
        counts["replays"] += 1
        counts["streamed"] += self.streamed
        with replaying(self, tensors):
            yield

    monkeypatch.setattr(base.LayerRecord, "replaying", counted)
    yield counts


def _grads(model, adapter, checkpointing: bool, gradient: str, offload=None, seed: int = 0):
    adapter.activation_checkpointing = checkpointing
    prompt, responses = _ids(29, seed), [_ids(n, seed + 1 + i) for i, n in enumerate(LENGTHS)]
    state = adapter.prefill(prompt, chunk_size=6, checkpoints="device", offload=offload)
    config = ls.GRPOConfig(gradient=gradient)
    metrics, grads = step_grads(
        model, adapter, prompt, responses, REWARDS, config, state=state, chunk_size=6
    )
    return metrics, grads, state


# --- equivalence ----------------------------------------------------------------------------


@pytest.mark.parametrize("offloaded", [False, True], ids=["device", "offload"])
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("gradient", ["detached", "exact"])
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_checkpointing_changes_no_gradient(monkeypatch, model_type, gradient, lora, offloaded):
    """Bit-identical gradients: the recompute rebuilds the saved tensors of the first run's
    graph, whose nodes (and ``dS`` sinks) are the ones backward runs, once."""
    model = _model(model_type, lora)
    adapter = ls.adapt(model)
    offload = OffloadPolicy.cpu(resident_layers=1) if offloaded else None
    expected_metrics, expected, _ = _grads(model, adapter, False, gradient, offload)
    with counting_replays(monkeypatch) as counts:
        metrics, grads, state = _grads(model, adapter, True, gradient, offload)

    assert metrics.loss == expected_metrics.loss
    assert grads.keys() == expected.keys() and grads
    assert all(("lora_" in name) == lora for name in grads)
    for name, want in expected.items():
        assert torch.equal(grads[name], want), name
    layers = len(adapter.decoder.layers)
    chunks = -(-state.length // 6)
    recomputed = len(LENGTHS) * layers + (chunks * layers if gradient == "exact" else 0)
    assert counts["replays"] == recomputed  # every layer of every pass with autograd, once
    assert counts["streamed"] == (recomputed if offloaded else 0)
    if offloaded:
        assert state.residency.live_layers() == set() == state.residency.held_layers()


@pytest.mark.parametrize("offloaded", [False, True], ids=["device", "offload"])
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_state_gradient_is_added_once(monkeypatch, model_type, offloaded):
    """Exact mode's ``dS`` after a branch's backward, and after the sweep: the recomputed
    forward adds nothing into it (its sinks are in a graph no backward runs), and a
    recomputed chunk's writes are not handed to the sweep again."""
    writes = [0]
    for view in (AttentionKVExactView, LatentKVExactView, RecurrentExactView, WindowExactView):
        name = "update" if view is RecurrentExactView else "write"
        original = getattr(view, name)

        def counted(self, *args, original=original):
            writes[0] += 1
            return original(self, *args)

        monkeypatch.setattr(view, name, counted)
    model = _model(model_type, lora=False)
    adapter = ls.adapt(model)
    offload = OffloadPolicy.cpu() if offloaded else None
    state = adapter.prefill(_ids(29, 0), chunk_size=6, checkpoints="device", offload=offload)
    buffers = []
    for checkpointing in (False, True):
        adapter.activation_checkpointing = checkpointing
        state_grad = new_state_grad(state)
        adapter.score(state, _ids(7, 1), state_grad=state_grad).sum().backward()
        after_branch = [t.clone() for layer in state_grad.layers for t in vars(layer).values()]
        writes[0] = 0
        adapter.backprop_prompt(state, state_grad)
        after_sweep = [t.clone() for layer in state_grad.layers for t in vars(layer).values()]
        buffers.append((after_branch, after_sweep))
        model.zero_grad(set_to_none=True)
        assert writes[0] == len(state.layers) * -(-state.length // 6)  # once per layer, chunk
    (branch, sweep), (ckpt_branch, ckpt_sweep) = buffers
    assert any(t.abs().sum() > 0 for t in branch)
    assert all(torch.equal(a, b) for a, b in zip(branch, ckpt_branch, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(sweep, ckpt_sweep, strict=True))


def test_dropout_masks_are_recomputed_alike(monkeypatch):
    """LoRA dropout in a detached replay: the recompute restores the RNG, so it draws the
    forward's masks again."""
    runs = []
    for checkpointing in (False, True):
        model = tiny_model("qwen3", dtype=torch.float64, seed=3)
        lora = LoraConfig(r=4, lora_dropout=0.3, target_modules=LORA_TARGETS["qwen3"])
        model = get_peft_model(model, lora).train()
        adapter = ls.adapt(model)
        torch.manual_seed(7)
        with counting_replays(monkeypatch) as counts:
            runs.append(_grads(model, adapter, checkpointing, "detached")[1])
        assert counts["replays"] == (len(LENGTHS) * 2 if checkpointing else 0)
    plain, checkpointed = runs
    for name, want in plain.items():
        assert torch.equal(checkpointed[name], want), name


def test_passes_without_autograd_are_not_checkpointed(monkeypatch):
    """Prefill, scoring under ``no_grad`` and rollout run as before: no checkpoint, no
    wrapped records."""
    adapter = ls.adapt(tiny_model("qwen3_5_text", seed=3))
    adapter.activation_checkpointing = True
    made = []
    monkeypatch.setattr(base, "_checkpointed", lambda *args: made.append(args))
    state = adapter.prefill(_ids(20, 0), chunk_size=8)
    with torch.no_grad():
        logps = adapter.score(state, _ids(6, 1))
    ls.rollout(adapter, state, num_generations=2, max_new_tokens=3, seed=0)
    assert made == [] and logps.shape == (6,)
    assert not adapter._checkpointing  # the pass flag is only set during a pass


# --- memory ---------------------------------------------------------------------------------


def _replay_memory(adapter, state, response, state_grad=None) -> tuple[int, int, int]:
    """(graph kept after the forward, replay peak, sweep peak), above what was live before."""
    with LiveTensorMemory() as memory:
        before = memory.current
        with memory.phase("replay"):
            logps = adapter.score(state, response, state_grad=state_grad)
            graph = memory.current - before
            logps.sum().backward()
            del logps
        with memory.phase("sweep"):
            if state_grad is not None:
                adapter.backprop_prompt(state, state_grad)
    adapter.model.zero_grad(set_to_none=True)
    return graph, memory.phases["replay"] - before, memory.phases["sweep"] - before


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_checkpointing_shrinks_the_branch_graph(model_type):
    """8 layers, a 384-token branch: the graph keeps one input per layer instead of every
    activation. GLM's peak is the DSA top-k search's fixed blocks (2^22 elements), and that
    of a model with sliding-window layers (gpt-oss) their attention's score blocks (the
    blocked torch kernel: PyTorch's fused CPU kernels take no window), so only their graph
    is compared."""
    torch.set_num_threads(1)
    overrides = {"num_hidden_layers": 8}
    if model_type == "glm_moe_dsa":
        overrides["indexer_types"] = ["full", "shared"] * 4
    model = tiny_model(model_type, seed=1, **overrides)
    adapter = ls.adapt(model)
    gradient = "detached" if model_type == "glm_moe_dsa" else "exact"
    state = adapter.prefill(_ids(64, 0), chunk_size=64, checkpoints="device")
    response = _ids(384, 1)
    results = []
    for checkpointing in (False, True):
        adapter.activation_checkpointing = checkpointing
        state_grad = new_state_grad(state) if gradient == "exact" else None
        results.append(_replay_memory(adapter, state, response, state_grad))
    (graph, peak, sweep), (ckpt_graph, ckpt_peak, ckpt_sweep) = results
    assert ckpt_graph < 0.25 * graph, results
    sliding = "sliding_attention" in (getattr(model.config, "layer_types", None) or ())
    if model_type != "glm_moe_dsa" and not sliding:
        assert ckpt_peak < 0.35 * peak, results
        assert ckpt_sweep < 0.8 * sweep, results  # one 64-token chunk: K/V and dS slices stay


# --- offload --------------------------------------------------------------------------------


@pytest.mark.parametrize("resident_layers", [1, 2])
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_offloaded_layers_stay_within_budget(model_type, resident_layers):
    """The checkpoint keeps handles to the streamed copies, not copies: between a branch's
    forward and its backward none is alive, and while backward recomputes layer by layer at
    most ``resident_layers`` are on the device."""
    model = tiny_model(model_type, dtype=torch.float64, seed=3)
    adapter = ls.adapt(model)
    adapter.activation_checkpointing = True
    policy = OffloadPolicy.cpu(resident_layers=resident_layers)
    prompt, responses = _ids(61, 3), [_ids(n, 4 + i) for i, n in enumerate(LENGTHS)]
    state = adapter.prefill(prompt, chunk_size=8, checkpoints="cpu", offload=policy)
    residency = state.residency
    most = []
    sample = lambda *_: most.append(len(residency.live_layers() | residency.held_layers()))  # noqa: E731
    handles = [p.register_hook(lambda g: sample() or g) for p in model.parameters()]
    try:
        logps = adapter.score(state, responses[0])
        assert residency.live_layers() == set()  # the graph holds handles only
        copies = residency.copies
        logps.sum().backward()
        assert residency.copies > copies  # fetched again for the recompute
        for gradient in ("detached", "exact"):
            config = ls.GRPOConfig(gradient=gradient)
            step_grads(model, adapter, prompt, responses, REWARDS, config, state=state)
    finally:
        for handle in handles:
            handle.remove()
    assert len(most) > 50 and 1 <= max(most) <= resident_layers
    assert residency.peak_live <= resident_layers and residency.peak_held <= resident_layers
    assert residency.live_layers() == set() == residency.held_layers()


# --- FSDP2 ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "case,offload",
    [
        (worker.Case("qwen3", "exact", lora=True), None),
        (worker.Case("qwen3_5_text", "exact"), OffloadPolicy.cpu()),
        (worker.Case("glm_moe_dsa", "detached"), None),
    ],
    ids=["qwen3-lora-exact", "qwen3_5_text-exact-offload", "glm_moe_dsa-detached"],
)
def test_sharded_checkpointing_changes_no_gradient(world_of_one, monkeypatch, case, offload):
    """Checkpointing inside each layer's FSDP forward method (FSDP gathers, then the
    checkpointed work; backward gathers again before the recompute)."""
    from longstraw_core.parallel.fsdp import shard_model

    group = worker.step_groups(0)[0]
    args = (group.prompt, group.responses, group.rewards)
    kwargs = {"config": worker.grpo_config(case), "chunk_size": worker.CHUNK_SIZE}
    plain_model, plain = worker.build(case)
    expected_metrics, expected = step_grads(plain_model, plain, *args, **kwargs, offload=offload)
    model, adapter = worker.build(case)
    shard_model(adapter)
    adapter.activation_checkpointing = True
    with counting_replays(monkeypatch) as counts:
        metrics, grads = step_grads(model, adapter, *args, **kwargs, offload=offload)
    assert counts["replays"] > 0
    assert metrics.loss == expected_metrics.loss
    assert_grads_close({n: g.full_tensor() for n, g in grads.items()}, expected, rtol=0.0)


@pytest.fixture(scope="module")
def sharded_runs(tmp_path_factory) -> Path:
    """``SHARDED_CASES`` on two ranks with checkpointing on; the directory of their results."""
    out = tmp_path_factory.mktemp("fsdp_checkpointed")
    torchrun_ok(__file__, str(out), *SHARDED_CASES)
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", SHARDED_CASES)
def test_two_ranks_with_checkpointing_train_like_one_process(sharded_runs, name):
    case = worker.CASES[name]
    model, adapter = worker.build(case)  # one process, no checkpointing
    grads, metrics = worker.train(model, adapter, case, worker.step_groups)
    sharded = torch.load(sharded_runs / f"{name}.pt")
    worker.assert_like_one_process(sharded, model, grads, metrics)


def _rank_main(out_dir: str, names: list[str]) -> None:
    """A rank under torchrun: ``distributed_worker``'s cases with checkpointing on; a case
    whose training recomputed no layer fails the run."""
    build, train, replaying = worker.build, worker.train, base.LayerRecord.replaying
    replays = [0]

    def build_checkpointed(case):
        model, adapter = build(case)
        adapter.activation_checkpointing = True
        return model, adapter

    def train_checkpointed(*args):
        replays[0] = 0
        result = train(*args)
        assert replays[0] > 0, "no layer was recomputed"
        return result

    @contextlib.contextmanager
    def counted(self, tensors):
        replays[0] += 1
        with replaying(self, tensors):
            yield

    worker.build, worker.train, base.LayerRecord.replaying = (
        build_checkpointed, train_checkpointed, counted,
    )  # fmt: skip
    worker.main(out_dir, names)


if __name__ == "__main__":
    _rank_main(sys.argv[1], sys.argv[2:])
