"""The KV-cache sampler: greedy parity with transformers, sampling law, truncation, turns."""

import tempfile

import jax
import numpy as np
import pytest
from flax import nnx
from scipy import stats

from ragen_jax.models import Qwen2ForCausalLM, QwenConfig, positions_from_mask
from ragen_jax.rollout import Sampler, SamplingParams

CFG = QwenConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0)
PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]]


@pytest.fixture(scope="module")
def model():
    m = Qwen2ForCausalLM(CFG, rngs=nnx.Rngs(1))
    # Sharpen the output distribution (random init is near-uniform over 512 tokens), so the
    # sampling tests see a distribution with structure: a few likely tokens and a long tail.
    head = m.lm_head.weight
    head[...] = head[...] * 10.0
    return m


@pytest.fixture(scope="module")
def sampler(model):
    return Sampler(model)


@jax.jit
def _full_jit(graphdef, state, tokens, mask):
    return nnx.merge(graphdef, state)(tokens, positions_from_mask(mask), mask)[0]


def _teacher_forced_logits(model, out):
    """Logits that produced each generated token, from one full forward over the slots."""
    steps = int(out.steps)
    p = out.prompt_tokens.shape[1]
    tokens, mask = out.slots()
    np.testing.assert_array_equal(np.asarray(mask), np.asarray(out.cache.row_valid()[:, :p + steps]))
    full = np.asarray(_full_jit(*nnx.split(model), tokens, mask))
    return full[:, p - 1: p - 1 + steps]  # [B, steps, V]


def test_greedy_matches_transformers_generate(model, sampler):
    torch = pytest.importorskip("torch")
    import transformers

    from ragen_jax.models import save_pretrained

    with tempfile.TemporaryDirectory() as d:
        save_pretrained(model, d)
        hf = transformers.AutoModelForCausalLM.from_pretrained(d).eval()
    gp = SamplingParams(max_new_tokens=16, temperature=0.0)
    first = sampler(PROMPTS, key=jax.random.key(0), params=gp)
    stop = int(first.tokens[0, 5])  # a token row 0 emits at step 5: it must stop there
    out = sampler(PROMPTS, key=jax.random.key(0), params=gp, stop_tokens=[stop])

    width = max(map(len, PROMPTS))
    ids = np.zeros((3, width), np.int64)
    am = np.zeros((3, width), np.int64)
    for i, p in enumerate(PROMPTS):
        ids[i, width - len(p):], am[i, width - len(p):] = p, 1
    with torch.no_grad():
        ref = hf.generate(torch.tensor(ids), attention_mask=torch.tensor(am), max_new_tokens=16,
                          do_sample=False, eos_token_id=stop, pad_token_id=0)[:, width:].numpy()
    lengths = np.asarray(out.lengths)
    first_stop = np.asarray(first.tokens[0]).tolist().index(stop)
    assert lengths[0] == first_stop + 1 < 16
    for i in range(3):
        np.testing.assert_array_equal(np.asarray(out.tokens[i, : lengths[i]]),
                                      ref[i, : lengths[i]])
        assert (np.asarray(out.tokens[i, lengths[i]:]) == 0).all()
        assert np.asarray(out.mask[i]).sum() == lengths[i]


