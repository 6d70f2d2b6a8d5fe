"""Loading a run config: ``--config path[:preset]`` plus ``--config.a.b=value`` overrides,
and the ConfigDict <-> ``RunConfig`` conversion.

The same loader serves ``launch.py``, ``python -m ragen_jax.eval`` and
``python -m ragen_jax.export``; all three can start from a run folder's saved ``config.json``
(``load_run_config``; ``launch.py --config <run folder>/config.json`` resumes that run)
instead of a config file. A ``config.json`` written before the schema's fields were
renamed or regrouped is read through ``config.legacy``'s table. The fields, defaults and
their documentation are ``ragen_jax/config/schema.py``'s.

The config file is a Python module with ``get_config(preset)`` returning an ml_collections
``ConfigDict`` (ml_collections' config-file convention). The config is locked before
overrides, so a misspelt field is an error, and ``ConfigDict``'s type checks reject an
ill-typed value; values are parsed as Python literals (``1e-5``, ``(8, 8)``, ``False``) or
taken as strings. ``env.params`` and ``env.val_extra`` accept new keys (the env names the
unknown ones). ``env.mix`` (a tuple of dicts) is set whole, ``--config.env.mix="({...}, ...)"``,
or one entry's field at a time, ``--config.env.mix.<index or tag>.groups=4``. Every failure is one ``ValueError`` line naming the flag or field.

A training run keeps a copy of its model folder's tokenizer and configs in
``<output_dir>/model/`` (``models.hf_folder.snapshot``); ``use_run_snapshot`` points a config
whose ``model.path`` no longer exists at that copy, so a run resumes, evaluates and exports
after the original folder was moved (its trained weights are in the checkpoints).
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import json
import sys
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ml_collections import ConfigDict

from ragen_jax.config import legacy
from ragen_jax.config.fields import ConfigError, read_section, read_value
from ragen_jax.config.schema import TINY_ONLY_FIELDS, RunConfig

OPEN_FIELDS = ("env.params", "env.val_extra")


def load_file(spec: str) -> ConfigDict:
    """``path[:preset]`` -> the file's ``get_config(preset)`` (no preset: its default); a
    run folder's ``config.json`` -> that run's config (``load_run_config``)."""
    path, _, preset = spec.partition(":")
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"--config: no such config file: {path}")
    if file.suffix == ".json":
        return load_run_config(file.parent)
    root = str(file.resolve().parent.parent)
    if root not in sys.path:  # config files import their base as `configs.base`
        sys.path.insert(0, root)
    module_spec = importlib.util.spec_from_file_location(f"_ragen_config_{file.stem}", file)
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
        config = module.get_config(preset) if preset else module.get_config()
    except ValueError as e:
        raise ValueError(f"--config {spec}: {e}") from None
    except Exception as e:  # a broken config file: say which and why, in one line
        raise ValueError(f"--config {spec}: {type(e).__name__}: {e}") from None
    if not isinstance(config, ConfigDict):
        raise ValueError(f"--config {spec}: get_config must return an ml_collections.ConfigDict")
    return config


# Words Python's float() reads as non-finite; a literal_eval of them fails, so without this a
# float field given "nan" met ConfigDict's "nan is of original type <class 'str'>".
NON_FINITE = ("nan", "+nan", "-nan", "inf", "+inf", "-inf", "infinity", "+infinity", "-infinity")


def parse_value(text: str) -> Any:
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def override(config: ConfigDict, field: str, text: str) -> None:
    """Sets ``config.<field>`` from ``text`` (locked: unknown fields and wrong types fail)."""
    if field.startswith("env.mix."):
        return _override_mix_entry(config, field, text)
    *parents, leaf = field.split(".")
    node = config
    for i, name in enumerate(parents):
        if not isinstance(node, ConfigDict) or name not in node:
            renamed = legacy.renamed_field(field)
            raise ValueError(f"--config.{field}: " + (
                renamed or f"unknown field {'.'.join(parents[:i + 1])}"))
        node = node[name]
    if not isinstance(node, ConfigDict):
        raise ValueError(f"--config.{field}: {'.'.join(parents)} is not a group of fields")
    value = parse_value(text)
    is_open = any(field.startswith(p + ".") for p in OPEN_FIELDS)
    if leaf not in node and not is_open:
        renamed = legacy.renamed_field(field)
        raise ValueError(f"--config.{field}: " + (renamed or "unknown field (see "
                                                   "ragen_jax/config/schema.py)"))
    if (isinstance(value, str) and value.strip().lower() in NON_FINITE
            and isinstance(node[leaf], float)):
        value = float(value)  # a float field's nan or inf: the schema refuses it by name
    if isinstance(value, dict):
        value = ConfigDict(value)
    try:
        if is_open:
            with node.unlocked():
                node[leaf] = value
        else:
            node[leaf] = value
    except (TypeError, ValueError, KeyError, AttributeError) as e:
        raise ValueError(f"--config.{field}={text}: {str(e).splitlines()[0]}") from None


def _override_mix_entry(config: ConfigDict, field: str, text: str) -> None:
    """``--config.env.mix.<i or tag>.<field>[.<param>]=value``: one field of one entry of
    ``env.mix`` (a tuple of dicts, which ConfigDict cannot address); the schema checks the
    names and types when the run is built."""
    _, _, which, *path = field.split(".")
    entries = [dict(e) for e in config.env.mix]
    index = next((i for i, e in enumerate(entries) if which == str(i) or which == e.get("tag")),
                 None)
    if index is None or not path:
        raise ValueError(f"--config.{field}: env.mix has no entry {which!r} (an index or a tag; "
                         f"then a field: --config.env.mix.{which}.groups=4)")
    node = entries[index]
    for name in path[:-1]:  # e.g. params.dim_room
        child = dict(node.get(name) or {})
        node[name] = child
        node = child
    node[path[-1]] = parse_value(text)
    config.env.mix = tuple(entries)


def load_run_config(run_dir: str | Path) -> ConfigDict:
    """The config a training run saved in ``run_dir/config.json`` (an older schema's through
    ``legacy.upgrade``), pointed at ``run_dir`` (and at its model snapshot if the model folder
    is gone, see ``use_run_snapshot``)."""
    file = Path(run_dir) / "config.json"
    if not file.is_file():
        raise FileNotFoundError(f"--checkpoint: {run_dir} is not a run folder (no config.json)")
    values = legacy.upgrade(read_run_json(file))
    values.setdefault("trainer", {})["output_dir"] = str(run_dir)
    return use_run_snapshot(ConfigDict(values))


def read_run_json(file: Path) -> dict[str, Any]:
    """The saved config in ``file``: a JSON object whose sections (``trainer``, ``rollout``,
    ...) are objects. Anything else is a ``ConfigError`` naming the file (and, for JSON that
    does not parse, the line and column), where it was an ``AttributeError`` traceback or a
    decoder message that named no file."""
    try:
        values = json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ConfigError(f"{file}: not valid JSON at line {e.lineno} column {e.colno} "
                          f"({e.msg})") from None
    except (OSError, UnicodeDecodeError, RecursionError) as e:
        reason = "nested too deeply" if isinstance(e, RecursionError) else type(e).__name__
        raise ConfigError(f"{file}: not a readable config ({reason}: {e})") from None
    if not isinstance(values, dict):
        raise ConfigError(f"{file}: expected a JSON object of config sections, got "
                          f"{type(values).__name__}")
    hints = typing.get_type_hints(RunConfig)
    for name, value in values.items():
        if dataclasses.is_dataclass(hints.get(name)) and not isinstance(value, dict):
            raise ConfigError(f"{file}: {name!r} must be a JSON object of its fields, got "
                              f"{json.dumps(value)[:80]}")
    return values


def run_folder(config: Any) -> Path:
    """The run folder a config trains into: ``trainer.output_dir``, else
    ``runs/<env>-<preset>`` (``runs/mixed-<preset>`` with ``env.mix``); for a ``ConfigDict`` or a
    ``schema.RunConfig`` alike."""
    env = "mixed" if getattr(config.env, "mix", ()) else config.env.name
    return Path(config.trainer.output_dir or f"runs/{env}-{config.preset}")


def use_run_snapshot(config: ConfigDict) -> ConfigDict:
    """``config`` with ``model.path`` replaced by the run folder's model snapshot when the
    folder it names does not exist and the snapshot does (a note goes to stderr)."""
    from ragen_jax.models.hf_folder import is_snapshot

    path = config.model.path
    snap = run_folder(config) / "model"
    if path and not Path(path).exists() and is_snapshot(snap):  # exists: a .gguf file is no folder
        print(f"note: model.path {path} is gone; using the run's copy of its tokenizer and "
              f"configs in {snap} (the weights come from the checkpoint)", file=sys.stderr)
        config.model.path = str(snap)
    return config


def load_config(args: Sequence[str], *, prog: str = "ragen_jax", default: str | None = None,
                base: ConfigDict | None = None) -> ConfigDict:
    """The config named by ``args`` (command-line words after the program name): the
    ``--config`` file (else ``base``, else the ``default`` file) with the overrides."""
    spec, overrides = None, []
    args = list(args)
    i = 0
    while i < len(args):
        a = args[i]
        if a == "--config":
            if i + 1 >= len(args):
                raise ValueError("--config needs a value: configs/<env>.py[:preset]")
            spec, i = args[i + 1], i + 2
            continue
        if a.startswith("--config="):
            spec = a.split("=", 1)[1]
        elif a.startswith("--config."):
            if "=" not in a:
                raise ValueError(f"{a}: overrides are written --config.<field>=value")
            field, text = a[len("--config."):].split("=", 1)
            overrides.append((field, text))
        else:
            raise ValueError(f"{prog}: unexpected argument {a!r} (only --config and "
                             f"--config.<field>=value)")
        i += 1
    if spec is None and base is None:
        spec = default
    if spec is None and base is None:
        raise ValueError("--config is required, e.g. --config configs/sokoban.py")
    config = load_file(spec) if spec is not None else base
    config.lock()
    for field, text in overrides:
        override(config, field, text)
    return config


# ----------------------------------------------------------------------------------------------
# ConfigDict <-> RunConfig
# ----------------------------------------------------------------------------------------------


def to_config_dict(run: RunConfig | None = None) -> ConfigDict:
    """The ConfigDict of ``run`` (default: every default), one entry per schema field, a
    section's as a nested ConfigDict (``env.mix`` as a tuple of plain dicts)."""
    return _as_config_dict(RunConfig() if run is None else run)


