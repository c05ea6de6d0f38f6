"""Checkpoints against faults: a save stopped at any instant, damaged files, a checkpoint of
another kind or model, resuming from an earlier checkpoint, pruning, strict JSON.

Every fault is made on disk, in the state a stopped save or a damaged disk leaves behind. The
``multiprocess`` test runs this file under torchrun as its own 2-rank worker (``__main__``).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import warnings
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from launch import torchrun_ok
from peft import LoraConfig, get_peft_model
from test_checkpoint import _built
from tiny_training import optimizer_and_schedule, tiny_policy, train_step

from longstraw_core.checkpoint import (
    FORMAT_VERSION,
    INCOMPLETE,
    LATEST,
    MANIFEST,
    CheckpointError,
    FormatError,
    complete_checkpoints,
    load_checkpoint,
    prepare_resume,
    resolve_checkpoint,
    save_checkpoint,
)
from longstraw_core.models.tiny import tiny_model

LORA = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])


def _trained(lora: bool = False, seed: int = 0):
    """A tiny model (LoRA or not) after one update, with its optimizer and schedule."""
    model = tiny_policy(seed)
    if lora:
        torch.manual_seed(seed)
        model = get_peft_model(model, LORA)
    optimizer, scheduler = optimizer_and_schedule(model)
    train_step(model, optimizer, scheduler)
    return model, optimizer, scheduler


def _save(root: Path, steps, state, **kwargs) -> list[Path]:
    return [save_checkpoint(root, step, *state, data_position=step, **kwargs) for step in steps]


def _names(paths) -> list[str]:
    return [path.name for path in paths]


def _strict(text: str):
    """``json.loads`` that refuses NaN and infinities, as strict parsers do."""

    def refuse(name: str):
        raise ValueError(f"not strict JSON: {name}")

    return json.loads(text, parse_constant=refuse)


def _manifest(path: Path) -> dict:
    return _strict((path / MANIFEST).read_text())


def _flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


# --------------------------------------------------------------------------- manifest


def test_manifest_lists_every_file_with_its_size_and_sha256(tmp_path: Path) -> None:
    (path,) = _save(tmp_path, [1], _trained())
    manifest = _manifest(path)
    assert manifest["format_version"] == FORMAT_VERSION == 2 and manifest["step"] == 1
    on_disk = {p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file()}
    listed = {entry["path"]: entry for entry in manifest["files"]}
    assert set(listed) == on_disk - {MANIFEST}
    assert {"model/model.safetensors", "optimizer.pt", "trainer_state.json"} <= set(listed)
    for name, entry in listed.items():
        data = (path / name).read_bytes()
        assert entry["size"] == len(data), name
        assert entry["sha256"] == hashlib.sha256(data).hexdigest(), name
    assert _strict((path / "trainer_state.json").read_text())["format_version"] == 2
    assert complete_checkpoints(tmp_path) == [path]


# --------------------------------------------------------------------------- stopped saves


def _stopped_in_tmp(root: Path, state=None) -> None:
    """Stopped while writing ``.tmp-step-000002``: some files, no manifest."""
    tmp = root / ".tmp-step-000002"
    shutil.copytree(root / "step-000001", tmp)
    (tmp / MANIFEST).unlink()
    (tmp / "optimizer.pt").write_bytes((tmp / "optimizer.pt").read_bytes()[:100])


def _stopped_before_latest(root: Path, state) -> None:
    """Stopped after the rename of ``step-000002``, before ``latest`` named it."""
    save_checkpoint(root, 2, *state)
    (root / LATEST).write_text("step-000001")


def _no_manifest(root: Path, state=None) -> None:
    """A ``step-000002`` without its manifest (copied in part, or written by hand)."""
    shutil.copytree(root / "step-000001", root / "step-000002")
    (root / "step-000002" / MANIFEST).unlink()


def _wrong_size(root: Path, state=None) -> None:
    """A ``step-000002`` whose manifest lists a file with another size (truncated file)."""
    shutil.copytree(root / "step-000001", root / "step-000002")
    weights = root / "step-000002" / "model" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-10])


@pytest.mark.parametrize(
    ("stop", "newest"),
    [
        (_stopped_in_tmp, "step-000001"),
        (_stopped_before_latest, "step-000002"),
        (_no_manifest, "step-000001"),
        (_wrong_size, "step-000001"),
    ],
)
def test_a_save_stopped_at_any_stage_resumes_from_the_newest_complete_one(
    tmp_path: Path, stop, newest: str
) -> None:
    state = _trained()
    _save(tmp_path, [1], state)
    stop(tmp_path, state)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # skipped incomplete checkpoints are warned of
        assert resolve_checkpoint("latest", tmp_path) == tmp_path / newest
        assert resolve_checkpoint(tmp_path) == tmp_path / newest
        info = load_checkpoint("latest", tiny_policy(seed=1), output_dir=tmp_path)
    assert info.path.name == newest and info.step == int(newest[-6:])

    step = info.step + 1  # what the resumed run saves next, set aside what is in its way
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        saved = save_checkpoint(tmp_path, step, *state)
    set_aside = [str(w.message) for w in caught if "set aside" in str(w.message)]
    assert len(set_aside) == (newest == "step-000001"), set_aside
    assert saved.name == f"step-{step:06d}" and (tmp_path / LATEST).read_text() == saved.name
    assert resolve_checkpoint("latest", tmp_path) == saved
    assert _names(complete_checkpoints(tmp_path)) == sorted({"step-000001", newest, saved.name})
    if newest == "step-000001":  # the incomplete one was set aside, with its files, not deleted
        (aside,) = (tmp_path / INCOMPLETE).iterdir()
        assert aside.name.startswith(("step-000002-", "tmp-step-000002-"))
        assert (aside / "trainer_state.json").is_file()
    assert not list(tmp_path.glob(".tmp-*"))


def test_an_incomplete_checkpoint_named_explicitly_fails_clearly(tmp_path: Path) -> None:
    _save(tmp_path, [1], _trained())
    _no_manifest(tmp_path)
    with pytest.raises(CheckpointError, match=r"no manifest.json.*train.resume_from=.*step-000001"):
        load_checkpoint(tmp_path / "step-000002", tiny_policy())


def test_a_complete_step_is_never_overwritten_nor_saved_below_a_later_one(tmp_path: Path) -> None:
    state = _trained()
    _save(tmp_path, [1, 3], state)
    with pytest.raises(FileExistsError, match=r"step-000003 already exists.*prepare_resume"):
        save_checkpoint(tmp_path, 3, *state)
    with pytest.raises(FileExistsError, match=r"later than step 2 \(step-000003\).*prepare_resume"):
        save_checkpoint(tmp_path, 2, *state)


# --------------------------------------------------------------------------- damaged files


def test_a_flipped_byte_in_the_weights_is_refused_naming_the_file(tmp_path: Path) -> None:
    _save(tmp_path, [1, 2], _trained())
    weights = tmp_path / "step-000002" / "model" / "model.safetensors"
    _flip_last_byte(weights)
    assert resolve_checkpoint("latest", tmp_path).name == "step-000002"  # sizes still match
    fresh = tiny_policy(seed=1)
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    expected = (
        f"{weights}: sha256 differs from the manifest: the file is corrupt; resume from an "
        f"earlier checkpoint: train.resume_from={tmp_path / 'step-000001'}"
    )
    with pytest.raises(CheckpointError) as caught:
        load_checkpoint(tmp_path, fresh)
    assert str(caught.value) == expected
    for name, value in fresh.state_dict().items():
        assert torch.equal(value, before[name]), name  # nothing was loaded
    load_checkpoint(tmp_path, fresh, verify=False)  # on request: unverified, as before


def test_a_truncated_optimizer_file_is_refused_naming_it(tmp_path: Path) -> None:
    model, optimizer, scheduler = _trained()
    (path,) = _save(tmp_path, [1], (model, optimizer, scheduler))
    state = path / "optimizer.pt"
    size = state.stat().st_size
    state.write_bytes(state.read_bytes()[: size // 2])
    with pytest.raises(CheckpointError) as caught:
        load_checkpoint(path, tiny_policy(), *optimizer_and_schedule(tiny_policy()))
    assert str(caught.value).startswith(
        f"{state}: truncated: {size // 2} bytes, the manifest says {size}; "
    )
    assert "no earlier complete checkpoint" in str(caught.value)


def _as_format_1(path: Path) -> None:
    """What format 1 wrote: no manifest, ``format_version`` 1 (and maybe a bare NaN)."""
    (path / MANIFEST).unlink()
    state = json.loads((path / "trainer_state.json").read_text())
    state["format_version"] = 1
    text = json.dumps({**state, "extra": {"loss": float("nan")}})
    (path / "trainer_state.json").write_text(text)


def test_a_checkpoint_of_another_format_is_refused_in_one_line_wherever_it_is_met(
    tmp_path: Path,
) -> None:
    """Format 1 (no manifest) no longer loads: loading it, resolving ``latest`` to it and saving
    beside it all fail with one line naming its format, this one's and what to do; it is not
    taken for an incomplete checkpoint (never set aside). A newer manifest is refused alike."""
    model, optimizer, scheduler = _trained()
    (path,) = _save(tmp_path, [1], (model, optimizer, scheduler))
    _as_format_1(path)
    expected = (
        f"{path}: checkpoint format 1, but this LongStraw reads format {FORMAT_VERSION} only: "
        "start a new output_dir, or resume with the older LongStraw version that wrote it"
    )
    fresh = tiny_policy(seed=1)
    before = {name: value.clone() for name, value in fresh.state_dict().items()}
    loads = [
        lambda: load_checkpoint(path, fresh, *optimizer_and_schedule(fresh)),
        lambda: load_checkpoint("latest", fresh, output_dir=tmp_path),
        lambda: save_checkpoint(tmp_path, 2, model, optimizer, scheduler),
        lambda: complete_checkpoints(tmp_path),
    ]
    for load in loads:
        with pytest.raises(FormatError) as caught:
            load()
        assert str(caught.value) == expected
    for name, value in fresh.state_dict().items():
        assert torch.equal(value, before[name]), name  # nothing was loaded
    assert _names(sorted(tmp_path.iterdir())) == ["latest", "step-000001"]  # nothing set aside

    newer = tmp_path / "newer"
    (saved,) = _save(newer, [1], (model, optimizer, scheduler))
    (saved / MANIFEST).write_text(json.dumps({**_manifest(saved), "format_version": 3}))
    with pytest.raises(FormatError) as caught:
        load_checkpoint(saved, fresh)
    assert str(caught.value) == (
        f"{saved}: checkpoint format 3, but this LongStraw reads format {FORMAT_VERSION} only: "
        "start a new output_dir, or resume with the LongStraw version that wrote it"
    )


def test_an_unverified_load_names_a_file_torch_cannot_read(tmp_path: Path) -> None:
    model, optimizer, scheduler = _trained()
    (path,) = _save(tmp_path, [1], (model, optimizer, scheduler))
    state = path / "optimizer.pt"  # its size kept: only a checksum would tell
    state.write_bytes(bytes(state.stat().st_size))
    with pytest.raises(CheckpointError, match=f"{state}: cannot be read .*damaged"):
        load_checkpoint(path, tiny_policy(), *optimizer_and_schedule(tiny_policy()), verify=False)


# --------------------------------------------------------------------------- another kind or model


def test_lora_and_full_checkpoints_refuse_the_other_kind_of_run(tmp_path: Path) -> None:
    lora = save_checkpoint(tmp_path / "lora", 1, *_trained(lora=True))
    full = save_checkpoint(tmp_path / "full", 1, *_trained())
    with pytest.raises(CheckpointError) as caught:
        load_checkpoint(lora, tiny_policy())
    assert str(caught.value) == (
        f"{lora} holds LoRA adapters (adapter_config.json) but this run trains full weights: "
        "set lora.enabled=true with the same lora settings, or resume from a full-weights "
        "checkpoint"
    )
    with pytest.raises(CheckpointError) as caught:
        load_checkpoint(full, get_peft_model(tiny_policy(), LORA))
    assert str(caught.value) == (
        f"{full} holds full model weights (model/model.safetensors) but this run trains LoRA "
        "adapters: set lora.enabled=false with the same model, or resume from a LoRA checkpoint"
    )


def test_another_models_weights_are_refused_naming_keys_and_shapes(tmp_path: Path) -> None:
    path = save_checkpoint(tmp_path, 1, *_trained())
    narrow = tiny_model("qwen3", hidden_size=32)
    before = {k: v.clone() for k, v in narrow.state_dict().items()}
    with pytest.raises(CheckpointError) as caught:
        load_checkpoint(path, narrow, *optimizer_and_schedule(narrow))
    message = str(caught.value)
    assert message.startswith(
        f"{path / 'model' / 'model.safetensors'}: the weights do not match the model, they "
        "look like another model's (different shapes: "
    )
    assert "model.embed_tokens.weight is [512, 64] in the checkpoint, [512, 32] in the model" in (
        message
    )
    assert message.endswith("resume with the model settings of the run that saved them")
    for name, value in narrow.state_dict().items():
        assert torch.equal(value, before[name]), name

    lora = save_checkpoint(tmp_path / "lora", 1, *_trained(lora=True))
    other_r = get_peft_model(tiny_policy(), LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    with pytest.raises(CheckpointError, match=r"adapter_model.safetensors: the adapters do not "
                       r"match the model \(different shapes: .*lora_A.weight is \[4, 64\] in "
                       r"the checkpoint, \[2, 64\] in the model"):  # fmt: skip
        load_checkpoint(lora, other_r)


# --------------------------------------------------------------------------- resume, prune


def test_prepare_resume_sets_later_checkpoints_aside_so_they_can_be_saved_again(
    tmp_path: Path,
) -> None:
    model, optimizer, scheduler = _trained()
    _save(tmp_path, [1, 2, 3, 4], (model, optimizer, scheduler))
    fresh = tiny_policy(seed=1)
    fresh_opt, fresh_sched = optimizer_and_schedule(fresh)
    with pytest.warns(UserWarning, match=r"later than the resumed step 2 \(step-000003, step-0000"):
        info = load_checkpoint(tmp_path / "step-000002", fresh, fresh_opt, fresh_sched)

    moved = prepare_resume(tmp_path, info.path)
    (folder,) = tmp_path.glob("superseded-*")
    assert moved == [folder / "step-000003", folder / "step-000004"]
    assert _names(complete_checkpoints(folder)) == ["step-000003", "step-000004"]  # kept whole
    assert resolve_checkpoint("latest", tmp_path) == info.path
    assert (tmp_path / LATEST).read_text() == "step-000002"
    assert prepare_resume(tmp_path, info.path) == []  # nothing later any more

    train_step(fresh, fresh_opt, fresh_sched)
    _save(tmp_path, [3, 4], (fresh, fresh_opt, fresh_sched))
    assert _names(complete_checkpoints(tmp_path)) == [f"step-00000{s}" for s in (1, 2, 3, 4)]
    assert load_checkpoint(folder / "step-000004", tiny_policy()).step == 4  # still resumable


def test_keep_last_keeps_the_newest_complete_checkpoints_and_set_aside_ones(
    tmp_path: Path,
) -> None:
    state = _trained()
    _save(tmp_path, [1, 2, 3], state)
    prepare_resume(tmp_path, tmp_path / "step-000001")
    (folder,) = tmp_path.glob("superseded-*")
    _stopped_in_tmp(tmp_path)  # set aside into incomplete/ by the next save
    with pytest.warns(UserWarning, match="set aside"):
        _save(tmp_path, [2, 3], state, keep_last=0)  # 0: keep everything
    assert _names(complete_checkpoints(tmp_path)) == ["step-000001", "step-000002", "step-000003"]
    _save(tmp_path, [4, 5], state, keep_last=2)
    assert _names(complete_checkpoints(tmp_path)) == ["step-000004", "step-000005"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [INCOMPLETE, LATEST, folder.name, "step-000004", "step-000005"]
    )
    assert _names(complete_checkpoints(folder)) == ["step-000002", "step-000003"]
    assert len(list((tmp_path / INCOMPLETE).iterdir())) == 1
    _save(tmp_path, [6], state, keep_last=1)
    assert _names(complete_checkpoints(tmp_path)) == ["step-000006"]
    with pytest.raises(ValueError, match="keep_last"):
        save_checkpoint(tmp_path, 7, *state, keep_last=-1)


# --------------------------------------------------------------------------- strict JSON


def test_json_files_are_strict_and_non_finite_extra_is_refused(tmp_path: Path) -> None:
    state = _trained()
    extra = {"history": [{"loss": 1.5}, {"loss": float("nan")}]}
    with pytest.raises(ValueError, match=r"extra\.history\[1\]\.loss is nan: .*strict"):
        save_checkpoint(tmp_path / "run", 1, *state, extra=extra)
    with pytest.raises(ValueError, match=r"extra\.best is -inf"):
        save_checkpoint(tmp_path / "run", 1, *state, extra={"best": float("-inf")})
    assert not (tmp_path / "run").exists()

    extra = {"history": [{"loss": 1.5}, {"loss": None}], "run": "abc"}
    path = save_checkpoint(tmp_path / "run", 1, *state, extra=extra)
    for name in ("trainer_state.json", MANIFEST):
        _strict((path / name).read_text())
    assert load_checkpoint(path, tiny_policy()).extra == extra


# --------------------------------------------------------------------------- sharded (FSDP2)


def test_sharded_load_makes_the_same_checks(tmp_path: Path, world_of_one) -> None:
    model, optimizer, scheduler = _built(lora=False, sharded=True)
    train_step(model, optimizer, scheduler)
    path = save_checkpoint(tmp_path, 1, model, optimizer, scheduler)
    assert _manifest(path)["step"] == 1
    lora_model = _built(lora=True, sharded=True)[0]
    with pytest.raises(CheckpointError, match="holds full model weights"):
        load_checkpoint(path, lora_model)
    _flip_last_byte(path / "optimizer.pt")
    other, other_opt, _ = _built(lora=False, sharded=True, seed=7)
    with pytest.raises(CheckpointError, match=r"optimizer.pt: sha256 differs from the manifest"):
        load_checkpoint(path, other, other_opt)


# --------------------------------------------------------------------------- two ranks


@pytest.mark.multiprocess
def test_two_ranks_resolve_set_aside_and_refuse_alike(tmp_path: Path) -> None:
    torchrun_ok(Path(__file__), str(tmp_path))
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert results[0]["latest"] == results[1]["latest"] == "step-000003"
    assert results[0]["moved"] == results[1]["moved"]
    assert [Path(p).name for p in results[0]["moved"]] == ["step-000002", "step-000003"]
    weights = tmp_path / "step-000002" / "model" / "model.safetensors"
    assert results[0]["corrupt"].startswith(f"CheckpointError: {weights}: sha256 differs")
    assert results[1]["corrupt"] == results[0]["corrupt"]  # the same one-line error on both
    assert results[0]["final"] == results[1]["final"] == "step-000003"


def _two_ranks(out: Path) -> None:
    """The worker of the test above: every rank runs it; rank 0 alone damages files."""
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    model, optimizer, scheduler = _built(lora=False, sharded=True)
    train_step(model, optimizer, scheduler)
    for step in (1, 2, 3):
        save_checkpoint(out, step, model, optimizer, scheduler)
    if rank == 0:  # stopped before ``latest`` named step 3
        (out / LATEST).write_text("step-000001")
    dist.barrier()
    result = {"latest": resolve_checkpoint("latest", out).name}
    load_checkpoint(out / "step-000001", model, optimizer, scheduler)
    result["moved"] = [str(p) for p in prepare_resume(out, out / "step-000001")]
    save_checkpoint(out, 2, model, optimizer, scheduler)
    if rank == 0:
        _flip_last_byte(out / "step-000002" / "model" / "model.safetensors")
    dist.barrier()
    try:
        load_checkpoint(out / "step-000002", model, optimizer)
    except Exception as error:  # every rank raises; none is left waiting
        result["corrupt"] = f"{type(error).__name__}: {error}"
    result["final"] = save_checkpoint(out, 3, model, optimizer, scheduler).name
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # as tests/support/distributed_worker.py: skip gloo's racy interpreter teardown


if __name__ == "__main__":
    torch.set_num_threads(1)
    _two_ranks(Path(sys.argv[1]))
