"""Loading that scales (``longstraw_core.models.sharded_loading``): each rank reads only what it owns.

- ``multiprocess``: a qwen3 model of ~560 MB (float32, hidden 1024, 8 layers, vocab 32000)
  saved as safetensors in shards; 4 CPU ranks (gloo) load it as S=4 pipeline stages. Each
  rank's resident memory grows by less than half the model's size while loading, and every
  tensor a rank holds is bit-equal to ``from_pretrained``'s, LoRA's initial adapters too
  (the same seed gives the same adapters as the old path); the planner's load phase
  predicts each rank's growth. With FSDP on 2 ranks (S=1) each rank holds exactly its rows
  of ``from_pretrained``'s tensors.
- ``multiprocess``: the same checkpoint as a QLoRA base (``model.quantization=nf4``) on 4
  stages: each rank quantizes only its layers' weights, one at a time as it reads them
  (growth below half the model: the planner's 4-bit share, its embeddings or head, and one
  weight being quantized), and every tensor (packed codes, absmax, nested scales, the rest,
  LoRA's) is bit-equal to quantizing the whole model (``models.build_model``).
- ``multiprocess``: the recipes' step from a saved toy checkpoint, on 2 stages (Qwen3.6 with
  KL to the reference, GLM-5.2 exact) and with FSDP on 2 ranks (Qwen3.6 exact, GLM-5.2
  detached), is bit-equal to its step from the toy.
- In-process: one process's load equals the old path for each family, in float32, in
  bfloat16 (LoRA's adapters rounded as PEFT rounds them) and as NF4; a missing tensor is
  named with the checkpoint (and the file the index puts it in); GLM's per-expert
  checkpoint tensors fill transformers' fused experts; tied embeddings stay tied; the
  plan's load phase, NF4's too.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import loading_worker as worker
import pytest
import torch
from launch import SUPPORT, torchrun_ok
from recipe_runs import GLM, QWEN, SMALL, run_on_ranks, tensors
from transformers import AutoConfig, AutoModelForCausalLM

import longstraw_core as ls
from longstraw_core.adapters import registry
from longstraw_core.adapters.matrix import probe_types
from longstraw_core.adapters.probe import LOADING
from longstraw_core.config import LoraSection, ModelSection, load_config
from longstraw_core.models import build as models
from longstraw_core.models import sharded_loading as loading
from longstraw_core.models.tiny import tiny_model
from longstraw_core.plan import ModelSpec, Workload, compute_plan, render_text
from longstraw_core.tensors import quantization

ROOT = Path(__file__).resolve().parents[2]
WORKER = SUPPORT / "loading_worker.py"
# ~560 MB in float32: 131 MB each for the embeddings and the head, 38 MB per layer.
LARGE = dict(
    hidden_size=1024, intermediate_size=2048, num_hidden_layers=8, num_attention_heads=8,
    num_key_value_heads=4, head_dim=128, vocab_size=32000, tie_word_embeddings=False,
)  # fmt: skip


@pytest.fixture(scope="module")
def large_checkpoint(tmp_path_factory) -> tuple[Path, int]:
    """The saved model's directory and its size in bytes."""
    directory = tmp_path_factory.mktemp("large")
    torch.manual_seed(0)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen3", **LARGE))
    model.to_empty(device="cpu")
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(std=0.02)
    model.model.rotary_emb.__init__(model.config)  # inv_freq, which to_empty left unset
    model.save_pretrained(directory, max_shard_size="200MB")
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    return directory, size


def _reference(directory: Path, lora: bool, **section: str) -> dict[str, torch.Tensor]:
    """What the old path (``models.build_model``, ``add_lora``) gives, seeded as the worker
    (``section``: more ``ModelSection`` fields)."""
    torch.manual_seed(worker.SEED)
    model = models.build_model(ModelSection(path=str(directory), **section), seed=worker.SEED)
    if lora:
        model = models.add_lora(model, LoraSection(enabled=True, r=4))
    return model.state_dict()


