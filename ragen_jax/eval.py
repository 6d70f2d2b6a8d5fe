"""Evaluate a policy on the fixed validation seeds: ``python -m ragen_jax.eval``.

Runs the multi-turn rollout (``ragen_jax.rollout.agent``) on ``--groups x --group-size``
validation envs (seeds ``--val-seed + i``, the same every run) and writes, under ``--out``:

* ``metrics.json``: the RAGEN-named metrics (``{tag}/success``, ``pass@k``, ...), the settings
  and the timings;
* ``trajectories.jsonl``: one line per episode: chat messages, per-turn state, thinking,
  actions, rewards and penalties, success;
* ``viewer.html``: a static page, per episode and turn the state grid, the thinking, the
  actions and the reward. Every string there (model text above all) is HTML-escaped, so the
  page runs no script whatever the model wrote;

and prints a short table. The policy is a Hugging Face Qwen2/Qwen2.5 folder (``--model``) or,
without one, the tiny random preset with the built-in tokenizer (a smoke test; its answers are
noise), or a training run's checkpoint (``--checkpoint RUN_DIR [--step N]``: its actor and
tokenizer, and by default its env, env params and budgets). Decoding is sampled at temperature 0.5 by default
(RAGEN's validation setting); ``--temperature 0`` is greedy.
"""

from __future__ import annotations

import argparse
import dataclasses
import html
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from ragen_jax.envs import make
from ragen_jax.models import CheckpointError, Qwen2ForCausalLM, QwenConfig, from_pretrained
from ragen_jax.models import tokenizer as tokenizers
from ragen_jax.rollout.agent import AgentRollout, RolloutBatch, RolloutConfig, val_seeds
from ragen_jax.rollout.context import ContextConfig
from ragen_jax.rollout.sampler import Sampler


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m ragen_jax.eval", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="Hugging Face Qwen2 folder (default: tiny random)")
    p.add_argument("--checkpoint", default=None, help="training run folder (default: none)")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: last)")
    p.add_argument("--env", default=None, help="registered env name (default: sokoban, or the run's)")
    p.add_argument("--env-param", action="append", default=[], metavar="K=V",
                   help="env parameter (repeatable), e.g. dim_room=(6,6) num_boxes=1")
    p.add_argument("--groups", type=int, default=64, help="validation groups")
    p.add_argument("--group-size", type=int, default=1)
    p.add_argument("--val-seed", type=int, default=123)
    p.add_argument("--max-turn", type=int, default=None, help="default 5 (or the run's)")
    p.add_argument("--max-actions-per-traj", type=int, default=None, help="default 10 (or the run's)")
    p.add_argument("--max-actions-per-turn", type=int, default=None, help="default 2 (or the run's)")
    p.add_argument("--response-length", type=int, default=None, help="default 400 (or the run's)")
    p.add_argument("--max-model-len", type=int, default=None, help="default 3600 (or the run's)")
    p.add_argument("--temperature", type=float, default=0.5, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--no-think", action="store_true", default=None,
                   help="answer-only format (default: think, or the run's)")
    p.add_argument("--seed", type=int, default=0, help="sampling / env-noise seed")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--tiny-hidden", type=int, default=None,
                   help="random tiny model: hidden size (default: the tiny preset's)")
    p.add_argument("--tiny-layers", type=int, default=None,
                   help="random tiny model: layers (default: the tiny preset's)")
    p.add_argument("--out", default="results/eval", help="output folder")
    return p


_ROLLOUT_DEFAULTS = dict(max_turn=5, max_actions_per_traj=10, max_actions_per_turn=2,
                         response_length=400, max_model_len=3600, no_think=False)


def _env_value(text: str) -> Any:
    try:
        return json.loads(text.replace("(", "[").replace(")", "]"))
    except json.JSONDecodeError:
        return text


