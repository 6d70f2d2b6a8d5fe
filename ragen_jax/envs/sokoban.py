"""Sokoban as a pure JAX environment, with RAGEN's dynamics, rewards and text rendering.

Levels are generated inside ``reset`` from the PRNG key, the way gym-sokoban (and RAGEN, which
adapts it) does: a random-walk room topology, the player and the boxes placed on floor with
every box on its own target, then reverse play (the player *pulls* boxes) away from the
solved position. Reverse play makes every level solvable by construction.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from gymnax.environments import spaces

from ragen_jax.envs.base import TextEnv
from ragen_jax.envs.grid import reachable

# Fixed cells (``room_fixed``).
WALL, FLOOR, TARGET = 0, 1, 2
# Observation codes, RAGEN's ``room_state`` values plus 6 for the player standing on a target.
BOX_ON_TARGET, BOX, PLAYER, PLAYER_ON_TARGET = 3, 4, 5, 6

ACTION_NAMES = ("Up", "Down", "Left", "Right")
DELTAS = np.array([[-1, 0], [1, 0], [0, -1], [0, 1]], np.int32)  # (row, col) per action

GRID_VOCAB = {WALL: "#", FLOOR: "_", TARGET: "O", BOX_ON_TARGET: "√", BOX: "X", PLAYER: "P",
              PLAYER_ON_TARGET: "S"}
# RAGEN's SokobanDifferentGridVocab.
ALT_GRID_VOCAB = {WALL: "W", FLOOR: ".", TARGET: "G", BOX_ON_TARGET: "C", BOX: "B", PLAYER: "A",
                  PLAYER_ON_TARGET: "@"}
GRID_VOCABS = {"default": GRID_VOCAB, "alt": ALT_GRID_VOCAB}
SYMBOL_MEANINGS = {WALL: "wall", FLOOR: "empty", TARGET: "target", BOX_ON_TARGET: "box on target",
                   BOX: "box", PLAYER: "player", PLAYER_ON_TARGET: "player on target"}
OBSERVATION_FORMATS = ("grid", "coord", "grid_coord")

# (walks, pulls per walk) of the reverse search for 1, 2, 3 and more boxes (see ``Sokoban``).
_SEARCH_EFFORT = ((2, 8), (16, 16), (64, 72))

# gym-sokoban's five 3x3 floor stamps for the topology random walk.
_STAMPS = np.array([
    [[0, 0, 0], [1, 1, 1], [0, 0, 0]],
    [[0, 1, 0], [0, 1, 0], [0, 1, 0]],
    [[0, 0, 0], [1, 1, 0], [0, 1, 0]],
    [[0, 0, 0], [1, 1, 0], [1, 1, 0]],
    [[0, 0, 0], [0, 1, 1], [0, 1, 0]],
], bool)


@struct.dataclass
class EnvState:
    room_fixed: jax.Array  # [H, W] int8: WALL, FLOOR or TARGET
    boxes: jax.Array  # [H, W] bool
    player: jax.Array  # [2] int32, (row, col)
    boxes_on_target: jax.Array  # int32
    time: jax.Array  # int32, env steps taken


@struct.dataclass
class EnvParams:
    max_steps: int = 100
    step_penalty: float = -0.1
    box_on_target_reward: float = 1.0
    box_off_target_penalty: float = -1.0
    finished_reward: float = 10.0


class Sokoban(TextEnv[EnvState, EnvParams]):
    """Push every box onto a target. Actions 0-3: Up, Down, Left, Right.

    Each action is gym-sokoban's push action: the player steps in that direction, pushing a box
    if one is there and the cell behind it is free; a push into a wall or a second box leaves
    everything in place. Rewards: ``step_penalty`` every step, ``box_on_target_reward`` when the
    count of boxes on targets rises, ``box_off_target_penalty`` when it falls, and
    ``finished_reward`` when all boxes are on targets (terminated). Truncated after
    ``max_steps`` steps. ``info``: ``success`` (all boxes on targets), ``action_is_effective``
    (the player moved).

    Differences from RAGEN, all deliberate:

    - Action ids are 0-3 (RAGEN: 1-4); the names and their order are the same.
    - RAGEN's reverse play is a depth-first search over moves (``search_depth``, at most 300k
      states; moving away from a box pulls it) that keeps the state maximising ``box_swaps *
      total box displacement`` with all targets uncovered. Here ``num_walks`` walks of at most
      ``num_pulls`` pulls run in parallel on device (``_reverse_search``): each step walks the
      player along a shortest path to a box and pulls it, the moves counted against RAGEN's
      ``search_depth - 2`` (one less for a shallow one-box search: ``search_budget``); every
      state reached (with ``lookahead``, every state one pull away) gets RAGEN's score and the
      best is kept. The defaults by number of boxes and depth are calibrated so that
      BFS-optimal solution lengths match a RAGEN-style generator at 6x6/1, 8x8/2 and 10x10/3
      boxes, depths 10 and 300
      (``experiments/results/bench_envs_sokoban.md``, which also says where they fall short).
    - Retries are deterministic: ``num_layouts`` cheap layouts are drawn per try and reverse
      play runs on the first ``searches_per_try`` where some box can be pulled; a try that
      still fails repeats from ``fold_in(key, try)``, at most ``max_tries`` times. A level
      whose every try failed is ``fallback_level`` (each box one push from its target), never
      a solved one; ``generate_level`` reports it. RAGEN retries from Python's per-process
      salted ``hash``.
    - The observation for the agent is built host side by ``render_text``; ``get_obs``
      returns the RAGEN ``room_state`` codes (plus 6 = player on target) as a device array
      for non-LLM agents.
    """

    action_names = ACTION_NAMES
    params_cls = EnvParams

    def __init__(
        self,
        dim_room: tuple[int, int] = (6, 6),
        num_boxes: int = 1,
        search_depth: int = 300,
        num_walks: int | None = None,
        num_pulls: int | None = None,
        greedy: float | None = None,
        lookahead: bool | None = None,
        num_layouts: int = 6,
        searches_per_try: int | None = None,
        max_tries: int = 32,
        observation_format: str = "grid",
        grid_vocab: str = "default",
    ):
        height, width = (int(d) for d in dim_room)
        if not (5 <= height <= 31 and 5 <= width <= 31):
            raise ValueError(f"sokoban: dim_room must be within (5, 5)..(31, 31), got {dim_room}")
        if not 1 <= num_boxes <= 8:
            raise ValueError(f"sokoban: num_boxes must be in 1..8, got {num_boxes}")
        if search_depth < 3:
            raise ValueError(f"sokoban: search_depth must be >= 3, got {search_depth}")
        if observation_format not in OBSERVATION_FORMATS:
            raise ValueError(
                f"sokoban: observation_format must be one of {OBSERVATION_FORMATS}, "
                f"got {observation_format!r}")
        if grid_vocab not in GRID_VOCABS:
            raise ValueError(f"sokoban: grid_vocab must be one of {tuple(GRID_VOCABS)}, got {grid_vocab!r}")
        self.dim_room = (height, width)
        self.num_boxes = int(num_boxes)
        self.search_depth = int(search_depth)
        if num_boxes > width - 2:
            raise ValueError(f"sokoban: num_boxes must be at most width - 2 = {width - 2}, got {num_boxes}")
        # Reverse-search effort, calibrated so that the optimal solution lengths match RAGEN's
        # DFS (experiments/bench_envs.py): (walks, pulls per walk) by number of boxes. A shallow
        # search (under 16 moves) is weaker in RAGEN (its DFS marks a state explored on the
        # first, often deepest, path that reaches it), so one unbiased walk with one box.
        budget = self.search_depth - 2
        shallow = budget < 16
        walks, pulls = _SEARCH_EFFORT[min(num_boxes, len(_SEARCH_EFFORT)) - 1]
        one_shallow = num_boxes == 1 and shallow
        self.num_walks = int(num_walks if num_walks is not None
                             else 1 if one_shallow else 16 if shallow else walks)
        self.num_pulls = int(num_pulls if num_pulls is not None else min(budget, pulls))
        # Moves of reverse play: RAGEN's DFS reaches states ``search_depth - 2`` moves deep, but
        # a shallow one with one box reaches fewer of them than a shortest-path walk does (a
        # state explored first along a long path is never re-expanded from a shorter one): one
        # move less matches its lengths (6x6, depth 10: mean 3.26 vs 3.21, 3.40 at the full
        # budget).
        self.search_budget = max(1, budget - 1) if one_shallow else budget
        # Deep multi-box searches pull away from the targets more often (0.7: 8x8/2 mean 12.99
        # vs 12.85 at 0.5, RAGEN-style 13.71; 10x10/3 24.39 vs 23.65, RAGEN-style 25.78).
        self.greedy = float(greedy if greedy is not None else 0.0 if one_shallow
                            else 0.7 if num_boxes > 1 and not shallow else 0.5)
        self.lookahead = bool(lookahead if lookahead is not None else num_boxes > 1)
        self.num_layouts = int(num_layouts)
        # With several boxes a search can fail to uncover every target (shallow ones mostly do,
        # RAGEN's too): searching a few layouts per try keeps the retry loop short there. Deep
        # searches fail ~20% of the time at 10x10 with 3 boxes; a batch retries only its failed
        # levels (``generate_level``), so one layout per try is cheapest.
        self.searches_per_try = int(searches_per_try if searches_per_try is not None
                                    else 4 if shallow and num_boxes > 1 else 1)
        self.max_tries = int(max_tries)
        self.num_gen_steps = int(1.7 * (height + width))
        self.observation_format = observation_format
        self.grid_vocab = GRID_VOCABS[grid_vocab]

    @property
    def default_params(self) -> EnvParams:
        return EnvParams()

    # ------------------------------------------------------------------ dynamics

    def step_env(
        self, key: jax.Array, state: EnvState, action: int | jax.Array, params: EnvParams
    ) -> tuple[jax.Array, EnvState, jax.Array, jax.Array, dict[str, Any]]:
        del key
        height, width = self.dim_room
        delta = jnp.asarray(DELTAS)[action]
        one = jnp.clip(state.player + delta, 0, jnp.array([height - 1, width - 1]))
        two = jnp.clip(state.player + 2 * delta, 0, jnp.array([height - 1, width - 1]))
        box_one = state.boxes[one[0], one[1]]
        floor_one = state.room_fixed[one[0], one[1]] != WALL
        free_two = (state.room_fixed[two[0], two[1]] != WALL) & ~state.boxes[two[0], two[1]]
        push = box_one & free_two
        moved = push | (floor_one & ~box_one)
        boxes = state.boxes.at[one[0], one[1]].set(box_one & ~push)
        boxes = boxes.at[two[0], two[1]].set(boxes[two[0], two[1]] | push)
        player = jnp.where(moved, one, state.player)

        on_target = jnp.sum(boxes & (state.room_fixed == TARGET), dtype=jnp.int32)
        solved = on_target == self.num_boxes
        reward = (
            params.step_penalty
            + jnp.where(on_target > state.boxes_on_target, params.box_on_target_reward, 0.0)
            + jnp.where(on_target < state.boxes_on_target, params.box_off_target_penalty, 0.0)
            + jnp.where(solved, params.finished_reward, 0.0)
        ).astype(jnp.float32)
        state = EnvState(state.room_fixed, boxes, player, on_target, state.time + 1)
        info = {"success": solved, "action_is_effective": moved}
        return self.get_obs(state), state, reward, solved, info

    def reset_env(self, key: jax.Array, params: EnvParams) -> tuple[jax.Array, EnvState]:
        """Generates a level from ``key`` (the same key always gives the same level)."""
        del params
        _, state = generate_level(
            key, self.dim_room, self.num_boxes, self.num_gen_steps, self.search_budget,
            self.num_walks, self.num_pulls, self.greedy, self.lookahead, self.num_layouts,
            self.searches_per_try,
            self.max_tries)
        return self.get_obs(state), state

    def is_terminated(self, state: EnvState, params: EnvParams) -> jax.Array:
        return state.boxes_on_target == self.num_boxes

    def level(self, state: EnvState) -> tuple[jax.Array, ...]:
        """Room, boxes and player (the rest follows from them)."""
        return state.room_fixed, state.boxes, state.player

    def get_obs(self, state: EnvState, params: EnvParams | None = None, key=None) -> jax.Array:
        """RAGEN's room codes: 0 wall, 1 floor, 2 target, 3 box on target, 4 box, 5 player, 6
        player on target.  # [H, W] int8"""
        del params, key
        return room_codes(state.room_fixed, state.boxes, state.player)

    # ------------------------------------------------------------------ spaces

    def action_space(self, params: EnvParams | None = None) -> spaces.Discrete:
        return spaces.Discrete(len(ACTION_NAMES))

    def observation_space(self, params: EnvParams) -> spaces.Box:
        return spaces.Box(0, PLAYER_ON_TARGET, self.dim_room, jnp.int8)

    def state_space(self, params: EnvParams) -> spaces.Dict:
        height, width = self.dim_room
        return spaces.Dict({
            "room_fixed": spaces.Box(WALL, TARGET, self.dim_room, jnp.int8),
            "boxes": spaces.Box(0, 1, self.dim_room, jnp.bool_),
            "player": spaces.Box(0, max(height, width) - 1, (2,), jnp.int32),
            "boxes_on_target": spaces.Discrete(self.num_boxes + 1),
            "time": spaces.Discrete(params.max_steps + 1),
        })

    # ------------------------------------------------------------------ text (host side)

    def render_text(self, state: EnvState, observation_format: str | None = None) -> str:
        """RAGEN's text observation of one unbatched state: ``grid``, ``coord`` or
        ``grid_coord``."""
        fmt = observation_format or self.observation_format
        codes = np.asarray(room_codes(np.asarray(state.room_fixed), np.asarray(state.boxes),
                                      np.asarray(state.player), xp=np))
        if fmt == "grid":
            return "\n".join("".join(self.grid_vocab[int(c)] for c in row) for row in codes)
        if fmt == "coord":
            return _coord_text(codes, np.asarray(state.room_fixed))
        if fmt == "grid_coord":
            return ("Coordinates: \n" + _coord_text(codes, np.asarray(state.room_fixed))
                    + "\nGrid Map: \n" + self.render_text(state, "grid"))
        raise ValueError(f"sokoban: unknown observation_format {fmt!r}")

    def symbol_legend(self) -> str:
        """``"#: wall, _: empty, ..."``, for the system prompt in grid formats."""
        return ", ".join(f"{self.grid_vocab[c]}: {SYMBOL_MEANINGS[c]}" for c in SYMBOL_MEANINGS)


