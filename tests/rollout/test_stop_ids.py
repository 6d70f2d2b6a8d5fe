"""Extra end-of-sequence ids (a folder's ``generation_config.json`` list) end a turn like the
end-of-turn token: same parsed text, no format error, and a well-formed chat after it."""

import jax
import numpy as np
import pytest

from ragen_jax.envs import make
from ragen_jax.rollout import ScriptedPolicy
from ragen_jax.rollout.agent import AgentRollout
from ragen_jax.rollout.config import RolloutConfig
from ragen_jax.rollout.context import ChatFormat

CFG = RolloutConfig(env_groups=1, group_size=2, response_length=32, max_turn=2)
ANSWER = "x</think><answer>Up</answer>"


@pytest.fixture(scope="module")
def ids(tok):
    return {name: tok.convert_tokens_to_ids(name)
            for name in ("<|endoftext|>", "<|im_end|>", "<|im_start|>", "||")}


def test_eos_ids_join_stop_and_special_ids(tok, ids):
    eot, eos = ids["<|im_end|>"], ids["<|endoftext|>"]
    assert ChatFormat(tok, RolloutConfig().context).stop_ids.tolist() == [eot]
    chat = ChatFormat(tok, RolloutConfig().context, eos_ids=[eos, eot, eos])
    assert chat.stop_ids.tolist() == [eot, eos]  # end-of-turn first, no repeats
    assert chat.eot_id == eot
    odd = ChatFormat(tok, RolloutConfig().context, eos_ids=(np.int64(ids["||"]),))  # not special
    assert odd.stop_ids.tolist() == [eot, ids["||"]] and ids["||"] in odd.special_ids
    assert ids["||"] not in chat.special_ids


def test_generated_text_treats_every_stop_id_alike(tok, ids):
    eot, eos = ids["<|im_end|>"], ids["<|endoftext|>"]
    body = tok("<answer>Up</answer>", add_special_tokens=False)["input_ids"]
    chat = ChatFormat(tok, RolloutConfig().context, eos_ids=[eos])
    by_eot, by_eos = chat.generated_text(body + [eot]), chat.generated_text(body + [eos])
    assert by_eos == by_eot == ("<answer>Up</answer>", True, False)
    assert by_eos.stopped and not by_eos.special_inside
    # Only the end-of-turn token itself spares next_chunk from inserting it.
    assert chat.emitted_eot(body + [eot]) and not chat.emitted_eot(body + [eos])
    assert not chat.emitted_eot([])
    # Without eos_ids the same ids are an unfinished turn with a special token inside.
    plain = ChatFormat(tok, RolloutConfig().context).generated_text(body + [eos])
    assert not plain.stopped and plain.special_inside
    # A stop id before the end is still a special token inside.
    assert chat.generated_text(body[:1] + [eos] + body[1:] + [eot]).special_inside


def _play(tok, ids, eos_ids):
    """Both rows answer ``ANSWER`` then ``<|endoftext|>`` then more text, every turn."""
    env, params = make("sokoban")
    tail = tok(" and more", add_special_tokens=False)["input_ids"]
    answer = tok(ANSWER, add_special_tokens=False)["input_ids"] + [ids["<|endoftext|>"]] + tail
    policy = ScriptedPolicy(lambda row, call, prompt, state: answer, pad_id=tok.pad_token_id)
    ro = AgentRollout(env, params, tok, CFG, eos_ids=eos_ids)
    return ro.collect(policy, [3], jax.random.key(0)), policy, answer


def test_rollout_stops_on_an_eos_id_and_keeps_the_chat_well_formed(tok, ids):
    eot, eos = ids["<|im_end|>"], ids["<|endoftext|>"]
    batch, policy, answer = _play(tok, ids, [eos])
    traj = batch.trajectories[0]
    first = traj["turns"][0]
    assert first["format_error"] == "" and first["penalty"] == 0.0 and first["stopped"]
    assert first["actions"] == ["Up"] and first["response"] == "<think>" + ANSWER
    # The turn was cut after <|endoftext|>, which is sampled (trained on); the end-of-turn
    # token is then inserted (not trained on) before the next user message.
    cut = answer.index(eos) + 1
    real = batch.attention_mask[0]
    seq, loss = batch.input_ids[0, real], batch.loss_mask[0, real]
    assert seq[loss].tolist()[:cut] == answer[:cut]
    at = int(np.flatnonzero(seq == eos)[0])
    assert loss[at] and seq[at + 1] == eot and not loss[at + 1]
    assert tok.decode(policy.calls[1][0]).startswith("<|im_end|>\n<|im_start|>user\n")
    assert "</answer><|endoftext|><|im_end|>\n<|im_start|>user\n" in tok.decode(seq.tolist())


def test_without_eos_ids_the_same_answer_is_a_format_error(tok, ids):
    batch, policy, answer = _play(tok, ids, ())
    first = batch.trajectories[0]["turns"][0]
    assert first["format_error"] == "special token" and first["penalty"] == -0.1
    assert not first["stopped"] and first["num_tokens"] == len(answer)  # not cut
    assert batch.metrics["Sokoban/format_error_rate"] == 1.0
