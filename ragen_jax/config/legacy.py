"""Run configs written before the schema's fields were renamed or regrouped.

A run folder's ``config.json`` is the whole config as its run saw it; one written by an
older schema is read through ``upgrade``: each old field path to its new one (``RENAMED``),
the ``-1`` sentinels to ``None`` (``NONE_WAS``), a reward-normalisation preset to the two
fields it set (``starpo.normalization.PRESETS``). A command-line override that names an old
field gets one line naming the new one (``renamed_field``).
"""

from __future__ import annotations

import copy
from typing import Any

from ragen_jax.starpo.normalization import PRESETS

# old field path -> new field path
RENAMED = {
    **{f"rollout.{name}": f"rollout.sampling.{name}"
       for name in ("temperature", "top_p", "top_k", "stop_strings")},
    **{f"rollout.{name}": f"rollout.prompt.{name}"
       for name in ("enable_think", "format_penalty", "turn_template", "system_template",
                    "max_tokens_hint", "max_answer_chars")},
    "rollout.val_groups": "rollout.val.env_groups",
    "rollout.val_group_size": "rollout.val.group_size",
    "rollout.val_temperature": "rollout.val.temperature",
    "rollout.val_seed": "rollout.val.seed",
    "rollout.held_out_val": "rollout.val.held_out",
    "rollout.context_window": "rollout.window.mode",
    "rollout.window_turns": "rollout.window.turns",
    "rollout.overlong": "rollout.window.overlong",
    "rollout.pad_multiple": "rollout.sampler.prompt_pad_multiple",
    "rollout.cache_multiple": "rollout.sampler.cache_multiple",
    "rollout.group_prefix": "rollout.sampler.share_prompt_cache",
    "actor.pad_multiple": "actor.row_pad_multiple",
    "actor.share_prefix": "actor.share_prompt_forward",
    "warmstart.turn_steps": "warmstart.turns.steps",
    "warmstart.turn_batch_size": "warmstart.turns.batch_size",
    "warmstart.turn_system_prompt": "warmstart.turns.system_prompt",
    "warmstart.turn_solver_share": "warmstart.turns.solver_share",
    "warmstart.turn_episodes": "warmstart.turns.episodes",
}
# new field path -> the old sentinel that meant what None means now
NONE_WAS = {"warmstart.turns.solver_share": -1, "warmstart.seed": -1, "mesh.data": -1}
PRESET_FIELD = "algorithm.reward_norm_preset"


def _pop(config: dict, path: str) -> tuple[bool, Any]:
    *parents, leaf = path.split(".")
    node = config
    for name in parents:
        node = node.get(name)
        if not isinstance(node, dict):
            return False, None
    return (True, node.pop(leaf)) if leaf in node else (False, None)


def _put(config: dict, path: str, value: Any) -> None:
    *parents, leaf = path.split(".")
    node = config
    for name in parents:
        node = node.setdefault(name, {})
    node[leaf] = value


def _get(config: dict, path: str) -> tuple[bool, Any]:
    found, value = _pop(config, path)
    if found:
        _put(config, path, value)
    return found, value


def _upgrade_mix_entry(entry: Any) -> Any:
    """An ``env.mix`` entry: ``val_groups=-1`` is None; its own rollout values by their new
    paths within the rollout section (e.g. ``turn_template`` -> ``prompt.turn_template``)."""
    if not isinstance(entry, dict):
        return entry
    entry = dict(entry)
    if entry.get("val_groups") == -1:
        entry["val_groups"] = None
    own = entry.get("rollout")
    if isinstance(own, dict):
        own = {"rollout": copy.deepcopy(own)}
        for old, new in RENAMED.items():
            if old.startswith("rollout."):
                found, value = _pop(own, old)
                if found:
                    _put(own, new, value)
        entry["rollout"] = own["rollout"]
    return entry


def upgrade(config: dict) -> dict:
    """``config`` (a saved ``config.json``'s dict, of any schema since the rename) in the
    current schema's field paths; a current one comes back equal."""
    config = copy.deepcopy(config)
    for old, new in RENAMED.items():
        found, value = _pop(config, old)
        if found:
            _put(config, new, value)
    for path, sentinel in NONE_WAS.items():
        found, value = _get(config, path)
        if found and value == sentinel:
            _put(config, path, None)
    found, preset = _pop(config, PRESET_FIELD)
    if found and preset:
        grouping, method = PRESETS[preset]
        _put(config, "algorithm.reward_norm_grouping", grouping)
        _put(config, "algorithm.reward_norm_method", method)
    env = config.get("env")
    if isinstance(env, dict) and isinstance(env.get("mix"), list | tuple):
        env["mix"] = type(env["mix"])(_upgrade_mix_entry(e) for e in env["mix"])
    return config


def renamed_field(field: str) -> str | None:
    """One line for an override of an old field path (``rollout.val_groups``), naming what
    replaced it; None for a path that never was a field."""
    if field in RENAMED:
        return f"renamed: --config.{RENAMED[field]}"
    if field == PRESET_FIELD:
        table = ", ".join(f"{name} = grouping {g}, method {m}" for name, (g, m) in PRESETS.items())
        return ("removed: set --config.algorithm.reward_norm_grouping and "
                f"--config.algorithm.reward_norm_method ({table})")
    return None
