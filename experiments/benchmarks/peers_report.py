"""``bench_peers``' markdown report: ours beside Tunix for logits, sampling (with the roofline
reading), the train step and the multi-turn rollout."""

from __future__ import annotations

import os
import platform

import numpy as np

from experiments.benchmarks.roofline import decode_bytes, work_gflop
from experiments.benchmarks.shapes import peer_config

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


NOTES = (
    "Tokens/s count generated tokens over a whole warm call (prefill included). Ours "
    "samples in its CPU decoding layout (`[in, out]` weights, an untied `[E, V]` head, XLA's "
    "default options); \"ours, HF layout\" is the same sampler with `layout=False` (the "
    "Hugging Face `[out, in]` weights, as before that layout), \"ours, with K=V\" the "
    "decoding layout compiled with those XLA options (`--baseline-options`), "
    "\"ours, prefill_tokens=N\" our sampler prefilling in blocks of at most N tokens (0: "
    "each call's chunk at once; `--baseline-prefill-tokens`), timed in the same run. The "
    "train "
    "step runs Tunix's `grpo_loss_fn` (full `[B, L, V]` logits) under an `nnx.Optimizer` "
    "as its `PeftTrainer` steps it; ours `jit_optimizer_step` (log-probs from hidden states in "
    "chunks, entropy bonus 0.001, dual clip 3), under each `remat` policy listed (Tunix's "
    "model at its default, `RematConfig.NONE`). The pg losses agree at the first step "
    "(ratio 1: minus the token-mean advantage). With `--train-group` above 1 the rows are a "
    "GRPO batch, groups of answers to one prompt: Tunix's loss runs every row's prompt; ours "
    "is timed per row and with each group's prompt run once per step (the trainer's "
    "`actor.share_prompt_forward`, exact); tokens/s counts the batch's rows x length on both sides.")


def baseline_label(args) -> str:
    if args.baseline_prefill_tokens is not None:
        return f"prefill_tokens={args.baseline_prefill_tokens}"
    return "HF layout" if args.baseline_options is None else f"with {args.baseline_options}"


def roofline_lines(args, ours: dict, peak: float) -> list[str]:
    """Ours against this CPU's two ceilings: prefill against the matmul peak, decode against
    the time to read the weights and the attended cache once per step."""
    from ragen_jax.rollout.sampler import bucket_length

    bandwidth = ours["bandwidth"]
    lines = ["", f"## Roofline reading (ours): prefill against the matmul peak ({peak:.0f} "
             f"GFLOP/s), decode against the memory bandwidth ({bandwidth:.1f} GB/s, a jitted "
             "sum over 1 GiB)", "",
             "| shape | batch | prefill s | prefill GFLOP | prefill GFLOP/s | % of matmul peak | "
             "decode ms/token-step | MB read per step (weights + cache) | bandwidth bound ms | "
             "bound / measured |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for size in args.size_list:
        cfg = peer_config(size, args.big_vocab)
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
                    "`roofline.work_gflop` for one new token. Decode: the rest of the "
                    f"{args.new}-token call per token-step. The bound reads every weight and "
                    "the whole cache buffer once per step; compute is ignored, so a step cannot "
                    "beat it, and bound / measured is the share of the bandwidth used.", ""]


def report(args, ours: dict, theirs: dict, tunix_arrays: dict, peak: float, jax_version: str) -> str:
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
    lines += sampling_lines(args, ours, theirs, tunix_arrays)
    if args.roofline:
        lines += roofline_lines(args, ours, peak)
    lines += [*train_lines(args, ours, theirs), "", *rollout_lines(args, ours, theirs), NOTES, ""]
    return "\n".join(lines)


def sampling_lines(args, ours: dict, theirs: dict, tunix_arrays: dict) -> list[str]:
    """Greedy sampling's table: tokens/s of both, identical rows, GFLOP/s, the baseline column."""
    lines = [
        "",
        f"## Greedy sampling: {args.prompt}-token prompts, {args.new} new tokens",
        "",
        "| shape | batch | ours tok/s | Tunix tok/s | ours / Tunix | identical rows | "
        "ours GFLOP/s | Tunix GFLOP/s | ours first call s | Tunix first call s | "
        f"ours, {baseline_label(args)}: tok/s | its / Tunix | identical rows |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for size in args.size_list:
        cfg = peer_config(size, args.big_vocab)
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
        return ["", "## Greedy sampling: not run (`--batches=`)"]
    return lines


def train_lines(args, ours: dict, theirs: dict) -> list[str]:
    """The train step's table: tokens/s, peak memory, first-step loss and compile seconds."""
    length = args.prompt + args.train_completion
    lines = [
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
    return lines


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
