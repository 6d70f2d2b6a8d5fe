"""FrozenLake as a pure JAX environment, with RAGEN's dynamics, rewards and text rendering.

RAGEN wraps gymnasium's ``FrozenLakeEnv`` on a random map: tiles are frozen with probability
``p``, start and goal are distinct random cells, and the map is redrawn until the goal can be
reached from the start. Here the map is drawn inside ``reset`` from the PRNG key (redraws use
keys split from it, so the same key always gives the same map), and reachability is a flood
fill in a ``lax.while_loop``, so ``vmap(reset)`` builds a batch of different maps on device.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from ragen_jax.envs.base import TextEnv
from ragen_jax.envs.grid import reachable
from ragen_jax.envs.gymnax_base import spaces

# The board is each prompt's text: 64 x 64 cells are ~4,000 tokens a turn, past every
# preset's rollout.max_model_len; a larger size only allocated until memory ran out.
MAX_SIZE = 64

# Observation codes (RAGEN's ``GRID_LOOKUP`` order).
PLAYER, FROZEN, HOLE, GOAL, PLAYER_IN_HOLE, PLAYER_ON_GOAL = 0, 1, 2, 3, 4, 5
SYMBOLS = ("P", "_", "O", "G", "X", "√")  # index = observation code
SYMBOL_MEANINGS = ("player", "empty", "hole", "goal", "player in hole", "player on goal")

ACTION_NAMES = ("Left", "Down", "Right", "Up")  # gymnasium's action ids 0-3, same order
DELTAS = np.array([[0, -1], [1, 0], [0, 1], [-1, 0]], np.int32)  # [4, 2] (row, col) per action
OBSERVATION_FORMATS = ("grid", "coord", "grid_coord")

# The env instruction for ``grid`` and ``coord`` text: our wording (RAGEN's FrozenLake tag says
# "Forbid the whole and go to the target").
INSTRUCTION = (
    "You are walking on a frozen lake. Reach the goal G without falling into a hole O. The ice "
    "may be slippery, so you may move in a direction you did not choose. The answer should be "
    "a sequence of actions, like <answer>Left || Up</answer>"
)
# RAGEN V2's CoordFrozenLake instruction (``config/envs.yaml``, ``grid_coord`` text), verbatim
# but for the corner: a YAML block scalar, so its line breaks and final newline are kept (the
# legend then follows a blank line). RAGEN writes (5, 5) on its 4x4 map; here it is this
# board's bottom-right cell.
COORD_INSTRUCTION = (
    "You are solving the FrozenLake puzzle. The observation includes both a symbol grid and "
    "zero-indexed coordinates for the start, goal, player, and any holes.\n"
    "Coordinates range from the top-left corner (0, 0) to the bottom-right corner "
    "({last}, {last}).\n"
    "Beware that the ice is slippery, so the agent might slide and end up in an unintended "
    "tile.\n"
    "Respond with a sequence of actions such as <answer>Left || Up || Up</answer>.\n"
)

# Map redraws before giving up and clearing every hole (only reachable for tiny ``p``).
MAX_MAP_DRAWS = 1000


@struct.dataclass
class EnvState:
    holes: jax.Array  # [n, n] bool; start and goal are never holes
    start: jax.Array  # [2] int32, (row, col)
    goal: jax.Array  # [2] int32, (row, col); != start
    player: jax.Array  # [2] int32, (row, col)
    time: jax.Array  # int32, env steps taken


@struct.dataclass
class EnvParams:
    max_steps: int = 100
    p: float = 0.9  # probability that a tile is frozen when the map is drawn
    is_slippery: bool = True
    success_rate: float = 0.8  # P(intended move) when slippery; each perpendicular (1 - it) / 2
    goal_reward: float = 1.0


def _draw_map(key: jax.Array, size: int, p: jax.Array) -> tuple[jax.Array, ...]:
    """One candidate map: holes [n, n] bool, start [2], goal [2], and whether a path exists."""
    key_tiles, key_ends = jax.random.split(key)
    holes = jax.random.uniform(key_tiles, (size, size)) >= p
    cells = jax.random.choice(key_ends, size * size, (2,), replace=False)
    start = jnp.stack([cells[0] // size, cells[0] % size]).astype(jnp.int32)
    goal = jnp.stack([cells[1] // size, cells[1] % size]).astype(jnp.int32)
    holes = holes.at[start[0], start[1]].set(False).at[goal[0], goal[1]].set(False)
    ok = reachable(~holes, start)[goal[0], goal[1]]
    return holes, start, goal, ok


class FrozenLake(TextEnv[EnvState, EnvParams]):
    """Walk from the start to the goal over a frozen lake without falling into a hole.

    Actions 0-3: Left, Down, Right, Up. On a slippery lake the intended move happens with
    probability ``success_rate`` and each perpendicular move with ``(1 - success_rate) / 2``
    (gymnasium's ``success_rate`` semantics); a move off the board leaves the player in place.
    Reward ``goal_reward`` (1) on reaching the goal, 0 otherwise; terminated in a hole or at the
    goal; truncated after ``max_steps`` steps. A hole or the goal is absorbing: stepping there
    does not move the player and pays 0. ``info``: ``success`` (player on the goal),
    ``action_is_effective`` (the player moved) and ``move`` (the direction actually taken,
    which differs from the action after a slip).

    Observation (``get_obs``): the [size, size] int8 grid of codes into ``SYMBOLS``
    (``P _ O G X √``: player, frozen incl. the start, hole, goal, player in hole, player on goal).
    Text (``render_text``, RAGEN's three formats): ``grid`` (the symbols, rows joined by
    newlines), ``coord`` (the board size, then start, goal, player and holes as ``(row, col)``,
    a line only for what is there) or ``grid_coord`` (RAGEN's CoordFrozenLake: the coordinates,
    then the grid). For the system message: ``instruction`` (CoordFrozenLake's for
    ``grid_coord``), ``symbol_legend`` and ``observation_note`` (``coord``: which way the
    coordinates run, which RAGEN's ``coord``-only text never says; it has no such tag).

    Differences from RAGEN, all deliberate:

    - Action ids are 0-3 (RAGEN's are 1-4, mapped to gymnasium's 0-3); order and names agree.
    - The map comes from the reset key through JAX's PRNG, not NumPy's, so a seed gives a
      different (equally distributed) map than in RAGEN.
    - Truncation at ``params.max_steps`` (default 100); RAGEN's env has no time limit and relies
      on the agent's action budget.
    - The map is redrawn at most ``MAX_MAP_DRAWS`` times; if no draw has a path (only plausible
      for ``p`` near 0), the last draw's holes are all cleared. RAGEN would loop forever.
    - CoordFrozenLake's instruction names this board's bottom-right corner; RAGEN's says
      (5, 5) on its 4x4 map.
    - ``grid`` and ``coord`` text get our own instruction (``INSTRUCTION``).
    - ``goal_reward`` is a param (RAGEN's is fixed at 1).
    """

    action_names = ACTION_NAMES
    params_cls = EnvParams

    def __init__(self, size: int = 4, observation_format: str = "grid") -> None:
        super().__init__()
        if not 2 <= size <= MAX_SIZE:
            raise ValueError(f"FrozenLake size must be in [2, {MAX_SIZE}], got {size}")
        if observation_format not in OBSERVATION_FORMATS:
            raise ValueError(
                f"unknown observation_format {observation_format!r}; one of {OBSERVATION_FORMATS}"
            )
        self.size = size
        self.observation_format = observation_format

    @property
    def default_params(self) -> EnvParams:
        return EnvParams()

    def reset_env(self, key: jax.Array, params: EnvParams) -> tuple[jax.Array, EnvState]:
        """Draws a map with a start-to-goal path; the player stands on the start."""
        key, key_draw = jax.random.split(key)
        holes, start, goal, ok = _draw_map(key_draw, self.size, params.p)

        def cond(carry: tuple[Any, ...]) -> jax.Array:
            _, draws, _, _, _, ok = carry
            return ~ok & (draws < MAX_MAP_DRAWS)

        def body(carry: tuple[Any, ...]) -> tuple[Any, ...]:
            key, draws, *_ = carry
            key, key_draw = jax.random.split(key)
            return (key, draws + 1, *_draw_map(key_draw, self.size, params.p))

        _, _, holes, start, goal, ok = jax.lax.while_loop(
            cond, body, (key, jnp.int32(1), holes, start, goal, ok)
        )
        holes = holes & ok  # the fallback: no path after MAX_MAP_DRAWS draws -> no holes
        state = EnvState(holes=holes, start=start, goal=goal, player=start, time=jnp.int32(0))
        return self.get_obs(state), state

    def step_env(
        self, key: jax.Array, state: EnvState, action: int | jax.Array, params: EnvParams
    ) -> tuple[jax.Array, EnvState, jax.Array, jax.Array, dict[str, jax.Array]]:
        """Moves the player (maybe slipping); see the class docstring for the rules."""
        action = jnp.asarray(action, jnp.int32)
        row, col = state.player[0], state.player[1]
        was_done = state.holes[row, col] | jnp.all(state.player == state.goal)

        # Slip: intended with success_rate, (a - 1) % 4 or (a + 1) % 4 with (1 - it) / 2 each.
        success_rate = jnp.where(params.is_slippery, params.success_rate, 1.0)
        u = jax.random.uniform(key)
        move = jnp.where(
            u < success_rate,
            action,
            jnp.where(u < success_rate + (1.0 - success_rate) / 2, (action - 1) % 4, (action + 1) % 4),
        )
        target = jnp.clip(state.player + jnp.asarray(DELTAS)[move], 0, self.size - 1)  # [2]
        player = jnp.where(was_done, state.player, target)

        at_goal = jnp.all(player == state.goal)
        in_hole = state.holes[player[0], player[1]]
        reward = jnp.where(at_goal & ~was_done, params.goal_reward, 0.0).astype(jnp.float32)
        terminated = at_goal | in_hole
        info = {
            "success": at_goal,
            "action_is_effective": jnp.any(player != state.player),
            "move": move.astype(jnp.int32),
        }
        state = state.replace(player=player, time=state.time + 1)
        return self.get_obs(state), state, reward, terminated, info

    def get_obs(
        self, state: EnvState, params: EnvParams | None = None, key: jax.Array | None = None
    ) -> jax.Array:
        """The [n, n] int8 grid of observation codes (indices into ``SYMBOLS``)."""
        del params, key
        grid = jnp.where(state.holes, HOLE, FROZEN).astype(jnp.int8)
        grid = grid.at[state.goal[0], state.goal[1]].set(GOAL)
        row, col = state.player[0], state.player[1]
        here = grid[row, col]
        code = jnp.where(here == HOLE, PLAYER_IN_HOLE, jnp.where(here == GOAL, PLAYER_ON_GOAL, PLAYER))
        return grid.at[row, col].set(code.astype(jnp.int8))

    def level(self, state: EnvState) -> tuple[jax.Array, ...]:
        """The map: holes, start and goal."""
        return state.holes, state.start, state.goal

    def holdout_fields(self, state: EnvState) -> tuple[jax.Array, ...]:
        """``grid`` text shows holes, goal and player, not the start, so a training level on a
        validation level's holes and goal could walk onto that level's starting board: held
        out is the map without its start (no step changes it). ``coord`` and ``grid_coord`` text
        name the start in every state, so there the level is enough."""
        return (state.holes, state.goal) if self.observation_format == "grid" else self.level(state)

    def is_terminated(self, state: EnvState, params: EnvParams) -> jax.Array:
        return state.holes[state.player[0], state.player[1]] | jnp.all(state.player == state.goal)

    def action_space(self, params: EnvParams | None = None) -> spaces.Discrete:
        return spaces.Discrete(len(ACTION_NAMES))

    def observation_space(self, params: EnvParams | None = None) -> spaces.Box:
        return spaces.Box(0, len(SYMBOLS) - 1, (self.size, self.size), jnp.int8)

    def state_space(self, params: EnvParams | None = None) -> spaces.Dict:
        params = self.default_params if params is None else params
        n = self.size
        return spaces.Dict(
            {
                "holes": spaces.Box(0, 1, (n, n), jnp.bool_),
                "start": spaces.Box(0, n - 1, (2,), jnp.int32),
                "goal": spaces.Box(0, n - 1, (2,), jnp.int32),
                "player": spaces.Box(0, n - 1, (2,), jnp.int32),
                "time": spaces.Discrete(int(params.max_steps) + 1),
            }
        )

    # ---- host-side text -------------------------------------------------------------------

    @property
    def instruction(self) -> str:
        """The system message's env instruction: CoordFrozenLake's for ``grid_coord``, ours
        otherwise."""
        if self.observation_format == "grid_coord":
            return COORD_INSTRUCTION.format(last=self.size - 1)
        return INSTRUCTION

    def symbol_legend(self) -> str:
        """``"P: player, _: empty, ..."`` (RAGEN's ``grid_vocab``), for grid formats."""
        return ", ".join(f"{s}: {m}" for s, m in zip(SYMBOLS, SYMBOL_MEANINGS, strict=True))

    def observation_note(self) -> str:
        """What the system message says about reading ``coord`` text (which way its
        coordinates run); the other formats need none."""
        return coord_note(self.size) if self.observation_format == "coord" else ""

    def render_text(self, state: EnvState, fmt: str | None = None) -> str:
        """The text for one unbatched state, in ``fmt`` (default: the constructor's format)."""
        fmt = self.observation_format if fmt is None else fmt
        if fmt == "grid":
            return "\n".join("".join(SYMBOLS[c] for c in row) for row in symbol_grid(state))
        if fmt == "coord":
            return coord_text(state)
        if fmt == "grid_coord":
            return ("Coordinates: \n" + coord_text(state) + "\nGrid Map: \n"
                    + self.render_text(state, "grid"))
        raise ValueError(f"unknown observation format {fmt!r}; one of {OBSERVATION_FORMATS}")


def symbol_grid(state: EnvState) -> np.ndarray:
    """NumPy twin of ``FrozenLake.get_obs`` for one host state: [n, n] int8 codes."""
    holes = np.asarray(state.holes, bool)
    grid = np.where(holes, HOLE, FROZEN).astype(np.int8)
    goal = tuple(int(v) for v in np.asarray(state.goal))
    player = tuple(int(v) for v in np.asarray(state.player))
    grid[goal] = GOAL
    grid[player] = {HOLE: PLAYER_IN_HOLE, GOAL: PLAYER_ON_GOAL}.get(int(grid[player]), PLAYER)
    return grid


def coord_note(size: int) -> str:
    """Which way ``coord`` coordinates run, said once in the system message."""
    return (f"Coordinates are (row, col), from (0, 0) at the top left to ({size - 1}, "
            f"{size - 1}) at the bottom right.")


def coord_text(state: EnvState) -> str:
    """RAGEN's ``coord`` rendering of one host state: the board size, then Start, Goal, the
    player (``Player``, ``Player on goal`` or ``Player in hole``) and Holes, each line only when
    it has a cell (a map without holes has no Holes line)."""
    holes = np.asarray(state.holes, bool)
    start = tuple(int(v) for v in np.asarray(state.start))
    goal = tuple(int(v) for v in np.asarray(state.goal))
    player = tuple(int(v) for v in np.asarray(state.player))
    rows, cols = holes.shape
    if player == goal:
        player_label = "Player on goal"
    elif holes[player]:
        player_label = "Player in hole"
    else:
        player_label = "Player"
    lines = [f"Board size: {rows} rows x {cols} cols (zero-indexed).", f"Start: {start}",
             f"Goal: {goal}", f"{player_label}: {player}"]
    hole_cells = [(int(r), int(c)) for r, c in zip(*np.nonzero(holes), strict=True)]
    if hole_cells:
        lines.append("Holes: " + ", ".join(str(h) for h in hole_cells))
    return "\n".join(lines)
