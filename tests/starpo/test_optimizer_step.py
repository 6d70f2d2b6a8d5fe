"""The jitted actor update: accumulation, non-finite skipping, improvement, sharding."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from ragen_jax.config.resolve import update_settings
from ragen_jax.models import Qwen2ForCausalLM, QwenConfig
from ragen_jax.starpo.optimizer_step import (
    TrainBatch,
    jit_optimizer_step,
    make_optimizer,
)
from ragen_jax.starpo.token_scores import token_logprobs
from tests.conftest import child_xla_flags

CFG = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=2, head_dim=8)


def make_case(seed: int = 0, batch: int = 8, length: int = 16):
    model = Qwen2ForCausalLM(QwenConfig.tiny(**CFG), rngs=nnx.Rngs(seed))
    rng = np.random.default_rng(seed)
    ids = jnp.asarray(rng.integers(0, 64, (batch, length)), jnp.int32)
    lengths = rng.integers(length // 2, length + 1, batch)
    attn = jnp.asarray(np.arange(length)[None] < lengths[:, None])
    pos = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
    loss_mask = attn & jnp.asarray(rng.random((batch, length)) < 0.6) & (jnp.arange(length) > 0)
    loss_mask = loss_mask.at[-1].set(False)  # one row with nothing to train on
    old, _ = token_logprobs(model, ids, attn, pos)
    adv = jnp.asarray(rng.normal(size=(batch, length)), jnp.float32) * loss_mask
    tb = TrainBatch(ids, attn, pos, loss_mask.astype(jnp.float32), old, adv, old)
    return model, tb


def run_step(model, batch, optimizer=None, **kw):
    cfg = update_settings(**kw)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    optimizer = optimizer or make_optimizer(cfg)
    step = jit_optimizer_step(graphdef, cfg, optimizer, donate=False)
    opt_state = optimizer.init(params)
    return step(params, rest, opt_state, batch), graphdef, rest


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_micro_batch_accumulation_equals_full_batch(mode):
    model, batch = make_case()
    sgd = optax.apply_if_finite(optax.scale(-1.0), 10)  # with lr 1: params - gradient
    (p1, _, m1), _, _ = run_step(model, batch, sgd, lr=1.0, loss_agg_mode=mode, micro_batches=1)
    (p4, _, m4), _, _ = run_step(model, batch, sgd, lr=1.0, loss_agg_mode=mode, micro_batches=4)
    for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p4), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)
    assert float(m1["actor/grad_norm"]) == pytest.approx(float(m4["actor/grad_norm"]), rel=1e-4)
    assert float(m1["actor/pg_loss"]) == pytest.approx(float(m4["actor/pg_loss"]), abs=1e-6)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"])
def test_long_rows_apart_equals_every_row_at_full_width(mode):
    """Rows sorted by length, the longest quarter at the full width and the rest cut to
    ``short_width``: the same step as all rows at the full width. Cutting real tokens (a
    width too narrow) changes it, so the comparison can fail (shown once: a cut changes the
    step whichever the aggregation)."""
    model, batch = make_case(seed=3, batch=8, length=16)
    lengths = np.array([5, 16, 7, 8, 3, 13, 6, 8])  # two long rows: one micro-batch of 4 holds them
    attn = jnp.asarray(np.arange(16)[None] < lengths[:, None])
    batch = batch.replace(attention_mask=attn, loss_mask=batch.loss_mask * attn,
                          advantages=batch.advantages * attn)
    sgd = optax.apply_if_finite(optax.scale(-1.0), 10)
    kw = dict(lr=1.0, loss_agg_mode=mode, micro_batches=4)
    (p_full, _, m_full), _, _ = run_step(model, batch, sgd, **kw)
    (p_apart, _, m_apart), _, _ = run_step(model, batch.replace(short_width=8), sgd, **kw)
    for a, b in zip(jax.tree.leaves(p_full), jax.tree.leaves(p_apart), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)
    for k in m_full:
        assert float(m_apart[k]) == pytest.approx(float(m_full[k]), rel=1e-5, abs=1e-6), k
    if mode != "token-mean":
        return
    (p_cut, _, _), _, _ = run_step(model, batch.replace(short_width=4), sgd, **kw)
    assert max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(
        jax.tree.leaves(p_full), jax.tree.leaves(p_cut), strict=True)) > 1e-4


def test_first_step_ratio_is_one_and_surrogate_improves():
    model, batch = make_case(1)
    (params, _, metrics), graphdef, rest = run_step(model, batch, lr=3e-4, entropy_coeff=0.0)
    mask = np.asarray(batch.loss_mask)
    adv = np.asarray(batch.advantages)
    # At the sampling policy the ratio is 1, so the loss is -mean(A) and nothing is clipped.
    assert float(metrics["actor/pg_loss"]) == pytest.approx(-(adv * mask).sum() / mask.sum(), abs=1e-5)
    assert float(metrics["actor/pg_clipfrac"]) == 0.0 and float(metrics["actor/update_skipped"]) == 0.0
    new_logp, _ = token_logprobs(nnx.merge(graphdef, params, rest), batch.input_ids,
                                 batch.attention_mask, batch.positions)
    ratio = np.exp(np.asarray(new_logp) - np.asarray(batch.old_logp))
    surrogate_before = (adv * mask).sum() / mask.sum()
    surrogate_after = (adv * ratio * mask).sum() / mask.sum()
    assert surrogate_after > surrogate_before + 1e-4


def test_non_finite_loss_skips_the_update():
    model, batch = make_case(2)
    bad = batch.replace(advantages=batch.advantages.at[0, 3].set(jnp.nan).at[0, 3].set(jnp.nan))
    bad = bad.replace(loss_mask=bad.loss_mask.at[0, 3].set(1.0))
    (params, opt_state, metrics), _, _ = run_step(model, bad, lr=1e-2)
    before = nnx.state(model, nnx.Param)
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert float(metrics["actor/update_skipped"]) == 1.0
    assert float(metrics["actor/nonfinite_total"]) == 1.0


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="update.loss_agg_mode"):
        update_settings(loss_agg_mode="mean")


_SHARDED = textwrap.dedent("""
    import json, sys
    import jax
    jax.config.update("jax_num_cpu_devices", 8)
    import numpy as np
    from flax import nnx
    sys.path.insert(0, {root!r})
    from tests.starpo.test_optimizer_step import make_case
    from ragen_jax.models import shard_model
    from ragen_jax.sharding import make_mesh, shard_batch
    from ragen_jax.config.resolve import update_settings
    from ragen_jax.starpo.optimizer_step import make_optimizer, jit_optimizer_step

    out = {{}}
    for shape in [(1, 1, 1), (8, 1, 1), (2, 2, 2)]:  # every axis split, and data alone
        model, batch = make_case(3)
        devices = jax.devices()[:int(np.prod(shape))]
        mesh = make_mesh(shape, devices)
        shard_model(model, mesh)
        batch = shard_batch(batch, mesh)
        cfg = update_settings(lr=1e-3, micro_batches=2)
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        before = jax.tree.leaves(params)
        params, _, m = jit_optimizer_step(graphdef, cfg, mesh=mesh, donate=False)(params, rest, make_optimizer(cfg).init(params), batch)
        for x, y in zip(before, jax.tree.leaves(params)):  # the step keeps each parameter's sharding
            assert x.sharding.is_equivalent_to(y.sharding, x.ndim), (shape, x.sharding, y.sharding)
        out[str(shape)] = {{"loss": float(m["actor/pg_loss"]), "grad_norm": float(m["actor/grad_norm"]),
                           "params": [np.asarray(x).ravel()[:64].tolist() for x in jax.tree.leaves(params)]}}
    print(json.dumps(out))
