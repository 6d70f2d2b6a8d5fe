"""Side by side with Google's Tunix (the JAX peer): logits, sampling, GRPO train step, multi-turn rollout.

The same Qwen2 checkpoint folder (``config.json`` + ``model.safetensors``, written by our
``save_pretrained`` from a random model) is loaded by Tunix
(``tunix.models.qwen2.params.create_model_from_safe_tensors``) and by us (``from_pretrained``);
then, in float32 on the CPU:

0. logits on the same tokens (max abs difference);
1. greedy sampling, ``--prompt`` random prompt tokens then exactly ``--new`` new tokens (no stop
   token), batch 1/8/32: tokens/s of a warm call (prefill included; the first call compiles),
   and whether both produced the same tokens. Tunix: ``tunix.generate.sampler.Sampler`` with a
   tokenizer whose ``encode`` splits space-separated ids, so both see the same ids;
2. one policy-gradient optimizer step on the same batch (``--train-batch`` rows of ``--prompt``
   prompt and ``--train-completion`` completion tokens, sequence advantages, no reference
   model, token-mean loss, clip 0.2, AdamW with global-norm clipping 1.0, one micro-batch):
   Tunix's GRPO loss (``tunix.rl.algo_core.grpo_loss_fn``, the learner's policy loss) with an
   ``nnx.Optimizer`` stepped as its ``PeftTrainer._train_step`` does (``nnx.value_and_grad``,
   then ``optimizer.update``), jitted with the model and optimizer state donated; ours
   ``starpo.optimizer_step.jit_optimizer_step`` under each ``--train-remat`` policy (Tunix's model at
   its default, no rematerialisation). ``--train-group G``: a GRPO batch, each prompt's G
   answers in a row (Tunix's learner trains such groups, ``num_generations``); ours is then
   also timed with each group's prompt run once per step (``actor.share_prompt_forward``).
   Peak memory: ``jax.devices()[0].memory_stats()`` is None
   on the CPU backend, so the column is XLA's compiled memory analysis of the step
   (arguments + outputs + temporaries - aliased, i.e. what the step needs live at its peak);
3. a multi-turn Sokoban rollout (``--groups x --group-size`` episodes, ``--turns`` turns,
   ``--response-length`` tokens a turn, tiny shape, greedy): ours (``AgentRollout.collect``)
   against Tunix's agentic loop (``TrajectoryCollectEngine.collect_multiple`` with its
   ``ModelAgent``, our jitted Sokoban wrapped as its ``BaseTaskEnv``, Tunix's ``Sampler`` as
   the ``model_call``): it runs on CPU; ``ROLLOUT_NOTE`` says what each side does;
4. ours against this CPU's ceilings (``--no-roofline`` skips it): prefill (a 1-token call)
   against the float32 matmul peak, decode ms per token-step against the time to read every
   weight and the attended cache once at the measured memory bandwidth.

Two processes, arrays exchanged through ``.npz`` files: this script runs our side in the
Python that starts it and runs ``peers_tunix`` under Tunix's own interpreter
(``--tunix-python``) with this checkout on ``PYTHONPATH``. Why not one process: Tunix 0.1.7 pins an older ``transformers`` than
ours, so the two packages' dependency sets cannot share a venv without one of them running on
versions it was not tested with; for parts 0-2 the worker imports nothing of ragen_jax (only
numpy, jax and tunix; part 3 imports our env, prompt and parser there), and
each framework's timings are taken alone in its process, one after the other, so
they never compete for the cores. The checkpoint folder, the prompts and the training batch
are written once by the driver, so both read identical inputs.

Tunix's venv (once; PyPI only; ~1.5 GB):

    python3 -m venv .venv-tunix
    .venv-tunix/bin/pip install google-tunix==0.1.7     # brings jax 0.10.2, flax 0.12.8
    # part 3 only (our Sokoban inside Tunix's process; --no-deps keeps Tunix's jax and flax):
    .venv-tunix/bin/pip install --no-deps gymnax==1.0.1 chex==0.1.92 toolz gymnasium==1.3.0 \
        farama-notifications && .venv-tunix/bin/pip install matplotlib seaborn

Run from the repository root (our side in our own venv):

    python -m experiments.benchmarks.bench_peers --quick      # tiny shape, batch 1/8, short
    python -m experiments.benchmarks.bench_peers              # tiny and 0.5B shapes
    python -m experiments.benchmarks.bench_peers --big-vocab 151936   # the real vocabulary

The 0.5B shape uses a ``--big-vocab``-token vocabulary by default (8192: the layers are
Qwen2.5-0.5B's, the embedding smaller, so a run fits this 2-core CPU's time). Writes
``experiments/results/bench_peers.md`` and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

from experiments.benchmarks.peers_report import baseline_label, report
from experiments.benchmarks.roofline import matmul_peak, memory_bandwidth, memory_reading
from experiments.benchmarks.shapes import peer_config
from experiments.common import RESULTS, ROOT, timed

OUT = RESULTS / "bench_peers.md"
TUNIX_PYTHON = ROOT / ".venv-tunix" / "bin" / "python"



def write_inputs(size: str, folder: Path, args) -> dict:
    """The checkpoint folder and the npz every process reads: logit tokens, prompts per
    batch, the training batch."""
    from flax import nnx

    from ragen_jax.models import Qwen2ForCausalLM, save_pretrained

    cfg = peer_config(size, args.big_vocab)
    save_pretrained(Qwen2ForCausalLM(cfg, rngs=nnx.Rngs(0)), folder)
    rng = np.random.RandomState(0)
    v = cfg.vocab_size
    inputs = {"logit_tokens": rng.randint(10, v, (2, 64)).astype(np.int32)}
    for b in args.batch_list[size]:
        inputs[f"prompts_{b}"] = rng.randint(10, v, (b, args.prompt)).astype(np.int32)
    tb = args.train_batch[size]
    if tb % args.train_group:
        raise SystemExit(f"--train-group {args.train_group} must divide the {size} train batch {tb}")
    prompts = rng.randint(10, v, (tb // args.train_group, args.prompt)).astype(np.int32)
    inputs["train_prompt_ids"] = np.repeat(prompts, args.train_group, 0)  # GRPO: G answers a prompt
    inputs["train_completion_ids"] = rng.randint(10, v, (tb, args.train_completion)).astype(np.int32)
    inputs["train_advantages"] = rng.randn(tb).astype(np.float32)
    np.savez(folder.parent / f"{size}_inputs.npz", **inputs)
    return inputs


def our_sampling(model, prompts: np.ndarray, new: int, repeats: int, layout: bool | None = None,
                 options: dict | None = None, prefill_tokens: int | None = None):
    """(warm s, first-call s, tokens) of greedy sampling; ``layout=False``: the Hugging Face
    weight layout (the sampler before its CPU decoding layout); ``options``: XLA compiler
    options for the sampler's program; ``prefill_tokens``: the sampler's prefill blocks."""
    import jax

    from ragen_jax.rollout import Sampler, SamplingParams

    sampler = Sampler(model, layout=layout, compiler_options=options,
                      prefill_tokens=prefill_tokens)
    sp = SamplingParams(max_new_tokens=new, temperature=0.0)
    out = {}

    def call():
        out["o"] = sampler(prompts.tolist(), key=jax.random.key(0), params=sp)
        jax.block_until_ready(out["o"].tokens)

    t0 = time.perf_counter()
    call()
    first = time.perf_counter() - t0
    warm = timed(call, repeats)
    tokens = np.asarray(out["o"].tokens)[:, :new]
    sampler = None  # noqa: F841 (the copy goes before the trim)
    out.clear()
    release_freed_memory()
    return warm, first, tokens


def release_freed_memory() -> None:
    """Hands the heap's free pages back to the OS (glibc ``malloc_trim``): each sampler holds
    a ~2.5 GB copy of the 0.5B weights, and without this the freed copies of several
    samplers stayed in the process (fragmented) until the train step ran out of 24 GB."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:  # not glibc
        pass


