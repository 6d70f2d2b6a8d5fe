"""Typed reading of config values: the checks every section's ``__post_init__`` shares, and
the conversion of a plain dict (a ConfigDict's, a saved ``config.json``'s) into a section's
dataclass, nested sections included, with errors that name the field."""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any


class ConfigError(ValueError):
    """A bad config value or path; the message names the field."""


def choice(field: str, value: Any, allowed: tuple) -> None:
    """Refuses ``value`` unless it is one of ``allowed``."""
    if value not in allowed:
        raise ConfigError(f"{field} must be one of {allowed}, got {value!r}")


def at_least(section: str, obj: Any, names: tuple[str, ...], low: int) -> None:
    """Refuses any field ``names`` of ``obj`` below ``low``."""
    for n in names:
        if getattr(obj, n) < low:
            raise ConfigError(f"{section}.{n} must be >= {low}, got {getattr(obj, n)}")


def learning_rate(field: str, lr: float) -> None:
    """A learning rate must be finite and in (0, 1]: a negative one ascends the loss, and
    AdamW's first steps move every weight by about lr, so past 1 a pretrained model is
    scrambled in one step (the tiny presets' largest is 2e-3). Both trained on silently."""
    if not (math.isfinite(lr) and 0 < lr <= 1):
        raise ConfigError(f"{field} must be in (0, 1], got {lr!r}")


def dotted(values: dict, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` as ``{"a.b": 1}``: a nested group of fields by their paths."""
    out = {}
    for k, v in values.items():
        if isinstance(v, dict):
            out |= dotted(v, f"{prefix}{k}.")
        else:
            out[f"{prefix}{k}"] = v
    return out


def read_section(name: str, cls: type, values: Any) -> Any:
    """The dataclass ``cls`` of the config section ``name`` from its dict of ``values``
    (its nested sections as dicts too); a ``ConfigError`` names a bad field."""
    if not isinstance(values, dict):
        raise ConfigError(f"{name}: expected a group of fields, got {values!r}")
    hints = typing.get_type_hints(cls)
    unknown = set(values) - set(hints)
    if unknown:
        raise ConfigError(f"{name}.{sorted(unknown)[0]}: unknown config field")
    kw = {k: read_section(f"{name}.{k}", hints[k], v) if dataclasses.is_dataclass(hints[k])
          else read_value(f"{name}.{k}", v, hints[k]) for k, v in values.items()}
    try:
        return cls(**kw)
    except ConfigError:
        raise
    except (ValueError, TypeError) as e:
        message = str(e)
        raise ConfigError(message if message.startswith(name) else f"{name}: {message}") from None


def read_value(field: str, value: Any, hint: Any) -> Any:
    """``value`` as the schema type ``hint`` (ints widen to floats; lists become tuples;
    None where the type allows it)."""
    origin = typing.get_origin(hint) or hint
    if origin in (types.UnionType, typing.Union):
        if value is None and type(None) in typing.get_args(hint):
            return None
        origin = next(a for a in typing.get_args(hint) if a is not type(None))
    if origin is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if origin is float and isinstance(value, float) and not math.isfinite(value):
        # nan passes every comparison a bound makes (nan < 0 and nan > 1 are both False)
        raise ConfigError(f"{field} must be a finite number, got {value}")
    if origin is tuple and isinstance(value, list | tuple):
        return tuple(value)
    if origin is tuple and isinstance(value, str):  # --config.trainer.logger=wandb
        return tuple(v.strip() for v in value.split(",") if v.strip())
    if origin is dict and isinstance(value, dict):
        return {k: tuple(v) if isinstance(v, list) else v for k, v in value.items()}
    if origin in (int, float, str, bool, dict, tuple) and not (
            isinstance(value, origin) and not (origin is int and isinstance(value, bool))):
        raise ConfigError(f"{field}: expected {origin.__name__}, got {value!r}")
    return value