def load_policy(args: argparse.Namespace) -> tuple[Qwen2ForCausalLM, Any, str]:
    """``(model, tokenizer, description)`` from ``--model`` or the tiny random preset."""
    dtype = jnp.bfloat16 if args.dtype == "bfloat16" else jnp.float32
    if args.checkpoint:
        from ragen_jax.export import load_checkpoint

        actor, tok, _, step = load_checkpoint(args.checkpoint, args.step)
        return actor, tok, f"{args.checkpoint} (step {step})"
    if args.model:
        return (from_pretrained(args.model, dtype=dtype), tokenizers.load(args.model),
                str(args.model))
    kw = {}
    if args.tiny_hidden:
        heads = max(1, args.tiny_hidden // 64)
        kw.update(hidden_size=args.tiny_hidden, intermediate_size=2 * args.tiny_hidden,
                  num_attention_heads=heads * 2, num_key_value_heads=heads,
                  head_dim=args.tiny_hidden // (heads * 2))
    if args.tiny_layers:
        kw["num_hidden_layers"] = args.tiny_layers
    config = QwenConfig.tiny(**kw).replace(param_dtype=dtype, dtype=dtype)
    model = Qwen2ForCausalLM(config, rngs=nnx.Rngs(args.seed))
    return model, tokenizers.load(None), "tiny random model"


def run(args: argparse.Namespace) -> tuple[RolloutBatch, dict[str, Any]]:
    """Runs the evaluation rollout and writes the three files; returns (batch, summary)."""
    env_kw = {k: _env_value(v) for k, v in (kv.split("=", 1) for kv in args.env_param)}
    context_kw: dict[str, Any] = {}
    if args.checkpoint:  # the run's env, budgets and format unless given here
        from ragen_jax.export import load_run_config

        run = load_run_config(args.checkpoint)
        if args.env is None:
            args.env = run.env.name
            env_kw = {**dict(run.env.params), **env_kw}
        for name in ("max_turn", "max_actions_per_traj", "max_actions_per_turn", "response_length",
                     "max_model_len"):
            if getattr(args, name) is None:
                setattr(args, name, run.rollout[name])
        if args.no_think is None:
            args.no_think = not run.rollout.enable_think
        if run.rollout.get("turn_template"):  # the run's prompt wording
            context_kw["turn_template"] = run.rollout.turn_template
    args.env = args.env or "sokoban"
    env, env_params = make(args.env, **env_kw)
    for name, default in _ROLLOUT_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    model, tok, model_name = load_policy(args)
    cfg = RolloutConfig(
        env_groups=args.groups, group_size=args.group_size, val_groups=args.groups,
        val_group_size=args.group_size, val_seed=args.val_seed, max_turn=args.max_turn,
        max_actions_per_traj=args.max_actions_per_traj, response_length=args.response_length,
        max_model_len=args.max_model_len, temperature=args.temperature, top_k=args.top_k,
        top_p=args.top_p,
        context=ContextConfig(max_actions_per_turn=args.max_actions_per_turn,
                              enable_think=not args.no_think, **context_kw))
    rollout = AgentRollout(env, env_params, tok, cfg)
    sampler = Sampler(model, pad_id=tok.pad_token_id or 0)
    t0 = time.perf_counter()
    batch = rollout.collect(sampler, val_seeds(cfg), jax.random.key(args.seed))
    wall = time.perf_counter() - t0

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    settings = {k: v for k, v in vars(args).items()}
    settings["config"] = json.loads(json.dumps(dataclasses.asdict(cfg), default=str))
    summary = {"model": model_name, "env": args.env, "episodes": len(batch.trajectories),
               "metrics": batch.metrics, "timing": {**batch.timing, "wall_s": wall},
               "settings": settings}
    (out / "metrics.json").write_text(json.dumps(summary, indent=2, default=str))
    with open(out / "trajectories.jsonl", "w") as f:
        for traj in batch.trajectories:
            f.write(json.dumps(traj, ensure_ascii=False) + "\n")
    (out / "viewer.html").write_text(render_html(batch.trajectories, summary), encoding="utf-8")
    return batch, summary


def render_html(trajectories: Sequence[dict[str, Any]], summary: dict[str, Any]) -> str:
    """A static page: metrics, then per episode and turn the state, thinking, actions, reward.

    Everything interpolated is passed through ``html.escape`` (model text is untrusted).
    """
    e = lambda x: html.escape(str(x), quote=True)  # noqa: E731
    parts = [
        "<!DOCTYPE html><html><head><meta charset='utf-8'><title>ragen_jax eval</title><style>",
        "body{font-family:sans-serif;margin:1em}pre{background:#f4f4f4;padding:4px;margin:2px}"
        "details{border:1px solid #ccc;margin:4px;padding:4px}.ok{color:#080}.bad{color:#a00}"
        "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:2px 6px}",
        "</style></head><body>",
        f"<h1>{e(summary.get('model', ''))} on {e(summary.get('env', ''))}</h1><table>",
    ]
    for k, v in sorted(summary.get("metrics", {}).items()):
        parts.append(f"<tr><td>{e(k)}</td><td>{e(f'{v:.4g}' if isinstance(v, float) else v)}</td></tr>")
    parts.append("</table>")
    for traj in trajectories:
        cls = "ok" if traj.get("success") else "bad"
        parts.append(
            f"<details><summary class='{cls}'>env {e(traj.get('env_id'))} (group "
            f"{e(traj.get('group_id'))}, seed {e(traj.get('seed'))}): success "
            f"{e(traj.get('success'))}, score {e(round(float(traj.get('score', 0.0)), 4))}, "
            f"actions {e(traj.get('num_actions'))}</summary>")
        for t in traj.get("turns", []):
            parts.append(f"<h4>Turn {e(t.get('turn'))}</h4><pre>{e(t.get('state', ''))}</pre>")
            parts.append(f"<p><b>thinking</b></p><pre>{e(t.get('think', ''))}</pre>")
            parts.append(f"<p><b>raw response</b></p><pre>{e(t.get('response', ''))}</pre>")
            parts.append(
                f"<p><b>actions</b> {e(t.get('actions', []))} executed "
                f"{e(t.get('executed', []))}; reward {e(t.get('reward', ''))}, penalty "
                f"{e(t.get('penalty', ''))} {e(t.get('format_error', ''))}</p>")
        parts.append(f"<h4>Final state</h4><pre>{e(traj.get('final_state', ''))}</pre></details>")
    parts.append("</body></html>")
    return "\n".join(parts)


def format_table(summary: dict[str, Any]) -> str:
    """A short plain-text table of the main metrics."""
    m = summary["metrics"]
    keys = [k for k in m if not k.startswith("rollout/")]
    keys += ["rollout/length_truncated", "rollout/truncated"]
    width = max(len(k) for k in keys)
    lines = [f"{summary['model']} | {summary['env']} | {summary['episodes']} episodes | "
             f"{summary['timing']['wall_s']:.1f} s"]
    lines += [f"  {k:<{width}}  {m[k]:.4f}" for k in keys]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    try:
        _, summary = run(args)
    except (CheckpointError, FileNotFoundError, ValueError) as e:  # bad folder, config or flag
        raise SystemExit(f"ragen_jax.eval: {e}") from None
    print(format_table(summary))
    print(f"wrote {Path(args.out) / 'metrics.json'}, trajectories.jsonl, viewer.html")
    return summary


if __name__ == "__main__":
    main(sys.argv[1:])
