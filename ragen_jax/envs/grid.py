"""Grid-world building blocks shared by the environments: shifting a boolean grid and flood
fill, both jittable and vmappable."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def shift(grid: jax.Array, dr: int, dc: int) -> jax.Array:
    """``out[r, c] = grid[r - dr, c - dc]``, False where that falls outside.  # [H, W] bool"""
    height, width = grid.shape
    padded = jnp.pad(grid, ((abs(dr), abs(dr)), (abs(dc), abs(dc))))
    r0, c0 = abs(dr) - dr, abs(dc) - dc
    return padded[r0:r0 + height, c0:c0 + width]


def reachable(passable: jax.Array, start: jax.Array) -> jax.Array:
    """Cells reachable from ``start`` [2] through ``passable`` [H, W] cells (4-connected).

    ``start`` itself counts as reachable even if it is not passable.  # [H, W] bool
    """
    seed = jnp.zeros_like(passable).at[start[0], start[1]].set(True)

    def grow(carry: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        reach, _ = carry
        bigger = reach | shift(reach, 1, 0) | shift(reach, -1, 0) | shift(reach, 0, 1) | shift(reach, 0, -1)
        bigger = (bigger & passable) | seed
        return bigger, jnp.any(bigger != reach)

    reach, _ = jax.lax.while_loop(lambda carry: carry[1], grow, (seed, jnp.bool_(True)))
    return reach
