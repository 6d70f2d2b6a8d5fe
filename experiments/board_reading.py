"""Can the tiny model learn to read a Sokoban board at all? A supervised check, no RL.

    python experiments/board_reading.py [--form chat] [--steps 600] [--levels 2000]

The tiny presets' Sokoban prior picks an optimal first move less often than a random legal
move (``first_move_accuracy.py``). This separates *can the 4-layer width-128 model read the
board* from *does the warm-start recipe teach it*: states of training levels (each level's
start and a few random legal moves on, ``--walk``) labelled with their optimal moves (every
move after which the BFS solver needs one move less: ``first_move_accuracy.optimal_first_moves``),
a fresh tiny model trained to put its next-token probability on one of them (the answer
token after the text), and held-out levels (levels no training seed plays, by level identity,
``envs.levels``; each once) scored by
whether its most likely move is optimal and whether it is legal, beside a random legal move.

``--form bare``: the grid text alone and one query token; ``--form chat``: the rollout's own
turn text (the user block of turn 1 in the chat template and the assistant header up to
``<answer>``, the tiny preset's wording, without the system message), as the warm-start's
single-turn rows show it. ``--label solver`` trains on the solver's one move (what the
warm-start data hold) instead of the set of optimal moves.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from ragen_jax.rollout.config import RolloutConfig

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from first_move_accuracy import optimal_first_moves  # noqa: E402

from configs import base  # noqa: E402
from ragen_jax.envs.registry import make  # noqa: E402
from ragen_jax.models import Qwen2ForCausalLM, QwenConfig  # noqa: E402
from ragen_jax.models import tokenizer as tokenizers  # noqa: E402
from ragen_jax.rollout.context import ChatFormat, user_message  # noqa: E402
from ragen_jax.rollout.env_driver import JaxEnvDriver, env_functions, row_state  # noqa: E402
from ragen_jax.rollout.scripted import LegalActions  # noqa: E402

TRAIN_SEEDS, VAL_SEEDS = 10_000, 50_000  # first seeds of the two level sets (disjoint ranges)


def held_out_seeds(env, env_params, train: np.ndarray, candidates: np.ndarray) -> np.ndarray:
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


def board_rows(env, env_params, seeds: np.ndarray, walk: int, rng: np.random.Generator
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


def encode(env, rows, tokenizer, form: str, num_actions: int) -> dict[str, np.ndarray]:
    """Token rows (all of one length: the grid has a fixed size) and the label masks."""
    if form == "chat":
        cfg = dataclasses.replace(RolloutConfig().context, enable_think=False, turn_template=base.get_config('tiny').rollout.prompt.turn_template)
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--form", choices=("bare", "chat"), default="chat")
    p.add_argument("--label", choices=("optimal", "solver"), default="optimal")
    p.add_argument("--levels", type=int, default=2000, help="training levels")
    p.add_argument("--val-levels", type=int, default=500)
    p.add_argument("--walk", type=int, default=2, help="random legal moves on from each start")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--evals", type=int, default=8)
    args = p.parse_args()

    env, env_params = make("sokoban", dim_room=(6, 6), num_boxes=1, max_steps=100)
    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    train_seeds = TRAIN_SEEDS + np.arange(args.levels)
    val_seeds = held_out_seeds(env, env_params, train_seeds, VAL_SEEDS + np.arange(args.val_levels))
    train_rows = board_rows(env, env_params, train_seeds, args.walk, rng)
    val_rows = board_rows(env, env_params, val_seeds, args.walk, rng)
    names = env.action_names_for(train_rows[0][0])
    tokenizer = tokenizers.builtin()
    train = encode(env, train_rows, tokenizer, args.form, len(names))
    val = encode(env, val_rows, tokenizer, args.form, len(names))
    print(f"{len(train_rows)} training rows ({args.levels} seeds), {len(val_rows)} held-out rows "
          f"({len(val_seeds)} distinct levels of {args.val_levels} seeds that no training seed "
          f"plays), built in {time.perf_counter() - t0:.0f} s", flush=True)

    vocab = len(tokenizer.get_vocab()) + 1
    answer_ids = (jnp.array([tokenizer.convert_tokens_to_ids(n) for n in names]) if args.form == "chat"
                  else vocab + jnp.arange(len(names)))  # bare: the moves as tokens of their own
    config = QwenConfig.tiny(hidden_size=args.hidden, num_hidden_layers=args.layers,
                             intermediate_size=3 * args.hidden, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=args.hidden // 4,
                             vocab_size=vocab + len(names))
    graphdef, params = nnx.split(Qwen2ForCausalLM(config, rngs=nnx.Rngs(0)), nnx.Param)
    optimizer = optax.adamw(args.lr, weight_decay=0.0)
    opt_state = optimizer.init(params)
    width = train["input_ids"].shape[1]
    positions = jnp.arange(width)[None]

    def move_logits(p, ids):  # [B, T] -> [B, moves]: the next token after the text
        logits, _ = nnx.merge(graphdef, p)(ids, jnp.broadcast_to(positions, ids.shape))
        return logits[:, -1, answer_ids]

    @jax.jit
    def step(p, state, ids, target):  # -log P(one of the target moves)
        def loss(p):
            logp = jax.nn.log_softmax(move_logits(p, ids))
            return -jnp.mean(jax.nn.logsumexp(jnp.where(target, logp, -jnp.inf), -1))
        value, grads = jax.value_and_grad(loss)(p)
        updates, state = optimizer.update(grads, state, p)
        return optax.apply_updates(p, updates), state, value

    @jax.jit
    def predict(p, ids):
        return jnp.argmax(move_logits(p, ids), -1)

    def score(data, p) -> tuple[float, float]:
        pick = np.asarray(predict(p, jnp.asarray(data["input_ids"])))
        at = np.arange(pick.size)
        return float(data["optimal"][at, pick].mean()), float(data["legal"][at, pick].mean())

    chance = float((val["optimal"].sum(1) / val["legal"].sum(1)).mean())
    print(f"| step | loss | held-out: optimal | legal | training rows: optimal | wall s |\n"
          f"|---:|---:|---:|---:|---:|---:|\n| random legal move | | {chance:.3f} | 1.000 | | |", flush=True)
    target = train["optimal" if args.label == "optimal" else "solver"]
    sample = {k: v[:2000] for k, v in train.items()}
    t0 = time.perf_counter()
    for i in range(1, args.steps + 1):
        idx = rng.choice(len(target), args.batch, replace=False)
        params, opt_state, loss = step(params, opt_state, jnp.asarray(train["input_ids"][idx]),
                                       jnp.asarray(target[idx]))
        if i % max(1, args.steps // args.evals) == 0 or i == args.steps:
            (optimal, legal), (seen, _) = score(val, params), score(sample, params)
            print(f"| {i} | {float(loss):.3f} | {optimal:.3f} | {legal:.3f} | {seen:.3f} "
                  f"| {time.perf_counter() - t0:.0f} |", flush=True)


if __name__ == "__main__":
    main()
