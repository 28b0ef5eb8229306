"""Loading a config: `conf/` groups (Hydra style), a --config file and key=value overrides merged onto the
dataclasses (OmegaConf structured configs), so that unknown keys (with the closest valid ones), wrong types and bad
values fail at start-up with the key named; and a config to and from YAML and dicts (checkpoints, run dirs)."""

from __future__ import annotations

import difflib
import re
from dataclasses import MISSING, fields, is_dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from keel.config.data import MOVED_KEYS, new_spelling, with_sections
from keel.config.run import Config
from keel.errors import ConfigError

GROUPS = ("model", "data", "trainer", "eval", "recipe")
ROOT_GROUPS = ("recipe",)  # groups whose files set keys of several sections (optim.*, trainer.*), not one section


def conf_dir() -> Path:
    return Path(str(resources.files("keel.conf")))


def _group_file(group: str, choice: str) -> Path:
    path = Path(choice)
    if path.suffix in (".yaml", ".yml"):
        if not path.exists():
            raise ConfigError(f"{group}: no such file {choice}")
        return path
    path = conf_dir() / group / f"{choice}.yaml"
    if not path.exists():
        available = sorted(p.stem for p in (conf_dir() / group).glob("*.yaml"))
        raise ConfigError(f"{group}: unknown choice {choice!r}; available: {', '.join(available)} (or a YAML path)")
    return path


def _valid_keys(node: Any, prefix: str = "") -> list[str]:
    keys = []
    for f in fields(node):
        value = getattr(node, f.name)
        keys.append(prefix + f.name)
        if is_dataclass(value):
            keys += _valid_keys(value, prefix + f.name + ".")
    return keys


def _explain(err: OmegaConfBaseException) -> ConfigError:
    key = getattr(err, "full_key", None) or "?"
    if isinstance(err, ConfigKeyError):
        section, _, name = key.partition(".")
        if section == "data" and name in MOVED_KEYS:
            return ConfigError(f"{key}: moved into its source's section: use {new_spelling(name)}")
        close = difflib.get_close_matches(key, _valid_keys(Config()), n=3, cutoff=0.5)
        hint = f"; did you mean {' or '.join(close)}?" if close else ""
        return ConfigError(f"{key}: unknown config key{hint}")
    if isinstance(err, ValidationError) and (wrong_type := _wrong_type(key, err)):
        return wrong_type
    return ConfigError(f"{key}: {str(err).splitlines()[0]}")


# OmegaConf's words for a value of the wrong type (value, the type wanted), and what each type it names is in Keel's
CONVERSIONS = (
    re.compile(r"Value '(.*)' of type '\w+' could not be converted to (\w+)"),
    re.compile(r"Value '(.*)' is not a valid (bool) "),
)
WANTED = {
    "Integer": "a whole number",
    "Float": "a number",
    "Boolean": "true or false",
    "bool": "true or false",
    "String": "a string",
}


def _wrong_type(key: str, err: ValidationError) -> ConfigError | None:
    """`model.depth: 'two' is not a whole number (e.g. model.depth=16)`: the type the key takes, and whether null
    is allowed, from its dataclass field; an example from its default."""
    said = str(err).splitlines()[0]
    match = next((m for pattern in CONVERSIONS if (m := pattern.match(said))), None)
    if match is None or match[2] not in WANTED:
        return None
    section = err.object_type if is_dataclass(err.object_type) else None
    field = next((f for f in fields(section) if f.name == err.key), None) if section else None
    wanted = WANTED[match[2]] + (" or null" if field is not None and "None" in str(field.type) else "")
    default = field.default if field is not None and field.default not in (MISSING, None) else None
    shown = str(default).lower() if isinstance(default, bool) else default
    return ConfigError(f"{key}: {match[1]!r} is not {wanted}" + (f" (e.g. {key}={shown})" if shown is not None else ""))


def _read_yaml(path: Path) -> DictConfig:
    if not path.is_file():  # else read as a YAML error: "cannot parse YAML: [Errno 2] ..."
        raise ConfigError(
            f"config: {path} {'is a directory, not' if path.is_dir() else 'does not exist: give'} a YAML file"
        )
    try:
        loaded = OmegaConf.load(path)
    except Exception as err:  # yaml's own errors carry line numbers
        raise ConfigError(f"{path}: cannot parse YAML: {err}") from err
    if not isinstance(loaded, DictConfig):
        raise ConfigError(
            f"{path}: its top level is a list; a config file maps keys to settings "
            "(e.g. a line `optim:`, then `  lr: 0.001`)"
        )
    return loaded


def _parse_overrides(dotlist: list[str]) -> DictConfig:
    try:
        return OmegaConf.from_dotlist(dotlist)
    except OmegaConfBaseException:
        raise
    except Exception:  # a YAML error in one value: find which, and say so without yaml's traceback
        for item in dotlist:
            try:
                OmegaConf.from_dotlist([item])
            except Exception as err:
                reason = " ".join(str(err).split())
                raise ConfigError(
                    f"override {item!r}: cannot parse its value as YAML ({reason}); quote it or "
                    "fix the brackets, e.g. data.text_files.paths='[a.txt,b.txt]'"
                ) from None
        raise


def load_config(config_file: str | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    base = _read_yaml(conf_dir() / "config.yaml")
    user = _read_yaml(Path(config_file)) if config_file else OmegaConf.create()
    choices = {**base.pop("defaults", {}), **user.pop("defaults", {})}
    dotlist = []
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"override {item!r}: expected key=value (e.g. model.depth=32 or trainer=fsdp)")
        if key in GROUPS:
            choices[key] = value
        else:
            dotlist.append(item)
    schema = OmegaConf.structured(Config)
    try:
        merged = schema
        for group, choice in choices.items():
            if group not in GROUPS:
                raise ConfigError(f"defaults.{group}: unknown group; allowed: {', '.join(GROUPS)}")
            keys = _read_yaml(_group_file(group, str(choice)))
            merged = OmegaConf.merge(merged, keys if group in ROOT_GROUPS else {group: keys})
        merged = OmegaConf.merge(merged, base, user, _parse_overrides(dotlist))
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:
        raise _explain(err) from None


def to_yaml(cfg: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def to_dict(cfg: Config) -> dict:
    return OmegaConf.to_container(OmegaConf.structured(cfg))


def from_dict(data: dict) -> Config:
    """A Config from a saved dict (checkpoint hparams, a run's config.yaml), with the same validation as load_config;
    one saved before each data source had its own section is read in today's spelling (data.with_sections)."""
    if isinstance(data.get("data"), dict):
        data = {**data, "data": with_sections(data["data"])}
    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), data))
    except OmegaConfBaseException as err:
        raise _explain(err) from None
