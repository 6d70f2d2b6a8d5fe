"""Env drivers: how the agent loop resets and steps a batch of environments.

``AgentRollout`` plays every env through one small interface (``EnvDriver``): reset a batch
from seeds, step each row with its turn's parsed actions. Two drivers implement it:

* ``JaxEnvDriver`` for the pure-JAX ``TextEnv``s: ``vmap``-batched, jitted once per env object
  (``env_functions``), one device call per turn for the whole batch;
* ``HostEnvDriver`` (``ragen_jax.rollout.host_driver``) for host envs (``envs.host.family``): one
  Python instance per row, stepped on worker threads with a timeout, failures recorded per
  episode.

``rollout.agent.make_driver`` picks one once, when the rollout is built, so the loop has a
single path and the JAX envs pay nothing for the host ones.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np


class TurnActions(NamedTuple):
    """One row's actions to run this turn, in order (already cut to the action budget)."""

    ids: list[int]  # indices into the row's action names (free text: into ``texts``)
    texts: list[str]  # the same actions as text (names, or the free-text answer parts)


class StepOutcome(NamedTuple):
    """A turn's per-row results, on the host (``[B]`` arrays) plus the rows that failed."""

    reward: np.ndarray  # env rewards of the executed actions, summed
    executed: np.ndarray  # actions executed
    effective: np.ndarray  # of which changed the state
    last_effective: np.ndarray  # bool: the last executed action changed the state (False: none executed); RAGEN's per-turn action_is_effective
    terminated: np.ndarray
    truncated: np.ndarray
    success: np.ndarray
    errors: dict[int, str]  # row -> why its env failed (host envs); the episode ends there
    anchors: np.ndarray | None = None  # [B] uint64, each row's new state's anchor id (a JAX env's ``levels.anchor_hash``); None: not hashed (host envs: the rollout keys the rendered text)


class ResetOutcome(NamedTuple):
    """A batch reset: ``row_state(host, b)`` is row ``b``'s state for rendering and policies;
    ``errors`` maps a row whose reset failed to the reason (its episode ends before it starts);
    ``levels`` are the rows' level ids (``envs.levels``; 0 for a failed reset), ``holdout``
    the ids of what validation holds out (``envs.levels.holdout_hash``: the ids ``hold_out``
    takes; the level ids except where the env holds out something else, Sokoban's room) and
    ``redraws`` how many times each row's level was drawn again because it was held out."""

    states: Any
    host: Any
    errors: dict[int, str]
    levels: np.ndarray  # [N] uint64
    redraws: np.ndarray  # [N] int32
    holdout: np.ndarray  # [N] uint64, what validation holds out (``levels.holdout_hash``)
    anchors: np.ndarray | None = None  # [N] uint64, as ``StepOutcome.anchors``


class EnvDriver(Protocol):
    """Resets and steps one batch of envs (one row per episode).

    ``hold_out(ids)`` makes later resets skip the levels whose held-out id
    (``ResetOutcome.holdout``) is in ``ids`` (the run's validation levels' ids, for training and
    prior data; a validation reset passes ``held_out=False``): a seed drawing one is drawn
    again (deterministically, so a group's rows still share a level) until it does not."""

    def hold_out(self, ids: np.ndarray) -> None:
        ...

    def reset(self, seeds: np.ndarray, *, held_out: bool = True) -> ResetOutcome:
        """One env per seed (see ``ResetOutcome``), skipping the held-out levels if
        ``held_out``."""
        ...

    def step(self, states: Any, actions: dict[int, TurnActions],
             keys: jax.Array) -> tuple[Any, Any, StepOutcome]:
        """Runs each listed row's actions in order until its env is done; other rows are
        left as they are: ``(states, host view, outcome)``."""
        ...


# ----------------------------------------------------------------------------------------------
# Pure-JAX envs
# ----------------------------------------------------------------------------------------------