def room_codes(room_fixed, boxes, player, xp=jnp):
    """Combines fixed cells, boxes and player into RAGEN's codes (see ``get_obs``)."""
    codes = xp.where(boxes, xp.where(room_fixed == TARGET, BOX_ON_TARGET, BOX), room_fixed)
    height, width = room_fixed.shape
    is_player = (xp.arange(height)[:, None] == player[0]) & (xp.arange(width)[None, :] == player[1])
    player_code = xp.where(room_fixed == TARGET, PLAYER_ON_TARGET, PLAYER)
    return xp.where(is_player, player_code, codes).astype(xp.int8)


def _coord_text(codes: np.ndarray, room_fixed: np.ndarray) -> str:
    height, width = codes.shape

    def cells(mask: np.ndarray) -> str:
        return ", ".join(f"({r}, {c})" for r, c in np.argwhere(mask))

    lines = [f"Board size: {height} rows x {width} cols (zero-indexed)."]
    for label, mask in (
        ("Targets", room_fixed == TARGET),
        ("Boxes", codes == BOX),
        ("Boxes on target", codes == BOX_ON_TARGET),
        ("Player", codes == PLAYER),
        ("Player on target", codes == PLAYER_ON_TARGET),
    ):
        if mask.any():
            lines.append(f"{label}: {cells(mask)}")
    return "\n".join(lines)


