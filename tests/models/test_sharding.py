"""A forward pass (and a sampler's blocked prefill) on 8 simulated CPU devices equals the
single-device one.

Runs in a subprocess: the test process has already initialised JAX with one CPU device.
"""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.conftest import child_xla_flags

SCRIPT = textwrap.dedent(
    """
    import sys
    import jax
    jax.config.update("jax_num_cpu_devices", 8)
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from ragen_jax.models import (KVCache, Qwen2ForCausalLM, QwenConfig, from_pretrained,
                                  positions_from_mask, save_pretrained, shard_model)

    assert jax.device_count() == 8, jax.devices()
    cfg = QwenConfig(vocab_size=512, hidden_size=64, intermediate_size=128,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    model = Qwen2ForCausalLM(cfg, rngs=nnx.Rngs(0))
    rng = np.random.RandomState(0)
    tokens = jnp.asarray(rng.randint(0, 512, (8, 8)))
    mask = jnp.asarray(rng.rand(8, 8) < 0.8).at[:, 0].set(True)
    pos = positions_from_mask(mask)

    @jax.jit
    def fwd(graphdef, state, tokens, pos, mask):
        return nnx.merge(graphdef, state)(tokens, pos, mask)[0]

    ref = np.asarray(fwd(*nnx.split(model), tokens, pos, mask))
    save_pretrained(model, sys.argv[1])

    mesh = Mesh(np.array(jax.devices()).reshape(2, 2, 2), ("data", "fsdp", "tensor"))
    batch = NamedSharding(mesh, P(("data", "fsdp")))
    args = [jax.device_put(x, batch) for x in (tokens, pos, mask)]
    for m in (shard_model(model, mesh), from_pretrained(sys.argv[1], mesh=mesh)):
        w = m.model.layers.self_attn.q_proj.weight[...][0]
        assert w.sharding.spec == P("tensor", "fsdp"), w.sharding
        assert len(w.addressable_shards) == 8 and w.addressable_shards[0].data.shape == (32, 32)
        out = fwd(*nnx.split(m), *args)
        assert len(out.sharding.device_set) == 8
        err = float(np.abs(np.asarray(out) - ref).max())
        assert err < 1e-5, err

    # A cached call with attention in row blocks (2 rows per device: 2 blocks, each keeping
    # the batch sharding) gives the same logits as the unsharded full forward.
    bcfg = cfg.replace(attention_block_bytes=1)
    blocked = shard_model(Qwen2ForCausalLM(bcfg, rngs=nnx.Rngs(0)), mesh)

    @jax.jit
    def cached(graphdef, state, tokens, pos, mask):
        return nnx.merge(graphdef, state)(tokens, pos, mask, KVCache.init(bcfg, 8, 8))[0]

    out = cached(*nnx.split(blocked), *args)
    assert len(out.sharding.device_set) == 8
    err = float(np.abs(np.asarray(out) - ref)[np.asarray(mask)].max())
    assert err < 1e-5, err

    # The sampler on the sharded model, its prompts prefilled in blocks of rows (4 blocks of
    # 4 rows, one per device each), samples what one unsharded block samples.
    from ragen_jax.rollout import Sampler, SamplingParams
    prompts = rng.randint(1, 512, (16, 12)).tolist()
    sp = SamplingParams(max_new_tokens=4, temperature=0.0)
    ref = Sampler(model, prefill_tokens=0)(prompts, key=jax.random.key(0), params=sp)
    sharded = shard_model(model, mesh)
    assert sharded.model.batch_shards() == 4
    got = Sampler(sharded, prefill_tokens=64)(prompts, key=jax.random.key(0), params=sp)
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(ref.tokens))
    np.testing.assert_allclose(np.asarray(got.model_logprobs), np.asarray(ref.model_logprobs),
                               atol=1e-5)
    print("SHARDED_OK")
    """
)


def test_forward_on_8_devices_equals_single_device(tmp_path):
    root = Path(__file__).resolve().parents[2]
    # The session's compile settings stay; the child sets its own devices.
    flags = child_xla_flags()
    env = dict(os.environ, PYTHONPATH=str(root), JAX_PLATFORMS="cpu", XLA_FLAGS=flags)
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "ckpt")], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "SHARDED_OK" in proc.stdout, proc.stderr[-3000:]
