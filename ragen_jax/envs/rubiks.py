"""RAGEN's 2x2 Rubik's cube (Pocket Cube, its ``rubikscube``) as a pure JAX environment.

The state is 24 sticker colours, four per face, faces in RAGEN's order U, L, F, R, B, D
(colours 0-5: White, Orange, Green, Red, Blue, Yellow; solved: face ``f`` all colour ``f``).
Each face's stickers read ``[0, 1] / [2, 3]``, seen from outside the cube with the side
stickers' top row next to U (and D's top row next to F). A move is a fixed permutation of the
stickers (``MOVES``): the 12 quarter turns U, U', D, D', L, L', R, R', F, F', B, B'.

RAGEN's B is not a rotation of a real cube: it puts the D stickers of the back row onto R's
back column in reverse order, and L's back column onto D's back row in reverse, so a B turn
breaks corners apart (its six moves generate every permutation of the 24 stickers, against
the real cube's 88,179,840 states). ``moves="ragen"`` (the default) plays RAGEN's moves exactly;
``moves="physical"`` plays a real cube (B corrected, the other five are RAGEN's).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from ragen_jax.envs.base import TextEnv
from ragen_jax.envs.gymnax_base import spaces

ACTION_NAMES = ("U", "U'", "D", "D'", "L", "L'", "R", "R'", "F", "F'", "B", "B'")
FACES = ("Up (U)", "Left (L)", "Front (F)", "Right (R)", "Back (B)", "Down (D)")
COLOURS = ("W", "O", "G", "R", "B", "Y")
SOLVED = np.repeat(np.arange(6, dtype=np.int8), 4)  # [24]

# Clockwise quarter turns as gathers: after the move, sticker i shows the old sticker T[i].
_CLOCKWISE = {
    "U": [2, 0, 3, 1, 8, 9, 6, 7, 12, 13, 10, 11, 16, 17, 14, 15, 4, 5, 18, 19, 20, 21, 22, 23],
    "D": [0, 1, 2, 3, 4, 5, 18, 19, 8, 9, 6, 7, 12, 13, 10, 11, 16, 17, 14, 15, 22, 20, 23, 21],
    "L": [19, 1, 17, 3, 6, 4, 7, 5, 0, 9, 2, 11, 12, 13, 14, 15, 16, 22, 18, 20, 8, 21, 10, 23],
    "R": [0, 9, 2, 11, 4, 5, 6, 7, 8, 21, 10, 23, 14, 12, 15, 13, 3, 17, 1, 19, 20, 18, 22, 16],
    "F": [0, 1, 7, 5, 4, 20, 6, 21, 10, 8, 11, 9, 2, 13, 3, 15, 16, 17, 18, 19, 14, 12, 22, 23],
}
_B = {
    "ragen": [13, 15, 2, 3, 1, 5, 0, 7, 8, 9, 10, 11, 12, 22, 14, 23, 18, 16, 19, 17, 20, 21, 6, 4],
    "physical": [13, 15, 2, 3, 1, 5, 0, 7, 8, 9, 10, 11, 12, 23, 14, 22, 18, 16, 19, 17, 20, 21, 4, 6],
}
MOVE_SETS = tuple(_B)

# RAGEN's env_instruction of the ``rubikscube`` tag.
INSTRUCTION = (
    "You are solving a 2x2 Rubik's Cube (Pocket Cube). The goal is to restore the cube so that "
    "each of the faces consists of a single, unique color.\nAvailable actions use standard "
    "Singmaster notation for face rotations: U, U', D, D', L, L', R, R', F, F', B, B'.\n- Faces: "
    "U (Up), D (Down), L (Left), R (Right), F (Front), B (Back).\n- Modifiers: A letter alone "
    "means 90° clockwise (e.g., 'R'). A letter with prime (') means 90° counter-clockwise "
    "(e.g., \"R'\").\nRespond with a sequence of actions separated by \"||\".\n"
    "Example: <answer>U</answer>\n"
)


def move_table(moves: str = "ragen") -> np.ndarray:
    """[12, 24] int32 gathers in ``ACTION_NAMES`` order: ``stickers[table[a]]`` is action
    ``a`` applied (a prime move is the clockwise one three times, as RAGEN applies it)."""
    if moves not in MOVE_SETS:
        raise ValueError(f"unknown cube moves {moves!r}; one of {MOVE_SETS}")
    rows = []
    for face in "UDLRFB":
        turn = np.asarray(_B[moves] if face == "B" else _CLOCKWISE[face])
        rows += [turn, turn[turn[turn]]]  # gathers compose: x[t][t][t] = x[t[t[t]]]
    return np.stack(rows).astype(np.int32)


def is_solved(stickers: jax.Array) -> jax.Array:
    """Every face shows one colour (RAGEN's test; any whole-cube orientation counts)."""
    faces = stickers.reshape(stickers.shape[:-1] + (6, 4))
    return jnp.all(faces == faces[..., :1], axis=(-2, -1))


def scramble_move(key: jax.Array, i: jax.Array | int) -> jax.Array:
    """The ``i``-th scramble move of a reset from ``key``: uniform over the 12, independent."""
    return jax.random.randint(jax.random.fold_in(key, i), (), 0, len(ACTION_NAMES), jnp.int32)


@struct.dataclass
class EnvState:
    stickers: jax.Array  # [24] int8 colours, faces U L F R B D, 4 stickers each
    time: jax.Array  # int32, env steps taken
    max_steps: jax.Array  # int32, params.max_steps at reset (the text shows "Step: t/max")


@struct.dataclass
class EnvParams:
    max_steps: int = 20  # RAGEN's max_steps (and the tag's max_actions_per_traj)
    scramble_depth: int = 1  # random moves from solved at reset (RAGEN's tag: 1; its class: 5)
    solved_reward: float = 1.0


class RubiksCube(TextEnv[EnvState, EnvParams]):
    """Solve a scrambled 2x2 cube. Actions 0-11: U, U', D, D', L, L', R, R', F, F', B, B'.

    Reset: ``scramble_depth`` moves drawn uniformly from the 12 (independently, as RAGEN's:
    a move may undo the one before, and the scramble may even leave the cube solved) applied to
    the solved cube. A step applies the move; reward ``solved_reward`` (1) and terminated when
    every face shows one colour, else 0. Truncated after ``max_steps`` steps (RAGEN's env ends
    its episode there itself, with reward 0). ``info``: ``success`` (solved),
    ``action_is_effective`` (always true, as in RAGEN: every move changes the stickers).

    Observation (``get_obs``): the [24] int8 colours. Text (``render_text``): RAGEN's rendering,
    the step count, each face's two rows and the available actions (or, once the episode is
    over, RAGEN's "Game Over" line).

    Differences from RAGEN, all deliberate:

    - Action ids are 0-11 (RAGEN's are 1-12); order and names agree.
    - The scramble comes from the reset key through JAX's PRNG, not NumPy's, so a seed gives a
      different (equally distributed) scramble than in RAGEN.
    - ``moves="physical"`` plays a real cube; RAGEN's B (the default here too) does not (module
      docstring).
    - ``solved_reward`` is a param (RAGEN's is fixed at 1).
    """

    action_names = ACTION_NAMES
    params_cls = EnvParams
    instruction = INSTRUCTION

    def __init__(self, moves: str = "ragen") -> None:
        super().__init__()
        self.moves = moves
        self.table = move_table(moves)

    @property
    def default_params(self) -> EnvParams:
        return EnvParams()

    def apply(self, stickers: jax.Array, action: jax.Array) -> jax.Array:
        """``stickers`` [24] after move ``action`` (jittable)."""
        return stickers[jnp.asarray(self.table)[action]]

    def reset_env(self, key: jax.Array, params: EnvParams) -> tuple[jax.Array, EnvState]:
        """The solved cube scrambled by ``scramble_depth`` random moves."""
        stickers = jnp.asarray(SOLVED)

        def body(i: jax.Array, stickers: jax.Array) -> jax.Array:
            return self.apply(stickers, scramble_move(key, i))

        stickers = jax.lax.fori_loop(0, params.scramble_depth, body, stickers)
        state = EnvState(stickers=stickers, time=jnp.int32(0),
                         max_steps=jnp.asarray(params.max_steps, jnp.int32))
        return self.get_obs(state), state

    def step_env(
        self, key: jax.Array, state: EnvState, action: int | jax.Array, params: EnvParams
    ) -> tuple[jax.Array, EnvState, jax.Array, jax.Array, dict[str, jax.Array]]:
        """Turns one face; pays ``solved_reward`` when the cube is solved."""
        del key
        stickers = self.apply(state.stickers, jnp.asarray(action, jnp.int32))
        solved = is_solved(stickers)
        state = state.replace(stickers=stickers, time=state.time + 1)
        reward = jnp.where(solved, params.solved_reward, 0.0).astype(jnp.float32)
        info = {"success": solved, "action_is_effective": jnp.bool_(True)}
        return self.get_obs(state), state, reward, solved, info

    def get_obs(
        self, state: EnvState, params: EnvParams | None = None, key: jax.Array | None = None
    ) -> jax.Array:
        """The [24] int8 sticker colours."""
        del params, key
        return state.stickers

    def level(self, state: EnvState) -> jax.Array:
        """The scrambled stickers."""
        return state.stickers

    def is_terminated(self, state: EnvState, params: EnvParams) -> jax.Array:
        return is_solved(state.stickers)

    def action_space(self, params: EnvParams | None = None) -> spaces.Discrete:
        return spaces.Discrete(len(ACTION_NAMES))

    def observation_space(self, params: EnvParams | None = None) -> spaces.Box:
        return spaces.Box(0, 5, (24,), jnp.int8)

    def state_space(self, params: EnvParams | None = None) -> spaces.Dict:
        params = self.default_params if params is None else params
        return spaces.Dict(
            {
                "stickers": spaces.Box(0, 5, (24,), jnp.int8),
                "time": spaces.Discrete(int(params.max_steps) + 1),
                "max_steps": spaces.Discrete(int(params.max_steps) + 1),
            }
        )

    # ---- host-side text -------------------------------------------------------------------

    def render_text(self, state: EnvState) -> str:
        """RAGEN's text for one unbatched state (its line layout, a face's second row on a
        line of its own)."""
        stickers = [COLOURS[int(c)] for c in np.asarray(state.stickers)]
        time, max_steps = int(np.asarray(state.time)), int(np.asarray(state.max_steps))
        lines = ["=== Rubik's Cube 2x2 State ===", f"Step: {time}/{max_steps}", ""]
        for f, face in enumerate(FACES):
            c = stickers[4 * f: 4 * f + 4]
            label = f"{face}:".ljust(11)
            lines.append(f"{label}[{c[0]}, {c[1]}]\n [{c[2]}, {c[3]}]")
        faces = np.asarray(state.stickers).reshape(6, 4)
        solved = bool(np.all(faces == faces[:, :1]))
        if time > 0 and (solved or time >= max_steps):  # RAGEN's reset text is never "over"
            message = "Cube Solved!" if solved else "Max steps reached."
            lines += ["", f"=== Game Over: {message} ==="]
        else:
            lines += ["", "Available Actions:", ", ".join(ACTION_NAMES), "\nWhat is your next move?"]
        return "\n".join(lines)
