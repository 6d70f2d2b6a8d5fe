"""Logit parity of the NNX Qwen2 with transformers' Qwen2ForCausalLM (float32, CPU)."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
import transformers

from ragen_jax.models import from_pretrained, positions_from_mask, save_pretrained

TOL = 1e-4

# (tied, head_dim, kv_heads): tied and untied, head dims 16 and 32, GQA ratios 1, 2 and 4.
CASES = [(True, 16, 4), (False, 16, 2), (True, 32, 1), (False, 32, 4)]


def _batch(vocab, seed=0):
    """Two rows of 12 slots: row 0 left-padded by 3, row 1 right-padded by 2."""
    rng = np.random.RandomState(seed)
    tokens = rng.randint(0, vocab, (2, 12))
    mask = np.ones((2, 12), np.int32)
    mask[0, :3] = 0
    mask[1, -2:] = 0
    return tokens, mask


@pytest.mark.parametrize("tied,head_dim,kv_heads", CASES)
def test_logits_match_transformers(make_hf, hf_logits, tmp_path, tied, head_dim, kv_heads):
    hf, folder = make_hf(seed=head_dim + kv_heads, tie_word_embeddings=tied, head_dim=head_dim,
                         num_key_value_heads=kv_heads)
    model = from_pretrained(folder)
    assert (model.lm_head is None) == tied
    tokens, mask = _batch(512)
    pos = np.asarray(positions_from_mask(jnp.asarray(mask)))
    ref = hf_logits(hf, tokens, mask, pos)
    out, cache = model(jnp.asarray(tokens), jnp.asarray(pos), jnp.asarray(mask))
    assert cache is None and out.shape == (2, 12, 512) and out.dtype == jnp.float32
    real = mask.astype(bool)
    err = np.abs(np.asarray(out) - ref)[real].max()
    assert err <= TOL, err

    # Our save_pretrained -> transformers loads it with the same logits.
    save_pretrained(model, tmp_path / "ours")
    hf2 = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    assert type(hf2).__name__ == "Qwen2ForCausalLM"
    ref2 = hf_logits(hf2, tokens, mask, pos)
    err2 = np.abs(np.asarray(out) - ref2)[real].max()
    assert err2 <= TOL, err2
    # ... and so do we, after a second round trip.
    out3, _ = from_pretrained(tmp_path / "ours")(jnp.asarray(tokens), jnp.asarray(pos),
                                                 jnp.asarray(mask))
    np.testing.assert_array_equal(np.asarray(out3), np.asarray(out))


def test_padding_equals_unpadded_sequence(make_hf, hf_logits):
    """Real tokens with padding around and between them see exactly the unpadded sequence."""
    hf, folder = make_hf(seed=3)
    model = from_pretrained(folder)
    rng = np.random.RandomState(1)
    real = rng.randint(0, 512, (1, 9))
    mask = np.array([[0, 1, 1, 0, 0, 1, 1, 1, 0, 1, 1, 1, 1, 0]], np.int32)
    tokens = np.zeros_like(mask)
    tokens[mask.astype(bool)] = real[0]
    tokens[~mask.astype(bool)] = rng.randint(0, 512, (~mask.astype(bool)).sum())
    out, _ = model(jnp.asarray(tokens), positions_from_mask(jnp.asarray(mask)), jnp.asarray(mask))
    ref = hf_logits(hf, real)
    err = np.abs(np.asarray(out)[mask.astype(bool)] - ref[0]).max()
    assert err <= TOL, err


def test_top_level_rope_theta_and_sharded_files(make_hf, hf_logits, tmp_path):
    """Hub-style config (top-level rope_theta) and a sharded safetensors index both load."""
    hf, _ = make_hf(seed=5, rope_theta=500.0)
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg.pop("rope_parameters", None)
    cfg["rope_theta"] = 500.0
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    model = from_pretrained(tmp_path)
    assert model.config.rope_theta == 500.0
    tokens = np.random.RandomState(2).randint(0, 512, (1, 16))
    out, _ = model(jnp.asarray(tokens), jnp.arange(16)[None])
    err = np.abs(np.asarray(out) - hf_logits(hf, tokens)).max()
    assert err <= TOL, err


def test_bfloat16_close_to_float32(make_hf):
    _, folder = make_hf(seed=7)
    tokens = jnp.asarray(np.random.RandomState(3).randint(0, 512, (2, 8)))
    pos = jnp.broadcast_to(jnp.arange(8), (2, 8))
    f32, _ = from_pretrained(folder)(tokens, pos)
    m16 = from_pretrained(folder, dtype=jnp.bfloat16)
    assert m16.model.layers.mlp.up_proj.weight[...].dtype == jnp.bfloat16
    b16, _ = m16(tokens, pos)
    assert b16.dtype == jnp.float32
    assert np.abs(np.asarray(b16) - np.asarray(f32)).max() < 0.05
