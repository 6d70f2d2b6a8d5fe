"""Token log-probs under bf16 compute: bf16 logits from the LM head against float32 ones.

veRL (RAGEN's trainer) computes log-probs, ratios and entropies from float32 logits. Our head
takes bf16 operands (``model.dtype=bfloat16``); this measures what rounding its logits to bf16
costs, against an all-float32 forward of the same weights:

* ``bf16 head``: the head's matmul returns bf16 logits, cast to float32 afterwards;
* ``float32 head``: the same bf16 operands accumulate into float32 logits
  (``preferred_element_type``, what ``models.qwen`` does).

Random Qwen2.5-0.5B-width weights (hidden 896, the real 151,936-token vocabulary, ``--layers``
layers), the final norm's weight scaled by ``--logit-scale`` so the logits spread as a trained
model's do (std of a few units; random init gives ~0.6). Reports the absolute error of the
sampled-token log-probs and of the per-token entropy, over ``--rows x --length`` tokens.

    python -m experiments.benchmarks.head_precision --out experiments/results/head_precision.md
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from experiments.common import report
from ragen_jax.models import Qwen2ForCausalLM, QwenConfig


def scores(logits: jax.Array, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Log-probs of ``tokens`` and entropies, from float32 logits [B, T, V]."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), -1)
    picked = jnp.take_along_axis(logp, tokens[..., None], -1)[..., 0]
    return picked, -(jnp.exp(logp) * logp).sum(-1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--length", type=int, default=128)
    ap.add_argument("--logit-scale", type=float, default=5.0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    cfg = QwenConfig.qwen2_5_0_5b(num_hidden_layers=args.layers)
    # The same float32 weights (same seed) computing in float32, and in bf16.
    model, bf16 = (Qwen2ForCausalLM(dataclasses.replace(cfg, dtype=d), rngs=nnx.Rngs(0))
                   for d in (jnp.float32, jnp.bfloat16))
    for m in (model, bf16):
        m.model.norm.weight[...] = m.model.norm.weight[...] * args.logit_scale
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (args.rows, args.length)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(args.length), tokens.shape)
    targets = jnp.roll(tokens, -1, axis=1)

    @nnx.jit
    def reference(m):
        logits, _ = m(tokens, positions)
        return logits, scores(logits, targets)

    @nnx.jit
    def both_heads(m):
        x = m.model(tokens, positions)  # [B, T, E] bf16 final hidden
        w = m.model.embed_tokens.weight[...] if m.lm_head is None else m.lm_head.weight[...]
        rounded = jnp.einsum("bte,ve->btv", x.astype(jnp.bfloat16), w.astype(jnp.bfloat16))
        return scores(rounded.astype(jnp.float32), targets), scores(m.logits(x), targets)

    t0 = time.perf_counter()
    ref_logits, (ref_lp, ref_ent) = jax.device_get(reference(model))
    (old_lp, old_ent), (new_lp, new_ent) = jax.device_get(both_heads(bf16))
    seconds = time.perf_counter() - t0
    rows = [("bf16 head (logits rounded to bf16)", old_lp, old_ent),
            ("float32 head (bf16 operands, float32 accumulation)", new_lp, new_ent)]
    lines = [
        "# Token log-probs under bf16 compute: the LM head's output precision",
        "",
        f"`python -m experiments.benchmarks.head_precision --layers {args.layers} --rows {args.rows} "
        f"--length {args.length} --logit-scale {args.logit_scale}` (XLA_FLAGS="
        f"`{os.environ.get('XLA_FLAGS', '')}`) on {jax.devices()[0].device_kind} "
        f"(jax {jax.__version__}, {seconds:.0f} s). Random Qwen2.5-0.5B-width weights, "
        f"{args.layers} layers, 151,936-token vocabulary; reference: the same weights in float32. "
        f"Reference logits: std {np.std(ref_logits):.2f}, max {np.max(ref_logits):.1f}.",
        "",
        "| head | log-prob error: mean | p99 | max | entropy error: mean | max |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, lp, ent in rows:
        e, h = np.abs(lp - ref_lp).ravel(), np.abs(ent - ref_ent).ravel()
        lines.append(f"| {name} | {e.mean():.4f} | {np.quantile(e, 0.99):.4f} | {e.max():.4f} | "
                     f"{h.mean():.4f} | {h.max():.4f} |")
    lines += ["", "Both rows share the bf16 body (its rounding is in both); the difference "
              "between them is the head's rounding of the logits alone."]
    report(lines, args.out)


if __name__ == "__main__":
    main()
