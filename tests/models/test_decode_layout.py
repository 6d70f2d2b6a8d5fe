"""The CPU decoding layout: ``[in, out]`` weights and an untied head compute the same logits,
keep the partition specs consistent, and the sampler decodes the same tokens through it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ragen_jax.models import Qwen2ForCausalLM, QwenConfig, compute_copy, positions_from_mask
from ragen_jax.models.copies import decode_layout, in_decode_layout, per_layer
from ragen_jax.models.lora import add_lora, merge_lora
from ragen_jax.models.qwen import Linear
from ragen_jax.rollout import Sampler, SamplingParams
from ragen_jax.rollout.sampler import generate_jit

CFG = QwenConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0)


def _logits(model, tokens):
    mask = jnp.ones(tokens.shape, bool)
    return np.asarray(model(tokens, positions_from_mask(mask), mask)[0])


def _tokens(seed=0, shape=(3, 11)):
    return jax.random.randint(jax.random.key(seed), shape, 0, CFG.vocab_size)


@pytest.mark.parametrize("tied", [False, True])
def test_decode_layout_gives_the_same_logits_and_leaves_the_model_alone(tied):
    model = Qwen2ForCausalLM(CFG.replace(tie_word_embeddings=tied), rngs=nnx.Rngs(3))
    before = jax.tree.map(np.asarray, nnx.state(model))
    copy = decode_layout(per_layer(model))
    assert in_decode_layout(copy) and not in_decode_layout(model)
    linears = [m for _, m in copy.iter_modules() if isinstance(m, Linear)]
    assert linears and all(m.transposed for m in linears)
    q = copy.model.layers[0].self_attn.q_proj.weight
    assert q.shape == (CFG.hidden_size, CFG.num_attention_heads * CFG.head_dim)  # [in, out]
    if tied:  # the head is the embedding table, transposed: [E, V]
        np.testing.assert_array_equal(np.asarray(copy.lm_head.weight[...]),
                                      np.asarray(model.model.embed_tokens.weight[...]).T)
    tokens = _tokens()
    np.testing.assert_allclose(_logits(copy, tokens), _logits(model, tokens), rtol=1e-5, atol=1e-5)
    after = jax.tree.map(np.asarray, nnx.state(model))
    jax.tree.map(np.testing.assert_array_equal, before, after)


def test_partition_specs_follow_the_swapped_axes():
    model = Qwen2ForCausalLM(CFG.replace(tie_word_embeddings=True), rngs=nnx.Rngs(0))
    copy = decode_layout(per_layer(model))
    orig = model.model.layers.self_attn.q_proj.weight.get_metadata()["out_sharding"]
    swapped = copy.model.layers[0].self_attn.q_proj.weight.get_metadata()["out_sharding"]
    assert tuple(swapped[-2:]) == (orig[-1], orig[-2])
    embed = model.model.embed_tokens.weight.get_metadata()["out_sharding"]
    assert tuple(copy.lm_head.weight.get_metadata()["out_sharding"]) == (embed[1], embed[0])


def test_lora_on_the_decode_layout_matches_the_hf_layout():
    model = Qwen2ForCausalLM(CFG, rngs=nnx.Rngs(5))
    add_lora(model, rank=2, alpha=4.0, target_modules="all-linear", seed=1)
    for _, m in model.iter_modules():  # adapters that do something (lora_b starts at zero)
        if isinstance(m, Linear) and m.lora_b is not None:
            m.lora_b[...] = 0.1 * jax.random.normal(jax.random.key(7), m.lora_b.shape)
    copy = decode_layout(per_layer(model))
    tokens = _tokens(1)
    want = _logits(model, tokens)
    np.testing.assert_allclose(_logits(copy, tokens), want, rtol=1e-5, atol=1e-5)
    merge_lora(copy)  # the fold goes into the [in, out] weights
    np.testing.assert_allclose(_logits(copy, tokens), want, rtol=1e-4, atol=1e-4)


def test_compute_copy_chooses_the_layout_once():
    model = Qwen2ForCausalLM(CFG, rngs=nnx.Rngs(0))
    plain = compute_copy(model, layout=False)
    assert not in_decode_layout(plain)
    laid = compute_copy(model, layout=True)
    assert in_decode_layout(laid) and compute_copy(laid, layout=True) is laid
    assert in_decode_layout(compute_copy(model)) == (jax.default_backend() == "cpu")


def test_cpu_sampler_decodes_the_same_tokens_in_the_decode_layout_and_under_compiler_options():
    if jax.default_backend() != "cpu":
        pytest.skip("the layout is the CPU's default")
    model = Qwen2ForCausalLM(CFG, rngs=nnx.Rngs(2))
    head = model.lm_head.weight
    head[...] = head[...] * 8.0  # a peaked distribution: greedy ties cannot flip on rounding
    sampler = Sampler(model)
    assert in_decode_layout(nnx.merge(sampler.graphdef, sampler.state))
    assert sampler.options == ()  # XLA's default options unless asked
    plain = Sampler(model, layout=False)  # the Hugging Face layout
    assert not in_decode_layout(nnx.merge(plain.graphdef, plain.state))
    options = {"xla_cpu_experimental_ynn_fusion_type": ""}  # YNNPACK fusions off
    tuned = Sampler(model, compiler_options=options)
    assert dict(tuned.options) == options
    prompts = [[5, 6, 7, 8, 9], [10, 11], [1, 2, 3]]
    sp = SamplingParams(max_new_tokens=8, temperature=0.0)
    out = sampler(prompts, key=jax.random.key(0), params=sp)
    base = plain(prompts, key=jax.random.key(0), params=sp)
    compiled = generate_jit(False, tuned.options)._cache_size()
    other = tuned(prompts, key=jax.random.key(0), params=sp)
    assert generate_jit(False, tuned.options)._cache_size() == compiled + 1  # its own program
    for o in (base, other):
        np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(o.tokens))
        np.testing.assert_allclose(np.asarray(out.logprobs), np.asarray(o.logprobs), atol=1e-5)
    # Reference: greedy decoding by full forward passes of the original model, no cache. One
    # causal forward over the prompt and the 8 decoded tokens gives each step's logits from the
    # tokens before it (what a forward of that prefix gives): each decoded token must be their
    # argmax, so by induction the decode is the greedy one.
    for row, prompt in enumerate(prompts):
        seq = list(prompt) + [int(t) for t in out.tokens[row, :8]]
        every = _logits(model, jnp.asarray([seq]))[0]
        for step in range(8):
            logits = every[len(prompt) - 1 + step]
            tok = int(np.argmax(logits))
            assert int(out.tokens[row, step]) == tok, (row, step)
            np.testing.assert_allclose(float(out.logprobs[row, step]),
                                       float(jax.nn.log_softmax(logits)[tok]), atol=1e-4)