@pytest.mark.multiprocess
def test_four_stages_load_only_their_share(large_checkpoint, tmp_path):
    directory, size = large_checkpoint
    start = time.perf_counter()
    torchrun_ok(WORKER, str(tmp_path), str(directory), "4", "stages", ranks=4)
    print(f"4 ranks loaded in {time.perf_counter() - start:.1f} s")
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(4)]
    assert sorted(i for r in results for i in r["layers"]) == list(range(8))
    for rank, result in enumerate(results):
        grew, model = result["growth"] / 2**20, size / 2**20
        print(
            f"rank {rank}: layers {result['layers']}, grew {grew:.0f} MiB ({model:.0f} MiB model)"
        )
        assert result["growth"] < 0.5 * size, (rank, result["growth"], size)
    # The planner's load phase: each stage's own share, what the ranks measured.
    starts = tuple(result["layers"][0] for result in results)
    plan = compute_plan(_large_spec(), _workload(stages=4, gpus=4, stage_starts=starts))
    for rank, (result, stage) in enumerate(zip(results, plan.stage_plans, strict=True)):
        predicted = stage.phases["load"]
        assert abs(result["growth"] - predicted) <= 0.1 * predicted + 16 * 2**20, rank
    for kind in ("plain", "lora"):
        expected = _reference(directory, lora=kind == "lora")
        held = [name for r in results for name in r[kind]]
        assert sorted(held) == sorted(expected), kind  # every tensor on exactly one rank
        for result in results:
            for name, tensor in result[kind].items():
                assert torch.equal(tensor, expected[name]), (kind, name)
        del expected


@pytest.mark.multiprocess
def test_four_stages_quantize_only_their_share(large_checkpoint, tmp_path):
    directory, size = large_checkpoint
    start = time.perf_counter()
    torchrun_ok(WORKER, str(tmp_path), str(directory), "4", "stages", "nf4", ranks=4)
    print(f"4 ranks loaded and quantized in {time.perf_counter() - start:.1f} s")
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(4)]
    assert sorted(i for r in results for i in r["layers"]) == list(range(8))
    starts = tuple(result["layers"][0] for result in results)
    work = _workload(stages=4, gpus=4, stage_starts=starts, quantization="nf4")
    plan = compute_plan(_large_spec(), work)
    for rank, (result, stage) in enumerate(zip(results, plan.stage_plans, strict=True)):
        grew, share = result["growth"], stage.phases["load"]
        largest = max(layer.largest_quantizable for layer in stage.spec.layers)
        quantizing = quantization.nf4_load_bytes(largest, 4)  # one weight being quantized
        print(
            f"rank {rank}: layers {result['layers']}, grew {grew / 2**20:.0f} MiB (share "
            f"{share / 2**20:.0f} MiB, quantizing {quantizing / 2**20:.0f} MiB)"
        )
        assert grew < 0.5 * size, (rank, grew, size)
        # A CPU rank's device is its host: its 4-bit share (and embeddings or head) and one
        # weight being quantized, whose scratch glibc may place at up to twice its size (it
        # keeps chunks under 32 MiB in its heap); not another layer's weights.
        assert share <= grew <= share + 2 * quantizing + 16 * 2**20, (rank, grew, share)
    expected = _reference(directory, lora=True, quantization="nf4")  # LoRA's holds the base
    held = [name for result in results for name in result["lora"]]
    assert sorted(held) == sorted(expected)  # every tensor on exactly one rank
    assert any(name.endswith(".weight.nested_absmax") for name in held)
    for result in results:
        for name, tensor in result["lora"].items():
            assert torch.equal(tensor, expected[name]), name


def _large_spec(**changes: int) -> ModelSpec:
    config = AutoConfig.for_model("qwen3", **{**LARGE, **changes})
    return ModelSpec.from_config(config, "large", torch.float32)


def _workload(**settings: object) -> Workload:
    return Workload(
        prompt_tokens=1024, group=2, response_tokens=16, chunk_size=128, device="cpu", **settings
    )


def test_the_plan_loads_each_rank_s_share_one_tensor_at_a_time():
    spec = _large_spec()
    one, sharded = (compute_plan(spec, _workload(fsdp=f, gpus=g)) for f, g in ((0, 1), (1, 2)))
    assert one.phases["load"] == one.line("parameters").device  # then the step adds to it
    assert sharded.phases["load"] == one.phases["load"] // 2
    assert one.load_host == spec.largest_param * 4  # the embeddings, float32
    assert sharded.load_host == one.load_host // 2
    assert "peak in load" in render_text(one) and one.peak_phase != "load"


