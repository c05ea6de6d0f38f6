"""Export a checkpoint as a plain transformers model directory, for serving.

    python -m longstraw_core.models.export outputs/run/step-000100 exported/
    python -m longstraw_core.models.export outputs/run exported/ --force     # the run's newest checkpoint

Why: a checkpoint holds what a resume needs (full weights or only LoRA adapters, optimizer,
RNG states) and rebuilds the rest from the run config it recorded; a server (vLLM, TGI,
``AutoModelForCausalLM.from_pretrained``) wants one self-contained model. The export

- verifies the checkpoint first (manifest, sizes, every file's sha256): an incomplete or
  damaged checkpoint is refused with the file and the fix before anything is built;
- rebuilds the policy as the run built it (``models.build_model`` from the run config in
  ``trainer_state.json``'s ``extra.config``, ``add_lora``) and loads the checkpoint into it with
  ``checkpoint.load_checkpoint`` (kind, names and shapes checked);
- merges LoRA adapters into their base weights (peft's ``merge_and_unload``); a QLoRA base
  (``model.quantization=nf4``) is dequantized first (``quantization.dequantize_``), to the
  float values its 4-bit layers computed with, in ``model.dtype``;
- writes ``save_pretrained``'s files and the run's tokenizer (the built-in byte tokenizer
  too) into a new directory beside the target, then moves it into place. A non-empty target
  is replaced only with ``--force``; a target inside the checkpoint, or holding it, never.

The weights keep ``model.dtype`` (a ``distributed.mixed_precision=bf16`` run exports its
float32 master weights). The model is held whole in host memory; a full fine-tune from
``model.path`` is built from the checkpoint's own files, then loaded again through the
checkpoint checks (about twice the model at the peak).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedModel

from longstraw_core import checkpoint
from longstraw_core.checkpoint.files import (
    TRAINER_STATE,
    check_sizes,
    read_manifest,
    verify_checksums,
)
from longstraw_core.config import ConfigError, RunConfig, config_from_dict
from longstraw_core.data.tokenizer import is_builtin, load_tokenizer
from longstraw_core.models import build as models
from longstraw_core.tensors.peft_types import is_peft_model
from longstraw_core.tensors.quantization import dequantize_


class ExportError(ValueError):
    """Why a checkpoint cannot be exported, and the fix."""


@dataclass(frozen=True)
class Exported:
    """What ``export`` wrote."""

    directory: Path
    checkpoint: Path
    step: int
    merged_lora: bool
    dequantized: bool


def export(
    source: str | os.PathLike,
    target: str | os.PathLike,
    *,
    force: bool = False,
    model_path: str | None = None,
    tokenizer_path: str | None = None,
) -> Exported:
    """Write the policy of checkpoint ``source`` (or the newest complete checkpoint of an
    output directory) to ``target`` as a transformers model directory with its tokenizer.

    ``model_path`` / ``tokenizer_path``: where the run's ``model.path`` / ``tokenizer.path``
    are now, if they moved (a LoRA checkpoint holds no base weights). Raises ``ExportError``
    (or ``CheckpointError``) naming the problem before anything is written.
    """
    resolved = _resolve(source)
    target = Path(target)
    _check_target(target, resolved, force)
    _verify(resolved)
    cfg = _run_config(resolved, model_path, tokenizer_path)
    tokenizer = load_tokenizer(cfg.tokenizer.path, model_path=cfg.model.path)
    model, step = _trained_policy(cfg, resolved)
    dequantized = cfg.model.quantization is not None
    staging = target.parent / f".{target.name}.export-tmp"
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    if target.exists():  # non-empty only with force (checked above)
        shutil.rmtree(target)
    os.replace(staging, target)
    return Exported(target, resolved, step, cfg.lora.enabled, dequantized)


def _resolve(source: str | os.PathLike) -> Path:
    try:
        resolved = checkpoint.resolve_checkpoint(source)
    except FileNotFoundError as error:
        raise ExportError(str(error)) from None
    if resolved is None:  # only for "latest", which needs an output dir: name the directory
        raise ExportError(f"{source}: name a checkpoint directory or a run's output directory")
    return resolved


def _check_target(target: Path, resolved: Path, force: bool) -> None:
    if target.exists() and not target.is_dir():
        raise ExportError(f"{target} is a file; name a directory to export into")
    here, there = target.resolve(), resolved.resolve()
    if here == there or here.is_relative_to(there) or there.is_relative_to(here):
        raise ExportError(
            f"{target} overlaps the checkpoint {resolved}; export into another directory"
        )
    if target.is_dir() and any(target.iterdir()) and not force:
        raise ExportError(
            f"{target} is not empty; pass --force to replace its contents, or name a new directory"
        )


def _verify(resolved: Path) -> None:
    """Every file the manifest lists: there, of its size, and with its sha256."""
    entries = read_manifest(resolved)
    check_sizes(resolved, entries)
    verify_checksums(resolved, entries)


def _run_config(resolved: Path, model_path: str | None, tokenizer_path: str | None) -> RunConfig:
    """The run config the checkpoint recorded, with moved paths replaced and checked."""
    try:
        state = json.loads((resolved / TRAINER_STATE).read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise ExportError(f"{resolved / TRAINER_STATE}: unreadable ({error})") from None
    saved = state.get("extra", {}).get("config") if isinstance(state, dict) else None
    if not isinstance(saved, dict):
        raise ExportError(
            f"{resolved / TRAINER_STATE} records no run config (extra.config, which the "
            "recipes' save_checkpoint writes): the export cannot know which model to rebuild"
        )
    try:
        # Its reward functions are not needed (nor imported): the export scores nothing.
        cfg = config_from_dict(
            saved, f"{resolved / TRAINER_STATE}", check_paths=False, check_rewards=False
        )
    except ConfigError as error:
        raise ExportError(f"the checkpoint's run config: {error}") from None
    model, tokenizer = cfg.model, cfg.tokenizer
    if model_path is not None:
        model = dataclasses.replace(model, path=model_path)
    if tokenizer_path is not None:
        tokenizer = dataclasses.replace(tokenizer, path=tokenizer_path)
    for key, value, flag in [
        ("model.path", model.path, "--model-path"),
        ("tokenizer.path", tokenizer.path, "--tokenizer-path"),
    ]:
        if value is not None and not is_builtin(value) and not Path(value).is_dir():
            raise ExportError(
                f"the run's {key} {value!r} is not a directory here; pass {flag} with where "
                "it is now"
            )
    return dataclasses.replace(cfg, model=model, tokenizer=tokenizer)


def _trained_policy(cfg: RunConfig, resolved: Path) -> tuple[PreTrainedModel, int]:
    """The policy as the checkpoint holds it, as one plain transformers model."""
    section = cfg.model
    if not cfg.lora.enabled and section.path is not None:
        # Full weights: build from the checkpoint's own files, not the original base's.
        section = dataclasses.replace(section, path=str(resolved / "model"))
    base = models.build_model(section, seed=cfg.train.seed)
    if section.quantization is not None:
        dequantize_(base, dtype=getattr(torch, section.dtype))
    model = models.add_lora(base, cfg.lora)
    info = checkpoint.load_checkpoint(resolved, model, restore_rng=False, verify=False)
    if is_peft_model(model):
        model = model.merge_and_unload()
    return model.eval(), info.step


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m longstraw_core.models.export", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("checkpoint", help="a step-NNNNNN directory, or a run's output_dir")
    parser.add_argument("target", help="the directory to write the model into")
    parser.add_argument("--force", action="store_true", help="replace a non-empty target")
    parser.add_argument("--model-path", help="where the run's model.path is now (LoRA base)")
    parser.add_argument("--tokenizer-path", help="where the run's tokenizer.path is now")
    args = parser.parse_args(argv)
    try:
        done = export(
            args.checkpoint,
            args.target,
            force=args.force,
            model_path=args.model_path,
            tokenizer_path=args.tokenizer_path,
        )
    except (ExportError, checkpoint.CheckpointError) as error:
        sys.exit(f"export: {error}")
    what = "LoRA merged into the " if done.merged_lora else ""
    what += "dequantized NF4 base" if done.dequantized else "base" if done.merged_lora else ""
    note = f" ({what})" if what else ""
    print(f"exported {done.checkpoint} (step {done.step}){note} to {done.directory}")


if __name__ == "__main__":
    main()