def test_frequencies_match_softmax(model, sampler):
    """Chi-square goodness of fit of 4096 first tokens against softmax(logits / T)."""
    n, temp = 4096, 0.7
    out = sampler([PROMPTS[0]] * n, key=jax.random.key(3),
                  params=SamplingParams(max_new_tokens=1, temperature=temp))
    logits = _teacher_forced_logits(model, out)[0, 0]
    counts = np.bincount(np.asarray(out.tokens[:, 0]), minlength=CFG.vocab_size)

    def chi2_pvalue(probs):
        expected = probs * n
        big = expected >= 5
        obs = np.append(counts[big], counts[~big].sum())
        exp = np.append(expected[big], max(expected[~big].sum(), 1e-9))  # tail pooled
        stat = ((obs - exp) ** 2 / exp).sum()
        return stats.chi2.sf(stat, len(obs) - 1), big.sum()

    probs = np.asarray(jax.nn.softmax(logits / temp))
    p_value, bins = chi2_pvalue(probs)
    assert bins >= 10, "distribution too flat for a meaningful test"
    assert p_value > 1e-3, p_value
    # The same test rejects a slightly wrong temperature (so it can fail).
    wrong, _ = chi2_pvalue(np.asarray(jax.nn.softmax(logits / (temp * 1.3))))
    assert wrong < 1e-6, wrong
    # Returned log-probs are those of the sampled tokens under the model.
    lp = np.log(probs)[np.asarray(out.tokens[:, 0])]
    np.testing.assert_allclose(np.asarray(out.model_logprobs[:, 0]), lp, atol=1e-4)
    np.testing.assert_allclose(np.asarray(out.logprobs[:, 0]), lp, atol=1e-4)


@pytest.mark.parametrize("top_k,top_p", [(5, 1.0), (0, 0.6), (20, 0.8)])
def test_truncation_sets_and_logprobs(model, sampler, top_k, top_p):
    temp = 1.3
    sp = SamplingParams(max_new_tokens=6, temperature=temp, top_k=top_k, top_p=top_p)
    out = sampler([PROMPTS[i % 3] for i in range(64)], key=jax.random.key(7), params=sp)
    logits = _teacher_forced_logits(model, out) / temp  # [B, steps, V]
    toks, mask = np.asarray(out.tokens), np.asarray(out.mask)
    for b in range(logits.shape[0]):
        for t in range(int(out.lengths[b])):
            x = logits[b, t]
            order = np.argsort(-x)
            allowed = order[:top_k] if top_k else order
            p = np.exp(x[allowed] - x[allowed].max())
            p /= p.sum()
            before = np.cumsum(p) - p
            allowed = allowed[before < top_p - 1e-6]
            assert toks[b, t] in allowed, (b, t)
            q = np.exp(x[allowed] - x[allowed].max())
            want = np.log(q[allowed == toks[b, t]][0] / q.sum())
            assert abs(out.logprobs[b, t] - want) < 1e-3
            full = x - x.max() - np.log(np.exp(x - x.max()).sum())
            assert abs(out.model_logprobs[b, t] - full[toks[b, t]]) < 1e-3
    assert mask.sum() == int(np.asarray(out.lengths).sum())


def test_reproducible_budgets_and_inactive_rows(sampler):
    sp = SamplingParams(max_new_tokens=8, temperature=1.0)
    a = sampler(PROMPTS, key=jax.random.key(11), params=sp, max_new=[3, 8, 5],
                active=[True, True, False])
    b = sampler(PROMPTS, key=jax.random.key(11), params=sp, max_new=[3, 8, 5],
                active=[True, True, False])
    c = sampler(PROMPTS, key=jax.random.key(12), params=sp, max_new=[3, 8, 5],
                active=[True, True, False])
    np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
    np.testing.assert_array_equal(np.asarray(a.logprobs), np.asarray(b.logprobs))
    assert not np.array_equal(np.asarray(a.tokens), np.asarray(c.tokens))
    np.testing.assert_array_equal(np.asarray(a.lengths), [3, 8, 0])
    assert int(a.steps) == 8
    assert not np.asarray(a.cache.valid[2, a.prompt_tokens.shape[1]:]).any()
    assert a.prompt_tokens.shape[1] == 32  # 17 tokens -> bucket 32


