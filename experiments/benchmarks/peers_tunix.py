"""``bench_peers``' Tunix side: loads the bench's checkpoint folder with Tunix and measures
logits, greedy sampling, a GRPO train step and (with ragen_jax importable) a multi-turn
Sokoban rollout through Tunix's agentic loop; writes ``tunix_results.json`` and
``tunix_arrays.npz`` beside the spec.

Runs under Tunix's interpreter, started by ``bench_peers`` with this checkout on
``PYTHONPATH``: ``.venv-tunix/bin/python -m experiments.benchmarks.peers_tunix WORK/spec.json``.
Imports numpy, Tunix and its JAX, and ragen_jax only for the rollout.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np

from experiments.benchmarks.roofline import memory_reading
from experiments.common import timed


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


def bucketed_samplers(model, tcfg, response_length: int):
    """``sampler_for(prompt_length) -> (Sampler, bucket)``: one Tunix ``Sampler`` per
    power-of-two prompt bucket, its cache the bucket plus the response (a Sampler's cache size
    is fixed when built): the tightest cache Tunix allows each call. Thread-safe."""
    import threading

    from tunix.generate import sampler as sampler_lib

    samplers, lock = {}, threading.Lock()

    def sampler_for(prompt_length: int):
        bucket = 1 << max(prompt_length - 1, 1).bit_length()
        with lock:
            if bucket not in samplers:
                cache = sampler_lib.CacheConfig(
                    cache_size=bucket + response_length, num_layers=tcfg.num_layers,
                    num_kv_heads=tcfg.num_kv_heads, head_dim=tcfg.head_dim)
                samplers[bucket] = sampler_lib.Sampler(model, IdsTokenizer(), cache)
            return samplers[bucket], bucket

    return sampler_for


def sokoban_task_env(env, params, cfg):
    """Our jitted Sokoban as Tunix's ``BaseTaskEnv`` (one episode per instance, its level
    from the seed), with RAGEN's turn text and answer parser from ragen_jax."""
    import jax
    import jax.numpy as jnp
    from tunix.rl.agentic.environments.base_environment import BaseTaskEnv, EnvStepResult

    from ragen_jax.rollout.context import parse_response, user_message
    from ragen_jax.rollout.env_driver import env_functions

    ctx = cfg.context
    reset_fn, step_fn = env_functions(env)

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
            self.state, reward, n_exec, _, _, term, _, success = step_fn(
                self.state, params, jnp.asarray(ids), jnp.asarray([n], jnp.int32),
                jax.random.key(self.seed)[None])
            self.actions += int(n_exec[0])
            reward = float(reward[0]) - (0.1 if parsed.format_error else 0.0)
            return EnvStepResult(self._observation(reward), reward, bool(term[0]),
                                 {"success": bool(success[0])})

    return SokobanTaskEnv


def tunix_rollout(folder: Path, spec: dict) -> dict:
    """5-turn Sokoban through Tunix's agentic loop (``TrajectoryCollectEngine.collect_multiple``:
    one asyncio task per episode, each turn a batch-1 ``model_call`` on a worker thread), our
    jitted Sokoban wrapped as its ``BaseTaskEnv``, RAGEN's prompt and parser from ragen_jax
    (needs ragen_jax and gymnax importable here), Tunix's ``Sampler`` as the model, greedy."""
    import asyncio

    import jax.numpy as jnp
    from tunix.models.qwen2 import params as qwen2_params
    from tunix.rl.agentic.agents.model_agent import ModelAgent
    from tunix.rl.agentic.trajectory.trajectory_collect_engine import TrajectoryCollectEngine
    from tunix.rl.rollout.base_rollout import RolloutOutput

    from ragen_jax.envs import make
    from ragen_jax.models import tokenizer as tokenizers
    from ragen_jax.rollout.agent import train_seeds
    from ragen_jax.rollout.config import RolloutConfig, SamplingConfig
    from ragen_jax.rollout.context import system_message

    r = spec["rollout"]
    cfg = RolloutConfig(env_groups=r['groups'], group_size=r['group_size'], max_turn=r['turns'], response_length=r['response_length'], sampling=SamplingConfig(temperature=0.0))
    ctx = cfg.context
    tok = tokenizers.load(None)
    env, params = make("sokoban")
    tcfg = tunix_config(folder)
    model = qwen2_params.create_model_from_safe_tensors(str(folder), tcfg, dtype=jnp.float32)
    sampler_for = bucketed_samplers(model, tcfg, cfg.response_length)
    stop = [tok.convert_tokens_to_ids("<|im_end|>")]
    task_env = sokoban_task_env(env, params, cfg)

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
        pairs = [(ModelAgent(system_message(env, names, ctx)), task_env(int(s)))
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


if __name__ == "__main__":
    tunix_worker(Path(sys.argv[1]))
