"""The ``config.rollout`` section of a run: what a rollout plays and how, by subject.

``rollout`` itself holds RAGEN's batch and budgets (``env_groups`` x ``group_size`` episodes
a step, ``max_turn``, the action budgets, ``response_length``, ``max_model_len``) and the
training seeds; its sections hold the rest:

- ``rollout.sampling``: how training answers are sampled (temperature, top-p, top-k, stop
  strings);
- ``rollout.prompt``: the prompt's wording and the answer parser's budget;
- ``rollout.val``: validation's groups, seeds and temperature (RAGEN's ``es_manager.val``);
- ``rollout.window``: what each turn's prompt shows of the episode (RAGEN's
  ``context_window_mode``);
- ``rollout.sampler``: the sampler's memory and shapes (prompt padding, KV-cache growth, a
  group's shared prompt), which change speed and memory, never the samples.

Defaults are RAGEN's V2 base config; each field's trailing comment is its user
documentation (``ragen_jax.config.reference`` reads it).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from ragen_jax.rollout.context import ContextConfig
from ragen_jax.rollout.sampling import SamplingParams
from ragen_jax.rollout.window import MODES, OVERLONG

frozen = dataclasses.dataclass(frozen=True, kw_only=True)


def _require(section: str, obj: Any, name: str, ok: bool, requirement: str) -> None:
    if not ok:
        raise ValueError(f"{section}.{name} must be {requirement}, got {getattr(obj, name)!r}")


@frozen
class SamplingConfig:
    """How training answers are sampled (``config.rollout.sampling``)."""

    temperature: float = 1.0  # training sampling temperature (RAGEN: 1)
    top_p: float = 1.0  # training nucleus (RAGEN: 1)
    top_k: int = 0  # training top-k, 0 = off (RAGEN: -1)
    stop_strings: tuple = ()  # a turn also ends right after the model writes one of these, exact across tokens (vLLM's stop), e.g. ("</answer>",); the end-of-turn token is then inserted as template text; () = off (RAGEN: off)

    def __post_init__(self):
        where = "rollout.sampling"
        for name in ("temperature", "top_k"):
            _require(where, self, name, getattr(self, name) >= 0, ">= 0")
        _require(where, self, "top_p", 0 < self.top_p <= 1, "in (0, 1]")
        _require(where, self, "stop_strings",
                 all(isinstance(x, str) and x for x in self.stop_strings),
                 "a tuple of non-empty strings")


@frozen
class PromptConfig:
    """The prompt's wording and the answer parser's budget (``config.rollout.prompt``)."""

    enable_think: bool = True  # <think>..</think><answer>..</answer>; False: answer only
    format_penalty: float = -0.1  # added once to a turn with a format error (RAGEN: -0.1)
    turn_template: str = ""  # per-turn user text ({turn} {state} {warning} {actions_left} {format} {max_tokens}); "" = RAGEN's
    system_template: str = ""  # the system message ({instruction} {legend} {actions} {max_actions_per_turn}); "" = RAGEN's (prefix, instruction, legend, actions)
    max_tokens_hint: int = 0  # the prompt's {max_tokens} ("Max response length"); 0 = rollout.response_length (RAGEN's max_tokens)
    max_answer_chars: int = 256  # an <answer> longer than this is a format error (keeps a runaway answer out of the env); code envs raise it

    def __post_init__(self):
        where = "rollout.prompt"
        _require(where, self, "max_answer_chars", self.max_answer_chars >= 1, ">= 1")
        _require(where, self, "max_tokens_hint", self.max_tokens_hint >= 0, ">= 0")
        try:
            self.system_template.format(instruction="", legend="", actions="", max_actions_per_turn=1)
        except (KeyError, IndexError, ValueError) as e:
            raise ValueError(f"rollout.prompt.system_template: only {{instruction}} {{legend}} "
                             f"{{actions}} {{max_actions_per_turn}} can be filled in, got "
                             f"{self.system_template!r} ({e!r})") from None


@frozen
class ValidationConfig:
    """Validation episodes (``config.rollout.val``; RAGEN's ``es_manager.val``)."""

    env_groups: int = 256  # validation groups (RAGEN: 512 x 1; V1: 256)
    group_size: int = 1  # validation group size (RAGEN: 1)
    temperature: float = 0.5  # validation sampling temperature (RAGEN: val_kwargs.temperature 0.5)
    seed: int = 123  # first validation group seed (RAGEN: 123)
    held_out: bool = True  # training and warm-start data skip every validation level (by level identity, envs.levels; Sokoban: every validation room); False: validation may replay training levels (RAGEN: seeds only)

    def __post_init__(self):
        for name in ("env_groups", "group_size"):
            _require("rollout.val", self, name, getattr(self, name) >= 1, ">= 1")
        _require("rollout.val", self, "temperature", self.temperature >= 0, ">= 0")


@frozen
class WindowConfig:
    """What each turn's prompt shows of its episode (``config.rollout.window``)."""

    mode: str = "full"  # each turn's prompt: full (the whole episode, KV cache across turns) | limited (system + the last `turns` turns) | single_turn (history summarised in one user message) (RAGEN: context_window_mode)
    turns: int = 0  # limited / single_turn: turns a prompt shows, the current one included; 0 = all (RAGEN: max_context_window, -1 = all)
    overlong: str = "end"  # a prompt + full answer past rollout.max_model_len: end (the episode, truncated) | truncate (drop the oldest turns, system message kept: RAGEN's _apply_max_length)

    def __post_init__(self):
        _require("rollout.window", self, "mode", self.mode in MODES, f"one of {MODES}")
        _require("rollout.window", self, "overlong", self.overlong in OVERLONG, f"one of {OVERLONG}")
        _require("rollout.window", self, "turns", self.turns >= 0, ">= 0")
        _require("rollout.window", self, "turns", self.mode != "full" or self.turns == 0,
                 "0 with rollout.window.mode=full (the window is the whole episode)")


@frozen
class SamplerConfig:
    """The sampler's memory and shapes (``config.rollout.sampler``): speed and memory only,
    the samples are the same."""

    prompt_pad_multiple: int = 64  # a turn's prompts (and the rollout batch's length) are padded to a multiple of this (bounds recompiles)
    cache_multiple: int = 0  # the KV cache grows to a multiple of this; 0 = powers of two
    share_prompt_cache: bool = True  # a group's common first prompt is held once in the KV cache and attended in place by its rows (exact); False: copied to every row
    paged: bool = False  # a paged KV cache: each row writes at its own length into blocks, decode attention reads only the blocks rows hold, a group's first prompt is held in blocks its rows share (same tokens as the dense cache)
    kv_blocks: int = 0  # with paged: blocks in the pool (0 = enough for every row's longest episode)
    kv_block_size: int = 16  # with paged: tokens per block

    def __post_init__(self):
        _require("rollout.sampler", self, "prompt_pad_multiple", self.prompt_pad_multiple >= 1, ">= 1")
        _require("rollout.sampler", self, "cache_multiple", self.cache_multiple >= 0, ">= 0")
        _require("rollout.sampler", self, "kv_blocks", self.kv_blocks >= 0, ">= 0")
        _require("rollout.sampler", self, "kv_block_size", self.kv_block_size >= 1, ">= 1")


@frozen
class RolloutConfig:
    """The ``config.rollout`` section of a run: groups, budgets and lengths of a rollout, with
    its sampling, prompt, validation, window and sampler sections (defaults: RAGEN's V2 base
    config). ``context`` is the prompt/parsing ``ContextConfig`` they imply."""

    env_groups: int = 8  # groups per training step (RAGEN: 8)
    group_size: int = 16  # envs per group, sharing an initial state (RAGEN: 16)
    max_turn: int = 5  # LLM calls per episode (RAGEN: 5)
    max_actions_per_traj: int = 10  # env actions per episode (RAGEN: 10)
    max_actions_per_turn: int = 2  # env actions parsed per answer (RAGEN: 2)
    response_length: int = 400  # max new tokens per turn (RAGEN: 400)
    max_model_len: int = 3600  # max tokens of a trajectory (RAGEN: 3600)
    use_turn_scores: bool = False  # each turn's score on its last token (bi-level GAE)
    turn_scores_penalty: bool = True  # with use_turn_scores: a turn's format penalty is part of its score (and so of the episode's); False: dropped from both, as RAGEN drops it under use_turn_scores (a format error then costs nothing)
    train_seed: int = 10000  # first training group seed (RAGEN: 10000)
    sampling: SamplingConfig = SamplingConfig()
    prompt: PromptConfig = PromptConfig()
    val: ValidationConfig = ValidationConfig()
    window: WindowConfig = WindowConfig()
    sampler: SamplerConfig = SamplerConfig()

    def __post_init__(self):
        for name in ("env_groups", "group_size", "max_turn", "max_actions_per_traj",
                     "max_actions_per_turn", "response_length", "max_model_len"):
            _require("rollout", self, name, getattr(self, name) >= 1, ">= 1")

    def replace(self, values: dict) -> RolloutConfig:
        """These settings with ``values`` (``{field: value}``, a section's as a nested dict,
        e.g. ``{"max_turn": 1, "prompt": {"turn_template": "..."}}``)."""
        changes = {k: dataclasses.replace(getattr(self, k), **v) if isinstance(v, dict) else v
                   for k, v in values.items()}
        return dataclasses.replace(self, **changes)

    @functools.cached_property
    def context(self) -> ContextConfig:
        """The prompt wording and parsing budget these settings imply ("" ``turn_template``:
        ``ContextConfig``'s, RAGEN's wording; the length hint is ``response_length`` unless
        ``prompt.max_tokens_hint`` is set)."""
        p = self.prompt
        return ContextConfig(
            enable_think=p.enable_think, max_actions_per_turn=self.max_actions_per_turn,
            format_penalty=p.format_penalty, max_answer_chars=p.max_answer_chars,
            max_tokens_hint=p.max_tokens_hint or self.response_length,
            system_template=p.system_template,
            **({"turn_template": p.turn_template} if p.turn_template else {}))

    def sampling_params(self, temperature: float | None = None) -> SamplingParams:
        """Training sampling (``temperature`` overrides the configured one)."""
        s = self.sampling
        t = s.temperature if temperature is None else temperature
        return SamplingParams(max_new_tokens=self.response_length, temperature=t,
                              top_k=s.top_k, top_p=s.top_p)

    def val_sampling_params(self) -> SamplingParams:
        """Validation sampling: ``val.temperature``, the training top-k / top-p."""
        return self.sampling_params(self.val.temperature)
