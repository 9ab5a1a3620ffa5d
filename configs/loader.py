"""Build an `EngineConfig` from defaults < YAML file < `PAGEDSERVE_*` env vars < CLI flags."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from pagedserve.configs.engine import SECTIONS, EngineConfig, section_of

ENV_PREFIX = "PAGEDSERVE_"
PRESETS_DIR = Path(__file__).parent / "presets"


def _read_file(path: str | Path) -> dict[str, dict[str, Any]]:
    candidate = Path(path)
    if not candidate.exists() and (PRESETS_DIR / f"{path}.yaml").exists():
        candidate = PRESETS_DIR / f"{path}.yaml"  # `--config cpu-small` names a shipped preset
    try:
        data = yaml.safe_load(candidate.read_text()) or {}
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        problem = getattr(error, "problem", None) or type(error).__name__
        raise ValueError(f"{candidate}: not valid YAML: {problem}{where}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{candidate}: expected a mapping of sections, got {type(data).__name__}")
    nested: dict[str, dict[str, Any]] = {}
    for key, value in data.items():
        if key in SECTIONS and isinstance(value, dict):
            for name, item in value.items():
                if _section_or_raise(name, candidate) != key:
                    raise ValueError(f"{candidate}: '{name}' is not a field of section '{key}'")
                nested.setdefault(key, {})[name] = item
        else:
            nested.setdefault(_section_or_raise(key, candidate), {})[key] = value
    return nested


def _section_or_raise(name: str, origin: object) -> str:
    try:
        return section_of(name)
    except KeyError:
        raise ValueError(f"{origin}: unknown setting '{name}'") from None


def _from_env(environ: Mapping[str, str]) -> dict[str, dict[str, Any]]:
    nested: dict[str, dict[str, Any]] = {}
    for key, value in environ.items():
        if not key.startswith(ENV_PREFIX) or key in (f"{ENV_PREFIX}CACHE", f"{ENV_PREFIX}CONFIG"):
            continue  # PAGEDSERVE_CACHE is the model/kernel cache dir, not a setting
        name = key[len(ENV_PREFIX) :].lower()
        nested.setdefault(_section_or_raise(name, f"environment variable {key}"), {})[name] = value
    return nested


def _merge(base: dict[str, dict[str, Any]], top: dict[str, dict[str, Any]]) -> None:
    for section, values in top.items():
        base.setdefault(section, {}).update(values)


def load_engine_config(
    cli: Mapping[str, Any] | None = None,
    config_file: str | Path | None = None,
    environ: Mapping[str, str] | None = None,
) -> EngineConfig:
    """Merge the four sources; `cli` holds only the flags the user actually gave (flat names).

    Raises:
        ValueError (pydantic.ValidationError) naming the bad setting.
    """
    environ = os.environ if environ is None else environ
    config_file = config_file or environ.get(f"{ENV_PREFIX}CONFIG")
    merged: dict[str, dict[str, Any]] = {}
    if config_file:
        _merge(merged, _read_file(config_file))
    _merge(merged, _from_env(environ))
    cli_nested: dict[str, dict[str, Any]] = {}
    for name, value in (cli or {}).items():
        if value is not None:
            cli_nested.setdefault(_section_or_raise(name, "command line"), {})[name] = value
    _merge(merged, cli_nested)
    return EngineConfig.model_validate(merged)