""")


def test_sharded_step_equals_single_device():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    # The session's compile settings stay; the child sets its own devices.
    flags = child_xla_flags()
    proc = subprocess.run([sys.executable, "-c", _SHARDED.format(root=root)], capture_output=True,
                          text=True, timeout=600, env={**os.environ, "XLA_FLAGS": flags})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    ref = out.pop("(1, 1, 1)")
    for shape, got in out.items():
        assert got["loss"] == pytest.approx(ref["loss"], abs=1e-6), shape
        assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4), shape
        for a, b in zip(ref["params"], got["params"], strict=True):
            np.testing.assert_allclose(a, b, atol=1e-5, err_msg=shape)


def test_critic_from_actor_and_value_steps_reduce_loss():
    from ragen_jax.models import Qwen2ForValue
    from ragen_jax.starpo.optimizer_step import CriticBatch, critic_objective, token_values

    actor, batch = make_case(4)
    critic = Qwen2ForValue.from_actor(actor)
    h_actor = actor.model(batch.input_ids, batch.positions, batch.attention_mask)
    h_critic = critic.model(batch.input_ids, batch.positions, batch.attention_mask)
    np.testing.assert_array_equal(np.asarray(h_actor), np.asarray(h_critic))
    old = token_values(critic, batch.input_ids, batch.attention_mask, batch.positions)
    returns = jnp.where(batch.loss_mask > 0, 1.0, 0.0)
    cb = CriticBatch(batch.input_ids, batch.attention_mask, batch.positions, batch.loss_mask, old, returns)
    cfg = update_settings(lr=3e-3, micro_batches=2, value_clip=10.0)
    graphdef, params, rest = nnx.split(critic, nnx.Param, ...)
    opt = make_optimizer(cfg)
    step = jit_optimizer_step(graphdef, cfg, opt, critic_objective, donate=False)
    opt_state = opt.init(params)
    losses = []
    for _ in range(5):
        params, opt_state, m = step(params, rest, opt_state, cb)
        losses.append(float(m["critic/vf_loss"]))
    assert losses[-1] < 0.5 * losses[0]
    assert "critic/grad_norm" in m and float(m["critic/update_skipped"]) == 0.0


def test_lora_only_update_leaves_base_weights():
    from ragen_jax.models.lora import add_lora

    model, batch = make_case(5)
    add_lora(model, rank=2)
    cfg = update_settings(lr=1e-2)
    graphdef, lora, rest = nnx.split(model, nnx.LoRAParam, ...)
    opt = make_optimizer(cfg)
    new_lora, _, m = jit_optimizer_step(graphdef, cfg, opt, donate=False)(lora, rest, opt.init(lora), batch)
    assert float(m["actor/update_skipped"]) == 0.0
    moved = [float(jnp.abs(a - b).max()) for a, b in zip(jax.tree.leaves(lora), jax.tree.leaves(new_lora), strict=True)]
    assert max(moved) > 0  # adapters train; the base weights are in `rest`, not updated


def test_mini_batch_epochs_and_schedule():
    from ragen_jax.starpo.optimizer_step import (
        learning_rate,
        make_optimizer_step,
        mini_batch_epochs,
    )

    model, batch = make_case(6)
    cfg = update_settings(lr=1e-3, lr_schedule="cosine", warmup_steps=2, total_steps=8,
                       micro_batches=2)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    opt = make_optimizer(cfg)
    step = make_optimizer_step(graphdef, cfg, opt)
    run = jax.jit(lambda p, o, b, lr: mini_batch_epochs(step, p, rest, o, b, lr, epochs=2,
                                                        mini_batch_size=4))
    new, opt_state, m = run(params, opt.init(params), batch, learning_rate(cfg, 3))
    assert float(m["train/num_mini_batches"]) == 4.0
    assert int(opt_state.inner_state[1].count) == 4  # four optimizer steps taken
    # The same four steps one by one (mini-batch i = rows i, i + 2, ..., in order, twice)
    # give the same params.
    jitted, o, p = jax.jit(step), opt.init(params), params
    for start in (0, 1, 0, 1):
        part = jax.tree.map(lambda x, s=start: x[s::2], batch)
        p, o, _ = jitted(p, rest, o, part, learning_rate(cfg, 3))
    for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(new), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)
    with pytest.raises(ValueError, match="mini_batch_size"):
        mini_batch_epochs(step, params, rest, opt_state, batch, 1e-3, epochs=1, mini_batch_size=3)
    with pytest.raises(ValueError, match="update.total_steps"):
        update_settings(lr_schedule="cosine", total_steps=0)


def test_learning_rate_counts_training_steps():
    from ragen_jax.starpo.optimizer_step import learning_rate

    const = update_settings(lr=2e-3)
    assert float(learning_rate(const, 0)) == float(learning_rate(const, 99)) == pytest.approx(2e-3)
    warm = update_settings(lr=1e-3, warmup_steps=4)
    assert [round(float(learning_rate(warm, s)), 8) for s in (0, 2, 4, 10)] == [0.0, 5e-4, 1e-3, 1e-3]
    cos = update_settings(lr=1e-3, lr_schedule="cosine", warmup_steps=2, total_steps=10)
    assert float(learning_rate(cos, 2)) == pytest.approx(1e-3)
    assert float(learning_rate(cos, 6)) == pytest.approx(5e-4, rel=1e-4)  # half way down
    assert float(learning_rate(cos, 10)) == pytest.approx(0.0, abs=1e-9)


def test_optimizer_equals_optax_adamw():
    """Adam + decoupled weight decay times the step's learning rate is optax's AdamW."""
    cfg = update_settings(lr=1e-2, weight_decay=0.1, grad_clip=1e9)
    params = {"w": jnp.arange(6.0).reshape(2, 3) / 7}
    grads = {"w": jnp.sin(jnp.arange(6.0)).reshape(2, 3)}
    ours, ref = make_optimizer(cfg), optax.adamw(1e-2, weight_decay=0.1)
    so, sr, po, pr = ours.init(params), ref.init(params), params, params
    for _ in range(3):
        uo, so = ours.update(grads, so, po)
        po = optax.apply_updates(po, jax.tree.map(lambda u: cfg.lr * u, uo))
        ur, sr = ref.update(grads, sr, pr)
        pr = optax.apply_updates(pr, ur)
    np.testing.assert_allclose(np.asarray(po["w"]), np.asarray(pr["w"]), rtol=1e-6)
