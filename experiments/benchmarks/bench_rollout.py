"""Multi-turn rollout throughput: KV cache kept across turns vs re-encoding the history.

Plays 5-turn Sokoban (``groups x group_size`` episodes) with a random-weight policy through
``AgentRollout.collect``, twice per setting: ``reuse_cache=True`` (each turn prefills only its
new chunk into the cache the previous turn left) and ``reuse_cache=False`` (the same loop,
each turn re-encoding the whole history without a cache). Random weights never answer in the
format, so every episode runs all turns and every response runs to the token budget (a fixed,
worst-case workload); the env is still stepped through the jitted vmapped path (with no valid
action it executes nothing).

Reported per setting (the median of ``--repeats`` timed runs after one warm-up run that
compiles): trajectories/s, sampled tokens/s, trajectory tokens/s (prompt + sampled real
tokens of the final sequences), and the host share of wall time (rendering, tokenising the
chunks, decoding and parsing, batch assembly: everything outside the generate and env calls).

    python -m experiments.benchmarks.bench_rollout            # tiny preset
    python -m experiments.benchmarks.bench_rollout --big      # + 0.5B-shaped random model
    python -m experiments.benchmarks.bench_rollout --sharing --groups 8 --group-size 16
        # a group's first prompt prefilled once, cache growth in multiples of 128: same seeds
    python -m experiments.benchmarks.bench_rollout --windows
        # rollout.window.mode full vs limited (k=1, k=2) vs single_turn: same seeds

Writes ``experiments/results/bench_rollout.md`` and prints the table.
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import jax
import numpy as np
from flax import nnx

from experiments.common import RESULTS
from ragen_jax.envs import make
from ragen_jax.models import Qwen2ForCausalLM, QwenConfig
from ragen_jax.models import tokenizer as tokenizers
from ragen_jax.rollout import Sampler
from ragen_jax.rollout.agent import AgentRollout, train_seeds
from ragen_jax.rollout.config import RolloutConfig, SamplingConfig

OUT = RESULTS / "bench_rollout.md"
BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"  # jax.monitoring event


def bench(name: str, config: QwenConfig, args) -> list[dict]:
    tok = tokenizers.load(None)
    model = Qwen2ForCausalLM(config, rngs=nnx.Rngs(0))
    sampler = Sampler(model, pad_id=tok.pad_token_id)
    env, params = make("sokoban")
    cfg = RolloutConfig(env_groups=args.groups, group_size=args.group_size, max_turn=args.turns, response_length=args.response_length, sampling=SamplingConfig(temperature=1.0))
    rollout = AgentRollout(env, params, tok, cfg)
    seeds = train_seeds(cfg, 0)
    rows = []
    for reuse in (True, False):
        t0 = time.perf_counter()
        rollout.collect(sampler, seeds, jax.random.key(0), reuse_cache=reuse)  # compiles
        warm = time.perf_counter() - t0
        runs = []
        for r in range(args.repeats):
            t0 = time.perf_counter()
            batch = rollout.collect(sampler, seeds, jax.random.key(0), reuse_cache=reuse)
            runs.append((time.perf_counter() - t0, batch))
            print(f"  {name} reuse_cache={reuse} run {r}: {runs[-1][0]:.2f} s", flush=True)
        wall, batch = sorted(runs, key=lambda x: x[0])[len(runs) // 2]
        n = len(batch.trajectories)
        sampled = int(batch.loss_mask.sum())
        total = int(batch.attention_mask.sum())
        tm = batch.timing
        rows.append({
            "model": name, "cache": "reuse" if reuse else "re-encode", "episodes": n,
            "turns": float(np.mean(batch.num_turns)), "wall_s": wall,
            "traj_per_s": n / wall, "sampled_tok_per_s": sampled / wall,
            "traj_tok_per_s": total / wall, "host_share": tm["host_s"] / tm["total_s"],
            "generate_s": tm["generate_s"], "env_s": tm["env_s"], "host_s": tm["host_s"],
            "first_run_s": warm, "mean_len": total / n,
        })
    rows[0]["speedup"] = rows[1]["wall_s"] / rows[0]["wall_s"]
    rows[1]["speedup"] = 1.0
    return rows


class CompileCounter:
    """Counts XLA backend compilations inside ``with counter:`` (``count``: the last block's)."""

    def __init__(self):
        self.count, self._on = 0, False
        jax.monitoring.register_event_duration_secs_listener(self._event)

    def _event(self, event: str, _secs: float, **_kw) -> None:
        if self._on and event == BACKEND_COMPILE:
            self.count += 1

    def __enter__(self):
        self.count, self._on = 0, True
        return self

    def __exit__(self, *exc):
        self._on = False


#: The CPU sampler's compile options until 2026-11-27 (YNNPACK fusions off), timed as rows.
NO_YNN_FUSIONS = {"xla_cpu_experimental_ynn_fusion_type": ""}
#: The sampler the trainer builds (row 6): a group's prompt held once, tight buckets.
GROUP_PREFIX_ROW = dict(share_prompts=True, group_prefix=True, cache_multiple=32,
                        bucket_multiple=16)


def bench_sharing(args) -> str:
    """The first prompt prefilled once per group and tighter cache growth, against neither,
    on the same seeds in one process, greedy (so the trajectories must be equal)."""
    tok = tokenizers.load(None)
    model = Qwen2ForCausalLM(QwenConfig.tiny(), rngs=nnx.Rngs(0))
    env, params = make("sokoban")
    cfg = RolloutConfig(env_groups=args.groups, group_size=args.group_size, max_turn=args.turns, response_length=args.response_length, sampling=SamplingConfig(temperature=0.0))
    rollout = AgentRollout(env, params, tok, cfg)
    seeds = train_seeds(cfg, 0)
    settings = [("every row prefilled, power-of-two cache", dict(share_prompts=False)),
                ("group prompt prefilled once", dict(share_prompts=True, group_prefix=False)),
                ("prompt once + cache in multiples of 128",
                 dict(share_prompts=True, group_prefix=False, cache_multiple=128)),
                ("prompt once + cache in multiples of 64",
                 dict(share_prompts=True, group_prefix=False, cache_multiple=64)),
                ("prompt once + cache in multiples of 32",
                 dict(share_prompts=True, group_prefix=False, cache_multiple=32)),
                ("prompt once + cache in multiples of 32 + prompt chunks in multiples of 16",
                 dict(share_prompts=True, group_prefix=False, cache_multiple=32,
                      bucket_multiple=16)),
                ("prompt once, held as a group prefix + multiples of 32 + chunks of 16",
                 GROUP_PREFIX_ROW),
                ("the row above compiled without YNNPACK fusions (the CPU sampler until "
                 "2026-11-27)",
                 dict(GROUP_PREFIX_ROW, prefill_tokens=0, compiler_options=NO_YNN_FUSIONS)),
                ("every row prefilled, power-of-two cache, without YNNPACK fusions (the "
                 "rollout before prefix sharing and tight buckets)",
                 dict(share_prompts=False, prefill_tokens=0,
                      compiler_options=NO_YNN_FUSIONS)),
                ("row 6 with every chunk prefilled in one block (the CPU sampler until "
                 "2026-11-27)",
                 dict(GROUP_PREFIX_ROW, prefill_tokens=0))]
    if args.rows:  # the first row stays the baseline
        settings = [settings[i] for i in dict.fromkeys([0, *args.rows])]
    rows, reference = [], None
    compiles = CompileCounter()
    for label, kw in settings:
        jax.clear_caches()  # every setting compiles its own shapes from nothing
        kw = {"bucket_multiple": cfg.sampler.prompt_pad_multiple, **kw}
        sampler = Sampler(model, pad_id=tok.pad_token_id, **kw)
        t0 = time.perf_counter()
        with compiles:
            rollout.collect(sampler, seeds, jax.random.key(0))  # compiles
        warm, first_compiles = time.perf_counter() - t0, compiles.count
        with compiles:  # other levels, other prompt and answer lengths: new shapes?
            for i in range(1, args.new_seed_batches + 1):
                rollout.collect(sampler, train_seeds(cfg, i), jax.random.key(i))
        later_compiles = compiles.count
        walls = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            batch = rollout.collect(sampler, seeds, jax.random.key(0))
            walls.append(time.perf_counter() - t0)
        same = reference is None or np.array_equal(batch.input_ids, reference.input_ids)
        reference = reference or batch
        wall = float(np.median(walls))
        rows.append(f"| {label} | {wall:.2f} | {len(batch.trajectories) / wall:.2f} | "
                    f"{batch.timing['generate_s']:.2f} | {warm:.1f} | {first_compiles} | "
                    f"{later_compiles} | {'yes' if same else 'NO'} |")
        print(rows[-1], flush=True)
    base = float(rows[0].split("|")[2])
    return "\n".join([
        f"## Group prompt sharing and cache growth ({args.groups} groups x {args.group_size}, "
        f"{args.turns} turns, {args.response_length} tokens per turn, greedy, tiny)",
        "",
        "| sampler | wall s | episodes/s | generate s | first run s | compiles, first run | "
        f"compiles, {args.new_seed_batches} runs on new levels | trajectories equal |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
        *rows, "", "Compiles: XLA backend compilations (jax's "
        f"`{BACKEND_COMPILE}` events), counted after `jax.clear_caches()`; the "
        "new-level runs use other training seeds (other prompt and answer lengths), after "
        "the first run compiled.", "", "Speed-up over the first row: " + ", ".join(
            f"{base / float(r.split('|')[2]):.2f}x" for r in rows[1:]) + " "
        f"(median of {args.repeats} runs after a compiling one; {platform.machine()}, "
        f"{os.cpu_count()} CPUs, jax {jax.__version__}).", ""])


WINDOWS = [("full", dict(context_window="full")),
           ("limited k=1", dict(context_window="limited", window_turns=1)),
           ("limited k=2", dict(context_window="limited", window_turns=2)),
           ("single_turn", dict(context_window="single_turn"))]


def bench_windows(args) -> str:
    """The context-window modes on the same seeds: a window that drops turns re-prefills
    each turn's whole prompt into a fresh cache; ``full`` prefills only each new chunk."""
    tok = tokenizers.load(None)
    model = Qwen2ForCausalLM(QwenConfig.tiny(), rngs=nnx.Rngs(0))
    env, params = make("sokoban")
    sampler = Sampler(model, pad_id=tok.pad_token_id, bucket_multiple=64)
    rows = []
    for label, kw in WINDOWS:
        cfg = RolloutConfig(env_groups=args.groups, group_size=args.group_size, max_turn=args.turns, response_length=args.response_length, **kw, sampling=SamplingConfig(temperature=1.0))
        rollout = AgentRollout(env, params, tok, cfg)
        seeds = train_seeds(cfg, 0)
        t0 = time.perf_counter()
        rollout.collect(sampler, seeds, jax.random.key(0))  # compiles
        warm = time.perf_counter() - t0
        runs = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            batch = rollout.collect(sampler, seeds, jax.random.key(0))
            runs.append((time.perf_counter() - t0, batch))
        wall, batch = sorted(runs, key=lambda x: x[0])[len(runs) // 2]
        n, m = len(batch.trajectories), batch.metrics
        rows.append(f"| {label} | {n} | {np.mean(batch.num_turns):.1f} | {wall:.2f} | "
                    f"{n / wall:.2f} | {m['rollout/prompt_tokens'] / n:.0f} | "
                    f"{m['rollout/prefill_tokens'] / n:.0f} | {m['rollout/sampled_tokens'] / n:.0f} | "
                    f"{m['rollout/tokens'] / n:.0f} | {batch.timing['generate_s']:.2f} | "
                    f"{batch.timing['host_s']:.2f} | {warm:.1f} |")
        print(rows[-1], flush=True)
    return "\n".join([
        f"## Context windows ({args.groups} groups x {args.group_size}, {args.turns} turns, "
        f"{args.response_length} tokens per turn, temperature 1, tiny, same seeds)",
        "",
        "Prompt tokens: summed over the turns, the prompts the model read (a turn-wise training "
        "row holds its prompt). Prefilled: the tokens actually encoded (``full`` continues the "
        "cache, so only each turn's new chunk; the others prefill every turn's whole prompt into "
        "a fresh cache). Transcript: the episode as one full-context sequence.",
        "",
        "| window | episodes | turns | wall s | traj/s | prompt tok/traj | prefilled tok/traj "
        "| sampled tok/traj | transcript tok/traj | generate s | host s | first run s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        *rows, "", f"Median of {args.repeats} runs after a compiling one; {platform.machine()}, "
        f"{os.cpu_count()} CPUs (shared), jax {jax.__version__}.", ""])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--big", action="store_true", help="also the 0.5B-shaped random model")
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--response-length", type=int, default=64)
    ap.add_argument("--big-groups", type=int, default=2, help="groups for --big (size 1)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--new-seed-batches", type=int, default=2,
                    help="--sharing: runs on other levels after the first, counting compiles")
    ap.add_argument("--big-only", action="store_true", help="only the 0.5B-shaped model")
    ap.add_argument("--append", action="store_true",
                    help="append this table to the results file instead of replacing it")
    ap.add_argument("--sharing", action="store_true",
                    help="only: group prompt sharing and cache growth (appended to the results)")
    ap.add_argument("--rows", type=int, nargs="+",
                    help="with --sharing: only these settings (indices; the first is always run)")
    ap.add_argument("--windows", action="store_true",
                    help="only: the context-window modes (appended to the results)")
    args = ap.parse_args()
    if args.sharing or args.windows:
        text = bench_windows(args) if args.windows else bench_sharing(args)
        OUT.write_text(OUT.read_text() + "\n" + text if OUT.exists() else text)
        print(text)
        return

    rows = [] if args.big_only else bench("tiny", QwenConfig.tiny(), args)
    if args.big or args.big_only:
        big = argparse.Namespace(**{**vars(args), "groups": args.big_groups, "group_size": 1,
                                    "repeats": 1})
        # The 0.5B shapes with the built-in tokenizer's vocabulary (the random model never
        # needs Qwen's 151k-token vocabulary to measure the loop; the embedding is smaller).
        rows += bench("0.5b-shaped", QwenConfig.qwen2_5_0_5b(vocab_size=tokenizers.TINY_VOCAB_SIZE,
                                                              tie_word_embeddings=True), big)

    head = ("| model | cache | episodes | turns | wall s | traj/s | sampled tok/s | traj tok/s "
            "| speed-up | host share | generate s | env s | host s | first run s |")
    lines = [
        "# Multi-turn rollout: KV cache across turns vs re-encoding the history",
        "",
        f"Sokoban 6x6, 1 box, {args.turns} turns, {args.response_length} new tokens per turn "
        "(random weights: responses always run to the budget, every turn is a format error, "
        "so every episode plays all turns), float32, temperature 1. Median of "
        f"{args.repeats} runs after a compiling warm-up (0.5B: one run; {args.big_groups} "
        "episodes). Host: "
        f"{platform.machine()}, {os.cpu_count()} CPUs, jax {jax.__version__}, "
        f"{jax.devices()[0].platform}. Host share = wall time outside the generate and env "
        "calls (rendering, chunk tokenisation, decoding, parsing, batch assembly) / wall time.",
        "",
        head,
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['cache']} | {r['episodes']} | {r['turns']:.1f} | "
            f"{r['wall_s']:.2f} | {r['traj_per_s']:.2f} | {r['sampled_tok_per_s']:.0f} | "
            f"{r['traj_tok_per_s']:.0f} | {r['speedup']:.2f}x | {100 * r['host_share']:.1f}% | "
            f"{r['generate_s']:.2f} | {r['env_s']:.2f} | {r['host_s']:.2f} | "
            f"{r['first_run_s']:.1f} |")
    text = "\n".join(lines) + "\n"
    OUT.parent.mkdir(parents=True, exist_ok=True)
    if args.append and OUT.exists():
        text = OUT.read_text() + "\n## Another run\n\n" + text.split("\n", 2)[2]
    OUT.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