# ---------------------------------------------------------------------- level generation


def _room_topology(key: jax.Array, dim_room: tuple[int, int], num_steps: int,
                   p_change_direction: float = 0.35) -> jax.Array:
    """gym-sokoban's random walk of 3x3 floor stamps; the border is wall.  # [H, W] bool"""
    height, width = dim_room
    bits = jax.random.bits(key, (num_steps + 1,))  # one 32-bit word per step (+1 for the start)
    first = bits[0]
    step_bits = bits[1:]
    return topology_from_draws(
        dim_room,
        start=1 + jnp.stack([_below(first, height - 1, 0), _below(first, width - 1, 8)]),
        first_direction=_below(first, 4, 16),
        change=_unit16(step_bits, 0) < p_change_direction,
        new_direction=_below(step_bits, 4, 16),
        stamp=_below(step_bits, len(_STAMPS), 24))


# Level generation draws raw 32-bit words and cuts them into small uniform numbers: on CPU,
# threefry costs about 10 ns per word, which dominated generation when every coin flip and
# every noise value took a word of its own. Resolution: 8 bits for small choices (bias below
# 1/256 of a cell), 16 bits for probabilities and tie-breaking noise.
def _below(bits: jax.Array, n: int, shift: int) -> jax.Array:
    """A nearly uniform integer in [0, n) from the 8 bits at ``shift``."""
    return (((bits >> shift) & 0xFF) * n >> 8).astype(jnp.int32)


