"""The paged sampler (``Sampler(paged=True)``, ``rollout/paged_sampling.py``) against the dense
one: the same tokens and log-probs over turns, with groups sharing a first prompt, answers of
mixed lengths and episodes that end early; rows hold exactly the blocks their tokens need; an
episode's tokens do not depend on the rows beside it."""

import jax
import numpy as np
import pytest
from flax import nnx

from ragen_jax.models import Qwen2ForCausalLM, QwenConfig
from ragen_jax.rollout import Sampler, SamplingParams
from ragen_jax.rollout.paged_sampling import PagedState, right_padded

CFG = QwenConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0)
FIRST = [[5, 6, 7, 8, 9], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], [10, 11]]
BLOCK = 4  # small blocks: prompts and answers end mid-block and cross several


@pytest.fixture(scope="module")
def model():
    m = Qwen2ForCausalLM(CFG, rngs=nnx.Rngs(1))
    head = m.lm_head.weight
    head[...] = head[...] * 10.0  # a peaked distribution: greedy ties are unlikely
    return m


def _turns(sampler, rows, keys, sp, stop):
    """Three turns: groups of three rows with one first prompt each, budgets of 3 to 8 new
    tokens; then chunks of different lengths per row; then the rows whose episodes ended
    (here: rows 1 and 5) sit out."""
    n = len(rows)
    budgets = np.array([8, 3, 6, 5, 8, 4, 7, 8, 3])[rows]
    out = [sampler([FIRST[r // 3] for r in rows], key=keys, params=sp, stop_tokens=stop,
                   max_new=budgets)]
    chunks = [[20 + r] * (1 + r % 4) for r in rows]
    out.append(sampler(chunks, key=keys, params=sp, cache=out[-1].cache, stop_tokens=stop,
                       max_new=budgets[::-1].copy()))
    active = np.array([r not in (1, 5) for r in rows])
    chunks = [[30 + r, 31] if a else [] for r, a in zip(rows, active, strict=True)]
    out.append(sampler(chunks, key=keys, params=sp, cache=out[-1].cache, stop_tokens=stop,
                       active=active, max_new=np.full(n, 6)))
    return out


def _host(out):
    return [np.asarray(x) for x in (out.tokens, out.mask, out.model_logprobs, out.logprobs,
                                    out.lengths, out.prompt_tokens, out.prompt_mask)]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_paged_turns_sample_what_the_dense_cache_samples(model, temperature):
    rows = list(range(9))
    keys = jax.random.split(jax.random.key(7), len(rows))
    sp = SamplingParams(max_new_tokens=8, temperature=temperature)
    stop = [0]
    dense = _turns(Sampler(model), rows, keys, sp, stop)
    paged_sampler = Sampler(model, paged=True, block_size=BLOCK, max_row_tokens=64)
    paged = _turns(paged_sampler, rows, keys, sp, stop)
    for turn, (a, b) in enumerate(zip(dense, paged, strict=True)):
        da, pa = _host(a), _host(b)
        for name, x, y in zip(("tokens", "mask", "model_logprobs", "logprobs", "lengths",
                               "prompt_tokens", "prompt_mask"), da, pa, strict=True):
            if x.dtype.kind == "f":
                np.testing.assert_allclose(x, y, atol=2e-5, err_msg=f"turn {turn} {name}")
            else:
                np.testing.assert_array_equal(x, y, err_msg=f"turn {turn} {name}")
        assert int(a.steps) == int(b.steps)
    lengths = [np.asarray(o.lengths) for o in dense]
    assert len(set(lengths[0].tolist())) > 2  # answers of mixed lengths
    # Every row holds the blocks its own tokens need and no more; finished rows hold none;
    # a group's first full blocks are one physical block shared by its three rows.
    state = paged[-1].cache
    assert isinstance(state, PagedState)
    alloc = state.allocator
    alloc.check()
    on = np.array([r not in (1, 5) for r in rows])
    tokens = np.array([len(FIRST[r // 3]) + 1 + r % 4 + 2 for r in rows]) + sum(lengths)
    np.testing.assert_array_equal(np.asarray(state.cache.lengths), np.where(on, tokens, 0))
    # (the host's room is the device lengths plus this turn's unused budget, cut next call)
    assert (alloc.lengths[on] >= tokens[on]).all() and (alloc.held[~on] == 0).all()
    assert state.released[~on].all()
    assert (alloc.table[3, :4] == alloc.table[4, :4]).all()  # FIRST[1]'s 17 tokens: 4 full blocks
    assert alloc.table[3, 4] != alloc.table[4, 4]  # its partial fifth block copied per row


def test_an_episode_samples_the_same_alone_and_among_others(model):
    """Batch invariance: rows 3-5 (one group) alone sample the tokens they sample among nine
    rows, each row drawing from its own key, over all three turns."""
    keys = jax.random.split(jax.random.key(11), 9)
    sp = SamplingParams(max_new_tokens=8, temperature=1.0)
    sampler = Sampler(model, paged=True, block_size=BLOCK, max_row_tokens=64)
    every = _turns(sampler, list(range(9)), keys, sp, [0])
    alone = _turns(sampler, [3, 4, 5], keys[3:6], sp, [0])
    for a, b in zip(every, alone, strict=True):
        np.testing.assert_array_equal(np.asarray(a.tokens)[3:6], np.asarray(b.tokens))
        np.testing.assert_allclose(np.asarray(a.model_logprobs)[3:6],
                                   np.asarray(b.model_logprobs), atol=2e-5)


def test_right_padding_keeps_each_rows_tokens_in_order():
    tokens = np.array([[0, 0, 5, 6], [1, 2, 3, 4], [0, 0, 0, 9]])
    valid = tokens > 0
    ids, counts = right_padded(tokens, valid)
    np.testing.assert_array_equal(counts, [2, 4, 1])
    np.testing.assert_array_equal(ids[0, :2], [5, 6])
    np.testing.assert_array_equal(ids[1], [1, 2, 3, 4])
    assert ids[2, 0] == 9


def test_a_row_past_its_table_is_one_error_naming_the_limit(model):
    sampler = Sampler(model, paged=True, block_size=BLOCK, max_row_tokens=16)
    with pytest.raises(Exception, match="a row holds at most 4"):
        sampler([FIRST[1]], key=jax.random.key(0), params=SamplingParams(max_new_tokens=8))