def _as_config_dict(obj: Any) -> ConfigDict:
    out = ConfigDict()
    for f in dataclasses.fields(obj):
        item = getattr(obj, f.name)
        if dataclasses.is_dataclass(item):
            item = _as_config_dict(item)
        elif isinstance(item, tuple) and item and dataclasses.is_dataclass(item[0]):
            item = tuple(dataclasses.asdict(x) for x in item)
        out[f.name] = item
    return out


def from_config_dict(config: ConfigDict | dict) -> RunConfig:
    """The typed ``RunConfig`` of a ConfigDict; raises ``ConfigError`` naming the bad field."""
    config = config.to_dict() if isinstance(config, ConfigDict) else dict(config)
    sections = {}
    hints = typing.get_type_hints(RunConfig)
    unknown = set(config) - set(hints)
    if unknown:
        raise ConfigError(f"{sorted(unknown)[0]}: unknown config field")
    for name, value in config.items():
        cls = hints[name]
        if dataclasses.is_dataclass(cls):
            sections[name] = read_section(name, cls, value)
        else:
            sections[name] = read_value(name, value, cls)
    try:
        return RunConfig(**sections)
    except ConfigError:
        raise
    except ValueError as e:
        raise ConfigError(str(e)) from None


def config_for_print(run: RunConfig) -> str:
    """``run`` rendered as ``print(ConfigDict)`` renders its ConfigDict (YAML, sorted keys),
    but showing only what the run uses: with ``model.path`` set, the tiny-model fields
    (``TINY_ONLY_FIELDS``) are replaced by one ``model.architecture`` line naming the
    folder's ``config.json`` (with its values of those fields when it is readable)."""
    config = to_config_dict(run)
    if not run.model.path:
        return str(config)
    for name in TINY_ONLY_FIELDS:
        del config.model[name]
    lines = str(config).splitlines()
    at = lines.index("model:") + 1  # "architecture" sorts first in the section
    lines.insert(at, f"  architecture: {_folder_architecture(run.model.path)}")
    return "\n".join(lines) + "\n"


def _folder_architecture(path: str) -> str:
    """``<path>/config.json``, followed by its tiny-field values when the file reads."""
    file = Path(path) / "config.json"
    try:
        found = json.loads(file.read_text())
    except (OSError, ValueError):
        found = {}
    values = ", ".join(f"{k}={found[k]}" for k in TINY_ONLY_FIELDS
                       if isinstance(found, dict) and k in found)
    return f"from {file}" + (f" ({values})" if values else "")
