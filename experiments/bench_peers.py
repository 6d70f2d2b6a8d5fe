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
   ``starpo.update.make_train_step`` under each ``--train-remat`` policy (Tunix's model at
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
Python that starts it and re-runs itself with ``--worker`` under Tunix's own interpreter
(``--tunix-python``). Why not one process: Tunix 0.1.7 pins an older ``transformers`` than
ours, so the two packages' dependency sets cannot share a venv without one of them running on
versions it was not tested with; for parts 0-2 the worker imports nothing of ragen_jax (only
numpy, jax and tunix; part 3 imports our env, prompt and parser there, on ``PYTHONPATH``), and
each framework's timings are taken alone in its process, one after the other, so
they never compete for the cores. The checkpoint folder, the prompts and the training batch
are written once by the driver, so both read identical inputs.

Tunix's venv (once; PyPI only; ~1.5 GB):

    python3 -m venv .venv-tunix
    .venv-tunix/bin/pip install google-tunix==0.1.7     # brings jax 0.10.2, flax 0.12.8
    # part 3 only (our Sokoban inside Tunix's process; --no-deps keeps Tunix's jax and flax):
    .venv-tunix/bin/pip install --no-deps gymnax==1.0.1 chex==0.1.92 toolz gymnasium==1.3.0 \
        farama-notifications && .venv-tunix/bin/pip install matplotlib seaborn

Run (our side from our own venv, with ``pip install -e .`` or ``PYTHONPATH=.``):

    PYTHONPATH=. python experiments/bench_peers.py --quick      # tiny shape, batch 1/8, short
    PYTHONPATH=. python experiments/bench_peers.py              # tiny and 0.5B shapes
    PYTHONPATH=. python experiments/bench_peers.py --big-vocab 151936   # the real vocabulary

The 0.5B shape uses a ``--big-vocab``-token vocabulary by default (8192: the layers are
Qwen2.5-0.5B's, the embedding smaller, so a run fits this 2-core CPU's time). Writes
``experiments/results/bench_peers.md`` and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "experiments" / "results" / "bench_peers.md"
TUNIX_PYTHON = ROOT / ".venv-tunix" / "bin" / "python"
AGENTIC_NOTE = (
    "Tunix's agentic loop needs nothing but the CPU; this run needs ragen_jax's env, prompt and "
    "parser importable in Tunix's venv (gymnax and its dependencies: see this script's "
    "docstring)")

ROLLOUT_NOTE = (
    "Same env (our jitted Sokoban, same seeds and levels), RAGEN's prompt and parser "
    "(ragen_jax's), the same weights. Tunix: its `TrajectoryCollectEngine.collect_multiple` "
    "with `ModelAgent`, our env wrapped as its `BaseTaskEnv`, and a `model_call` that applies "
    "the chat template to the whole conversation and runs Tunix's `Sampler` on it (batch 1 per "
    "episode-turn on asyncio's worker threads, the history re-encoded every turn into a cache of its power-of-two prompt bucket plus the response: on CPU, "
    "without vLLM or SGLang, that is the rollout engine it has). Ours: one batched sampler call "
    "per turn with the KV cache kept across turns. Random weights: answers are format errors, "
    "so the episodes play every turn (ours stops a row at its stop token, Tunix's at "
    "`<|im_end|>` too), a fixed worst-case load. Timed: the second run (the first compiles).")

# ----------------------------------------------------------------------------------------------
# shared helpers (both processes: numpy and jax only)
# ----------------------------------------------------------------------------------------------


def memory_reading(compiled) -> tuple[float, str]:
    """(GiB, source) of a compiled step's peak: the device's allocator peak where the backend
    reports one, else XLA's memory analysis (arguments + outputs + temporaries - aliased)."""
    import jax

    stats = jax.devices()[0].memory_stats()
    if stats and "peak_bytes_in_use" in stats:
        return stats["peak_bytes_in_use"] / 2**30, "memory_stats peak"
    m = compiled.memory_analysis()
    live = (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
            - m.alias_size_in_bytes)
    return live / 2**30, "XLA memory_analysis"


def timed(fn, repeats: int) -> float:
    """Best wall seconds of ``repeats`` calls of ``fn`` (which blocks on its result)."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


# ----------------------------------------------------------------------------------------------
# Tunix side (run under Tunix's interpreter with --worker; imports no ragen_jax)
# ----------------------------------------------------------------------------------------------


class IdsTokenizer:
    """The tokenizer Tunix's ``Sampler`` asks for, over space-separated ids (no BOS)."""

    def encode(self, text: str, **_) -> list[int]:
        return [int(t) for t in text.split()]

    def decode(self, ids, **_) -> str:
        return " ".join(str(int(i)) for i in ids)

    def bos_id(self) -> int:
        return 0  # falsy: Tunix prepends nothing

    def eos_id(self) -> int:
        return -1

    def pad_id(self) -> int:
        return 0


def tunix_config(folder: Path):
    from tunix.models.qwen2 import model as qwen2

    c = json.loads((folder / "config.json").read_text())
    theta = c.get("rope_theta", c.get("rope_parameters", {}).get("rope_theta", 10000.0))
    return qwen2.ModelConfig(
        num_layers=c["num_hidden_layers"], vocab_size=c["vocab_size"], embed_dim=c["hidden_size"],
        hidden_dim=c["intermediate_size"], num_heads=c["num_attention_heads"],
        head_dim=c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"],
        num_kv_heads=c["num_key_value_heads"], rope_theta=theta, norm_eps=c["rms_norm_eps"],
        use_tied_embedding=c.get("tie_word_embeddings", False))


def tunix_logits(model, tokens: np.ndarray) -> np.ndarray:
    import jax.numpy as jnp
    from tunix.rl import common

    ids = jnp.asarray(tokens)
    mask = jnp.ones_like(ids, dtype=bool)
    positions = common.build_positions_from_mask(mask)
    logits, _ = model(ids, positions, None, common.make_causal_attn_mask(mask))
    return np.asarray(logits, np.float32)


def tunix_sampling(model, cfg, prompts: np.ndarray, new: int, repeats: int):
    """(warm seconds, first-call seconds, tokens [B, new])."""
    from tunix.generate import sampler as sampler_lib

    p = prompts.shape[1]
    cache = sampler_lib.CacheConfig(cache_size=p + new, num_layers=cfg.num_layers,
                                    num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim)
    sampler = sampler_lib.Sampler(model, IdsTokenizer(), cache)
    texts = [" ".join(map(str, row)) for row in prompts]

    def call():
        out = sampler(texts, max_generation_steps=new, max_prompt_length=p, eos_tokens=[-1],
                      temperature=0.0)
        return np.stack([np.asarray(t) for t in out.tokens])

    t0 = time.perf_counter()
    tokens = call()
    first = time.perf_counter() - t0
    return timed(call, repeats), first, tokens


def tunix_train(model, batch: dict, spec: dict) -> dict:
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx
    from tunix.rl import algo_core, common
    from tunix.rl.grpo.grpo_learner import GRPOConfig

    algo = GRPOConfig(num_generations=2, beta=0.0, epsilon=0.2, loss_agg_mode="token-mean")
    algo.temperature = 1.0  # the learner sets it from the rollout config
    prompt = jnp.asarray(batch["prompt_ids"])
    completion = jnp.asarray(batch["completion_ids"])
    example = common.TrainExample(
        prompt_ids=prompt, prompt_mask=jnp.ones_like(prompt, dtype=bool),
        completion_ids=completion, completion_mask=jnp.ones_like(completion, jnp.int32),
        advantages=jnp.asarray(batch["advantages"]), ref_per_token_logps=None,
        old_per_token_logps=None)
    tx = optax.chain(optax.clip_by_global_norm(1.0),
                     optax.adamw(spec["lr"], b1=0.9, b2=0.999, weight_decay=0.01))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

    def loss_fn(m, ex):
        return algo_core.grpo_loss_fn(m, ex, algo, pad_id=0, eos_id=-1)

    graphdef, state = nnx.split((model, optimizer))

    def step(state, ex):  # PeftTrainer._train_step, on split state so it can be lowered
        m, opt = nnx.merge(graphdef, state)
        (loss, _), grads = nnx.value_and_grad(loss_fn, has_aux=True)(m, ex)
        opt.update(m, grads)
        return nnx.state((m, opt)), loss

    jitted = jax.jit(step, donate_argnums=0)
    t0 = time.perf_counter()
    compiled = jitted.lower(state, example).compile()
    compile_s = time.perf_counter() - t0
    gib, source = memory_reading(compiled)
    state, loss = compiled(state, example)
    first_loss = float(loss)
    holder = {"state": state}

    def one():
        holder["state"], out = compiled(holder["state"], example)
        jax.block_until_ready(out)

    step_s = timed(one, spec["repeats"])
    return {"step_s": step_s, "compile_s": compile_s, "mem_gib": gib, "mem_source": source,
            "loss": first_loss}


def tunix_rollout(folder: Path, spec: dict) -> dict:
    """5-turn Sokoban through Tunix's agentic loop (``TrajectoryCollectEngine.collect_multiple``:
    one asyncio task per episode, each turn a batch-1 ``model_call`` on a worker thread), our
    jitted Sokoban wrapped as its ``BaseTaskEnv``, RAGEN's prompt and parser from ragen_jax
    (needs ragen_jax and gymnax importable here), Tunix's ``Sampler`` as the model, greedy."""
    import asyncio
    import threading

    import jax
    import jax.numpy as jnp
    from tunix.generate import sampler as sampler_lib
    from tunix.models.qwen2 import params as qwen2_params
    from tunix.rl.agentic.agents.model_agent import ModelAgent
    from tunix.rl.agentic.environments.base_environment import BaseTaskEnv, EnvStepResult
    from tunix.rl.agentic.trajectory.trajectory_collect_engine import TrajectoryCollectEngine
    from tunix.rl.rollout.base_rollout import RolloutOutput

    from ragen_jax.envs import make
    from ragen_jax.models import tokenizer as tokenizers
    from ragen_jax.rollout.agent import train_seeds
    from ragen_jax.rollout.config import RolloutConfig, SamplingConfig
    from ragen_jax.rollout.context import parse_response, system_message, user_message
    from ragen_jax.rollout.env_driver import env_functions

    r = spec["rollout"]
    cfg = RolloutConfig(env_groups=r['groups'], group_size=r['group_size'], max_turn=r['turns'], response_length=r['response_length'], sampling=SamplingConfig(temperature=0.0))
    ctx = cfg.context
    tok = tokenizers.load(None)
    env, params = make("sokoban")
    reset_fn, step_fn = env_functions(env)
    tcfg = tunix_config(folder)
    model = qwen2_params.create_model_from_safe_tensors(str(folder), tcfg, dtype=jnp.float32)
    samplers, lock = {}, threading.Lock()

    def sampler_for(prompt_length: int):
        """A Sampler whose cache is the prompt's power-of-two bucket plus the response (its
        cache size is fixed when built): the tightest cache Tunix allows each call."""
        bucket = 1 << max(prompt_length - 1, 1).bit_length()
        with lock:
            if bucket not in samplers:
                cache = sampler_lib.CacheConfig(
                    cache_size=bucket + cfg.response_length, num_layers=tcfg.num_layers,
                    num_kv_heads=tcfg.num_kv_heads, head_dim=tcfg.head_dim)
                samplers[bucket] = sampler_lib.Sampler(model, IdsTokenizer(), cache)
            return samplers[bucket], bucket
    stop = [tok.convert_tokens_to_ids("<|im_end|>")]

    class SokobanTaskEnv(BaseTaskEnv):
        def __init__(self, seed: int):
            super().__init__(max_steps=cfg.max_turn)
            self.seed, self.actions, self.state = seed, 0, None

        def _observation(self, reward=None) -> str:
            host = jax.tree.map(lambda x: np.asarray(x)[0], self.state)
            return user_message(ctx, turn=self.step_count + 1, state=env.render_text(host),
                                actions_left=cfg.max_actions_per_traj - self.actions,
                                prev_reward=reward)

        def _initial_observation(self):
            _, self.state = reset_fn(jax.random.key(self.seed)[None], params)
            self.actions = 0
            return self._observation()

        def _step_impl(self, action) -> EnvStepResult:
            parsed = parse_response(ctx.answer_prefix + str(action), env.action_names, ctx)
            ids = np.zeros((1, cfg.max_actions_per_turn), np.int32)
            n = len(parsed.action_ids)
            ids[0, :n] = parsed.action_ids
            self.state, reward, n_exec, _, term, _, success = step_fn(
                self.state, params, jnp.asarray(ids), jnp.asarray([n], jnp.int32),
                jax.random.key(self.seed)[None])
            self.actions += int(n_exec[0])
            reward = float(reward[0]) - (0.1 if parsed.format_error else 0.0)
            return EnvStepResult(self._observation(reward), reward, bool(term[0]),
                                 {"success": bool(success[0])})

    sampled = []

    def model_call(messages, _env, max_generation_steps=None, **_):
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                      return_dict=False)
        sampler, bucket = sampler_for(len(ids))
        out = sampler([" ".join(map(str, ids))], max_generation_steps=cfg.response_length,
                      max_prompt_length=bucket, eos_tokens=stop, temperature=0.0)
        new = np.asarray(out.tokens[0])
        sampled.append(len(new))
        return RolloutOutput(text=[tok.decode(new.tolist(), skip_special_tokens=True)],
                             logits=[], tokens=[new], left_padded_prompt_tokens=np.asarray([ids]),
                             logprobs=None)

    seeds = np.repeat(train_seeds(cfg, 0), cfg.group_size)
    names = tuple(env.action_names)

    async def collect():
        pairs = [(ModelAgent(system_message(env, names, ctx)), SokobanTaskEnv(int(s)))
                 for s in seeds]
        return [t async for _, t in TrajectoryCollectEngine.collect_multiple(
            pairs, model_call=model_call, timeout=3600.0, overlong_filter=False)]

    t0 = time.perf_counter()
    asyncio.run(collect())  # compiles every prompt bucket
    first = time.perf_counter() - t0
    sampled.clear()
    t0 = time.perf_counter()
    trajectories = asyncio.run(collect())
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "first_s": first, "episodes": len(trajectories),
            "sampled": int(sum(sampled)), "turns": len(sampled) / max(len(trajectories), 1)}