_ENV_FNS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def env_functions(env: Any) -> tuple[Callable, Callable]:
    """``(reset, step_turn)`` for ``env``, batched with vmap and jitted (cached per env).

    ``reset(keys[N], params) -> (obs, states)``.
    ``step_turn(states, params, actions[N, A], n_act[N], keys[N])`` runs each env's first
    ``n_act`` actions in order (``step_env``: no auto-reset), stopping at terminated or
    truncated, and returns ``(states, reward_sum, n_executed, n_effective, last_effective,
    terminated, truncated, success)``; ``last_effective``: the last executed action was
    effective (RAGEN's turn keeps its last action's ``info``).
    """
    if env in _ENV_FNS:
        return _ENV_FNS[env]
    reset = jax.jit(jax.vmap(env.reset_env, in_axes=(0, None)))

    def one(state, params, acts, n, key):
        def body(carry, i):
            state, done, rew, n_exec, n_eff, last_eff, term, trunc, succ = carry
            do = (i < n) & ~done
            _, nxt, r, t, info = env.step_env(jax.random.fold_in(key, i), state, acts[i], params)
            t = jnp.asarray(t, bool)
            eff = jnp.asarray(info["action_is_effective"], bool)
            tr = jnp.asarray(env.is_truncated(nxt, params), bool) & ~t
            state = jax.tree.map(lambda a, b: jnp.where(do, a, b), nxt, state)
            carry = (
                state,
                done | (do & (t | tr)),
                rew + jnp.where(do, r, 0.0).astype(jnp.float32),
                n_exec + do.astype(jnp.int32),
                n_eff + (do & eff).astype(jnp.int32),
                jnp.where(do, eff, last_eff),
                term | (do & t),
                trunc | (do & tr),
                jnp.where(do, jnp.asarray(info["success"], bool), succ),
            )
            return carry, None

        f, i0 = jnp.bool_(False), jnp.int32(0)
        init = (state, f, jnp.float32(0.0), i0, i0, f, f, f, f)
        (state, _, rew, n_exec, n_eff, last_eff, term, trunc, succ), _ = jax.lax.scan(
            body, init, jnp.arange(acts.shape[0]))
        return state, rew, n_exec, n_eff, last_eff, term, trunc, succ

    step_turn = jax.jit(jax.vmap(one, in_axes=(0, None, 0, 0, 0)))
    _ENV_FNS[env] = (reset, step_turn)
    return reset, step_turn


_ANCHOR_HASHES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def anchor_hashes(env: Any) -> Callable:
    """``hashes(states[N]) -> [N, 2] uint32``: each row's ``levels.anchor_hash``, batched and
    jitted (cached per env); the rollout records one per turn (GiGPO's anchor states)."""
    from ragen_jax.envs import levels  # here: no env module at import

    if env not in _ANCHOR_HASHES:
        _ANCHOR_HASHES[env] = jax.jit(jax.vmap(lambda state: levels.anchor_hash(env, state)))
    return _ANCHOR_HASHES[env]


_HELD_OUT_RESETS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def held_out_reset(env: Any) -> Callable:
    """``reset(keys[N], params, held_out[M, 2]) -> (states, level lanes[N, 2], held-out lanes
    [N, 2], redraws[N], stuck[N])`` for ``env``, batched and jitted (cached per env): each row
    reset from its key, then, while its held-out id (``envs.levels.holdout_hash`` lanes) is one
    of ``held_out``, from its key folded with the redraw count, at most ``levels.MAX_DRAWS``
    times (``stuck``: still held out after them). Draw 0 is the plain reset, so levels that are
    not held out are exactly ``env_functions``' levels; with no held-out id the loop never
    runs. The level lanes (``levels.level_hash``) are hashed once, of the level drawn."""
    from ragen_jax.envs import levels  # here: no env module at import

    if env in _HELD_OUT_RESETS:
        return _HELD_OUT_RESETS[env]

    def one(key, params, held_out):
        def is_held_out(lanes):
            return jnp.any(jnp.all(held_out == lanes, axis=-1))

        def draw(carry):  # draw i: the key itself, then the key folded with i
            i = carry[0]
            data = jnp.where(i == 0, jax.random.key_data(key),
                             jax.random.key_data(jax.random.fold_in(key, i)))
            _, state = env.reset_env(jax.random.wrap_key_data(data, impl=jax.random.key_impl(key)),
                                     params)
            return i + 1, state, levels.holdout_hash(env, state)

        def again(carry):
            i, _, lanes = carry
            return (i == 0) | (is_held_out(lanes) & (i <= levels.MAX_DRAWS))

        # One traced reset (the generator is the costly part to compile), in the loop's body.
        blank = jax.tree.map(_blank, jax.eval_shape(lambda: env.reset_env(key, params)[1]))
        i, state, lanes = jax.lax.while_loop(again, draw, (jnp.int32(0), blank,
                                                          jnp.zeros(2, jnp.uint32)))
        return state, levels.level_hash(env, state), lanes, i - 1, is_held_out(lanes)

    fn = jax.jit(jax.vmap(one, in_axes=(0, None, None)))
    _HELD_OUT_RESETS[env] = fn
    return fn