def test_continuation_equals_concatenated_prompt(model, sampler):
    """Turn 2 from the turn-1 cache samples what a fresh call on the whole history samples."""
    sp = SamplingParams(max_new_tokens=6, temperature=1.0, top_k=50)
    t1 = sampler(PROMPTS, key=jax.random.key(21), params=sp, stop_tokens=[[7], [-1], [-1]])
    history_tokens = np.concatenate([np.asarray(t1.prompt_tokens), np.asarray(t1.tokens)], 1)
    history_mask = np.concatenate([np.asarray(t1.prompt_mask), np.asarray(t1.mask)], 1)
    turn2 = [[40, 41, 42], [43], [44, 45, 46, 47, 48, 49, 50]]  # new observation tokens

    t2 = sampler(turn2, key=jax.random.key(22), params=sp, cache=t1.cache)
    whole = [list(history_tokens[i][history_mask[i]]) + turn2[i] for i in range(3)]
    fresh = sampler(whole, key=jax.random.key(22), params=sp)
    np.testing.assert_array_equal(np.asarray(t2.tokens), np.asarray(fresh.tokens))
    np.testing.assert_allclose(np.asarray(t2.logprobs), np.asarray(fresh.logprobs), atol=1e-4)
    lengths = np.asarray(t2.cache.lengths)
    np.testing.assert_array_equal(lengths, [len(w) for w in whole] + np.asarray(t2.lengths))


def test_identical_prompts_are_prefilled_once_with_the_same_result(model):
    """A group's repeated first prompt is prefilled once and its cache rows copied: tokens,
    log-probs and the cache the next turn continues equal prefilling every row."""
    from ragen_jax.rollout.sampler import distinct_rows

    prompts = [PROMPTS[0], PROMPTS[2], PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[0]]
    tokens = np.array([[0] * (17 - len(p)) + p for p in prompts])
    valid = tokens > 0
    kept, kept_valid, expand = distinct_rows(tokens, valid)
    np.testing.assert_array_equal(expand, [0, 1, 0, 2, 1, 0])
    np.testing.assert_array_equal(kept[expand], tokens)
    assert distinct_rows(tokens[:2], valid[:2])[2] is None
    keys = jax.random.split(jax.random.key(3), len(prompts))
    outs = []
    for share in (False, True):
        s = Sampler(model, share_prompts=share)
        first = s(prompts, key=keys, params=SamplingParams(max_new_tokens=6, temperature=1.0))
        nxt = s([[7, 8]] * len(prompts), key=keys, cache=first.cache,
                params=SamplingParams(max_new_tokens=4, temperature=0.0))
        outs.append((first, nxt))
    (a, a2), (b, b2) = outs
    np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
    np.testing.assert_array_equal(np.asarray(a2.tokens), np.asarray(b2.tokens))
    np.testing.assert_allclose(np.asarray(a.model_logprobs), np.asarray(b.model_logprobs), atol=1e-5)
    np.testing.assert_array_equal(np.asarray(a.prompt_tokens), np.asarray(b.prompt_tokens))


def test_distinct_prompt_counts_share_a_compiled_bucket(model):
    """Fresh prompts with 5, 6 and 7 distinct among 8 rows (a windowed turn's prompts) prefill
    8 rows each: one program, not one per count; tokens equal prefilling every row."""
    from ragen_jax.rollout.sampler import generate_jit

    s, every = Sampler(model, group_prefix=False), Sampler(model, share_prompts=False)
    run = generate_jit(True, s.options)
    base = [[3, 4, i] for i in range(1, 9)]
    sp = SamplingParams(max_new_tokens=3, temperature=1.0)
    keys = jax.random.split(jax.random.key(0), 8)
    sizes = []
    for repeats in (3, 2, 1):
        prompts = base[:8 - repeats] + base[:repeats]
        out = s(prompts, key=keys, params=sp)
        sizes.append(run._cache_size())
        np.testing.assert_array_equal(np.asarray(out.tokens),
                                      np.asarray(every(prompts, key=keys, params=sp).tokens))
    assert sizes[0] == sizes[1] == sizes[2], sizes


