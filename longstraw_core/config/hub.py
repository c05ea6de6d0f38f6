"""Hugging Face Hub ids as ``model.path`` / ``tokenizer.path``, as TRL takes them
(``Qwen/Qwen3-0.6B``), resolved to a snapshot directory of huggingface_hub's cache.

Why here and in two parts: everything downstream reads a local directory (``config.json``
for validation and the planner, the tokenizer, safetensors read tensor by tensor per rank),
and the cache gives one: ``<HF_HUB_CACHE>/models--<org>--<name>/snapshots/<commit>/``.

- ``resolve_paths`` (``load_config``, before validation): a path that is not a local file or
  directory and reads as a repo id (``namespace/name``; never one starting with ``/``, ``.``
  or ``~``, which stay local paths) becomes its snapshot directory, holding the small files
  only: config, tokenizer, generation config, chat template. So a config error is reported
  before any weight is downloaded.
- ``fetch_weights`` (the loaders, when the model is built): a snapshot directory gets its
  ``*.safetensors`` at the same commit, so a data or config error found at setup costs no
  download, and a run that resumes with the same id reads the same revision.

Online, missing files are downloaded (``huggingface_hub.snapshot_download``; a gated or
private repo needs ``hf auth login``). With ``HF_HUB_OFFLINE=1`` only the cache is read, and
an id that is not there is refused in one line naming the cache and the fix. Concurrent
ranks share the cache safely (huggingface_hub locks each file).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

from huggingface_hub import constants, snapshot_download
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    HFValidationError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.utils import validate_repo_id

from longstraw_core.schema.run_config import ConfigError

if TYPE_CHECKING:
    from longstraw_core.schema.run_config import RunConfig

# What validation, the tokenizer and the planner read: config, tokenizer files, generation
# config, chat templates, and the code of trust_remote_code models.
SMALL_FILES = ["*.json", "*.jinja", "*.txt", "*.model", "*.tiktoken", "*.py"]
WEIGHT_FILES = ["*.safetensors"]  # what the loaders read (.bin copies are never fetched)


def is_hub_id(path: str) -> bool:
    """Whether ``path`` names a Hub repository rather than a local path: nothing exists
    there, and it is ``namespace/name`` (a relative two-part path that does not exist locally
    is taken as an id; the error then says both)."""
    return not Path(path).expanduser().exists() and looks_like_hub_id(path)


def looks_like_hub_id(path: str) -> bool:
    """Whether ``path`` has a Hub id's shape (``namespace/name``, not ``./...``), wherever
    it is read from (``config.relative_paths``)."""
    if path.startswith(("/", ".", "~")) or path.count("/") != 1:
        return False
    try:
        validate_repo_id(path)
    except HFValidationError:
        return False
    return True


def resolve_paths(cfg: RunConfig) -> RunConfig:
    """``cfg`` with a Hub id in ``model.path`` or ``tokenizer.path`` replaced by its snapshot
    directory (small files fetched: ``SMALL_FILES``; ``ConfigError`` naming the key if the id
    cannot be had)."""
    model, tokenizer = cfg.model, cfg.tokenizer
    if model.path is not None and is_hub_id(model.path):
        model = dataclasses.replace(model, path=snapshot("model.path", model.path))
    if tokenizer.path is not None and is_hub_id(tokenizer.path):
        tokenizer = dataclasses.replace(tokenizer, path=snapshot("tokenizer.path", tokenizer.path))
    return dataclasses.replace(cfg, model=model, tokenizer=tokenizer)


def fetch_weights(path: str | Path) -> None:
    """When ``path`` is a snapshot directory of the Hub cache, its weights at that commit are
    there afterwards (downloaded online; ``ConfigError`` when they cannot be had). Any other
    directory is left alone."""
    found = _snapshot_of(Path(path))
    if found is None:
        return
    cache, repo_id, commit = found
    snapshot("model.path", repo_id, revision=commit, cache_dir=cache, weights=True)
    if not any(Path(path).glob("*.safetensors")):
        raise ConfigError(
            "model.path",
            f"{repo_id} in the Hugging Face cache ({cache}) has no *.safetensors weights "
            f"(LongStraw reads safetensors only){_offline_fix(repo_id)}",
        )


def snapshot(
    key: str,
    repo_id: str,
    *,
    revision: str | None = None,
    cache_dir: Path | None = None,
    weights: bool = False,
) -> str:
    """The snapshot directory of ``repo_id`` with ``SMALL_FILES`` (and ``WEIGHT_FILES``),
    from the cache or downloaded; ``ConfigError`` on ``key`` in one line otherwise."""
    cache = cache_dir or Path(constants.HF_HUB_CACHE)
    try:
        return snapshot_download(
            repo_id,
            revision=revision,
            cache_dir=cache,
            allow_patterns=SMALL_FILES + (WEIGHT_FILES if weights else []),
            local_files_only=constants.HF_HUB_OFFLINE,
        )
    except (RepositoryNotFoundError, GatedRepoError) as exc:
        why = (
            "gated: accept its terms on the Hub"
            if isinstance(exc, GatedRepoError)
            else ("not found, or private")
        )
        raise ConfigError(
            key,
            f"{repo_id!r} is not a local directory, and as a Hugging Face Hub model it is "
            f"{why} (log in with `hf auth login` for private or gated models)",
        ) from None
    except RevisionNotFoundError:
        raise ConfigError(key, f"{repo_id!r}: revision {revision!r} not found on the Hub") from None
    except LocalEntryNotFoundError as exc:
        if type(exc).__name__ == "IncompleteSnapshotError":  # huggingface_hub >= 2: say which
            raise ConfigError(key, f"{_first_line(exc)}{_offline_fix(repo_id)}") from None
        unreachable = (
            f" and the Hub could not be reached ({type(exc.__cause__).__name__})"
            if exc.__cause__ is not None and not constants.HF_HUB_OFFLINE
            else ""
        )
        raise ConfigError(
            key,
            f"{repo_id!r} is not a local directory, nor in the Hugging Face cache ({cache})"
            f"{unreachable}{_offline_fix(repo_id)}",
        ) from None
    except (HfHubHTTPError, OSError) as exc:  # the network, the Hub, the disk
        raise ConfigError(
            key, f"{repo_id!r} from the Hugging Face Hub: {_first_line(exc)}"
        ) from None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _offline_fix(repo_id: str) -> str:
    if constants.HF_HUB_OFFLINE:
        return (
            f"; HF_HUB_OFFLINE=1 forbids downloading it: run `hf download {repo_id}` where "
            "there is a network (into this cache), or give a local directory"
        )
    return f"; run `hf download {repo_id}`, or give a local directory"


def _snapshot_of(path: Path) -> tuple[Path, str, str] | None:
    """``(cache, repo_id, commit)`` of a ``<cache>/models--<org>--<name>/snapshots/<commit>``
    directory, else None."""
    repo, parent = path.parent.parent, path.parent
    if parent.name != "snapshots" or not repo.name.startswith("models--"):
        return None
    return repo.parent, repo.name.removeprefix("models--").replace("--", "/"), path.name