def _unit16(bits: jax.Array, shift: int) -> jax.Array:
    """A uniform float in [0, 1) on a 2**-16 grid, from the 16 bits at ``shift``."""
    return ((bits >> shift) & 0xFFFF).astype(jnp.float32) / 65536.0


def _noise16(key: jax.Array, n: int) -> jax.Array:
    """``n`` uniform floats on a 2**-16 grid from ``ceil(n / 2)`` words (argmax tie-breaking)."""
    words = jax.random.bits(key, ((n + 1) // 2,))
    return jnp.stack([_unit16(words, 0), _unit16(words, 16)], -1).reshape(-1)[:n]


# Walk directions (row, col), in gym-sokoban's order; the stamps as 9-bit masks (bit 3r + c).
WALK_DIRECTIONS = np.array([[1, 0], [0, 1], [-1, 0], [0, -1]], np.int32)
_STAMP_BITS = np.array([sum(1 << i for i, v in enumerate(s.reshape(-1)) if v) for s in _STAMPS], np.int32)


def topology_from_draws(dim_room: tuple[int, int], start: jax.Array, first_direction: jax.Array,
                        change: jax.Array, new_direction: jax.Array, stamp: jax.Array) -> jax.Array:
    """The random walk given its random draws: ``start`` [2], ``first_direction`` (),
    per step ``change`` [T] bool, ``new_direction`` [T], ``stamp`` [T].  # [H, W] bool

    The walk itself is a scan over positions; the stamps are OR-ed as per-row bit masks
    (a scatter per step is several times slower under ``vmap``). Rooms up to 31 wide."""
    height, width = dim_room
    directions = jnp.asarray(WALK_DIRECTIONS)
    low, high = jnp.array([1, 1]), jnp.array([height - 2, width - 2])

    def walk(carry, xs):
        pos, direction = carry
        change_t, new_dir_t = xs
        direction = jnp.where(change_t, new_dir_t, direction)
        pos = jnp.clip(pos + directions[direction], low, high)
        return (pos, direction), pos

    _, centres = jax.lax.scan(walk, (start, first_direction), (change, new_direction))  # [T, 2]
    # Row r of the level as a bit mask over columns: OR over steps of the stamp's row
    # (r - centre_row + 1), a 3-bit pattern, shifted to start at column centre_col - 1.
    dr = jnp.arange(height)[None, :] - centres[:, 0, None] + 1  # [T, H]
    pattern = (jnp.asarray(_STAMP_BITS)[stamp][:, None] >> (3 * jnp.clip(dr, 0, 2))) & 7
    pattern = jnp.where((dr >= 0) & (dr < 3), pattern << (centres[:, 1, None] - 1), 0)
    row_bits = jax.lax.reduce(pattern, np.int32(0), jax.lax.bitwise_or, (0,))  # [H]
    level = ((row_bits[:, None] >> jnp.arange(width)[None, :]) & 1).astype(bool)
    rows = jnp.arange(height)[:, None]
    cols = jnp.arange(width)[None, :]
    interior = (rows > 0) & (rows < height - 1) & (cols > 0) & (cols < width - 1)
    return level & interior


_UNREACHED = 1 << 20
# A batched generate_level retries failed levels in chunks of batch size / _RETRY_CHUNKS.
_RETRY_CHUNKS = 16


def _row_bits(mask: jax.Array) -> jax.Array:
    """A [..., H, W] bool grid as per-row bit masks (bit c = column c).  # [..., H] int32"""
    width = mask.shape[-1]
    return jnp.sum(mask.astype(jnp.int32) << jnp.arange(width, dtype=jnp.int32), -1)


def _bit(rows: jax.Array, cells: jax.Array) -> jax.Array:
    """The bits of ``cells`` [..., 2] in the row masks ``rows`` [H].  # [...] int32 (0 or 1)"""
    return (rows[cells[..., 0]] >> cells[..., 1]) & 1


def _distances(passable: jax.Array, start: jax.Array, cells: jax.Array, max_dist: int) -> jax.Array:
    """Walking distance from ``start`` [2] to each of ``cells`` [C, 2] through the ``passable``
    row masks [H] (breadth-first, a layer per iteration, on bit masks); ``_UNREACHED`` beyond
    ``max_dist`` or where no path exists.  # [C] int32"""
    height = passable.shape[0]
    zero = jnp.zeros(1, jnp.int32)
    reach = jnp.zeros(height, jnp.int32).at[start[0]].set(1 << start[1])
    dist = jnp.where(_bit(reach, cells) == 1, 0, _UNREACHED)

    def layer(carry):
        reach, dist, i, _ = carry
        grown = reach | (reach << 1) | (reach >> 1)
        grown = grown | jnp.concatenate([reach[1:], zero]) | jnp.concatenate([zero, reach[:-1]])
        grown = (grown & passable) | reach
        dist = jnp.where((dist == _UNREACHED) & (_bit(grown, cells) == 1), i + 1, dist)
        return grown, dist, i + 1, jnp.any(grown != reach)

    _, dist, _, _ = jax.lax.while_loop(lambda c: c[3] & (c[2] < max_dist), layer,
                                       (reach, dist, jnp.int32(0), jnp.bool_(True)))
    return dist


def _reverse_search(key, floor, player, targets, num_walks, num_pulls, budget, greedy, lookahead):
    """Reverse play from the solved position, emulating the outcome of RAGEN's depth-first
    search: ``num_walks`` independent walks of at most ``num_pulls`` pulls each, in parallel.

    A step of a walk is one *pull*: the player walks (shortest path, pulling nothing) to a cell
    next to a box and steps away from it, dragging the box one cell. Walking plus pulling costs
    moves; a walk stops when no pull fits in ``budget`` moves (RAGEN's DFS reaches states at most
    ``search_depth - 2`` moves deep). The pull is random among those available, restricted with
    probability ``greedy`` to those taking the box further from its target. Every state a pull
    leads to (with ``lookahead``, also the pulls not followed) is scored like RAGEN's room score: ``box_swaps * sum |box - its
    target|_1`` (zero while a box or the player covers a target; a swap is a pull of another box
    than the previous pull). Returns the best over all walks: (score, player [2], boxes [N, 2]).
    """
    height, width = floor.shape
    n = targets.shape[0]
    deltas = jnp.asarray(DELTAS)
    floor_rows = _row_bits(floor)
    target_rows = _row_bits(jnp.zeros((height, width), bool).at[targets[:, 0], targets[:, 1]].set(True))
    max_dist = min(budget, (height - 2) * (width - 2))
    # Per walk step: 16-bit tie-breaking noise per candidate pull; bits 16-23 of the first word
    # are the greedy coin.
    bits = jax.random.bits(key, (num_pulls, num_walks, 4 * n))
    noise = (bits & 0xFFFF).astype(jnp.int32)
    greedy_coin = ((bits[..., 0] >> 16) & 0xFF) < int(round(greedy * 256))
    which = jnp.arange(4 * n) // 4  # candidate pull c moves box c // 4 in direction c % 4
    tgt = targets[which]
    limit = jnp.array([height - 1, width - 1])

    def pull(carry, xs):
        pos, boxes, moves, last, swaps, best = carry
        noise, coin = xs
        on_target = _bit(target_rows, boxes) == 1  # [N]
        passable = floor_rows & ~_row_bits(jnp.zeros((height, width), bool).at[boxes[:, 0], boxes[:, 1]].set(True))
        old = boxes[which]  # [4N, 2]
        stand = old + deltas[jnp.arange(4 * n) % 4]  # the box's new cell; the player walks here
        dest = jnp.clip(stand + deltas[jnp.arange(4 * n) % 4], 0, limit)  # where the player ends
        dist = _distances(passable, pos, stand, max_dist)
        ok = ((_bit(passable, stand) == 1) & (_bit(passable, dest) == 1)
              & (moves + dist + 1 <= budget))
        # Score every reachable next state.
        old_d = jnp.abs(old - tgt).sum(-1)
        new_d = jnp.abs(stand - tgt).sum(-1)
        others_cover = jnp.stack([jnp.any(on_target & (jnp.arange(n) != i)) for i in range(n)])
        covered = others_cover[which] | (_bit(target_rows, stand) == 1) | (_bit(target_rows, dest) == 1)
        cand_score = (swaps + (which != last)) * (jnp.abs(boxes - targets).sum() - old_d + new_d)
        cand_score = jnp.where(ok & ~covered, cand_score, 0)
        top = jnp.argmax(cand_score)
        # Follow one of them.
        c = jnp.argmax(jnp.where(ok, noise + jnp.where(coin & (new_d > old_d), 1 << 16, 0), -1))
        top = top if lookahead else c
        better = cand_score[top] > best[0]
        top_boxes = jnp.where((jnp.arange(n) == which[top])[:, None], stand[top], boxes)
        best = (jnp.where(better, cand_score[top], best[0]), jnp.where(better, dest[top], best[1]),
                jnp.where(better, top_boxes, best[2]))
        go = ok[c]
        boxes = jnp.where(go & (jnp.arange(n) == which[c])[:, None], stand[c], boxes)
        pos = jnp.where(go, dest[c], pos)
        moves = moves + jnp.where(go, dist[c] + 1, budget)  # a walk with no pull left stops
        swaps = swaps + (go & (which[c] != last))
        last = jnp.where(go, which[c], last)
        return (pos, boxes, moves, last, swaps, best), None

    def walk(noise, coin):
        zero = jnp.int32(0)
        carry = (player, targets, zero, jnp.int32(-1), zero, (zero, player, targets))
        (_, _, _, _, _, best), _ = jax.lax.scan(pull, carry, (noise, coin))
        return best

    scores, pos, boxes = jax.vmap(walk, in_axes=(1, 1))(noise, greedy_coin)
    top = jnp.argmax(scores)
    return scores[top], pos[top], boxes[top]


def _wander(key, floor, boxes_grid, player, displacement, max_moves=3):
    """RAGEN's finishing touch: the player, who ends reverse play next to a box, walks 1-3
    non-revisiting steps with probability 0.8 (total displacement 1) or 0.5, each further step
    with probability 0.5."""
    k_move, k_steps = jax.random.split(key)
    p_move = jnp.where(displacement == 1, 0.8, 0.5)
    active = jax.random.uniform(k_move) < p_move
    deltas = jnp.asarray(DELTAS)
    height, width = floor.shape
    visited = jnp.zeros((height, width), bool).at[player[0], player[1]].set(True)

    def step(i, carry):
        pos, visited, active = carry
        k_choice, k_go_on = jax.random.split(jax.random.fold_in(k_steps, i))
        nxt = jnp.clip(pos[None] + deltas, 0, jnp.array([height - 1, width - 1]))  # [4, 2]
        ok = floor[nxt[:, 0], nxt[:, 1]] & ~boxes_grid[nxt[:, 0], nxt[:, 1]] & ~visited[nxt[:, 0], nxt[:, 1]]
        choice = jnp.argmax(jnp.where(ok, jax.random.uniform(k_choice, (4,)), -1.0))
        go = active & ok.any()
        pos = jnp.where(go, nxt[choice], pos)
        visited = visited.at[pos[0], pos[1]].set(True)
        active = go & (jax.random.uniform(k_go_on) < 0.5)
        return pos, visited, active

    pos, _, _ = jax.lax.fori_loop(0, max_moves, step, (player, visited, active))
    return pos


def _layout(key, dim_room, num_boxes, num_gen_steps):
    """Topology plus player and targets (boxes start on them). Cheap; returns
    (floor [H, W] bool, player [2], targets [N, 2], plausible) where ``plausible`` says the room
    has enough floor and the player can reach a cell from which some box can be pulled (without
    which reverse play cannot move any box)."""
    height, width = dim_room
    k_topo, k_place = jax.random.split(key)
    floor = _room_topology(k_topo, dim_room, num_gen_steps)
    # Player, then targets on distinct floor cells, each uniform (argmax of iid noise).
    noise = _noise16(k_place, height * width)
    flat_floor = floor.reshape(-1)
    player_flat = jnp.argmax(jnp.where(flat_floor, noise, -1.0))
    free = flat_floor.at[player_flat].set(False)
    _, target_flat = jax.lax.top_k(jnp.where(free, noise, -1.0), num_boxes)
    player = jnp.stack(jnp.divmod(player_flat, width)).astype(jnp.int32)
    targets = jnp.stack(jnp.divmod(target_flat, width), axis=-1).astype(jnp.int32)  # [N, 2]

    boxes = jnp.zeros(dim_room, bool).at[targets[:, 0], targets[:, 1]].set(True)
    passable = floor & ~boxes
    reach = reachable(passable, player)
    # A pull from direction d: player on box + d (reachable), stepping to box + 2d (passable).
    # A pull from direction d: the player on box + d (reachable), stepping to box + 2d
    # (passable). Some box must have one (not every box: a box freed by moving another makes
    # a harder level, and RAGEN's search finds those too).
    limit = jnp.array([height - 1, width - 1])
    stand = targets[:, None, :] + jnp.asarray(DELTAS)[None]  # [N, 4, 2]
    dest = jnp.clip(stand + jnp.asarray(DELTAS)[None], 0, limit)
    can_pull = (reach[stand[..., 0], stand[..., 1]] & passable[stand[..., 0], stand[..., 1]]
                & passable[dest[..., 0], dest[..., 1]])
    enough_floor = jnp.sum(flat_floor) > num_boxes + 1
    return floor, player, targets, enough_floor & jnp.any(can_pull)


def _finish(key, dim_room, layout, num_walks, num_pulls, budget, greedy, lookahead):
    """Reverse play and the player's wander on a layout. Returns (ok, EnvState)."""
    floor, player, targets, plausible = layout
    k_walks, k_wander = jax.random.split(key)
    score, player, boxes = _reverse_search(k_walks, floor, player, targets, num_walks, num_pulls,
                                           budget, greedy, lookahead)
    boxes_grid = jnp.zeros(dim_room, bool).at[boxes[:, 0], boxes[:, 1]].set(True)
    displacement = jnp.abs(boxes - targets).sum()
    player = _wander(k_wander, floor, boxes_grid, player, displacement)
    room_fixed = jnp.where(floor, FLOOR, WALL).astype(jnp.int8)
    room_fixed = room_fixed.at[targets[:, 0], targets[:, 1]].set(TARGET)
    state = EnvState(room_fixed, boxes_grid, player, jnp.int32(0), jnp.int32(0))
    return plausible & (score > 0), state


def fallback_level(dim_room: tuple[int, int], num_boxes: int) -> EnvState:
    """The level ``generate_level`` returns when every try failed: an open room, the targets
    along the bottom row of the interior from the left, each box one push above its target,
    the player in the top-right interior corner. Solvable and not solved (needs
    ``num_boxes <= width - 2`` and a room of at least 5x5)."""
    height, width = dim_room
    room_fixed = np.full(dim_room, WALL, np.int8)
    room_fixed[1:-1, 1:-1] = FLOOR
    room_fixed[height - 2, 1:1 + num_boxes] = TARGET
    boxes = np.zeros(dim_room, bool)
    boxes[height - 3, 1:1 + num_boxes] = True
    return EnvState(jnp.asarray(room_fixed), jnp.asarray(boxes), jnp.array([1, width - 2], jnp.int32),
                    jnp.int32(0), jnp.int32(0))


@partial(jax.jit, static_argnums=tuple(range(1, 12)))
def generate_level(key: jax.Array, dim_room: tuple[int, int], num_boxes: int, num_gen_steps: int,
                   budget: int, num_walks: int, num_pulls: int, greedy: float,
                   lookahead: bool, num_layouts: int, searches_per_try: int, max_tries: int
                   ) -> tuple[jax.Array, EnvState]:
    """A solvable, unsolved level from ``key``. Returns (ok, state).

    A try draws ``num_layouts`` cheap layouts at once and runs reverse play (``_reverse_search``
    with ``budget`` moves) on the first ``searches_per_try`` plausible
    ones in parallel, keeping the first that uncovers every target. A failed try repeats from
    ``fold_in(key, try)``, at most ``max_tries`` times. If every try failed, ``ok`` is False and
    the level is ``fallback_level`` (never a solved one). ``boxes_on_target`` is counted, so a
    level can never pay a reward for a box it did not move.

    Under ``vmap`` (a custom batching rule) the first try runs on the whole batch and later
    tries only on the levels still failing, in chunks of ``batch / _RETRY_CHUNKS``, instead of
    the whole batch repeating tries until its unluckiest level is done; every key still gets
    the level it gets unbatched.
    """
    def attempt(attempt_key):
        k_layouts, k_finish = jax.random.split(attempt_key)
        layouts = jax.vmap(lambda k: _layout(k, dim_room, num_boxes, num_gen_steps))(
            jax.random.split(k_layouts, num_layouts))
        order = jnp.argsort(~layouts[3], stable=True)[:searches_per_try]  # plausible ones first
        oks, states = jax.vmap(
            lambda i, k: _finish(k, dim_room, jax.tree.map(lambda x: x[i], layouts), num_walks,
                                 num_pulls, budget, greedy, lookahead)
        )(order, jax.random.split(k_finish, searches_per_try))
        first = jnp.argmax(oks)
        return oks[first], jax.tree.map(lambda x: x[first], states)

    def finalize(ok, state):
        # (fallback_level is built inside each traced function: custom_vmap takes no closed-over
        # tracers.)
        fallback = fallback_level(dim_room, num_boxes)
        state = jax.tree.map(lambda new, old: jnp.where(ok, new, old), state, fallback)
        on_target = jnp.sum(state.boxes & (state.room_fixed == TARGET), dtype=jnp.int32)
        return ok, state.replace(boxes_on_target=on_target)

    @jax.custom_batching.custom_vmap
    def tries(key):
        def retry(carry):
            tries, _, _ = carry
            ok, state = attempt(jax.random.fold_in(key, tries))
            return tries + 1, ok, state

        fallback = fallback_level(dim_room, num_boxes)
        _, ok, state = jax.lax.while_loop(
            lambda c: ~c[1] & (c[0] < max_tries), retry, (jnp.int32(0), jnp.bool_(False), fallback))
        return finalize(ok, state)

    @tries.def_vmap
    def _batched_tries(axis_size, in_batched, keys):
        # Under ``vmap`` a while loop runs its body on the whole batch until the last level is
        # done, so a batch would pay for the most tries any of its levels needs (3 of ~1.05 at
        # 10x10 with 3 boxes). Instead: the first try on the whole batch, then the retries on
        # the failed levels only, gathered into chunks of ``axis_size // 8``. Each level still
        # sees tries ``fold_in(key, 0), fold_in(key, 1), ...`` in order: the same levels.
        out_batched = jax.tree.map(lambda _: True, jax.eval_shape(finalize, jnp.bool_(False),
                                                                     fallback_level(dim_room, num_boxes)))
        if not in_batched[0] or max_tries < 1:
            one = tries(keys if not in_batched[0] else keys[0])
            return jax.tree.map(lambda x: jnp.broadcast_to(x, (axis_size, *x.shape)), one), \
                out_batched
        ok, state = jax.vmap(lambda k: attempt(jax.random.fold_in(k, 0)))(keys)
        chunk = max(1, min(axis_size, -(-axis_size // _RETRY_CHUNKS)))

        def retry(carry):
            count, ok, state = carry
            pending = ~ok & (count < max_tries)
            (idx,) = jnp.nonzero(pending, size=chunk, fill_value=axis_size)
            safe = jnp.minimum(idx, axis_size - 1)
            ok_c, state_c = jax.vmap(lambda k, t: attempt(jax.random.fold_in(k, t)))(
                keys[safe], count[safe])
            count = count.at[idx].add(1, mode="drop")
            ok = ok.at[idx].set(ok_c, mode="drop")
            state = jax.tree.map(lambda s, c: s.at[idx].set(c, mode="drop"), state, state_c)
            return count, ok, state

        count = jnp.ones(axis_size, jnp.int32)
        _, ok, state = jax.lax.while_loop(
            lambda c: jnp.any(~c[1] & (c[0] < max_tries)), retry, (count, ok, state))
        return jax.vmap(finalize)(ok, state), out_batched

    return tries(key)
