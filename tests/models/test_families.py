"""Llama and Qwen3 beside Qwen2: logits equal transformers' (float32, tiny random configs of
each family's switches), folders round-trip as the same architecture, and the pieces built
on the model (KV cache, sampler copy, LoRA, stacked layers, sharding) work for each."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ragen_jax.models import (
    CheckpointError,
    KVCache,
    compute_copy,
    from_pretrained,
    load_config,
    positions_from_mask,
    save_pretrained,
)
from ragen_jax.models.hf_convert import config_from_hf
from ragen_jax.models.lora import add_lora, merge_lora

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TOL = 1e-4
BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, attn_implementation="eager")

# (id, transformers config class, model class, config overrides). Each case turns on a
# switch the others leave off, so a wrong mapping of any one cannot hide.
CASES = [
    ("llama", "LlamaConfig", "LlamaForCausalLM",
     dict(rope_theta=10000.0, tie_word_embeddings=True)),  # SmolLM2's kind
    ("llama-bias", "LlamaConfig", "LlamaForCausalLM",
     dict(rope_theta=500.0, attention_bias=True, mlp_bias=True, head_dim=24,
          tie_word_embeddings=False)),
    ("llama3-rope", "LlamaConfig", "LlamaForCausalLM",
     dict(rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0,
                               low_freq_factor=1.0, high_freq_factor=4.0,
                               original_max_position_embeddings=8),
          max_position_embeddings=64, tie_word_embeddings=True)),
    ("qwen3", "Qwen3Config", "Qwen3ForCausalLM",
     dict(rope_theta=1e6, head_dim=32, tie_word_embeddings=True)),  # head_dim != E / H
    ("qwen3-bias", "Qwen3Config", "Qwen3ForCausalLM",
     dict(rope_theta=1e4, head_dim=16, attention_bias=True, num_key_value_heads=1,
          tie_word_embeddings=False)),
]
IDS = [c[0] for c in CASES]


def _hf_model(case, seed=0):
    _, cfg_cls, model_cls, kw = case
    torch.manual_seed(seed)
    cfg = getattr(transformers, cfg_cls)(**{**BASE, **kw})
    model = getattr(transformers, model_cls)(cfg).eval()
    with torch.no_grad():  # random (not zero / one) biases and norm weights
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module", params=CASES, ids=IDS)
def family(request, tmp_path_factory):
    """(case, transformers model, saved folder) for each family case."""
    hf = _hf_model(request.param)
    folder = tmp_path_factory.mktemp(request.param[0])
    hf.save_pretrained(folder)
    return request.param, hf, folder


def _batch(seed=0, length=40):
    """Two rows: row 0 left-padded by 3, row 1 right-padded by 2; longer than the llama3
    case's original context (8), so its scaled frequencies matter."""
    rng = np.random.RandomState(seed)
    tokens = rng.randint(0, BASE["vocab_size"], (2, length))
    mask = np.ones((2, length), np.int32)
    mask[0, :3] = 0
    mask[1, -2:] = 0
    return tokens, mask, np.asarray(positions_from_mask(jnp.asarray(mask)))


def _hf_logits(model, tokens, mask, pos):
    with torch.no_grad():
        out = model(torch.tensor(tokens), attention_mask=torch.tensor(mask),
                    position_ids=torch.tensor(pos))
    return out.logits.float().numpy()


def test_logits_match_transformers_and_round_trip(family, tmp_path):
    case, hf, folder = family
    model = from_pretrained(folder)
    c = model.config
    assert c.model_type == case[2].removesuffix("ForCausalLM").lower()
    assert c.qk_norm == (c.model_type == "qwen3")
    assert (model.lm_head is None) == case[3]["tie_word_embeddings"]
    tokens, mask, pos = _batch()
    ref = _hf_logits(hf, tokens, mask, pos)
    out, _ = model(jnp.asarray(tokens), jnp.asarray(pos), jnp.asarray(mask))
    real = mask.astype(bool)
    err = np.abs(np.asarray(out) - ref)[real].max()
    assert err <= TOL, err

    # Exported as the same architecture, transformers reads the same logits back.
    save_pretrained(model, tmp_path / "ours")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    assert type(back).__name__ == case[2]
    assert json.loads((tmp_path / "ours" / "config.json").read_text())["model_type"] == c.model_type
    err2 = np.abs(_hf_logits(back, tokens, mask, pos) - np.asarray(out))[real].max()
    assert err2 <= TOL, err2
    assert load_config(tmp_path / "ours") == c


