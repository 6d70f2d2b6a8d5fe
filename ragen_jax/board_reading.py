"""Does a policy read the board? The BFS solver's optimal first moves from a state, and what
is built on them: a run's first-move accuracy on its validation episodes, and board states
labelled with their optimal moves for a supervised probe.

A move is *optimal* when the env's solver (``envs.solvers.solve``) needs one move less after
it; *legal* moves are those that change the state (``rollout.scripted.LegalActions``, the
solver-mixture data's non-solver moves). A policy that reads the board picks an optimal first
move more often than a random legal move does; one that learnt the answer format and which
moves are common, but not where the player, box and target are, does not.
``experiments/studies/first_move_accuracy.py`` and ``experiments/studies/board_reading.py``
run these on saved runs and on a fresh tiny model.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, NamedTuple

import jax
import numpy as np

from ragen_jax.config import legacy
from ragen_jax.envs.registry import make
from ragen_jax.envs.solvers import solve
from ragen_jax.rollout.config import RolloutConfig
from ragen_jax.rollout.context import ChatFormat, ContextConfig, parse_response, user_message
from ragen_jax.rollout.env_driver import JaxEnvDriver, env_functions, row_state
from ragen_jax.rollout.scripted import LegalActions


class FirstMoves(NamedTuple):
    """The optimal and legal first moves from a state, with what was computed on the way."""

    optimal: set[int]  # action ids after which the solver needs one move less
    legal: np.ndarray  # action ids that change the state
    path: list[int]  # one optimal action sequence from the state
    next_states: Any  # the state after each action (``LegalActions``)
    done: np.ndarray  # whether each action ends the episode


def optimal_first_moves(env: Any, legal_actions: LegalActions, state: Any) -> FirstMoves | None:
    """The optimal and legal first moves from ``state``, or None when unsolvable."""
    path = solve(env, state)
    if not path:
        return None
    legal, nxt, done = legal_actions(state)
    optimal = set()
    for a in legal:
        rest = solve(env, row_state(nxt, int(a)))
        if rest is not None and len(rest) == len(path) - 1:
            optimal.add(int(a))
    return FirstMoves(optimal, legal, path, nxt, done)


# ----------------------------------------------------------------------------------------------
# a run's first moves
# ----------------------------------------------------------------------------------------------


def first_action(answer: str, names: tuple[str, ...], context: ContextConfig) -> int | None:
    """The first move the env executed for ``answer``: the rollout's own parser
    (``rollout.context.parse_response``) with the run's settings; None when it found no
    valid action (the turn earned the format penalty and the env did not move)."""
    parsed = parse_response(answer, names, context)
    return parsed.action_ids[0] if parsed.action_ids else None


def run_context(config: dict) -> ContextConfig:
    """The parsing settings of the run whose ``config.json`` is ``config`` (of any schema:
    ``config.legacy.upgrade``)."""
    rollout, default = legacy.upgrade(config).get("rollout", {}), RolloutConfig()
    think = rollout.get("prompt", {}).get("enable_think", default.prompt.enable_think)
    return dataclasses.replace(default.context, enable_think=think, max_actions_per_turn=rollout.get(
        "max_actions_per_turn", default.max_actions_per_turn))


def first_move_accuracy(jsonl: Path, share: float | None = None) -> dict[str, float]:
    """How often a run's first answers were optimal moves, on one trajectories file.

    ``jsonl`` is a saved validation file (``RUN/trajectories/val_stepNNNNN.jsonl``; the env
    and its parameters come from ``RUN/config.json``). Each episode's level is reset from its
    seed as the rollout resets it, and the first move the env executed for the first answer
    is checked against the optimal ones; unsolvable levels are skipped. Returns ``levels``,
    ``policy`` (the rate), ``random_legal`` (a uniformly random legal move's expected rate),
    ``share`` and ``mixture_data`` (``share + (1 - share) * random_legal``: what the
    solver-mixture data with that solver share score; default the run's
    ``warmstart.solver_share``).
    """
    config = json.loads((jsonl.parent.parent / "config.json").read_text())
    params = {k: tuple(v) if isinstance(v, list) else v for k, v in config["env"]["params"].items()}
    env, env_params = make(config["env"]["name"], **params)
    episodes = [json.loads(line) for line in jsonl.read_text().splitlines() if line.strip()]
    seeds = np.array([e["seed"] for e in episodes], np.uint32)
    reset, _ = env_functions(env)
    _, states = jax.device_get(reset(jax.vmap(jax.random.key)(seeds), env_params))
    names = tuple(env.action_names_for(row_state(states, 0)))
    legal_actions = LegalActions(env, env_params, len(names), 1)
    context = run_context(config)
    hits, random_legal, used = 0, [], 0
    for i, ep in enumerate(episodes):
        found = optimal_first_moves(env, legal_actions, row_state(states, i))
        if found is None:
            continue
        optimal, legal = found.optimal, found.legal
        answers = [m["content"] for m in ep["messages"] if m["role"] == "assistant"]
        action = first_action(answers[0], names, context) if answers else None
        used += 1
        hits += action in optimal
        random_legal.append(len(optimal) / len(legal))
    share = config["warmstart"]["solver_share"] if share is None else share
    rl = float(np.mean(random_legal))
    return {"levels": used, "policy": hits / used, "random_legal": rl,
            "share": share, "mixture_data": share + (1 - share) * rl}


# ----------------------------------------------------------------------------------------------
# labelled board states
# ----------------------------------------------------------------------------------------------


def held_out_seeds(env: Any, env_params: Any, train: np.ndarray, candidates: np.ndarray) -> np.ndarray:
    """The ``candidates`` whose level (``envs.levels``) no ``train`` seed plays, one seed per
    distinct level: disjoint seed ranges still share levels (a small generator repeats them)."""
    driver = JaxEnvDriver(env, env_params, 1)
    seen = set(driver.reset(train).levels.tolist())
    keep, ids = [], driver.reset(candidates).levels.tolist()
    for seed, level in zip(candidates, ids, strict=True):
        if level not in seen:
            seen.add(level)
            keep.append(seed)
    return np.asarray(keep, np.int64)


def board_rows(env: Any, env_params: Any, seeds: np.ndarray, walk: int, rng: np.random.Generator
               ) -> list[tuple[object, list[int], list[int], int]]:
    """``(state, optimal moves, legal moves, the solver's move)`` for each level's start and
    up to ``walk`` states after random legal moves from it (levels the solver cannot finish,
    and finished states, are skipped)."""
    reset, _ = env_functions(env)
    _, states = jax.device_get(reset(jax.vmap(jax.random.key)(seeds.astype(np.uint32)), env_params))
    names = env.action_names_for(row_state(states, 0))
    legal_actions = LegalActions(env, env_params, len(names), 1)
    out = []
    for i in range(len(seeds)):
        state = row_state(states, i)
        for _ in range(walk + 1):
            found = optimal_first_moves(env, legal_actions, state)
            if found is None or not found[0]:
                break
            out.append((state, sorted(found.optimal), [int(a) for a in found.legal], int(found.path[0])))
            move = int(rng.choice(found.legal))
            if found.done[move]:
                break
            state = row_state(found.next_states, move)
    return out


def encode_board_rows(env: Any, rows: list, tokenizer: Any, form: str, num_actions: int,
                      turn_template: str | None = None) -> dict[str, np.ndarray]:
    """Token rows (all of one length: the grid has a fixed size) and the label masks.

    ``form="chat"``: the rollout's turn text (the user block of turn 1 in the chat template
    and the assistant header up to ``<answer>``, worded by ``turn_template``, default
    ``ContextConfig``'s); ``form="bare"``: the grid text and one query token of its own.
    """
    if form == "chat":
        template = RolloutConfig().context.turn_template if turn_template is None else turn_template
        cfg = dataclasses.replace(RolloutConfig().context, enable_think=False, turn_template=template)
        chat = ChatFormat(tokenizer, cfg)
        texts = [chat.next_chunk(user_message(cfg, turn=1, state=env.render_text(s), actions_left=10),
                                 emitted_eot=True) for s, *_ in rows]
        ids = chat.encode(texts)
    else:
        query = len(tokenizer.get_vocab())  # a token of its own after the grid
        ids = [tokenizer(env.render_text(s), add_special_tokens=False)["input_ids"] + [query] for s, *_ in rows]
    if len({len(r) for r in ids}) != 1:
        raise ValueError("rows of different lengths (this check pads nothing)")
    masks = {k: np.zeros((len(rows), num_actions), bool) for k in ("optimal", "legal", "solver")}
    for j, (_, optimal, legal, solver) in enumerate(rows):
        masks["optimal"][j, optimal] = masks["legal"][j, legal] = masks["solver"][j, solver] = True
    return {"input_ids": np.array(ids, np.int32), **masks}