def test_group_prefix_equals_copied_prompts_over_turns(model):
    """``group_prefix``: groups of rows with one first prompt each hold its slots once (the
    decode attends to them in place) and sample the same tokens and log-probs as the copied
    cache, on the first turn and on later turns continuing it (also as the cache grows, and
    with attention in blocks); other row layouts fall back to copies. Sampled at temperature
    1 (each row's own key draws its token; greedy is the same cache read with an argmax)."""
    temperature = 1.0
    prompts = [PROMPTS[0]] * 3 + [PROMPTS[2]] * 3 + [PROMPTS[1]] * 3
    keys = jax.random.split(jax.random.key(4), len(prompts))
    sp = SamplingParams(max_new_tokens=6, temperature=temperature)
    runs = []
    for grouped, block_bytes in ((False, None), (True, None), (True, 4 * 4 * 3 * 40)):
        m = model if block_bytes is None else Qwen2ForCausalLM(
            CFG.replace(attention_block_bytes=block_bytes), rngs=nnx.Rngs(1))
        if block_bytes is not None:
            nnx.update(m, nnx.state(model))
        s = Sampler(m, group_prefix=grouped, cache_multiple=8)
        turns = [s(prompts, key=keys, params=sp)]
        for chunk in ([7, 8], [9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]):
            turns.append(s([chunk] * len(prompts), key=keys, cache=turns[-1].cache, params=sp))
        runs.append(turns)
    for turns in runs[1:]:
        assert turns[-1].cache.groups == 3
        for a, b in zip(runs[0], turns, strict=True):
            np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
            np.testing.assert_allclose(np.asarray(a.model_logprobs), np.asarray(b.model_logprobs),
                                       atol=1e-5)
        np.testing.assert_array_equal(np.asarray(runs[0][-1].cache.lengths),  # earlier ones donated
                                      np.asarray(turns[-1].cache.lengths))
    assert runs[0][-1].cache.groups == 0
    # Not groups of equal size in order: the prompts' slots are copied.
    mixed = Sampler(model, group_prefix=True)([PROMPTS[0], PROMPTS[1], PROMPTS[0]], key=keys[:3],
                                              params=sp)
    assert mixed.cache.groups == 0
    with pytest.raises(ValueError, match="taken apart"):
        runs[1][-1].cache.take(np.arange(3))


def test_cache_grows_to_a_multiple_with_the_same_tokens(model):
    """``cache_multiple``: the cache grows to the next multiple (not power of two); the
    continuation is the same."""
    keys = jax.random.split(jax.random.key(5), 2)
    sp = SamplingParams(max_new_tokens=8, temperature=0.0)
    outs = []
    for multiple in (None, 24):
        s = Sampler(model, cache_multiple=multiple)
        first = s([PROMPTS[0], PROMPTS[1]], key=keys, params=sp)
        nxt = s([[3, 4, 5, 6, 7, 8, 9, 10, 11]] * 2, key=keys, cache=first.cache, params=sp)
        outs.append(nxt)
    assert outs[0].cache.size == 64 and outs[1].cache.size == 48
    np.testing.assert_array_equal(np.asarray(outs[0].tokens), np.asarray(outs[1].tokens))


def test_prefill_block_rows_by_hand():
    """Rows per prefill block: the largest divisor of the batch within the token budget, a
    multiple of the batch's device split; one block when the chunk fits or nothing divides."""
    from ragen_jax.rollout.sampler import prefill_block_rows

    assert prefill_block_rows(32, 256, 2048) == 8
    assert prefill_block_rows(24, 256, 2048) == 8
    assert prefill_block_rows(34, 256, 2048) == 2  # 34 = 2 x 17
    assert prefill_block_rows(32, 256, 0) == 32  # no budget: one block
    assert prefill_block_rows(8, 256, 2048) == 8  # fits
    assert prefill_block_rows(16, 256, 2048, shards=4) == 8
    assert prefill_block_rows(16, 1024, 2048, shards=4) == 4  # none fits: one row per device
    assert prefill_block_rows(6, 1024, 2048, shards=4) == 6  # an uneven split: one block
    assert prefill_block_rows(7, 1024, 2048) == 1
    assert prefill_block_rows(128, 64, 2048, unit=16) == 32  # 2 groups of 16 rows a block
    assert prefill_block_rows(128, 64, 2048, shards=2, unit=16) == 32
    assert prefill_block_rows(128, 64, 512, shards=2, unit=16) == 32  # none fits
    assert prefill_block_rows(48, 64, 2048, shards=2, unit=16) == 48  # 3 groups: uneven