def tunix_worker(spec_path: Path) -> None:
    import jax
    import jax.numpy as jnp
    from tunix.models.qwen2 import params as qwen2_params

    spec = json.loads(spec_path.read_text())
    work = spec_path.parent
    results = {"versions": {"jax": jax.__version__}}
    try:
        import importlib.metadata as md
        results["versions"]["tunix"] = md.version("google-tunix")
    except Exception:  # report what is known
        pass
    arrays = {}
    for size in spec["sizes"]:
        folder = work / size
        inputs = np.load(work / f"{size}_inputs.npz")
        cfg = tunix_config(folder)
        t0 = time.perf_counter()
        model = qwen2_params.create_model_from_safe_tensors(str(folder), cfg, dtype=jnp.float32)
        results[f"{size}/load_s"] = time.perf_counter() - t0
        arrays[f"{size}/logits"] = tunix_logits(model, inputs["logit_tokens"])
        for b in spec["batches"][size]:
            warm, first, tokens = tunix_sampling(model, cfg, inputs[f"prompts_{b}"], spec["new"],
                                                 spec["repeats"])
            results[f"{size}/sample/{b}"] = {"warm_s": warm, "first_s": first}
            arrays[f"{size}/tokens_{b}"] = tokens
            print(f"tunix {size} B={b}: {warm:.2f} s warm, {first:.1f} s first", flush=True)
        batch = {k[len("train_"):]: inputs[k] for k in inputs.files if k.startswith("train_")}
        try:
            results[f"{size}/train"] = tunix_train(model, batch, spec)
        except Exception as e:  # report, do not hide
            results[f"{size}/train"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        print(f"tunix {size} train: {results[f'{size}/train']}", flush=True)
    if spec.get("rollout"):
        try:
            results["rollout"] = tunix_rollout(work / "tiny", spec)
        except Exception as e:  # report, do not hide
            results["rollout"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        print(f"tunix rollout: {results['rollout']}", flush=True)
    np.savez(work / "tunix_arrays.npz", **arrays)
    (work / "tunix_results.json").write_text(json.dumps(results, indent=1))


# ----------------------------------------------------------------------------------------------
# our side and the driver
# ----------------------------------------------------------------------------------------------


def our_config(size: str, big_vocab: int):
    from ragen_jax.models import QwenConfig

    if size == "tiny":
        return QwenConfig.tiny()
    return QwenConfig.qwen2_5_0_5b(vocab_size=big_vocab)


def write_inputs(size: str, folder: Path, args) -> dict:
    """The checkpoint folder and the npz every process reads: logit tokens, prompts per
    batch, the training batch."""
    from flax import nnx

    from ragen_jax.models import Qwen2ForCausalLM, save_pretrained

    cfg = our_config(size, args.big_vocab)
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
    from ragen_jax.starpo.token_scores import token_logprobs
    from ragen_jax.starpo.update import (
        Prefixes,
        TrainBatch,
        make_optimizer,
        make_train_step,
    )

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
    step = make_train_step(graphdef, ucfg, opt)
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


def matmul_peak(n: int = 2048, repeats: int = 5, dtype: str = "float32") -> float:
    """GFLOP/s of a jitted ``n^3`` matmul in ``dtype`` (best of ``repeats``): the roofline."""
    import jax
    import jax.numpy as jnp

    a = jnp.asarray(np.random.RandomState(0).randn(n, n), dtype)
    dot = jax.jit(jnp.dot)
    dot(a, a).block_until_ready()
    return 2 * n**3 / timed(lambda: dot(a, a).block_until_ready(), repeats) / 1e9


def memory_bandwidth(gib: float = 1.0, repeats: int = 5) -> float:
    """GB/s of a jitted sum over a ``gib`` GiB float32 array (best of ``repeats``): the rate
    at which a decode step can read weights and cache, the bound decode is measured against."""
    import jax
    import jax.numpy as jnp

    x = jnp.ones((int(gib * 2**28),), jnp.float32)
    total = jax.jit(jnp.sum)
    total(x).block_until_ready()
    return x.size * 4 / timed(lambda: total(x).block_until_ready(), repeats) / 1e9


def decode_bytes(cfg, params_bytes: int, batch: int, slots: int) -> int:
    """Bytes a decode step must read at least: every weight once, and the keys and values
    of the ``slots`` cache slots it attends over, for every row."""
    kv = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 4
    return params_bytes + kv * batch * slots


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


def baseline_label(args) -> str:
    if args.baseline_prefill_tokens is not None:
        return f"prefill_tokens={args.baseline_prefill_tokens}"
    return "HF layout" if args.baseline_options is None else f"with {args.baseline_options}"


def run_tunix(work: Path, args) -> tuple[dict, dict]:
    spec = {"sizes": args.size_list, "batches": args.batch_list, "new": args.new,
            "repeats": args.repeats, "lr": args.lr, "rollout": None}
    if args.rollout:
        spec["rollout"] = {"groups": args.groups, "group_size": args.group_size,
                           "turns": args.turns, "response_length": args.response_length}
    (work / "spec.json").write_text(json.dumps(spec))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    if args.tunix_xla_flags is not None:
        env["XLA_FLAGS"] = args.tunix_xla_flags
    if args.rollout:  # only the rollout imports ragen_jax (its env, prompt and parser)
        env.update(PYTHONPATH=str(ROOT), MPLCONFIGDIR=tempfile.mkdtemp(prefix="mpl_"))
    cmd = [str(args.tunix_python), str(Path(__file__).resolve()), "--worker",
           str(work / "spec.json")]
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
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
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
    if args.worker:
        tunix_worker(Path(args.worker))
        return
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


def roofline_lines(args, ours: dict, peak: float) -> list[str]:
    """Ours against this CPU's two ceilings: prefill against the matmul peak, decode against
    the time to read the weights and the attended cache once per step."""
    from bench_sampler import work_gflop

    from ragen_jax.rollout.sampler import bucket_length

    bandwidth = ours["bandwidth"]
    lines = ["", f"## Roofline reading (ours): prefill against the matmul peak ({peak:.0f} "
             f"GFLOP/s), decode against the memory bandwidth ({bandwidth:.1f} GB/s, a jitted "
             "sum over 1 GiB)", "",
             "| shape | batch | prefill s | prefill GFLOP | prefill GFLOP/s | % of matmul peak | "
             "decode ms/token-step | MB read per step (weights + cache) | bandwidth bound ms | "
             "bound / measured |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for size in args.size_list:
        cfg = our_config(size, args.big_vocab)
        slots = bucket_length(args.prompt) + args.new  # the cache every decode step reads
        for b in args.batch_list[size]:
            prefill, total = ours[f"{size}/prefill/{b}"], ours[f"{size}/sample/{b}"][0]
            work = work_gflop(cfg, b, args.prompt, 1)
            decode_ms = 1e3 * (total - prefill) / max(args.new - 1, 1)
            read = decode_bytes(cfg, ours[f"{size}/param_bytes"], b, slots)
            bound_ms = 1e3 * read / (bandwidth * 1e9)
            lines.append(f"| {size} | {b} | {prefill:.2f} | {work:.0f} | {work / prefill:.0f} | "
                         f"{100 * work / prefill / peak:.0f}% | {decode_ms:.1f} | "
                         f"{read / 1e6:.0f} | {bound_ms:.1f} | {bound_ms / decode_ms:.2f} |")
    return lines + ["", "Prefill: a 1-token call on the same prompts (the prompt through every "
                    "layer, logits at its last token, one sampled token); its work is "
                    "`bench_sampler.work_gflop` for one new token. Decode: the rest of the "
                    f"{args.new}-token call per token-step. The bound reads every weight and "
                    "the whole cache buffer once per step; compute is ignored, so a step cannot "
                    "beat it, and bound / measured is the share of the bandwidth used.", ""]


def report(args, ours: dict, theirs: dict, tunix_arrays: dict, peak: float, jax_version: str) -> str:
    sys.path.insert(0, str(ROOT / "experiments"))
    from bench_sampler import work_gflop

    lines = [
        "# Side by side with Tunix (JAX peer): logits, sampling, GRPO train step, multi-turn rollout",
        "",
        f"Same random Qwen2 checkpoint folder loaded by both, float32, CPU. Tunix "
        f"{theirs['versions'].get('tunix', '?')} in its own venv and process"
        + (f" (XLA_FLAGS=`{args.tunix_xla_flags}`)" if args.tunix_xla_flags is not None else "")
        + "; ours jax "
        f"{jax_version}. Host: {platform.machine()}, {os.cpu_count()} CPUs, 1-minute load "
        f"average {ours['load'][0]:.1f} when our side started and {ours['load'][1]:.1f} after "
        "Tunix's (ratios come from one run; absolute numbers move with the machine's load). "
        + (f"Shape 0.5b: Qwen2.5-0.5B's layers with a {args.big_vocab}-token vocabulary. "
           if "0.5b" in args.size_list else "") +
        f"Best of {args.repeats} warm calls. This CPU's float32 matmul "
        f"roofline (jitted 2048^3 `jnp.dot`): {peak:.0f} GFLOP/s.",
        "",
        "| shape | check | max abs logit diff |",
        "|---|---|---:|",
    ]
    for size in args.size_list:
        diff = float(np.abs(ours[f"{size}/logits"] - tunix_arrays[f"{size}/logits"]).max())
        lines.append(f"| {size} | logits on 2 x 64 tokens | {diff:.2e} |")
    sampling_at = len(lines)
    lines += [
        "",
        f"## Greedy sampling: {args.prompt}-token prompts, {args.new} new tokens",
        "",
        "| shape | batch | ours tok/s | Tunix tok/s | ours / Tunix | identical rows | "
        "ours GFLOP/s | Tunix GFLOP/s | ours first call s | Tunix first call s | "
        f"ours, {baseline_label(args)}: tok/s | its / Tunix | identical rows |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for size in args.size_list:
        cfg = our_config(size, args.big_vocab)
        for b in args.batch_list[size]:
            warm, first, tokens = ours[f"{size}/sample/{b}"]
            t = theirs[f"{size}/sample/{b}"]
            same = float((tokens == tunix_arrays[f"{size}/tokens_{b}"]).all(axis=1).mean())
            work = work_gflop(cfg, b, args.prompt, args.new)
            n = b * args.new
            base = ""
            if f"{size}/sample_base/{b}" in ours:
                base_warm, _, base_tokens = ours[f"{size}/sample_base/{b}"]
                base = (f" {n / base_warm:.0f} | {t['warm_s'] / base_warm:.2f}x | "
                        f"{float((base_tokens == tokens).all(axis=1).mean()):.2f} |")
            lines.append(f"| {size} | {b} | {n / warm:.0f} | {n / t['warm_s']:.0f} | "
                         f"{t['warm_s'] / warm:.2f}x | {same:.2f} | {work / warm:.0f} | "
                         f"{work / t['warm_s']:.0f} | {first:.1f} | {t['first_s']:.1f} |"
                         + (base or " | | |"))
    if not any(args.batch_list.values()):
        lines[sampling_at:] = ["", "## Greedy sampling: not run (`--batches=`)"]
    if args.roofline:
        lines += roofline_lines(args, ours, peak)
    length = args.prompt + args.train_completion
    lines += [
        "",
        f"## Policy-gradient train step: {length}-token rows ({args.train_completion} trained), "
        "one micro-batch, no reference, AdamW"
        + (f"; groups of {args.train_group} rows share a prompt" if args.train_group > 1 else ""),
        "",
        "| shape | rows | ours: remat | ours: prompt | ours tok/s | Tunix tok/s | ours / Tunix | "
        "ours peak GiB | Tunix peak GiB | memory source | first-step pg loss ours / Tunix | "
        "compile s ours / Tunix |",
        "|---|---:|---|---|---:|---:|---:|---:|---:|---|---|---|",
    ]
    for size in args.size_list:
        t = theirs[f"{size}/train"]
        n = args.train_batch[size] * length  # the batch's tokens, however a side computes them
        for key in sorted(k for k in ours if k.startswith(f"{size}/train/")):
            o, remat = ours[key], key.split("/")[2]
            prompt = "once per group" if key.endswith("/shared") else "per row"
            head = f"| {size} | {args.train_batch[size]} | {remat} | {prompt} | {n / o['step_s']:.0f} |"
            if "error" in t:
                lines.append(f"{head} failed: {t['error']} | | {o['mem_gib']:.2f} | | | | |")
                continue
            lines.append(
                f"{head} {n / t['step_s']:.0f} | {t['step_s'] / o['step_s']:.2f}x | "
                f"{o['mem_gib']:.2f} | {t['mem_gib']:.2f} | {o['mem_source']} | "
                f"{o['loss']:.4f} / {t['loss']:.4f} | {o['compile_s']:.1f} / {t['compile_s']:.1f} |")
    lines += [
        "",
        *rollout_lines(args, ours, theirs),
        "Tokens/s count generated tokens over a whole warm call (prefill included). Ours "
        "samples in its CPU decoding layout (`[in, out]` weights, an untied `[E, V]` head, XLA's "
        "default options); \"ours, HF layout\" is the same sampler with `layout=False` (the "
        "Hugging Face `[out, in]` weights, as before that layout), \"ours, with K=V\" the "
        "decoding layout compiled with those XLA options (`--baseline-options`), "
        "\"ours, prefill_tokens=N\" our sampler prefilling in blocks of at most N tokens (0: "
        "each call's chunk at once; `--baseline-prefill-tokens`), timed in the same run. The "
        "train "
        "step runs Tunix's `grpo_loss_fn` (full `[B, L, V]` logits) under an `nnx.Optimizer` "
        "as its `PeftTrainer` steps it; ours `make_train_step` (log-probs from hidden states in "
        "chunks, entropy bonus 0.001, dual clip 3), under each `remat` policy listed (Tunix's "
        "model at its default, `RematConfig.NONE`). The pg losses agree at the first step "
        "(ratio 1: minus the token-mean advantage). With `--train-group` above 1 the rows are a "
        "GRPO batch, groups of answers to one prompt: Tunix's loss runs every row's prompt; ours "
        "is timed per row and with each group's prompt run once per step (the trainer's "
        "`actor.share_prompt_forward`, exact); tokens/s counts the batch's rows x length on both sides.",
        "",
    ]
    return "\n".join(lines)


def rollout_lines(args, ours: dict, theirs: dict) -> list[str]:
    """Part 3's table: our rollout against Tunix's agentic loop, or why Tunix's did not run."""
    head = [f"## Multi-turn Sokoban rollout: {args.groups} groups x {args.group_size}, "
            f"{args.turns} turns, {args.response_length} new tokens a turn, tiny, greedy", ""]
    t = theirs.get("rollout")
    if not args.rollout or not t or "error" in t:
        why = t["error"] if t and "error" in t else "not run (--no-rollout or no tiny shape)"
        return head + [f"Tunix: {why}. {AGENTIC_NOTE}", ""]
    o = ours["rollout"]
    rows = ["| framework | episodes | turns/episode | sampled tokens | wall s | episodes/s | "
            "sampled tok/s | first run s |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, r in (("ours (`AgentRollout`)", o), ("Tunix (`TrajectoryCollectEngine`)", t)):
        rows.append(f"| {name} | {r['episodes']} | {r['turns']:.1f} | {r['sampled']} | "
                    f"{r['wall_s']:.2f} | {r['episodes'] / r['wall_s']:.2f} | "
                    f"{r['sampled'] / r['wall_s']:.0f} | {r['first_s']:.1f} |")
    ratio = (o["episodes"] / o["wall_s"]) / (t["episodes"] / t["wall_s"])
    return head + rows + ["", f"Episodes/s, ours / Tunix: {ratio:.2f}x. {ROLLOUT_NOTE}", ""]


if __name__ == "__main__":
    main()
