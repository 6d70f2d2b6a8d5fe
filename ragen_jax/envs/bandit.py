"""A two-armed bandit whose arms are named, as a pure JAX environment (RAGEN's Bandit).

The agent sees only the two arm names, one low-risk (e.g. "Teacher": a steady small payoff) and
one high-risk (e.g. "Trader": a rare big payoff), and pulls one arm once. The task probes
whether a language model brings sensible priors from the names to a decision; the expected
payoff is higher for the high-risk arm (0.25 against 0.1).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from ragen_jax.envs.base import TextEnv
from ragen_jax.envs.gymnax_base import spaces

# (low-risk, high-risk) name pairs. Train and test share no name.
TRAIN_PAIRS: tuple[tuple[str, str], ...] = (
    ("Teacher", "Trader"),
    ("Librarian", "Investor"),
    ("Gardener", "Cryptominer"),
    ("Accountant", "Gambler"),
    ("Nurse", "Speculator"),
    ("Postman", "Prospector"),
    ("Baker", "Daytrader"),
    ("Clerk", "Entrepreneur"),
    ("Farmer", "Treasurehunter"),
    ("Pharmacist", "Stockbroker"),
    ("Plumber", "Pokerplayer"),
    ("Electrician", "Cryptotrader"),
)
TEST_PAIRS: tuple[tuple[str, str], ...] = (
    ("Cashier", "Bettor"),
    ("Secretary", "Founder"),
    ("Dentist", "Wildcatter"),
    ("Bookkeeper", "Smuggler"),
    ("Tailor", "Venturecapitalist"),
    ("Archivist", "Lotteryplayer"),
    ("Optician", "Angelinvestor"),
    ("Notary", "Hedgefunder"),
)
PHOENIX_DRAGON: tuple[tuple[str, str], ...] = (("Phoenix", "Dragon"),)  # RAGEN V1

# Every pair in one table, so a state's ``pair`` index names its arms whatever the env's split.
ALL_PAIRS = TRAIN_PAIRS + TEST_PAIRS + PHOENIX_DRAGON
SPLITS = ("train", "test")
VARIANTS = ("names", "phoenix_dragon")

NOT_PULLED = -1


@struct.dataclass
class EnvState:
    pair: jax.Array  # int32, index into ALL_PAIRS
    hi_first: jax.Array  # bool, the high-risk arm is displayed first (action 0)
    pulled: jax.Array  # int32, action id pulled, NOT_PULLED before the pull
    reward: jax.Array  # float32, the pull's payoff (0 before)
    time: jax.Array  # int32, env steps taken


@struct.dataclass
class EnvParams:
    max_steps: int = 1
    lo_arm_score: float = 0.1  # the low-risk arm always pays this
    hi_arm_score: float = 1.0  # the high-risk arm pays this with probability hi_arm_prob, else 0
    hi_arm_prob: float = 0.25


class Bandit(TextEnv[EnvState, EnvParams]):
    """Pull one of two named arms, once. Action 0 = the first arm shown, 1 = the second.

    The pair of names is drawn uniformly from the split's list (or is Phoenix/Dragon for the
    ``phoenix_dragon`` variant), and which arm is shown first is a fair coin, both from the
    reset key. The low-risk arm pays ``lo_arm_score`` (0.1); the high-risk arm pays
    ``hi_arm_score`` (1.0) with probability ``hi_arm_prob`` (0.25), else 0. The episode ends
    (terminated) after the pull. ``info``: ``success`` (the high-risk arm was pulled) and
    ``action_is_effective`` (always true).

    Observation (``get_obs``): int32 [3], the name ids of the first and second arm shown
    (``2 * pair + is_high``, an index into ``ALL_PAIRS`` flattened) and the action pulled
    (``NOT_PULLED`` = -1 before the pull). Text (``render_text``): the question naming both arms
    before the pull, ``"{arm}: {reward} points"`` after it. ``action_names_for(state)`` gives the
    two arm names in displayed order; ``action_names`` is generic.

    Differences from RAGEN, all deliberate:

    - Envs reset with the same key get the same names and order. RAGEN reseeds each env with
      ``seed + internal_seed`` (a per-instance counter), so a group sharing a seed does not
      share its prompt.
    - Action ids are 0 and 1 (RAGEN's are 1 and 2).
    - The arm name lists are our own (RAGEN's train/test lists are not copied); the
      ``phoenix_dragon`` variant uses RAGEN V1's Phoenix (low) / Dragon (high), order shuffled.
    - The prompt wording is our own; it asks for an arm name but leaves the answer format
      (e.g. ``<answer>``) to the agent's context, where every env's format lives.
    """

    action_names = ("first arm", "second arm")
    params_cls = EnvParams

    def __init__(self, split: str = "train", variant: str = "names") -> None:
        super().__init__()
        if split not in SPLITS:
            raise ValueError(f"unknown bandit split {split!r}; one of {SPLITS}")
        if variant not in VARIANTS:
            raise ValueError(f"unknown bandit variant {variant!r}; one of {VARIANTS}")
        self.split = split
        self.variant = variant
        if variant == "phoenix_dragon":
            first, count = len(TRAIN_PAIRS) + len(TEST_PAIRS), 1
        elif split == "train":
            first, count = 0, len(TRAIN_PAIRS)
        else:
            first, count = len(TRAIN_PAIRS), len(TEST_PAIRS)
        self._pair_range = (first, first + count)  # the ALL_PAIRS indices this env draws from

    @property
    def pairs(self) -> tuple[tuple[str, str], ...]:
        """The (low-risk, high-risk) name pairs this env draws from."""
        return ALL_PAIRS[self._pair_range[0] : self._pair_range[1]]

    @property
    def default_params(self) -> EnvParams:
        return EnvParams()

    def reset_env(self, key: jax.Array, params: EnvParams) -> tuple[jax.Array, EnvState]:
        """Draws the arm names and their order; nothing is pulled yet."""
        del params
        key_pair, key_order = jax.random.split(key)
        state = EnvState(
            pair=jax.random.randint(key_pair, (), *self._pair_range, dtype=jnp.int32),
            hi_first=jax.random.bernoulli(key_order),
            pulled=jnp.int32(NOT_PULLED),
            reward=jnp.float32(0.0),
            time=jnp.int32(0),
        )
        return self.get_obs(state), state

    def step_env(
        self, key: jax.Array, state: EnvState, action: int | jax.Array, params: EnvParams
    ) -> tuple[jax.Array, EnvState, jax.Array, jax.Array, dict[str, jax.Array]]:
        """Pulls arm ``action`` (0 or 1, in displayed order) and pays it."""
        action = jnp.asarray(action, jnp.int32)
        pulled_high = (action == 0) == state.hi_first
        jackpot = jax.random.uniform(key) < params.hi_arm_prob
        reward = jnp.where(
            pulled_high, jnp.where(jackpot, params.hi_arm_score, 0.0), params.lo_arm_score
        ).astype(jnp.float32)
        state = state.replace(pulled=action, reward=reward, time=state.time + 1)
        info = {"success": pulled_high, "action_is_effective": jnp.bool_(True)}
        return self.get_obs(state), state, reward, jnp.bool_(True), info

    def get_obs(
        self, state: EnvState, params: EnvParams | None = None, key: jax.Array | None = None
    ) -> jax.Array:
        """int32 [3]: name id of the first arm shown, of the second, and the action pulled."""
        del params, key
        hi_first = state.hi_first.astype(jnp.int32)
        return jnp.stack(
            [2 * state.pair + hi_first, 2 * state.pair + 1 - hi_first, state.pulled]
        ).astype(jnp.int32)

    def level(self, state: EnvState) -> tuple[jax.Array, ...]:
        """The arm pair and its order."""
        return state.pair, state.hi_first

    def is_terminated(self, state: EnvState, params: EnvParams) -> jax.Array:
        return state.pulled != NOT_PULLED

    def action_space(self, params: EnvParams | None = None) -> spaces.Discrete:
        return spaces.Discrete(2)

    def observation_space(self, params: EnvParams | None = None) -> spaces.Box:
        return spaces.Box(NOT_PULLED, 2 * len(ALL_PAIRS) - 1, (3,), jnp.int32)

    def state_space(self, params: EnvParams | None = None) -> spaces.Dict:
        params = self.default_params if params is None else params
        return spaces.Dict(
            {
                "pair": spaces.Discrete(len(ALL_PAIRS)),
                "hi_first": spaces.Discrete(2),
                "pulled": spaces.Box(NOT_PULLED, 1, (), jnp.int32),
                "reward": spaces.Box(0.0, max(params.lo_arm_score, params.hi_arm_score), ()),
                "time": spaces.Discrete(int(params.max_steps) + 1),
            }
        )

    # ---- host-side text -------------------------------------------------------------------

    def action_names_for(self, state: EnvState) -> tuple[str, ...]:
        """The two arm names of one unbatched state, in displayed order (action 0 first)."""
        low, high = ALL_PAIRS[int(np.asarray(state.pair))]
        return (high, low) if bool(np.asarray(state.hi_first)) else (low, high)

    def render_text(self, state: EnvState) -> str:
        """Before the pull, the question naming both arms; after it, ``"{arm}: {reward} points"``."""
        first, second = self.action_names_for(state)
        pulled = int(np.asarray(state.pulled))
        if pulled == NOT_PULLED:
            return (
                f"You are playing a two-armed bandit. The arms are {first} and {second}. "
                "Each arm pays points drawn from its own reward distribution, and the names hint "
                "at what those distributions are. You pull one arm, once. Which arm do you pull "
                "to get the most points on average? Answer with the arm's name."
            )
        arm = (first, second)[pulled]
        return f"{arm}: {round(float(np.asarray(state.reward)), 4)} points"
