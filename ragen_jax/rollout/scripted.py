"""Scripted policies: answers chosen by a function instead of sampled from a model.

``ScriptedPolicy`` has the sampler's call interface, so ``AgentRollout.collect`` plays it
exactly like a model: its answers go through the same chat format, parsing, env steps and
batch assembly. It drives the warm-starts (``RandomActionPolicy``, answering with random
valid or legal actions, and ``SolverMixturePolicy``, mixing in the env's optimal moves; see
``warmstart.warmstart_data``) and the rollout tests (chosen token streams).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from ragen_jax.rollout.context import ChatFormat, ContextConfig
from ragen_jax.rollout.env_driver import env_functions, row_state
from ragen_jax.rollout.sampler import pad_prompts
from ragen_jax.rollout.sampling import SampleOutput, SamplingParams
from ragen_jax.rollout.stop_strings import StopAutomaton

# script(row, call_index, prompt_ids, env_state) -> the row's answer token ids
Script = Callable[[int, int, list[int], Any], Sequence[int]]


class ScriptedPolicy:
    """A policy whose answers a function writes, through the sampler's interface.

    ``script(row, call_index, prompt_ids, env_state)`` gives row ``row``'s answer token ids
    at the policy's ``call_index``-th call (0-based); ``prompt_ids`` is what the rollout sent
    that row (the new chunk, or the whole history without cache reuse) and ``env_state``
    that row's env state this turn (an unbatched numpy pytree; None when the caller passes
    no ``env_states``). Only active rows are scripted. The answer is cut after its first stop
    token, after the token completing a stop string and at the token budget, exactly like
    the sampler. ``logprob`` is reported for
    every emitted token. Every call's prompts are recorded in ``calls`` (list of lists of id
    lists).
    """

    def __init__(self, script: Script, *, pad_id: int = 0, logprob: float = -1.0):
        self.script = script
        self.pad_id = int(pad_id)
        self.logprob = float(logprob)
        self.calls: list[list[list[int]]] = []

    @classmethod
    def from_texts(cls, tokenizer: Any, texts: Callable[[int, int], str], *,
                   end: bool = True, **kw) -> ScriptedPolicy:
        """Scripts from strings: ``texts(row, call) -> str``, encoded as plain text (special
        token strings in it become special tokens), followed by the eos (end-of-turn) token
        when ``end``."""
        eos = tokenizer.eos_token_id

        def script(row, call, _prompt, _state):
            ids = tokenizer(texts(row, call), add_special_tokens=False)["input_ids"]
            return list(ids) + ([eos] if end else [])

        return cls(script, pad_id=tokenizer.pad_token_id or 0, **kw)

    def __call__(self, prompts, *, key=None, params: SamplingParams = SamplingParams(),
                 stop_tokens=(), stop_strings: StopAutomaton | None = None, max_new=None,
                 active=None, cache=None, mask=None, bucket=None,
                 env_states=None) -> SampleOutput:
        del key, cache, mask
        rows = [list(map(int, p)) for p in prompts]
        call = len(self.calls)
        self.calls.append(rows)
        b, n = len(rows), params.max_new_tokens
        act = np.ones(b, bool) if active is None else np.asarray(active, bool)
        budget = np.full(b, n) if max_new is None else np.minimum(np.asarray(max_new), n)
        stops = set(np.asarray(stop_tokens).reshape(-1).tolist())
        tokens = np.full((b, n), self.pad_id, np.int32)
        lengths = np.zeros(b, np.int32)
        for i in map(int, np.flatnonzero(act)):
            state = None if env_states is None else row_state(env_states, i)
            out = _cut([int(t) for t in self.script(i, call, rows[i], state)],
                       int(budget[i]), stops, stop_strings)
            tokens[i, : len(out)] = out
            lengths[i] = len(out)
        mask = np.arange(n)[None, :] < lengths[:, None]
        lp = np.where(mask, self.logprob, 0.0).astype(np.float32)
        ptok, pmask = pad_prompts(rows, bucket=bucket, pad_id=self.pad_id) if any(rows) else (
            np.zeros((b, 1), np.int32), np.zeros((b, 1), bool))
        return SampleOutput(tokens=tokens, mask=mask, logprobs=lp, model_logprobs=lp,
                            lengths=lengths, steps=np.int32(lengths.max(initial=0)),
                            prompt_tokens=ptok, prompt_mask=pmask, cache=None)


def _cut(ids: list[int], budget: int, stops: set[int],
         stop_strings: StopAutomaton | None = None) -> list[int]:
    """``ids`` cut at ``budget`` tokens, after the first stop token and after the token
    that completes a stop string."""
    ids = ids[:budget]
    at = None if stop_strings is None else stop_strings.first_stop(ids)
    if at is not None:
        ids = ids[: at + 1]
    for j, t in enumerate(ids):
        if t in stops:
            return ids[: j + 1]
    return ids


# ----------------------------------------------------------------------------------------------
# Random-action answers (the format warm-start)
# ----------------------------------------------------------------------------------------------


def answer_text(actions: Sequence[str], ctx: ContextConfig) -> str:
    """A well-formed answer naming ``actions``, as the model would continue the prompt: an
    empty think block when thinking is on, then ``<answer>A || B</answer>``, without the tag
    the prompt already ends with (``ctx.answer_prefix``)."""
    think = "<think></think>" if ctx.enable_think else ""
    answer = f"<answer>{f' {ctx.action_sep} '.join(actions)}</answer>"
    return (think + answer).removeprefix(ctx.answer_prefix)


def random_actions(rng: np.random.Generator, num_actions: int, k: int,
                   opening: int | None = None) -> list[int]:
    """``k`` action ids drawn uniformly from ``num_actions``; with ``opening`` the first is
    ``opening mod num_actions`` instead (drawn, then replaced)."""
    picks = rng.integers(0, num_actions, size=k)
    if opening is not None:
        picks[0] = opening % num_actions
    return [int(a) for a in picks]


class LegalActions:
    """Which actions change a state (the env's ``action_is_effective``: no walking into a wall
    or off the grid), found by trying every action once from it (batched env step)."""

    def __init__(self, env: Any, env_params: Any, num_actions: int, max_actions_per_turn: int):
        if not hasattr(env, "step_env"):
            raise ValueError(f"legal actions are found by stepping a JAX env; {env.name} is a "
                             f"host env (set warmstart.legal_actions=False)")
        self.step_turn = env_functions(env)[1]
        self.env_params = env_params
        self.n = num_actions
        self.keys = jax.vmap(jax.random.key)(np.arange(num_actions, dtype=np.uint32))
        self.actions = np.zeros((num_actions, max_actions_per_turn), np.int32)
        self.actions[:, 0] = np.arange(num_actions)

    def __call__(self, state: Any) -> tuple[np.ndarray, Any, np.ndarray]:
        """``(legal ids, the state after each action (batched), whether it ended the
        episode)``; every action counts as legal when none is."""
        tiled = jax.tree.map(lambda x: np.repeat(np.asarray(x)[None], self.n, 0), state)
        nxt, _, _, n_eff, _, term, trunc, _ = jax.device_get(self.step_turn(
            tiled, self.env_params, self.actions, np.ones(self.n, np.int32), self.keys))
        legal = np.flatnonzero(n_eff > 0)
        return (legal if legal.size else np.arange(self.n)), nxt, term | trunc


def random_legal_actions(rng: np.random.Generator, legal_actions: LegalActions, state: Any,
                         k: int, opening: int | None = None, *,
                         prefer: Callable[[Any], int | None] | None = None) -> list[int]:
    """Up to ``k`` actions played in order from ``state``, each drawn uniformly from those
    legal in the state the previous ones lead to (no look-ahead); stops early when one ends
    the episode. With ``opening`` the first is ``legal[opening mod len(legal)]`` (no draw).
    ``prefer(state)``, when given and not None, replaces the draw (after it is made)."""
    picks: list[int] = []
    for j in range(k):
        legal, nxt, ended = legal_actions(state)
        if j == 0 and opening is not None:
            a = int(legal[opening % len(legal)])
        else:
            a = int(rng.choice(legal))
            preferred = None if prefer is None else prefer(state)
            a = a if preferred is None else int(preferred)
        picks.append(a)
        if ended[a]:
            break
        state = row_state(nxt, a)
    return picks


class RandomActionPolicy(ScriptedPolicy):
    """Answers every turn with a well-formed answer naming 1 to ``max_actions_per_turn``
    (uniform) random actions of the row's state, never from a solver: the format warm-start.
    A free-text host env (no action names) supplies them (``HostEnv.random_action``: e.g. a
    Countdown expression of the puzzle's numbers with random operations).

    ``legal_only`` draws each action from those that change the state (``LegalActions``),
    still uniformly and with no look-ahead. At its first call row ``r`` opens with action
    ``r mod (number of actions)`` (with ``legal_only``: legal action ``r mod (number
    legal)``), so a group of that many consecutive rows sharing an initial state opens with
    every action (every legal action) at least once. ``seed`` seeds
    the one numpy generator behind every draw. ``context`` must be the rollout's (its
    ``ContextConfig``), so the answers parse.
    """

    def __init__(self, env: Any, env_params: Any, tokenizer: Any, context: ContextConfig,
                 seed: int, legal_only: bool = False):
        chat = ChatFormat(tokenizer, context)
        super().__init__(self._answer, pad_id=chat.pad_id)
        self.env, self.env_params, self.tokenizer = env, env_params, tokenizer
        self.context, self.legal_only, self.eot_id = context, legal_only, chat.eot_id
        self.rng = np.random.default_rng(seed)
        self._legal: LegalActions | None = None

    def _answer(self, row: int, call: int, _prompt: list[int], state: Any) -> list[int]:
        if state is None:
            raise ValueError(f"{type(self).__name__} needs env_states (call it from a rollout)")
        names = tuple(self.env.action_names_for(state))
        k = int(self.rng.integers(1, self.context.max_actions_per_turn + 1))
        if names:
            actions = [names[a] for a in self._picks(row, call, state, len(names), k)]
        else:  # a free-text host env draws its own well-formed actions
            actions = [self.env.random_action(state, self.rng) for _ in range(k)]
        text = answer_text(actions, self.context)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.eot_id]

    def _picks(self, row: int, call: int, state: Any, num_actions: int, k: int) -> list[int]:
        opening = row if call == 0 else None
        if self.legal_only:
            return random_legal_actions(self.rng, self._legal_actions(num_actions), state, k, opening)
        return random_actions(self.rng, num_actions, k, opening)

    def _legal_actions(self, num_actions: int) -> LegalActions:
        if self._legal is None or self._legal.n != num_actions:
            self._legal = LegalActions(self.env, self.env_params, num_actions,
                                       self.context.max_actions_per_turn)
        return self._legal


# ----------------------------------------------------------------------------------------------
# Solver-mixture answers (the instruct-like warm-start)
# ----------------------------------------------------------------------------------------------


class SolverMixturePolicy(RandomActionPolicy):
    """``RandomActionPolicy`` whose every action is, with probability ``solver_share``, the
    env's optimal next move (``envs.solvers.solve``; BFS for Sokoban and FrozenLake) instead of a
    random one: the tiny stand-in for an instruct checkpoint, which reads the board a little.

    The share decides how good the data are: 0 is ``RandomActionPolicy`` with ``legal_only``
    (minus its balanced opening), 1 a solver. There is no balanced opening here: the first
    action is drawn like every other, so the data prefer the optimal opening by ``share``.
    A state the solver cannot finish gets the random move.
    """

    def __init__(self, env: Any, env_params: Any, tokenizer: Any, context: ContextConfig,
                 seed: int, solver_share: float):
        if not 0.0 <= solver_share <= 1.0:
            raise ValueError(f"solver_share must be in [0, 1], got {solver_share}")
        super().__init__(env, env_params, tokenizer, context, seed, legal_only=True)
        self.solver_share = float(solver_share)

    def _solver_move(self, state: Any) -> int | None:
        # Imported here: importing ragen_jax.rollout must not start JAX's backend (launch.py
        # reads the config before jax.distributed), whatever an env module does at import.
        from ragen_jax.envs.solvers import solve

        if self.rng.random() >= self.solver_share:
            return None
        path = solve(self.env, state)
        return path[0] if path else None

    def _picks(self, row: int, call: int, state: Any, num_actions: int, k: int) -> list[int]:
        del row, call
        return random_legal_actions(self.rng, self._legal_actions(num_actions), state, k,
                                    prefer=self._solver_move)