def _blank(x: jax.ShapeDtypeStruct) -> jax.Array:
    """A placeholder array of ``x``'s shape and type (a PRNG key array for a key type)."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return jnp.broadcast_to(jax.random.key(0), x.shape)
    return jnp.zeros(x.shape, x.dtype)


def row_state(states: Any, row: int) -> Any:
    """Row ``row`` of a batched env-state pytree (host numpy arrays: an unbatched state; a
    host env's object array: its ``HostState``)."""
    return jax.tree.map(lambda x: x[row], states)


class JaxEnvDriver:
    """A ``TextEnv`` batched on device: one jitted reset, one jitted ``step_turn`` a turn (a
    ``lax.scan`` over the turn's action slots, ``max_actions_per_turn`` wide); with
    ``anchors``, the new states' anchor ids too (``anchor_hashes``, fetched with the step's
    outcome)."""

    def __init__(self, env: Any, env_params: Any, max_actions_per_turn: int,
                 anchors: bool = False):
        self.env, self.env_params = env, env_params
        _, self._step_turn = env_functions(env)
        self._reset = held_out_reset(env)
        self._anchors = anchor_hashes(env) if anchors else None
        self.width = int(max_actions_per_turn)
        self.held_out = jnp.zeros((0, 2), jnp.uint32)

    def hold_out(self, ids: np.ndarray) -> None:
        from ragen_jax.envs import levels

        self.held_out = jnp.asarray(levels.as_lanes(np.unique(np.asarray(ids, np.uint64))))

    def reset(self, seeds: Sequence[int] | np.ndarray, *, held_out: bool = True) -> ResetOutcome:
        """Each env reset from ``jax.random.key(seed)`` (a held-out level: from the key folded
        with 1, 2, ... until it is not one, on device)."""
        from ragen_jax.envs import levels

        keys = jax.vmap(jax.random.key)(jnp.asarray(seeds, jnp.uint32))
        states, level, holdout, draws, stuck = self._reset(
            keys, self.env_params, self.held_out if held_out else self.held_out[:0])
        level, holdout, draws, stuck, host, anchors = jax.device_get(
            (level, holdout, draws, stuck, states, self._anchor_lanes(states)))
        if stuck.any():
            raise levels.held_out_error(self.env.name, np.asarray(seeds)[stuck])
        return ResetOutcome(states, host, {}, levels.as_uint64(level), draws.astype(np.int32),
                            levels.as_uint64(holdout),
                            None if anchors is None else levels.as_uint64(anchors))

    def _anchor_lanes(self, states: Any) -> jax.Array | None:
        """``[N, 2] uint32`` anchor hashes of ``states`` (None when not recorded)."""
        return None if self._anchors is None else self._anchors(states)

    def step(self, states: Any, actions: dict[int, TurnActions],
             keys: jax.Array) -> tuple[Any, Any, StepOutcome]:
        from ragen_jax.envs import levels

        n = keys.shape[0]
        ids = np.zeros((n, self.width), np.int32)
        n_act = np.zeros(n, np.int32)
        for i, a in actions.items():
            ids[i, : len(a.ids)] = a.ids
            n_act[i] = len(a.ids)
        result = self._step_turn(states, self.env_params, jnp.asarray(ids), jnp.asarray(n_act),
                                 keys)
        (host, *outcome), anchors = jax.device_get((result, self._anchor_lanes(result[0])))
        return result[0], host, StepOutcome(
            *outcome, errors={}, anchors=None if anchors is None else levels.as_uint64(anchors))