def test_the_plan_s_nf4_load_holds_the_4bit_share_and_one_weight_being_quantized():
    spec = _large_spec(vocab_size=1000)  # the 2048 x 1024 MLP weights are the largest
    for dtype, dtype_bytes in ((torch.float32, 4), (torch.bfloat16, 2)):
        work = _workload(quantization="nf4", param_dtype=dtype, compute_dtype=dtype)
        plain, nf4 = compute_plan(spec, _workload()), compute_plan(spec, work)
        assert nf4.phases["load"] == nf4.line("parameters").device < plain.phases["load"] / 3
        assert nf4.load_host == quantization.nf4_load_bytes(2048 * 1024, dtype_bytes)
        assert nf4.load_host > spec.largest_param * dtype_bytes  # more than a tensor's read
    # float32: the weight as read, bitsandbytes' scratch; bfloat16: and its float32 copy
    assert quantization.nf4_load_bytes(10, 4) == 145 and quantization.nf4_load_bytes(10, 2) == 165


def _shard(tensor: torch.Tensor, rank: int, ranks: int) -> torch.Tensor:
    """Rank ``rank``'s FSDP2 shard of ``tensor``: its rows, ``ceil(rows / ranks)`` each."""
    rows = -(-len(tensor) // ranks)
    return tensor[rank * rows : (rank + 1) * rows]


@pytest.mark.multiprocess
def test_fsdp_ranks_load_only_their_shards(large_checkpoint, tmp_path):
    directory, size = large_checkpoint
    torchrun_ok(WORKER, str(tmp_path), str(directory), "1", "fsdp", ranks=2)
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for rank, result in enumerate(results):
        print(
            f"rank {rank}: grew {result['growth'] / 2**20:.0f} MiB ({size / 2**20:.0f} MiB model)"
        )
        assert result["growth"] < 0.6 * size, (rank, result["growth"], size)  # half, and a bit
    for kind in ("plain", "lora"):
        expected = _reference(directory, lora=kind == "lora")
        for rank, result in enumerate(results):
            assert sorted(result[kind]) == sorted(expected), kind
            for name, tensor in result[kind].items():
                assert torch.equal(tensor, _shard(expected[name], rank, 2)), (kind, name)
        del expected


RECIPE_CASES = {  # name: (recipe, config, overrides); the tiny toy vs its saved checkpoint
    "qwen36-stages-full-kl": (
        "grpo_qwen36.py", QWEN, ["distributed.pipeline_stages=2", "grpo.beta=0.04"],
    ),
    "qwen36-fsdp-full-exact": (
        "grpo_qwen36.py", QWEN, ["distributed.fsdp=true", "grpo.gradient=exact"],
    ),
    "glm52-stages-full-exact": (
        "grpo_glm52.py", GLM, ["distributed.pipeline_stages=2", "grpo.gradient=exact"],
    ),
    "glm52-fsdp-full-detached": (  # each rank's rows of the fused experts: its experts
        "grpo_glm52.py", GLM, ["distributed.fsdp=true", "grpo.gradient=detached"],
    ),
}  # fmt: skip
# LoRA's adapters differ here (a toy's init draws from the RNG first); equal to the old
# path's from the same checkpoint: test_four_stages_load_only_their_share, test_fsdp_...


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", list(RECIPE_CASES))
def test_recipe_from_a_checkpoint_trains_like_the_toy_it_was_saved_from(case, tmp_path):
    """The recipe's step from the toy's saved weights (loaded by ``loading``) is bit-equal
    to its step from the toy itself (built whole on every rank): the same base weights on
    each rank's stage or shard, the same reference policy."""
    recipe, config_path, overrides = RECIPE_CASES[case]
    settings = [*SMALL, "train.steps=1", "train.save_every=1", *overrides]
    toy = load_config(ROOT / config_path, settings)
    models.build_model(toy.model, seed=toy.train.seed).save_pretrained(tmp_path / "weights")
    # The toy was trained on byte ids; its saved directory holds no tokenizer of its own.
    from_path = ["model.tiny=null", "model.tiny_overrides={}", f"model.path={tmp_path / 'weights'}",
                 "tokenizer.path=builtin:bytes"]  # fmt: skip
    for name, extra in (("toy", []), ("loaded", from_path)):
        run_on_ranks(recipe, config_path, tmp_path / name, *settings, *extra, ranks=2)
    got, expected = (tensors(tmp_path / n / "step-000001/model") for n in ("loaded", "toy"))
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name


def _load(directory: Path, lora: bool = False, **section: str) -> torch.nn.Module:
    with loading.keep_lora_init() as lora_init:
        model = loading.build_on_meta(ModelSection(path=str(directory), **section))
        if lora:
            model = models.add_lora(model, LoraSection(enabled=True, r=4))
    loading.materialize(ls.adapt(model), directory, torch.device("cpu"), lora_init)
    return model


SECTIONS = {  # the model's settings besides its path
    "float32": {},
    "bfloat16": {"dtype": "bfloat16"},  # PEFT rounds the adapters to bfloat16 and back
    "nf4-bfloat16": {"dtype": "bfloat16", "quantization": "nf4"},
}


@pytest.mark.parametrize("section", list(SECTIONS))
@pytest.mark.parametrize("model_type", probe_types(LOADING))
def test_one_process_load_equals_the_old_path(model_type, section, tmp_path):
    tiny_model(model_type).save_pretrained(tmp_path)
    torch.manual_seed(worker.SEED)
    got = _load(tmp_path, lora=True, **SECTIONS[section])
    after = torch.rand(4)  # the global RNG is left where the old path leaves it
    expected = _reference(tmp_path, lora=True, **SECTIONS[section])
    assert torch.equal(after, torch.rand(4))
    state = got.state_dict()
    assert sorted(state) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(state[name], tensor), name
    quantized = any(name.endswith(".weight.nested_absmax") for name in state)
    assert quantized == ("quantization" in SECTIONS[section])  # packed codes and their state
    buffers = dict(got.get_base_model().named_buffers())  # inv_freq (not saved) included
    old = models.build_model(ModelSection(path=str(tmp_path), **SECTIONS[section]), 0)
    for name, buffer in old.named_buffers():
        assert torch.equal(buffers[name], buffer), name


def _multimodal_qwen35(directory: Path) -> None:
    """A Qwen3.5/3.6-style checkpoint as published: the multimodal model, its text decoder
    under ``model.language_model.``, a vision tower beside it."""
    from transformers.models.qwen3_5 import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    text = {k: v for k, v in registry.tiny_configs()["qwen3_5_text"].items() if k != "model_type"}
    vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2}
    config = Qwen3_5Config(
        text_config=text, vision_config=vision | {"out_hidden_size": text["hidden_size"]}
    )
    torch.manual_seed(1)
    Qwen3_5ForConditionalGeneration(config).save_pretrained(directory)


