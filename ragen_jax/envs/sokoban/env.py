"""Sokoban as a pure JAX environment, with RAGEN's dynamics, rewards and text rendering.

Levels are generated inside ``reset`` from the PRNG key (``sokoban.generator``), the way
gym-sokoban (and RAGEN, which adapts it) does. Rendering (``render_text``, ``room_codes``) is
apart from the dynamics (``step_env``).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ragen_jax.envs.base import TextEnv
from ragen_jax.envs.gymnax_base import spaces
from ragen_jax.envs.sokoban.generator import SEARCH_EFFORT, generate_level
from ragen_jax.envs.sokoban.types import (
    ACTION_NAMES,
    BOX,
    BOX_ON_TARGET,
    DELTAS,
    FLOOR,
    PLAYER,
    PLAYER_ON_TARGET,
    TARGET,
    WALL,
    EnvParams,
    EnvState,
)

GRID_VOCAB = {WALL: "#", FLOOR: "_", TARGET: "O", BOX_ON_TARGET: "√", BOX: "X", PLAYER: "P",
              PLAYER_ON_TARGET: "S"}
# RAGEN's SokobanDifferentGridVocab.
ALT_GRID_VOCAB = {WALL: "W", FLOOR: ".", TARGET: "G", BOX_ON_TARGET: "C", BOX: "B", PLAYER: "A",
                  PLAYER_ON_TARGET: "@"}
GRID_VOCABS = {"default": GRID_VOCAB, "alt": ALT_GRID_VOCAB}
SYMBOL_MEANINGS = {WALL: "wall", FLOOR: "empty", TARGET: "target", BOX_ON_TARGET: "box on target",
                   BOX: "box", PLAYER: "player", PLAYER_ON_TARGET: "player on target"}
OBSERVATION_FORMATS = ("grid", "coord", "grid_coord")

# RAGEN V2's env instructions (``config/envs.yaml``), verbatim: they are YAML block scalars, so
# each keeps its line breaks, the trailing spaces on its lines and a final newline; the symbol
# legend that the system message appends next ("\nThe meaning of ...") so follows a blank line.
# SimpleSokoban's (also LargerSokoban's and SokobanDifferentGridVocab's):
INSTRUCTION = (
    "You are solving the Sokoban puzzle. \n"
    "You are the player and you need to push all boxes to targets. \n"
    "When you are right next to a box, you can push it by moving in the same direction. \n"
    "You cannot push a box through a wall, and you cannot pull a box. \n"
    "The answer should be a sequence of actions, like <answer>Right || Right || Up</answer>\n"
)
# CoordSokoban's (``observation_format="grid_coord"``). RAGEN writes the corner (5, 5) of its
# 6x6 room; here it is this room's bottom-right cell, so a 6x6 room gets RAGEN's text exactly.
COORD_INSTRUCTION = (
    "You are solving the Sokoban puzzle. You are the player and you need to push all boxes to "
    "targets.\n"
    "You are provided with a symbol grid and the zero-indexed coordinates of the player, each "
    "box, and each target. \n"
    "Coordinates range from the top-left corner (0, 0) to the bottom-right corner "
    "({last_row}, {last_col}). \n"
    "When you are exactly next to a box, you can push it by moving in the same direction. \n"
    "You cannot push a box through a wall, and you cannot pull a box.\n"
    "The answer should be a sequence of actions, like <answer>Right || Right || Up</answer>.\n"
)


class Sokoban(TextEnv[EnvState, EnvParams]):
    """Push every box onto a target. Actions 0-3: Up, Down, Left, Right.

    Each action is gym-sokoban's push action: the player steps in that direction, pushing a box
    if one is there and the cell behind it is free; a push into a wall or a second box leaves
    everything in place. Rewards: ``step_penalty`` every step, ``box_on_target_reward`` when the
    count of boxes on targets rises, ``box_off_target_penalty`` when it falls, and
    ``finished_reward`` when all boxes are on targets (terminated). Truncated after
    ``max_steps`` steps. ``info``: ``success`` (all boxes on targets), ``action_is_effective``
    (the player moved).

    Text (host side): ``render_text`` is RAGEN's ``grid``, ``coord`` or ``grid_coord`` state;
    ``instruction`` and ``symbol_legend`` are what RAGEN's system message says of the env
    (``rollout.context.system_message`` composes them).

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
    - CoordSokoban's instruction names this room's bottom-right corner; RAGEN's always says
      (5, 5), which is its 6x6 room's (the same text there).
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
        # DFS (experiments/benchmarks/bench_envs.py): (walks, pulls per walk) by number of boxes. A shallow
        # search (under 16 moves) is weaker in RAGEN (its DFS marks a state explored on the
        # first, often deepest, path that reaches it), so one unbiased walk with one box.
        budget = self.search_depth - 2
        shallow = budget < 16
        walks, pulls = SEARCH_EFFORT[min(num_boxes, len(SEARCH_EFFORT)) - 1]
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

    def holdout_fields(self, state: EnvState) -> jax.Array:
        """The room (walls and targets, ``[H, W]``): the board shows boxes and player, not
        where the episode started, so a training level in a validation level's room could push
        its way onto that level's starting board (the tiny preset's prior did, on 68 of 245);
        ``step_env`` never changes the room, so an episode in another room never can."""
        return state.room_fixed

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

    @property
    def instruction(self) -> str:
        """The env instruction of RAGEN's tag for this text: CoordSokoban's for ``grid_coord``,
        SimpleSokoban's for ``grid`` and ``coord`` (RAGEN has no ``coord``-only tag)."""
        if self.observation_format == "grid_coord":
            height, width = self.dim_room
            return COORD_INSTRUCTION.format(last_row=height - 1, last_col=width - 1)
        return INSTRUCTION

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

