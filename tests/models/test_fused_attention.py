"""The fused-attention path of calls without a cache (``QwenConfig.attention_impl``): real
tokens moved to the front of their row, then ``jax.nn.dot_product_attention`` with a causal
mask and per-row lengths. cuDNN's kernel needs an NVIDIA GPU, so here its plumbing runs with
JAX's XLA implementation in its place ("dpa_xla"): logits at real tokens and gradients equal
the materialised-scores path's, with padding at the front, in the middle and at the end of
rows; "auto" stays "xla" on a CPU."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ragen_jax.config.fields import ConfigError
from ragen_jax.config.schema import ModelConfig
from ragen_jax.models import Qwen2ForCausalLM, QwenConfig
from ragen_jax.models.attention import (
    attend,
    attend_compacted,
    flash_attention_problem,
    mask_causal,
)
from ragen_jax.models.kv_cache import positions_from_mask

CFG = QwenConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2)
T = 10
# padding in the middle, at the front, at the end, none, and a row of padding only
MASK = np.array([[1, 1, 1, 0, 0, 1, 1, 0, 1, 1],
                 [0, 0, 1, 1, 1, 1, 0, 1, 1, 1],
                 [1, 1, 1, 1, 1, 1, 0, 0, 0, 0],
                 [1] * T,
                 [0] * T], bool)


def _inputs(config):
    b = MASK.shape[0]
    ids = jax.random.randint(jax.random.key(1), (b, T), 0, config.vocab_size)
    mask = jnp.asarray(MASK)
    return ids, positions_from_mask(mask), mask


def loss_and_grads(config: QwenConfig):
    model = Qwen2ForCausalLM(config, rngs=nnx.Rngs(0))
    ids, pos, mask = _inputs(config)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(p):
        logits, _ = nnx.merge(graphdef, p, rest)(ids, pos, mask)
        logp = jax.nn.log_softmax(logits)
        # a loss over real tokens only (padding tokens' outputs are nobody's business)
        return jnp.sum(logp[..., 5] * mask) + jnp.sum(logp[..., 7] * mask) / 3, logits

    (value, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    return value, logits, grads


@pytest.mark.parametrize("scan,remat", [(True, "dots"), (False, "none")])
def test_compacted_path_equals_materialised_scores(scan, remat):
    ref_loss, ref_logits, ref_grads = loss_and_grads(
        CFG.replace(scan_layers=scan, remat=remat))
    got_loss, got_logits, got_grads = loss_and_grads(
        CFG.replace(scan_layers=scan, remat=remat, attention_impl="dpa_xla"))
    real = MASK[..., None]
    np.testing.assert_allclose(np.where(real, got_logits, 0), np.where(real, ref_logits, 0),
                               atol=1e-5)
    assert np.isfinite(np.asarray(got_logits)).all()
    # the new path did run: padding tokens' logits differ (their attention output is 0 there)
    assert not np.allclose(np.asarray(got_logits)[~MASK], np.asarray(ref_logits)[~MASK])
    np.testing.assert_allclose(float(got_loss), float(ref_loss), rtol=1e-5)
    for a, b in zip(jax.tree.leaves(got_grads), jax.tree.leaves(ref_grads), strict=True):
        scale = float(jnp.max(jnp.abs(b)))
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5 * max(scale, 1.0))


def test_attend_compacted_equals_attend_at_real_tokens():
    b, h, k, d = MASK.shape[0], 4, 2, 8
    keys = jax.random.split(jax.random.key(3), 3)
    q = jax.random.normal(keys[0], (b, T, h, d))
    kk = jax.random.normal(keys[1], (b, T, k, d))
    v = jax.random.normal(keys[2], (b, T, k, d))
    mask = jnp.asarray(MASK)
    got = attend_compacted(q, kk, v, mask, "xla")  # [B, T, H, D]
    qg = q.reshape(b, T, k, h // k, d).transpose(0, 2, 3, 1, 4)  # [B, K, G, T, D]
    ref = attend(qg, kk.transpose(0, 2, 3, 1), v.transpose(0, 2, 1, 3), mask_causal(mask))
    ref = ref.transpose(0, 3, 1, 2, 4).reshape(b, T, h, d)
    real = MASK[..., None, None]
    np.testing.assert_allclose(np.where(real, got, 0), np.where(real, ref, 0), atol=1e-5)
    assert not np.asarray(got)[~MASK].any()  # padding tokens' outputs are zero


def test_auto_is_xla_on_cpu_and_cudnn_needs_half_precision():
    assert jax.default_backend() == "cpu"
    assert CFG.replace(attention_impl="auto", dtype=jnp.bfloat16).fused_attention() is None
    assert CFG.fused_attention() is None  # the default: materialised scores
    assert CFG.replace(attention_impl="dpa_xla").fused_attention() == "xla"
    assert CFG.replace(attention_impl="cudnn", dtype=jnp.bfloat16).fused_attention() == "cudnn"
    with pytest.raises(ValueError, match="bfloat16"):
        CFG.replace(attention_impl="cudnn")  # float32 compute
    with pytest.raises(ValueError, match="attention_impl"):
        CFG.replace(attention_impl="flash")
    assert ModelConfig(attention_impl="auto").attention_impl == "auto"
    with pytest.raises(ConfigError, match="attention_impl"):
        ModelConfig(attention_impl="cudnn")  # model.dtype float32


def test_flash_attention_predicate_follows_jaxs_conditions():
    bf16 = jnp.bfloat16
    assert flash_attention_problem((2, 64, 9, 64), (2, 64, 3, 64), bf16) is None
    assert "Q 233" in flash_attention_problem((2, 233, 9, 64), (2, 233, 3, 64), bf16)
    assert "head dim 60" in flash_attention_problem((2, 64, 2, 60), (2, 64, 1, 60), bf16)
    assert "head dim 256" in flash_attention_problem((2, 64, 2, 256), (2, 64, 1, 256), bf16)
    assert "float32" in flash_attention_problem((2, 64, 2, 64), (2, 64, 1, 64), jnp.float32)


def test_a_cudnn_head_dim_the_kernel_cannot_take_falls_back_to_xla(capsys):
    config = CFG.replace(head_dim=10, attention_impl="cudnn", dtype=jnp.bfloat16)
    assert config.fused_attention() is None and config.fused_attention() is None
    assert capsys.readouterr().out.count("using xla") == 1  # said once


def test_every_cudnn_call_of_a_real_model_presets_run_meets_flash_attentions_conditions(
        tmp_path, monkeypatch):
    """FrozenLake's real-model preset (smollm2-135m's settings: stop strings, shared prompts in
    the update, diagnostics, validation) with a format-only warm start, on a micro random model
    (``preset=tiny`` after the preset is applied: no folder) of SmolLM2's head layout (head
    dim 64, 3 query heads a key/value head) with cuDNN attention:
    every call that would reach cuDNN's kernel, recorded (and run by XLA here), meets its
    conditions. Before the fused path padded its lengths, the warm start's shared prefix
    reached it at an odd length."""
    from ragen_jax.config.loading import load_config
    from ragen_jax.train import run

    calls = []
    original = jax.nn.dot_product_attention

    def recording(q, k, v, *args, implementation=None, **kw):
        if implementation == "cudnn":
            calls.append((q.shape, k.shape, q.dtype))
            implementation = "xla"
        return original(q, k, v, *args, implementation=implementation, **kw)

    monkeypatch.setattr(jax.nn, "dot_product_attention", recording)
    root = Path(__file__).resolve().parents[2]
    config = load_config([
        "--config", str(root / "configs/frozenlake.py:smollm2-135m"),
        f"--config.trainer.output_dir={tmp_path}", "--config.trainer.total_steps=1",
        "--config.trainer.progress=False", "--config.trainer.test_freq=1",
        "--config.model.hidden_size=192", "--config.model.num_attention_heads=3",
        "--config.model.num_key_value_heads=1", "--config.model.intermediate_size=128",
        "--config.model.num_hidden_layers=1", "--config.model.dtype=bfloat16",
        "--config.model.attention_impl=cudnn", "--config.preset=tiny",
        "--config.rollout.env_groups=2", "--config.rollout.group_size=2",
        "--config.rollout.val.env_groups=2", "--config.rollout.response_length=16",
        "--config.actor.ppo_mini_batch_size=4", "--config.actor.micro_batches=1",
        "--config.warmstart.steps=1", "--config.warmstart.episodes=4",
        "--config.warmstart.batch_size=4", "--config.warmstart.cache=False",
        "--config.diagnostics.compute_freq=1", "--config.diagnostics.num_samples=2",
        "--config.diagnostics.trajectory_samples=2"])
    assert run(config)["step"] == 1
    assert len(calls) > 2  # the warm start's, the update's, the diagnostics'
    problems = {flash_attention_problem(*c) for c in calls} - {None}
    assert not problems, problems
