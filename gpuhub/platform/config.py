"""Daemon configuration: TOML files under /etc/gpuhub/, read into traitlets config with clear errors.

Each daemon declares its settings as traits of one ``Configurable`` (``gpuhub.agent.config.AgentConfig``,
``gpuhub.scheduler.config.SchedulerConfig``). Its file holds those settings as top-level keys; they
become that class's section of a traitlets ``Config``, so command-line options such as
``--AgentConfig.port=8700`` can override them. Checks are strict: an unknown key or a value of the
wrong type is an error that names the setting and the file (traitlets itself would only warn or
coerce), and ``Int(min=, max=)``, ``Enum`` and ``@validate`` constraints give errors with the file named.
"""

from __future__ import annotations

import os
import stat
import tomllib
from pathlib import Path
from typing import Any, TypeVar

from traitlets import Bool, Dict, Enum, Float, Int, List, TraitError, TraitType, Unicode
from traitlets.config import Config, Configurable

C = TypeVar("C", bound=Configurable)


class ConfigError(ValueError):
    """A config file is missing, malformed, or has a wrong value; the message says which and where."""


def load_toml(path: str | os.PathLike) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: is a directory, not a config file") from None
    except PermissionError:
        raise ConfigError(f"{path}: cannot read config file (permission denied)") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None


def read_secret(path: str | os.PathLike, what: str) -> str:
    """Read a token file; refuse files others can read (a leaked token is an open cluster)."""
    p = Path(path)
    try:
        st = p.stat()
        value = p.read_text().strip()
    except FileNotFoundError:
        raise ConfigError(f"{what}: token file {path} does not exist") from None
    except PermissionError:
        raise ConfigError(f"{what}: cannot read token file {path} (permission denied)") from None
    if st.st_mode & (stat.S_IRWXO):
        raise ConfigError(f"{what}: token file {path} is readable by others; chmod 600 it")
    if len(value) < 16:
        raise ConfigError(f"{what}: token in {path} is shorter than 16 characters")
    return value


def check_settings(cls: type[Configurable], raw: dict[str, Any], source: str) -> None:
    """Reject keys ``cls`` has no setting for, and values of the wrong type, naming each."""
    traits = cls.class_traits(config=True)
    unknown = set(raw) - set(traits)
    if unknown:
        raise ConfigError(f"{source}: unknown setting(s) {', '.join(sorted(unknown))}")
    for name, value in raw.items():
        _check_type(traits[name], value, f"{source}: {name}")


_PY_TYPES = ((Bool, bool), (Unicode, str), (List, list), (Dict, dict))


def _check_type(trait: TraitType, value: Any, where: str) -> None:
    # TOML has exactly these types; traitlets would accept true for an Int (bool is an int).
    if isinstance(trait, Enum):
        if value not in trait.values:
            choices = " or ".join(repr(v) for v in trait.values)
            raise ConfigError(f"{where} must be {choices}, not {value!r}")
        return
    if isinstance(trait, (Int, Float)):
        expected = "an integer" if isinstance(trait, Int) else "a number"
        allowed: type | tuple = int if isinstance(trait, Int) else (int, float)
        if isinstance(value, bool) or not isinstance(value, allowed):
            raise ConfigError(f"{where} must be {expected}, not {type(value).__name__} ({value!r})")
        return
    for kind, pytype in _PY_TYPES:
        if isinstance(trait, kind) and not isinstance(value, pytype):
            raise ConfigError(f"{where} must be of type {pytype.__name__}, not {type(value).__name__} ({value!r})")
    if isinstance(trait, List) and trait._trait is not None:
        for i, item in enumerate(value):
            _check_type(trait._trait, item, f"{where}[{i}]")
    if isinstance(trait, Dict) and trait._value_trait is not None:
        for key, item in value.items():
            _check_type(trait._value_trait, item, f"{where}.{key}")


def load_config_file(cls: type[Configurable], path: str | os.PathLike) -> Config:
    """Read ``path`` into a traitlets ``Config`` with the file's settings as ``cls``'s section."""
    raw = load_toml(path)
    check_settings(cls, raw, str(path))
    return Config({cls.__name__: raw})


def make_settings(cls: type[C], config: Config, source: str, **kwargs: Any) -> C:
    """Build ``cls`` from ``config``; a constraint it breaks is a ConfigError naming ``source``."""
    try:
        return cls(config=config, **kwargs)
    except TraitError as exc:
        raise ConfigError(f"{source}: {exc}") from None


def load_settings(cls: type[C], path: str | os.PathLike) -> C:
    """The settings in file ``path`` (for tools that read a daemon's file, e.g. ``gpuhub nodes``)."""
    return make_settings(cls, load_config_file(cls, path), str(path))