@pytest.mark.parametrize("share,grouped", [(False, False), (True, False), (True, True)])
def test_prefill_in_row_blocks_samples_what_one_block_samples(model, share, grouped):
    """A chunk prefilled in blocks of rows (``prefill_tokens``) gives the tokens, log-probs
    and cache of prefilling it at once, on a first turn (every row, distinct prompts, group
    prefix) and on a later turn continuing the cache (with a group prefix: blocks of one and
    of two groups)."""
    prompts = [PROMPTS[0]] * 2 + [PROMPTS[2]] * 2 + [PROMPTS[1]] * 2 + [[3, 4]] * 2 if share \
        else [PROMPTS[i % 3][: 3 + i] for i in range(6)]
    keys = jax.random.split(jax.random.key(6), len(prompts))
    sp = SamplingParams(max_new_tokens=5, temperature=1.0)
    runs = []
    # Blocks of 2 rows (16-token buckets), and with a group prefix also of 4 (two groups a block).
    for budget in (0, 64, 128) if grouped else (0, 64):
        s = Sampler(model, share_prompts=share, group_prefix=grouped, prefill_tokens=budget)
        first = s(prompts, key=keys, params=sp)
        nxt = s([[7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26]]
                * len(prompts), key=keys, cache=first.cache, params=sp)
        runs.append((first, nxt))
    for blocked in runs[1:]:
        for a, b in zip(runs[0], blocked, strict=True):
            np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
            np.testing.assert_allclose(np.asarray(a.model_logprobs),
                                       np.asarray(b.model_logprobs), atol=1e-5)
        a, b = runs[0][1].cache, blocked[1].cache
        assert a.groups == b.groups == (4 if grouped else 0)
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
            np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=1e-5)


def test_update_samples_from_new_weights_without_recompiling(model):
    """``Sampler.update`` swaps the weights in: the next call samples what a fresh sampler on
    the new weights samples, from the program already compiled (the graph, hashed once per
    update, equals the old one)."""
    from ragen_jax.rollout.sampler import generate_jit

    sp = SamplingParams(max_new_tokens=4, temperature=0.0)
    s = Sampler(model, share_prompts=False)
    before = s(PROMPTS, key=jax.random.key(0), params=sp)
    run = generate_jit(False, s.options)
    compiled = run._cache_size()
    other = Qwen2ForCausalLM(CFG, rngs=nnx.Rngs(2))
    s.update(other)
    after = s(PROMPTS, key=jax.random.key(0), params=sp)
    assert run._cache_size() == compiled
    fresh = Sampler(other, share_prompts=False)(PROMPTS, key=jax.random.key(0), params=sp)
    np.testing.assert_array_equal(np.asarray(after.tokens), np.asarray(fresh.tokens))
    assert not np.array_equal(np.asarray(after.tokens), np.asarray(before.tokens))


def test_prompt_blocks_are_structural():
    """A rollout's first turn (groups of k rows, one prompt each) is k blocks whatever prompts
    the groups share, so the program does not depend on which levels a batch repeated."""
    from ragen_jax.rollout.sampler import prompt_blocks

    a, b, c = [1, 2, 3], [4, 5, 6], [7, 8, 9]
    valid = np.ones((8, 3), bool)
    assert prompt_blocks(np.array([a, a, b, b, c, c, a, a]), valid) == 2
    assert prompt_blocks(np.array([a, a, a, a, b, b, c, c]), valid) == 2  # groups 0, 1 alike
    assert prompt_blocks(np.array([a, a, a, a, b, b, b, b]), valid) == 4  # every pair alike: 4
    assert prompt_blocks(np.array([a, b, c, a, b, c, a, b]), valid) == 1
    assert prompt_blocks(np.array([a, a, a, b, b, b, c, c]), valid) == 1
    # padding counts as part of the prompt only where it is real
    tokens = np.array([[0, 1, 2], [9, 1, 2]] * 4)
    masked = np.tile(np.array([[False, True, True]]), (8, 1))
    assert prompt_blocks(tokens, masked) == 8 and prompt_blocks(tokens, valid) == 1