def our_train(model, inputs: dict, args, share: bool = False) -> dict:
    """One optimizer step of ours on the bench's batch; with ``share`` each group's prompt
    (``--train-group`` rows in a row) is a shared prefix, run once per step for the group
    (``actor.share_prompt_forward``, as the trainer builds it) and the rows hold the completions."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from ragen_jax.config.resolve import update_settings
    from ragen_jax.starpo.optimizer_step import (
        Prefixes,
        TrainBatch,
        jit_optimizer_step,
        make_optimizer,
    )
    from ragen_jax.starpo.token_scores import token_logprobs

    ids = np.concatenate([inputs["train_prompt_ids"], inputs["train_completion_ids"]], 1)
    b, length = ids.shape
    loss_mask = np.zeros((b, length), np.float32)
    loss_mask[:, args.prompt:] = 1.0
    ids = jnp.asarray(ids)
    mask = jnp.ones((b, length), bool)
    positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (b, length))
    old_logp, _ = token_logprobs(model, ids, mask, positions, 1.0)  # on-policy, as Tunix's None
    advantages = jnp.broadcast_to(jnp.asarray(inputs["train_advantages"])[:, None], (b, length))
    prefixes, start = None, 0
    if share:  # slot 0 of a completion row is scored from its prompt's last token
        start, g = args.prompt, args.train_group
        prompts = jnp.asarray(inputs["train_prompt_ids"][::g])  # [B / G, P]
        prefixes = Prefixes(prompts, jnp.ones(prompts.shape, bool))
    batch = TrainBatch(ids[:, start:], mask[:, start:], positions[:, start:],
                       jnp.asarray(loss_mask)[:, start:], jax.lax.stop_gradient(old_logp)[:, start:],
                       advantages[:, start:],
                       prefix_index=jnp.arange(b, dtype=jnp.int32) // args.train_group if share else None)
    ucfg = update_settings(lr=args.lr, clip_low=0.2, clip_high=0.2, micro_batches=1,
                        loss_agg_mode="token-mean")
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    opt = make_optimizer(ucfg)
    opt_state = opt.init(params)
    step = jit_optimizer_step(graphdef, ucfg, opt)
    t0 = time.perf_counter()
    compiled = step.lower(params, rest, opt_state, batch, prefixes).compile()
    compile_s = time.perf_counter() - t0
    gib, source = memory_reading(compiled)
    lr = jnp.float32(ucfg.lr)
    params, opt_state, metrics = compiled(params, rest, opt_state, batch, lr, prefixes)
    holder = {"p": params, "o": opt_state}
    first_loss = float(metrics["actor/pg_loss"])

    def one():
        holder["p"], holder["o"], m = compiled(holder["p"], rest, holder["o"], batch, lr, prefixes)
        jax.block_until_ready(m)

    return {"step_s": timed(one, args.repeats), "compile_s": compile_s, "mem_gib": gib,
            "mem_source": source, "loss": first_loss}


def our_rollout(model, args) -> dict:
    """The same 5-turn Sokoban episodes through ``AgentRollout.collect`` (every episode a row
    of one batched sampler call per turn, the KV cache kept across turns), greedy."""
    import jax

    from ragen_jax.envs import make
    from ragen_jax.models import tokenizer as tokenizers
    from ragen_jax.rollout import Sampler
    from ragen_jax.rollout.agent import AgentRollout, train_seeds
    from ragen_jax.rollout.config import RolloutConfig, SamplingConfig

    cfg = RolloutConfig(env_groups=args.groups, group_size=args.group_size, max_turn=args.turns, response_length=args.response_length, sampling=SamplingConfig(temperature=0.0))
    tok = tokenizers.load(None)
    env, params = make("sokoban")
    rollout = AgentRollout(env, params, tok, cfg)
    sampler = Sampler(model, pad_id=tok.pad_token_id)
    seeds = train_seeds(cfg, 0)
    t0 = time.perf_counter()
    rollout.collect(sampler, seeds, jax.random.key(0))  # compiles
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    batch = rollout.collect(sampler, seeds, jax.random.key(0))
    wall = time.perf_counter() - t0
    n = len(batch.trajectories)
    return {"wall_s": wall, "first_s": first, "episodes": n,
            "sampled": int(np.asarray(batch.loss_mask).sum()),
            "turns": float(np.mean(batch.num_turns))}








def baseline_sampler(args) -> dict:
    """``our_sampling``'s arguments for the baseline column: the Hugging Face layout, or with
    ``--baseline-options`` the decode layout under those XLA options, or with
    ``--baseline-prefill-tokens`` our default sampler with that prefill block budget."""
    if args.baseline_prefill_tokens is not None:
        return {"prefill_tokens": args.baseline_prefill_tokens}
    if args.baseline_options is None:
        return {"layout": False}
    pairs = (kv.split("=", 1) for kv in args.baseline_options.split(",") if kv)
    return {"options": {k: v for k, v in pairs}}




def run_tunix(work: Path, args) -> tuple[dict, dict]:
    spec = {"sizes": args.size_list, "batches": args.batch_list, "new": args.new,
            "repeats": args.repeats, "lr": args.lr, "rollout": None}
    if args.rollout:
        spec["rollout"] = {"groups": args.groups, "group_size": args.group_size,
                           "turns": args.turns, "response_length": args.response_length}
    (work / "spec.json").write_text(json.dumps(spec))
    # Tunix's own venv: none of ours but this checkout on the path (``experiments``; the
    # rollout imports ragen_jax's env, prompt and parser too)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(PYTHONPATH=str(ROOT), MPLCONFIGDIR=tempfile.mkdtemp(prefix="mpl_"))
    if args.tunix_xla_flags is not None:
        env["XLA_FLAGS"] = args.tunix_xla_flags
    cmd = [str(args.tunix_python), "-m", "experiments.benchmarks.peers_tunix", str(work / "spec.json")]
    proc = subprocess.run(cmd, env=env, cwd=str(work), timeout=args.tunix_timeout)
    if proc.returncode != 0:
        raise SystemExit(f"Tunix worker failed (exit {proc.returncode}); see its output above")
    results = json.loads((work / "tunix_results.json").read_text())
    return results, dict(np.load(work / "tunix_arrays.npz"))


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="smoke test: tiny only, batch 1/8, 64-token prompts, 16 new tokens")
    ap.add_argument("--sizes", default="tiny,0.5b")
    ap.add_argument("--batches", default="1,8,32", help="sampler batches ('' for none)")
    ap.add_argument("--big-batches", default=None, help="batches of the 0.5B shape (default --batches)")
    ap.add_argument("--big-vocab", type=int, default=8192, help="vocabulary of the 0.5B shape")
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--train-batch", default="8,2", help="rows of the train step: tiny,0.5b")
    ap.add_argument("--train-completion", type=int, default=128)
    ap.add_argument("--train-group", type=int, default=1,
                    help="train-step rows come in groups of this many answers to one prompt, as "
                         "a GRPO batch does (Tunix's learner: num_generations); above 1, ours is "
                         "timed both with each group's prompt run once (shared) and per row")
    ap.add_argument("--train-remat", default="none,dots",
                    help="our train step under each of these QwenConfig.remat policies: 'none' "
                         "(Tunix's default, nothing rematerialised), 'dots' (the Qwen2.5 "
                         "presets': only the weight matmuls' outputs kept)")
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--repeats", type=int, default=2, help="timed warm calls (best taken)")
    ap.add_argument("--no-roofline", dest="roofline", action="store_false",
                    help="skip the 1-token prefill calls and the bandwidth reading (ours)")
    ap.add_argument("--no-baseline-layout", dest="baseline_layout", action="store_false",
                    help="skip the baseline column (our sampler in the Hugging Face weight "
                         "layout, or under --baseline-options)")
    ap.add_argument("--baseline-options", default=None, metavar="K=V[,K=V]",
                    help="the baseline is our decode layout compiled with these XLA options "
                         "(e.g. xla_cpu_experimental_ynn_fusion_type=) instead of the HF layout")
    ap.add_argument("--baseline-prefill-tokens", type=int, default=None, metavar="N",
                    help="the baseline is our default sampler prefilling in blocks of at most N "
                         "tokens (0: the whole chunk at once) instead of the HF layout")
    ap.add_argument("--no-rollout", dest="rollout", action="store_false",
                    help="skip the multi-turn Sokoban rollout (part 3)")
    ap.add_argument("--groups", type=int, default=4, help="rollout: env groups")
    ap.add_argument("--group-size", type=int, default=4, help="rollout: episodes per group")
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--response-length", type=int, default=64, help="rollout: tokens per turn")
    ap.add_argument("--tunix-python", default=str(TUNIX_PYTHON))
    ap.add_argument("--tunix-timeout", type=int, default=3600)
    ap.add_argument("--tunix-xla-flags", default=None,
                    help="XLA_FLAGS for Tunix's process, e.g. our sampler's CPU option "
                         "'--xla_cpu_experimental_ynn_fusion_type=' process-wide")
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args(argv)
    if args.quick:
        args.sizes, args.batches, args.prompt, args.new = "tiny", "1,8", 64, 16
        args.train_completion, args.repeats = 32, 1
        args.groups, args.group_size, args.turns, args.response_length = 2, 2, 2, 16
    args.size_list = args.sizes.split(",")
    args.remat_list = args.train_remat.split(",")
    args.rollout = args.rollout and "tiny" in args.size_list
    batches = [int(b) for b in args.batches.split(",") if b]  # --batches= : no sampling
    big = [int(b) for b in args.big_batches.split(",") if b] if args.big_batches else batches
    args.batch_list = {s: batches if s == "tiny" else big for s in args.size_list}
    rows = [int(b) for b in args.train_batch.split(",")]
    args.train_batch = {s: rows[min(i, len(rows) - 1)] for i, s in enumerate(["tiny", "0.5b"])}
    return args


def main() -> None:
    args = parse()
    import jax
    from flax import nnx

    from ragen_jax.models import from_pretrained

    work = Path(tempfile.mkdtemp(prefix="bench_peers_"))
    print(f"work folder: {work}", flush=True)
    ours = {"load": [os.getloadavg()[0]]}
    for size in args.size_list:
        inputs = write_inputs(size, work / size, args)
        model = from_pretrained(work / size)
        tokens = inputs["logit_tokens"]
        positions = np.broadcast_to(np.arange(tokens.shape[1], dtype=np.int32), tokens.shape)
        ours[f"{size}/logits"] = np.asarray(model(tokens, positions)[0], np.float32)
        for b in args.batch_list[size]:
            ours[f"{size}/sample/{b}"] = our_sampling(model, inputs[f"prompts_{b}"], args.new,
                                                      args.repeats)
            print(f"ours {size} B={b}: {ours[f'{size}/sample/{b}'][0]:.2f} s warm", flush=True)
            if args.baseline_layout:
                ours[f"{size}/sample_base/{b}"] = our_sampling(
                    model, inputs[f"prompts_{b}"], args.new, args.repeats,
                    **baseline_sampler(args))
                print(f"ours {size} B={b} {baseline_label(args)}: "
                      f"{ours[f'{size}/sample_base/{b}'][0]:.2f} s", flush=True)
            if args.roofline:  # a 1-token call: the prompt's prefill and the first token
                ours[f"{size}/prefill/{b}"] = our_sampling(model, inputs[f"prompts_{b}"], 1,
                                                           args.repeats)[0]
        if size == "tiny" and args.rollout:
            ours["rollout"] = our_rollout(model, args)
            print(f"ours rollout: {ours['rollout']}", flush=True)
        ours[f"{size}/param_bytes"] = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model)))
        del model
        release_freed_memory()
        for remat in args.remat_list:  # each step donates its weights: a fresh load each
            for share in (False, True) if args.train_group > 1 else (False,):
                key = f"{size}/train/{remat}" + ("/shared" if share else "")
                ours[key] = our_train(from_pretrained(work / size, remat=remat), inputs, args, share)
                release_freed_memory()
                print(f"ours {size} train, remat {remat}, shared {share}: {ours[key]}", flush=True)
    peak = matmul_peak()
    ours["bandwidth"] = memory_bandwidth() if args.roofline else None
    theirs, tunix_arrays = run_tunix(work, args)
    ours["load"].append(os.getloadavg()[0])
    text = report(args, ours, theirs, tunix_arrays, peak, jax.__version__)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    print(text)








if __name__ == "__main__":
    main()
