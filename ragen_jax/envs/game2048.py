"""2048 as a pure JAX environment, with RAGEN's dynamics, rewards and text (its ``game_2048``).

Tiles slide as far as they go in the chosen direction; two equal tiles that meet merge into
one of twice the value, each tile at most once per move, the pair nearest the wall first.
After a move that changed the board a tile spawns on a uniformly chosen empty cell: a 2 with
probability ``two_prob`` (0.9), else a 4. A move that changes nothing spawns nothing.

As in RAGEN, the spawns come from the episode's own random stream, seeded at reset (RAGEN's
``np.random.default_rng(seed)``): the state carries that stream's key, so envs reset from the
same key see the same tiles spawn after the same moves, whatever the step keys.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from ragen_jax.envs.base import TextEnv
from ragen_jax.envs.gymnax_base import spaces

# The board is each prompt's text: 64 x 64 cells are ~4,000 tokens a turn, past every
# preset's rollout.max_model_len; a larger size only allocated until memory ran out.
MAX_SIZE = 64

ACTION_NAMES = ("Up", "Right", "Down", "Left")  # RAGEN's action_lookup, same ids 0-3

# RAGEN's env_instruction of the ``game_2048`` tag (its 4x4 made the board's real size).
INSTRUCTION = (
    "You are playing the 2048 game on a {n}x{n} grid. Merge equal tiles by sliding Up, Right, "
    "Down, or Left.\nIf a move is invalid (no tiles move), a small penalty is applied. Respond "
    "with a single action.\nExample: <answer>Up</answer>\n"
)


@struct.dataclass
class EnvState:
    board: jax.Array  # [n, n] int32 tile values, 0 = empty
    score: jax.Array  # int32, the sum of every merged tile so far (RAGEN's score)
    key: jax.Array  # [2] uint32, key data of the spawn stream (set at reset, advanced per spawn)
    time: jax.Array  # int32, env steps taken


@struct.dataclass
class EnvParams:
    max_steps: int = 700  # RAGEN's action budget for the tag (max_actions_per_traj)
    two_prob: float = 0.9  # P(a spawned tile is a 2); else a 4
    use_log_reward: bool = True  # reward 0.1 * log2(merged + 1) instead of the merged sum
    invalid_act_score: float = -0.1  # a move that changes nothing (reached only without the log)
    win_tile: int = 2048  # success: the game ended with a tile at least this large


def orientations(n: int) -> tuple[np.ndarray, np.ndarray]:
    """``(to_left, from_left)``, each [4, n * n] int32 per action: ``board.flat[to_left[a]]``
    is the board turned so that action ``a`` slides its rows towards column 0, and
    ``turned.flat[from_left[a]]`` turns it back."""
    r, c = np.meshgrid(np.arange(n), np.arange(n), indexing="ij")  # (row, col) of the turned board
    sources = (
        c * n + r,  # Up: turned row i is column i, top to bottom
        r * n + (n - 1 - c),  # Right: row i, right to left
        (n - 1 - c) * n + r,  # Down: column i, bottom to top
        r * n + c,  # Left: as it is
    )
    to_left = np.stack([s.reshape(-1) for s in sources]).astype(np.int32)
    from_left = np.argsort(to_left, axis=1).astype(np.int32)
    return to_left, from_left


def _compress(rows: jax.Array) -> jax.Array:
    """Non-zero entries moved to the front of each row (last axis), in order."""
    n = rows.shape[-1]
    nonzero = rows != 0
    slot = jnp.cumsum(nonzero, axis=-1) - 1
    lands = nonzero[..., :, None] & (slot[..., :, None] == jnp.arange(n))  # [..., src, dst]
    return jnp.sum(jnp.where(lands, rows[..., :, None], 0), axis=-2)


def slide_left(rows: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Slides every row (last axis) towards index 0 with 2048's merge rule: ``(rows, merged)``,
    ``merged`` the sum of the new tiles of each row."""
    c = _compress(rows)
    n = c.shape[-1]
    equal = (c[..., :-1] == c[..., 1:]) & (c[..., :-1] != 0)  # pair (j, j + 1) could merge
    # Pairs merge greedily from the front: a tile consumed by pair j - 1 cannot join pair j.
    merges = []
    previous = jnp.zeros(equal.shape[:-1], bool)
    for j in range(n - 1):
        previous = equal[..., j] & ~previous
        merges.append(previous)
    no = jnp.zeros(equal.shape[:-1] + (1,), bool)
    head = jnp.concatenate([jnp.stack(merges, -1), no], -1)  # j doubles
    tail = jnp.concatenate([no, jnp.stack(merges, -1)], -1)  # j is absorbed into j - 1
    doubled = jnp.where(head, 2 * c, 0)
    out = jnp.where(head, doubled, jnp.where(tail, 0, c))
    return _compress(out), jnp.sum(doubled, axis=-1)


