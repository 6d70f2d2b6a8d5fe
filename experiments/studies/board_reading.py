"""Can the tiny model learn to read a Sokoban board at all? A supervised check, no RL.

    python -m experiments.studies.board_reading [--form chat] [--steps 600] [--levels 2000]

The tiny presets' Sokoban prior picks an optimal first move less often than a random legal
move (``first_move_accuracy.py``). This separates *can the 4-layer width-128 model read the
board* from *does the warm-start recipe teach it*: states of training levels (each level's
start and a few random legal moves on, ``--walk``) labelled with their optimal moves (every
move after which the BFS solver needs one move less: ``ragen_jax.board_reading.optimal_first_moves``),
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
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from configs import base
from ragen_jax.board_reading import board_rows, encode_board_rows, held_out_seeds
from ragen_jax.envs.registry import make
from ragen_jax.models import Qwen2ForCausalLM, QwenConfig
from ragen_jax.models import tokenizer as tokenizers

TRAIN_SEEDS, VAL_SEEDS = 10_000, 50_000  # first seeds of the two level sets (disjoint ranges)


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
    template = base.get_config("tiny").rollout.prompt.turn_template  # the tiny preset's wording
    train = encode_board_rows(env, train_rows, tokenizer, args.form, len(names), template)
    val = encode_board_rows(env, val_rows, tokenizer, args.form, len(names), template)
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
