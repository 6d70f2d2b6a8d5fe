"""Level identity: which starting state an episode plays, so validation can be held out.

A level is what ``reset`` draws from a seed: Sokoban's room, boxes and player; FrozenLake's
map, start and goal; Bandit's arm pair and order (``TextEnv.level``); a host env's first
observation text (``HostEnv.level_key`` may name something else). Seeds are not levels: small
generators repeat levels often (Sokoban 6x6 with one box gives ~245 distinct levels from 256
seeds, and a supervised prior's few thousand levels met ~40% of them), so a validation set
defined by a seed range is not held out. The rollout compares levels by identity instead.

What validation holds out is an env's choice (``TextEnv.holdout_fields``), made once in the
env: by default the level, but where an episode can walk from one level's start into another
level's starting state, something coarser that no episode changes. Sokoban holds out its room
(walls and targets): a training episode in a validation level's room can push its way onto that
level's starting board, one in another room never can. So:

* ``level_hash(env, state)``: a jittable 64-bit hash (two ``uint32`` lanes, MurmurHash3's
  mixing) of one unbatched JAX state's level fields, their sizes included;
  ``anchor_hash(env, state)`` the same of its anchor fields (``TextEnv.anchor``: which state
  a turn acts from, GiGPO's anchor states);
* ``holdout_hash(env, state)``: the same hash of the fields validation holds out (the ids
  ``EnvDriver.hold_out`` compares; equal to ``level_hash`` where they are the level's);
* ``as_uint64`` / ``as_lanes``: the ids as host ``uint64`` and back to device lanes;
* ``text_level_id(text)``: a host env's identity, BLAKE2b of its level key (a host env holds
  out its level);
* ``redraw_seed(seed, draw)``: the seed a host env is reset with on its ``draw``-th redraw
  (a JAX env folds the draw into its key instead, ``env_driver.held_out_reset``).

A hash collision only makes the rollout skip a level that was not in the validation set (a
validation level always hashes to its own id); with 64 bits it does not happen in practice.
Level ids and held-out ids hash different fields and are never compared with each other.
"""

from __future__ import annotations

import hashlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

MAX_DRAWS = 64  # draws per reset before a row is declared impossible to hold out

_SEEDS = (0x9747B28C, 0x5BD1E995)  # the two lanes' hash seeds


def _fmix(h: jax.Array) -> jax.Array:
    """MurmurHash3's 32-bit finaliser (uint32 arithmetic wraps)."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def _rotl(x: jax.Array, r: int) -> jax.Array:
    return (x << r) | (x >> (32 - r))


def _murmur(words: jax.Array, seed: int) -> jax.Array:
    """MurmurHash3 (x86, 32-bit) of ``words [N] uint32``."""

    def body(h, k):
        k = _rotl(k * jnp.uint32(0xCC9E2D51), 15) * jnp.uint32(0x1B873593)
        h = _rotl(h ^ k, 13) * jnp.uint32(5) + jnp.uint32(0xE6546B64)
        return h, None

    h, _ = jax.lax.scan(body, jnp.uint32(seed), words)
    return _fmix(h ^ jnp.uint32(4 * words.shape[0]))


def _words(x: jax.Array) -> jax.Array:
    """``x`` as ``uint32`` words, its size first (so [1, 2] + [3] differs from [1] + [2, 3])."""
    if jax.dtypes.issubdtype(jnp.result_type(x), jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    x = jnp.asarray(x)
    if jnp.issubdtype(x.dtype, jnp.floating):
        flat = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32).reshape(-1)
    else:
        flat = x.astype(jnp.int32).reshape(-1).astype(jnp.uint32)
    return jnp.concatenate([jnp.array([x.size], jnp.uint32), flat])


def level_fields(env: Any, state: Any) -> Any:
    """The pytree that identifies ``state``'s level (``env.level``; default: the whole state)."""
    level = getattr(env, "level", None)
    return level(state) if level is not None else state


def holdout_fields(env: Any, state: Any) -> Any:
    """The pytree of ``state`` that validation holds out (``env.holdout_fields``; default: its
    level fields)."""
    fields = getattr(env, "holdout_fields", None)
    return fields(state) if fields is not None else level_fields(env, state)


def tree_hash(tree: Any) -> jax.Array:
    """``[2] uint32``: the 64-bit hash of a pytree's leaves, their sizes included (jittable)."""
    words = jnp.concatenate([_words(x) for x in jax.tree.leaves(tree)])
    return jnp.stack([_murmur(words, s) for s in _SEEDS])


def level_hash(env: Any, state: Any) -> jax.Array:
    """``[2] uint32``: the level identity of one unbatched JAX env state (jittable)."""
    return tree_hash(level_fields(env, state))


def anchor_hash(env: Any, state: Any) -> jax.Array:
    """``[2] uint32``: the anchor-state identity of one unbatched JAX env state
    (``TextEnv.anchor``; the whole state for an env without the method; jittable)."""
    anchor = getattr(env, "anchor", None)
    return tree_hash(anchor(state) if anchor is not None else state)


def holdout_hash(env: Any, state: Any) -> jax.Array:
    """``[2] uint32``: the identity of what validation holds out of one unbatched JAX env
    state, ``holdout_fields`` (jittable): Sokoban's room, other envs' level."""
    return tree_hash(holdout_fields(env, state))


def as_uint64(lanes: Any) -> np.ndarray:
    """``[..., 2] uint32`` hash lanes as ``[...] uint64`` ids."""
    lanes = np.asarray(lanes, np.uint64)
    return (lanes[..., 0] << np.uint64(32)) | lanes[..., 1]


def as_lanes(ids: Any) -> np.ndarray:
    """``[N] uint64`` ids as ``[N, 2] uint32`` lanes (the device's form)."""
    ids = np.asarray(ids, np.uint64).reshape(-1)
    return np.stack([ids >> np.uint64(32), ids & np.uint64(0xFFFFFFFF)], -1).astype(np.uint32)


def text_level_id(text: str) -> np.uint64:
    """A host env's level id: the first 8 bytes of BLAKE2b of its level key."""
    return np.uint64(int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big"))


def redraw_seed(seed: int, draw: int) -> int:
    """The seed of a host env's ``draw``-th redraw of ``seed`` (draw 0 is ``seed`` itself): a
    31-bit hash, so any env's seed type takes it, and redraws of nearby seeds do not overlap."""
    if draw == 0:
        return int(seed)
    digest = hashlib.blake2b(f"{int(seed)}:{int(draw)}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "big") >> 1


class HeldOutError(RuntimeError):
    """Training could not draw a level outside the validation set for some seed."""


def held_out_error(name: str, seeds: Any) -> HeldOutError:
    """The error for ``seeds`` whose every one of ``MAX_DRAWS`` draws was held out."""
    seeds = [int(s) for s in np.asarray(seeds).reshape(-1)]
    return HeldOutError(
        f"env {name}: {MAX_DRAWS} draws from seed {seeds[0]} (and {len(seeds) - 1} more) were all "
        f"held out (validation levels, or for Sokoban their rooms): the generator yields too few "
        f"distinct levels to hold validation out (set rollout.val.held_out=False to validate on "
        f"training levels)")