def test_cache_decode_sampler_copy_and_unstacked_layers_agree(family):
    """Prefill + one-token cached steps through the sampler's per-layer bf16-free copy equal
    the stacked model's full forward pass."""
    _, _, folder = family
    model = from_pretrained(folder)
    tokens, mask, _ = _batch(seed=1, length=14)
    full, _ = model(jnp.asarray(tokens), positions_from_mask(jnp.asarray(mask)), jnp.asarray(mask))
    copy = compute_copy(model)  # per-layer (and, on the CPU, the [in, out] layout)
    assert not copy.model.stacked
    cache = copy.init_cache(2, 16)
    p = 9
    logits, cache = copy(jnp.asarray(tokens[:, :p]),
                         positions_from_mask(jnp.asarray(mask[:, :p])), jnp.asarray(mask[:, :p]),
                         cache)
    got = [np.asarray(logits)]
    for t in range(p, tokens.shape[1]):
        m = jnp.asarray(mask[:, t:t + 1])
        logits, cache = copy(jnp.asarray(tokens[:, t:t + 1]),
                             positions_from_mask(m, cache.lengths), m, cache)
        got.append(np.asarray(logits))
    assert isinstance(cache, KVCache)
    got = np.concatenate(got, axis=1)
    real = mask.astype(bool)
    err = np.abs(got - np.asarray(full))[real].max()
    assert err <= TOL, err


def test_lora_starts_as_the_base_and_merges_exactly(family):
    _, _, folder = family
    model = from_pretrained(folder)
    tokens, mask, pos = _batch(seed=2, length=10)
    args = (jnp.asarray(tokens), jnp.asarray(pos), jnp.asarray(mask))
    base, _ = model(*args)
    add_lora(model, rank=4, alpha=8.0, seed=1)
    np.testing.assert_array_equal(np.asarray(model(*args)[0]), np.asarray(base))
    nnx.update(model, jax.tree.map(lambda a: a + 0.01, nnx.state(model, nnx.LoRAParam)))
    adapted, _ = model(*args)
    assert np.abs(np.asarray(adapted) - np.asarray(base)).max() > 1e-3
    merged = merge_lora(model)
    assert not nnx.state(merged, nnx.LoRAParam)
    np.testing.assert_allclose(np.asarray(merged(*args)[0]), np.asarray(adapted), atol=2e-5)


SHARDED = textwrap.dedent(
    """
    import jax
    jax.config.update("jax_num_cpu_devices", 4)
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx
    from ragen_jax.models import Qwen2ForCausalLM, QwenConfig, shard_model
    from ragen_jax.sharding import make_mesh

    mesh = make_mesh((1, 2, 2))
    tokens = jnp.asarray(np.random.RandomState(0).randint(0, 256, (4, 8)))
    pos = jnp.broadcast_to(jnp.arange(8), (4, 8))
    for kw in [dict(model_type="llama", attention_bias=True, mlp_bias=True),
               dict(model_type="qwen3", head_dim=32, attention_bias=True)]:
        cfg = QwenConfig(vocab_size=256, hidden_size=64, intermediate_size=96,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, **kw)
        model = Qwen2ForCausalLM(cfg, rngs=nnx.Rngs(0))
        ref = np.asarray(model(tokens, pos)[0])
        sharded = shard_model(model, mesh)
        q = sharded.model.layers.self_attn.q_proj.weight[...]
        assert len(q.sharding.device_set) == 4, q.sharding
        out = np.asarray(jax.jit(lambda m, t, p: m(t, p)[0])(sharded, tokens, pos))
        assert np.abs(out - ref).max() < 2e-5, (kw, np.abs(out - ref).max())
    print("OK")
    """
)


def test_sharded_on_a_mesh_gives_the_same_logits():
    """The new parameters (q_norm, k_norm, o and MLP biases) carry partition specs that place
    on a (1, 2, 2) fsdp x tensor mesh of 4 simulated CPU devices, with unchanged logits (a
    subprocess: this one has initialised JAX with one device)."""
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    out = subprocess.run([sys.executable, "-c", SHARDED], capture_output=True, text=True,
                         env=env, timeout=600)
    assert out.returncode == 0 and out.stdout.strip().endswith("OK"), out.stderr[-3000:]


def test_unsupported_configs_are_one_line_errors(tmp_path):
    hf = _hf_model(CASES[0])
    hf.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    for change, words in [
        (dict(model_type="gemma", architectures=["GemmaForCausalLM"]), "supported: Qwen2ForCausalLM"),
        (dict(rope_parameters=dict(rope_type="yarn", factor=4.0, rope_theta=1e4)), "rope_type 'yarn'"),
        (dict(hidden_act="gelu"), "hidden_act 'gelu'"),
        (dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], use_sliding_window=True),
         "sliding-window"),
    ]:
        (tmp_path / "config.json").write_text(json.dumps({**cfg, **change}))
        with pytest.raises(CheckpointError, match=words) as e:
            load_config(tmp_path)
        assert "\n" not in str(e.value)


def test_llama3_frequencies_match_transformers():
    """The scaled rope frequencies alone, over a realistic head dim and context."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = dict(rope_type="llama3", rope_theta=500000.0, factor=32.0, low_freq_factor=1.0,
                  high_freq_factor=4.0, original_max_position_embeddings=8192)
    hf_cfg = transformers.LlamaConfig(hidden_size=2048, num_attention_heads=32, head_dim=64,
                                      rope_parameters=params, max_position_embeddings=131072)
    ref, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg, "cpu")
    ours = config_from_hf(hf_cfg.to_dict()).rope_inv_freq()
    np.testing.assert_allclose(np.asarray(ours), ref.numpy(), rtol=1e-6)
