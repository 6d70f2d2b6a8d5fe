"""A scripted 2048 baseline: a two-move expectimax that keeps the large tiles in a corner.

``corner_action`` scores each move that changes the board by the expected value, over the
tile that spawns next (every empty cell equally likely, a 2 with probability 0.9), of the best
following move's board; a board's value is its tiles weighted ``2**k`` along a snake path that
winds up from the bottom-left corner (``snake_weights``), plus 0.1 per empty cell, plus the
merged sums, all over the board's largest tile. This is the usual hand strategy (large tiles
packed in a corner, in order) made greedy over two moves. ``play_corner`` plays whole games
(jittable, vmappable over keys); ``envs.solvers.solve`` offers its move as the 2048 "solver" of
the solver-mixture warm-start. 2048 has no practical optimal solver; this is a baseline, and
its figures are in ``experiments/results/bench_envs.md``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ragen_jax.envs.game2048 import EnvParams, Game2048, move

EMPTY_WEIGHT = 0.1  # value of an empty cell, in units of the largest tile's snake weight


def snake_weights(n: int) -> jax.Array:
    """[n, n] weights ``2**(k - n*n + 1)``: ``k`` counts down along a snake path from the
    bottom-left corner (weight 1) winding up the board row by row."""
    order = np.zeros((n, n), np.float64)
    k = n * n - 1
    for i, row in enumerate(range(n - 1, -1, -1)):
        for col in (range(n) if i % 2 == 0 else range(n - 1, -1, -1)):
            order[row, col] = k
            k -= 1
    return jnp.asarray(2.0 ** (order - (n * n - 1)), jnp.float32)


def _all_moves(env: Game2048, board: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The four slid boards [4, n, n], their merged sums [4] and which changed the board [4]."""
    slid, merged = jax.vmap(lambda a: move(board, a, env.to_left, env.from_left))(jnp.arange(4))
    return slid, merged, jnp.any(slid != board, axis=(1, 2))


def corner_action(env: Game2048, board: jax.Array) -> jax.Array:
    """The baseline's move for one board (jittable); ``Up`` when no move changes it."""
    n = env.size
    weights = snake_weights(n)
    scale = jnp.maximum(jnp.max(board), 1).astype(jnp.float32)

    def value(b: jax.Array) -> jax.Array:
        return (jnp.sum(b.astype(jnp.float32) * weights) / scale
                + EMPTY_WEIGHT * jnp.sum(b == 0))

    def best_next(b: jax.Array) -> jax.Array:
        slid, merged, moved = _all_moves(env, b)
        v = jax.vmap(value)(slid) + merged / scale
        return jnp.max(jnp.where(moved, v, value(b) - 1e3))  # stuck: far below any move

    def after_spawn(b: jax.Array) -> jax.Array:
        flat = b.reshape(-1)
        empty = flat == 0
        cells = jnp.arange(n * n)
        two = jax.vmap(lambda i: best_next(flat.at[i].set(2).reshape(n, n)))(cells)
        four = jax.vmap(lambda i: best_next(flat.at[i].set(4).reshape(n, n)))(cells)
        expected = jnp.where(empty, 0.9 * two + 0.1 * four, 0.0)
        return jnp.sum(expected) / jnp.maximum(jnp.sum(empty), 1)

    slid, merged, moved = _all_moves(env, board)
    score = jax.vmap(after_spawn)(slid) + merged / scale
    return jnp.argmax(jnp.where(moved, score, -jnp.inf)).astype(jnp.int32)


def play_corner(env: Game2048, params: EnvParams, key: jax.Array,
                max_moves: int) -> dict[str, jax.Array]:
    """One game of ``corner_action`` from ``key``'s reset, for at most ``max_moves`` moves
    (jittable, vmappable over ``key``): its score, max tile, moves, summed env reward and
    whether it ended (no move left)."""
    _, state = env.reset_env(key, params)

    def cond(carry: tuple[Any, ...]) -> jax.Array:
        state, _, done = carry
        return ~done & (state.time < max_moves)

    def body(carry: tuple[Any, ...]) -> tuple[Any, ...]:
        state, total, _ = carry
        action = corner_action(env, state.board)
        _, state, reward, done, _ = env.step_env(key, state, action, params)
        return state, total + reward, done

    state, total, done = jax.lax.while_loop(cond, body, (state, jnp.float32(0.0), jnp.bool_(False)))
    return {"score": state.score, "max_tile": jnp.max(state.board), "moves": state.time,
            "reward": total, "ended": done}