def move(board: jax.Array, action: jax.Array, to_left: np.ndarray,
         from_left: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """``board`` [n, n] after sliding in direction ``action`` (no spawn): ``(board, merged)``;
    ``to_left``/``from_left`` from ``orientations``."""
    n = board.shape[-1]
    turned = board.reshape(-1)[jnp.asarray(to_left)[action]].reshape(n, n)
    slid, merged = slide_left(turned)
    return slid.reshape(-1)[jnp.asarray(from_left)[action]].reshape(n, n), jnp.sum(merged)


def can_move(board: jax.Array) -> jax.Array:
    """Some move changes ``board``: an empty cell, or two equal neighbours."""
    return (jnp.any(board == 0) | jnp.any(board[:, 1:] == board[:, :-1])
            | jnp.any(board[1:, :] == board[:-1, :]))


def spawn(board: jax.Array, key: jax.Array, two_prob: jax.Array | float) -> jax.Array:
    """A 2 (probability ``two_prob``) or a 4 on a uniformly chosen empty cell (none if full)."""
    key_cell, key_value = jax.random.split(key)
    flat = board.reshape(-1)
    empty = flat == 0
    count = jnp.sum(empty)
    pick = jnp.minimum(jnp.floor(jax.random.uniform(key_cell) * count).astype(jnp.int32),
                       count - 1)  # the pick-th empty cell in row-major order, as RAGEN's list
    chosen = empty & (jnp.cumsum(empty) - 1 == pick)
    value = jnp.where(jax.random.uniform(key_value) < two_prob, 2, 4).astype(flat.dtype)
    return jnp.where(chosen, value, flat).reshape(board.shape)


class Game2048(TextEnv[EnvState, EnvParams]):
    """Slide the tiles of a 2048 board. Actions 0-3: Up, Right, Down, Left (RAGEN's ids).

    Reset: two tiles spawn on an empty ``size`` x ``size`` board. A step slides the tiles (see
    the module docstring); if the board changed, the merged tiles' sum is added to the score
    and a tile spawns. Reward (RAGEN's, with ``use_log_reward``): ``0.1 * log2(merged + 1)``
    for a move that merged, 0 for any other move, an ineffective one included (RAGEN computes
    ``invalid_act_score`` = -0.1 for it and then maps every non-positive reward to 0); without
    the log, the merged sum, or ``invalid_act_score`` for a move that changed nothing.
    Terminated when, after an effective move, no move can change the board. Truncated after
    ``max_steps`` steps. ``info``: ``success`` (terminated with a tile of at least
    ``win_tile``: RAGEN counts success only at the game's end), ``action_is_effective`` (the
    board changed: RAGEN's ``action_is_effective``, and ``action_is_valid`` too), ``score``
    and ``max_tile``.

    Observation (``get_obs``): the [size, size] int32 board. Text (``render_text``): RAGEN's
    rendering: the rows, the valid actions with their ids, the goal, the score and the question.

    Differences from RAGEN, all deliberate:

    - The spawn stream is JAX's PRNG from the reset key, not NumPy's from the seed, so a seed
      gives a different (equally distributed) game than in RAGEN.
    - Truncation at ``params.max_steps`` (default 700, RAGEN's ``max_actions_per_traj`` for the
      tag); RAGEN's env has no time limit and relies on the agent's action budget.
    - ``win_tile`` is a param (RAGEN's 2048 is fixed).
    """

    action_names = ACTION_NAMES
    params_cls = EnvParams

    def __init__(self, size: int = 4) -> None:
        super().__init__()
        if not 2 <= size <= MAX_SIZE:
            raise ValueError(f"2048 size must be in [2, {MAX_SIZE}], got {size}")
        self.size = size
        self.to_left, self.from_left = orientations(size)
        self.instruction = INSTRUCTION.format(n=size)

    @property
    def default_params(self) -> EnvParams:
        return EnvParams()

    def reset_env(self, key: jax.Array, params: EnvParams) -> tuple[jax.Array, EnvState]:
        """Two tiles on an empty board, from the episode's spawn stream (the reset key)."""
        if not jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
            key = jax.random.wrap_key_data(key)  # a raw uint32 key
        board = jnp.zeros((self.size, self.size), jnp.int32)
        for _ in range(2):
            key, key_spawn = jax.random.split(key)
            board = spawn(board, key_spawn, params.two_prob)
        state = EnvState(board=board, score=jnp.int32(0), key=jax.random.key_data(key),
                         time=jnp.int32(0))
        return self.get_obs(state), state

    def step_env(
        self, key: jax.Array, state: EnvState, action: int | jax.Array, params: EnvParams
    ) -> tuple[jax.Array, EnvState, jax.Array, jax.Array, dict[str, jax.Array]]:
        """Slides, scores, spawns; see the class docstring for the rules."""
        del key  # spawns come from the episode's stream (state.key), as in RAGEN
        action = jnp.asarray(action, jnp.int32)
        slid, merged = move(state.board, action, self.to_left, self.from_left)
        moved = jnp.any(slid != state.board)
        stream, key_spawn = jax.random.split(jax.random.wrap_key_data(state.key))
        board = jnp.where(moved, spawn(slid, key_spawn, params.two_prob), state.board)
        raw = jnp.where(moved, merged.astype(jnp.float32), params.invalid_act_score)
        log_reward = jnp.where(raw > 0, 0.1 * jnp.log2(raw + 1.0), 0.0)
        reward = jnp.where(params.use_log_reward, log_reward, raw).astype(jnp.float32)
        terminated = moved & ~can_move(board)
        max_tile = jnp.max(board)
        state = state.replace(
            board=board,
            score=state.score + jnp.where(moved, merged, 0),
            key=jnp.where(moved, jax.random.key_data(stream), state.key),
            time=state.time + 1,
        )
        info = {
            "success": terminated & (max_tile >= params.win_tile),
            "action_is_effective": moved,
            "score": state.score,
            "max_tile": max_tile,
        }
        return self.get_obs(state), state, reward, terminated, info

    def get_obs(
        self, state: EnvState, params: EnvParams | None = None, key: jax.Array | None = None
    ) -> jax.Array:
        """The [n, n] int32 board."""
        del params, key
        return state.board

    def level(self, state: EnvState) -> tuple[jax.Array, ...]:
        """The starting board and the spawn stream: together they fix the game."""
        return state.board, state.key

    def is_terminated(self, state: EnvState, params: EnvParams) -> jax.Array:
        return ~can_move(state.board)

    def valid_actions(self, board: jax.Array) -> jax.Array:
        """[4] bool: which actions change ``board`` (one unbatched board; jittable)."""
        slid = jax.vmap(lambda a: move(board, a, self.to_left, self.from_left)[0])(
            jnp.arange(4))
        return jnp.any(slid != board, axis=(1, 2))

    def action_space(self, params: EnvParams | None = None) -> spaces.Discrete:
        return spaces.Discrete(len(ACTION_NAMES))

    def observation_space(self, params: EnvParams | None = None) -> spaces.Box:
        return spaces.Box(0, 2 ** (self.size * self.size + 1), (self.size, self.size), jnp.int32)

    def state_space(self, params: EnvParams | None = None) -> spaces.Dict:
        params = self.default_params if params is None else params
        n = self.size
        return spaces.Dict(
            {
                "board": spaces.Box(0, 2 ** (n * n + 1), (n, n), jnp.int32),
                "score": spaces.Box(0, jnp.iinfo(jnp.int32).max, (), jnp.int32),
                "key": spaces.Box(jnp.uint32(0), jnp.uint32(2**32 - 1), (2,), jnp.uint32),
                "time": spaces.Discrete(int(params.max_steps) + 1),
            }
        )

    # ---- host-side text -------------------------------------------------------------------

    def render_text(self, state: EnvState) -> str:
        """RAGEN's text for one unbatched state."""
        board = np.asarray(state.board)
        lines = ["Current 2048 Grid:"]
        lines += [f"Row {i + 1}: [{', '.join(str(int(x)) for x in row)}]"
                  for i, row in enumerate(board)]
        valid = [a for a in range(4) if host_moves(board, a)]
        actions = ", ".join(f"{a}({ACTION_NAMES[a]})" for a in valid) if valid else "None"
        lines += ["", f"Valid Actions: {actions}.", "Goal: Merge same numbers to reach 2048.",
                  f"Current Score: {int(np.asarray(state.score))}", "What is your next move?"]
        return "\n".join(lines)


def host_moves(board: np.ndarray, action: int) -> bool:
    """Whether ``action`` changes the host ``board`` [n, n] (for the text's valid actions)."""
    n = board.shape[0]
    to_left, _ = orientations(n)
    for row in board.reshape(-1)[to_left[action]].reshape(n, n):
        tiles = [int(v) for v in row if v != 0]
        if any(int(v) != 0 for v in row[len(tiles):]):  # a gap before a tile
            return True
        if any(a == b for a, b in zip(tiles, tiles[1:], strict=False)):
            return True
    return False
