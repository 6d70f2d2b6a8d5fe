"""What every ragen_jax environment provides on top of a gymnax environment.

A ragen_jax env is a real gymnax ``Environment`` (pure ``reset_env``/``step_env``, jittable,
vmappable, usable by gymnax wrappers and PureJaxRL-style loops) plus the two things an LLM
agent needs: the names of its actions (so model text can be mapped to action ids) and a
host-side text rendering of one state.

Episodes end by ``terminated`` (the task is over) or ``truncated`` (``params.max_steps`` env
steps taken). gymnax's ``step`` auto-resets on either; the agent loop uses ``step_env``, which
does not.
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar

import jax
import jax.numpy as jnp

from ragen_jax.envs.gymnax_base import environment

TState = TypeVar("TState")
TParams = TypeVar("TParams")


class TextEnv(environment.Environment[TState, TParams], Generic[TState, TParams]):
    """A gymnax environment that an LLM plays through text.

    Subclasses define ``action_names`` (index = action id), ``reset_env``, ``step_env``,
    ``get_obs`` and ``render_text``. ``step_env`` returns ``info`` with at least ``success``
    and ``action_is_effective``. Their params dataclass has a ``max_steps`` field.
    """

    action_names: tuple[str, ...] = ()

    @property
    def num_actions(self) -> int:
        return len(self.action_names)

    def action_names_for(self, state: TState) -> tuple[str, ...]:
        """The action names in force in ``state`` (constant for most envs)."""
        del state
        return self.action_names

    def level(self, state: TState) -> Any:
        """The fields of a freshly reset ``state`` that make its level (``envs.levels``: two
        episodes with equal fields play the same level). Default: the whole state."""
        return state

    def anchor(self, state: TState) -> Any:
        """The fields of ``state`` that make it an anchor state (GiGPO's step-level groups,
        ``starpo.advantages.gigpo``: turns that act from equal anchors are compared). Default:
        the whole state but its step counter ``time``, so that trajectories reaching one
        position after different numbers of steps meet there (the agent's observation shows
        the position, not the counter; verl-agent compares observations)."""
        if hasattr(state, "time") and hasattr(state, "replace"):
            return state.replace(time=jnp.zeros_like(state.time))
        return state

    def holdout_fields(self, state: TState) -> Any:
        """The fields of a freshly reset ``state`` that validation holds out (``envs.levels``:
        no training level shares them with a validation level). Default: the level. An env
        whose episodes can pass through another level's starting state names something they
        never change instead (Sokoban: the room), so no training episode reaches a validation
        level's start."""
        return self.level(state)

    def is_truncated(self, state: Any, params: Any) -> jax.Array:
        return state.time >= params.max_steps

    def render_text(self, state: TState) -> str:
        """The text the agent reads for one unbatched state (host side)."""
        raise NotImplementedError(f"{self.name} must implement render_text")