@pytest.mark.parametrize("lora", [False, True])
def test_a_multimodal_qwen35_checkpoint_loads_its_text_decoder(lora, tmp_path):
    """The names transformers renames on load (``model.language_model.X`` -> ``model.X``)
    are renamed here too: the text model equals ``from_pretrained``'s."""
    _multimodal_qwen35(tmp_path)
    stored = list(loading.SafetensorsCheckpoint(tmp_path).entries)  # the names as stored
    assert any(name.startswith("model.language_model.layers.") for name in stored)
    assert any(name.startswith("model.visual.") for name in stored)
    torch.manual_seed(worker.SEED)
    got = _load(tmp_path, lora=lora).state_dict()
    expected = _reference(tmp_path, lora=lora)
    assert sorted(got) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name


def test_tied_embeddings_stay_tied(tmp_path):
    tiny_model("qwen3", tie_word_embeddings=True).save_pretrained(tmp_path)
    model = _load(tmp_path)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_a_missing_tensor_is_named_with_the_checkpoint(tmp_path):
    from safetensors.torch import load_file, save_file

    tiny_model("qwen3").save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(loading.CheckpointTensorError) as error:
        _load(tmp_path)
    message = str(error.value)
    assert "model.layers.1.mlp.up_proj.weight" in message and "model.safetensors" in message
    assert str(tmp_path) in message


def test_a_tensor_the_index_places_in_a_file_that_lacks_it_names_both(tmp_path):
    from safetensors.torch import load_file, save_file

    tiny_model("qwen3").save_pretrained(tmp_path, max_shard_size="20KB")
    index = json.loads((tmp_path / loading.INDEX).read_text())["weight_map"]
    name = "model.layers.0.self_attn.o_proj.weight"
    tensors = load_file(tmp_path / index[name])
    del tensors[name]
    save_file(tensors, tmp_path / index[name], metadata={"format": "pt"})
    with pytest.raises(loading.CheckpointTensorError) as error:
        _load(tmp_path)
    assert name in str(error.value) and f"puts it in {index[name]}" in str(error.value)
