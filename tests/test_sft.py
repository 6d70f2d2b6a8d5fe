"""SFT stages: chat JSONL tokenisation and masks, the format warm-start data, and training."""

from __future__ import annotations

import functools
import json

import numpy as np
import pytest
from flax import nnx

from ragen_jax.envs import make
from ragen_jax.models import Qwen2ForCausalLM, QwenConfig
from ragen_jax.models import tokenizer as tokenizers
from ragen_jax.rollout.config import PromptConfig, RolloutConfig
from ragen_jax.rollout.context import parse_response
from ragen_jax.sft import conversation_data, train_sft
from ragen_jax.warmstart import shared_prefix_batches, warmstart_data


@pytest.fixture(scope="module")
def tok():
    return tokenizers.builtin()


# One FrozenLake, one Sokoban and one Bandit (each with one rollout config and one episode
# count) for the file's warm-start collections: their env and rollout programs compile once.
EPISODES = 16
LAKE_CFG = RolloutConfig(max_turn=3, response_length=24, prompt=PromptConfig(enable_think=False))
BANDIT_CFG = RolloutConfig(max_turn=1, max_actions_per_traj=1, response_length=16, max_actions_per_turn=1,
                           prompt=PromptConfig(enable_think=False))
SOKOBAN_CFG = RolloutConfig(max_turn=3, response_length=16, max_actions_per_turn=2,
                            prompt=PromptConfig(enable_think=False))


# One env object each: the rollout's jitted env functions are cached per env object, so a
# second object would trace them again.
@functools.cache
def _lake():
    """Non-slippery (every action does what it names) and with coordinates as its state."""
    return make("frozenlake", success_rate=1.0, observation_format="coord")


@functools.cache
def _sokoban():
    return make("sokoban", dim_room=(6, 6), num_boxes=1, max_steps=100)


@pytest.fixture(scope="module")
def lake_rows(tok):
    """Solver-mixture episodes with their turn rows, without and with the system message."""
    env, params = _lake()
    out = {}
    for system in (False, True):
        rows: dict = {}
        data = warmstart_data(env, params, tok, LAKE_CFG, episodes=EPISODES, seed=0, solver_share=0.5,
                              observation_rows=rows, system_rows=system)
        out[system] = (data, rows)
    return out


@pytest.fixture(scope="module")
def lake_legal(tok):
    """Legal-only FrozenLake episodes and their metrics."""
    env, params = _lake()
    stats: dict = {}
    data = warmstart_data(env, params, tok, LAKE_CFG, episodes=EPISODES, seed=0, legal_only=True,
                          metrics=stats)
    return data, stats


def _write(path, convs):
    path.write_text("\n".join(json.dumps({"messages": m}) for m in convs) + "\n")


def test_conversation_masks_cover_assistant_text_and_end_of_turn(tok, tmp_path):
    convs = [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Go left?"},
              {"role": "assistant", "content": "<answer>Left</answer>"},
              {"role": "user", "content": "Again."},
              {"role": "assistant", "content": "<answer>Up || Down</answer>"}]]
    _write(tmp_path / "c.jsonl", convs)
    data = conversation_data(tmp_path / "c.jsonl", tok, max_len=512, pad_multiple=16)
    ids, mask, attn = data["input_ids"][0], data["loss_mask"][0], data["attention_mask"][0]
    assert data["input_ids"].shape[1] % 16 == 0 and attn.sum() > mask.sum() > 0
    full = tok.apply_chat_template(convs[0], tokenize=False)
    assert tok.decode(ids[attn].tolist()) == full.rstrip("\n")  # same text as the chat template
    trained = tok.decode(ids[mask].tolist())
    assert trained == "<answer>Left</answer><|im_end|><answer>Up || Down</answer><|im_end|>"
    np.testing.assert_array_equal(data["position_ids"][0][attn], np.arange(attn.sum()))


def test_bad_conversation_files_name_the_line(tok, tmp_path):
    (tmp_path / "a.jsonl").write_text('{"messages": []}\nnot json\n')
    with pytest.raises(ValueError, match="line 1"):
        conversation_data(tmp_path / "a.jsonl", tok, max_len=64)
    (tmp_path / "b.jsonl").write_text('{"messages": [{"role": "system", "content": "x"}]}\nnot json\n')
    with pytest.raises(ValueError, match="line 1: roles"):
        conversation_data(tmp_path / "b.jsonl", tok, max_len=64)
    _write(tmp_path / "c.jsonl", [[{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                                   {"role": "assistant", "content": "a"}]])
    (tmp_path / "c.jsonl").write_text((tmp_path / "c.jsonl").read_text() + "{oops\n")
    with pytest.raises(ValueError, match="line 2"):
        conversation_data(tmp_path / "c.jsonl", tok, max_len=64)


@pytest.mark.parametrize("think", [False, True])
def test_warmstart_answers_are_random_valid_actions_in_the_rollout_format(tok, think):
    env, params = _lake()
    cfg = LAKE_CFG.replace(dict(prompt={"enable_think": think}))
    ctx = cfg.context
    data = warmstart_data(env, params, tok, cfg, episodes=EPISODES, seed=0)
    answers = set()
    for ids, mask in zip(data["input_ids"], data["loss_mask"], strict=True):
        # each maximal run of trained tokens is one answer, ending with the end-of-turn token
        runs = np.split(ids, np.nonzero(np.diff(mask.astype(int)))[0] + 1)
        flags = np.split(mask, np.nonzero(np.diff(mask.astype(int)))[0] + 1)
        for run, f in zip(runs, flags, strict=True):
            if f[0]:
                text = tok.decode(run.tolist())
                assert text.endswith("<|im_end|>")
                p = parse_response(ctx.answer_prefix + text.removesuffix("<|im_end|>"),
                                   env.action_names, ctx)
                assert not p.format_error, text
                answers.add(tuple(p.actions))
    assert len(answers) > 4  # random, not one fixed answer


def test_warmstart_answers_every_prompt_with_every_action_first(tok):
    """No preference is taught: the episodes of one initial state open with each action once."""
    env, params = make("bandit")
    cfg = BANDIT_CFG
    data = warmstart_data(env, params, tok, cfg, episodes=EPISODES, seed=0)
    ids, mask = data["input_ids"], data["loss_mask"]
    assert ids.shape[0] == EPISODES
    for g in range(EPISODES // 2):  # rows 2g and 2g+1 share the prompt and answer with different arms
        a, b = (tok.decode(ids[r][mask[r]].tolist()) for r in (2 * g, 2 * g + 1))
        prompt = [ids[r][: int(np.argmax(mask[r]))].tolist() for r in (2 * g, 2 * g + 1)]
        assert prompt[0] == prompt[1] and a != b, (a, b)


def _micro_model(seed: int = 0) -> Qwen2ForCausalLM:
    """A 1-layer model small enough for exactness checks of the SFT step, the file's only shape."""
    return Qwen2ForCausalLM(QwenConfig.tiny(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                            num_attention_heads=4, num_key_value_heads=2, head_dim=8),
                            rngs=nnx.Rngs(seed))


def _contains(seq: list[int], sub: list[int]) -> bool:
    return any(seq[i:i + len(sub)] == sub for i in range(len(seq) - len(sub) + 1))


def test_turn_observation_rows_are_each_turn_as_its_transcript_shows_it(tok, lake_rows):
    """One row per answered turn: the turn's user block (as the transcript tokenises it, with
    no system message or history before it) and then the very answer ids of that turn."""
    data, rows = lake_rows[False]
    answers = []  # every answer of every transcript, in order
    for ids, mask in zip(data["input_ids"], data["loss_mask"], strict=True):
        edges = np.nonzero(np.diff(np.r_[0, mask.astype(int), 0]))[0]
        answers += [ids[a:b].tolist() for a, b in zip(edges[::2], edges[1::2], strict=True)]
    assert rows["input_ids"].shape[0] == len(answers) > data["input_ids"].shape[0]
    glue = len(tok("\n<|im_start|>user\n", add_special_tokens=False)["input_ids"])
    for r in range(len(answers)):
        attn, mask = rows["attention_mask"][r], rows["loss_mask"][r]
        ids = rows["input_ids"][r][attn].tolist()
        assert rows["input_ids"][r][mask].tolist() == answers[r]  # the answer as sampled
        head = ids[:int(np.argmax(mask[attn]))]
        text = tok.decode(head)
        assert "State:" in text and "system" not in text and "Turn" in text
        assert text.startswith("\n<|im_start|>user\n") and text.endswith("assistant\n<answer>")
        # the state and the assistant header are token for token what the transcript holds
        transcript = data["input_ids"][[i for i, m in enumerate(data["loss_mask"]) if m.any()]]
        body = head[glue:]
        assert any(_contains(t.tolist(), body) for t in transcript), text


def test_system_turn_rows_are_first_prompts_and_share_their_start_exactly(tok, lake_rows):
    """``system=True`` rows start with the system message: a turn-1 row is token for token its
    transcript's first prompt and answer, a later turn's row that same start with the turn's
    own user block. ``shared_prefix_batches`` groups them so that ``train_sft`` runs the
    system message once per step, with the losses of every row running its own copy."""
    data, rows = lake_rows[True]
    firsts = []  # each transcript up to the end of its first answer
    for ids, mask in zip(data["input_ids"], data["loss_mask"], strict=True):
        start = int(np.argmax(mask))
        firsts.append(ids[:start + int(np.argmin(mask[start:]))].tolist())
    starts = [rows["input_ids"][r][rows["attention_mask"][r]].tolist() for r in range(len(rows["input_ids"]))]
    system_ids = tok("<|im_start|>system\n", add_special_tokens=False)["input_ids"]
    assert all(r[:len(system_ids)] == system_ids for r in starts)
    assert sum(r in firsts for r in starts) >= len(firsts) // 2  # turn-1 rows (identical episodes repeat)
    assert any(tok.decode(r).count("Turn 2") == 1 and tok.decode(r).count("Turn 1") == 0 for r in starts)

    grouped = shared_prefix_batches(rows, size=8, seed=0)
    n = rows["input_ids"].shape[0] // 8 * 8
    assert grouped["input_ids"].shape[0] == n and np.bincount(grouped["group_ids"]).tolist() == [8] * (n // 8)
    assert set(map(tuple, grouped["input_ids"])) <= set(map(tuple, rows["input_ids"]))
    runs = [train_sft(_micro_model(), grouped, steps=2, batch_size=8, lr=1e-3, seed=0, share_prefix=share)
            for share in (False, True)]
    np.testing.assert_allclose(runs[0], runs[1], rtol=1e-5)
    with pytest.raises(ValueError, match="fewer rows"):
        shared_prefix_batches(rows, size=10**6, seed=0)


def test_train_sft_lowers_the_loss_and_updates_the_model(tok):
    env, params = make("bandit")
    cfg = BANDIT_CFG
    data = warmstart_data(env, params, tok, cfg, episodes=EPISODES, seed=0)
    model = _micro_model()
    before = nnx.state(model, nnx.Param)
    before = {k: np.asarray(v) for k, v in nnx.to_flat_state(before)}
    losses = train_sft(model, data, steps=30, batch_size=8, lr=3e-3, seed=0)
    assert np.mean(losses[-5:]) < 0.5 * np.mean(losses[:3])
    after = {k: np.asarray(v) for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    assert any(not np.array_equal(before[k], after[k]) for k in before)


def test_legal_only_warmstart_never_wastes_a_move(tok, lake_legal):
    for name, (env, params), cfg in (("sokoban", _sokoban(), SOKOBAN_CFG), ("frozenlake", _lake(), LAKE_CFG)):
        random_stats, legal_stats = {}, {}
        warmstart_data(env, params, tok, cfg, episodes=EPISODES, seed=0, metrics=random_stats)
        if name == "frozenlake":
            data, legal_stats = lake_legal
        else:
            data = warmstart_data(env, params, tok, cfg, episodes=EPISODES, seed=0, legal_only=True,
                                  metrics=legal_stats)
        assert legal_stats["effective_action_rate"] == 1.0, name  # every executed action moved something
        assert random_stats["effective_action_rate"] < 0.95, name  # random answers bump into walls
        assert legal_stats["format_error_rate"] == 0.0 and data["input_ids"].shape[0] == EPISODES, name


def test_train_sft_with_shared_group_prompts_equals_whole_rows(lake_legal):
    """Each warm-start group's common prompt runs once per step; the losses and the trained
    weights equal those of every row running its own copy."""
    data, _ = lake_legal
    runs = []
    for share in (False, True):
        model = _micro_model()
        losses = train_sft(model, data, steps=3, batch_size=8, lr=1e-3, seed=0, share_prefix=share)
        runs.append((losses, [np.asarray(v) for _, v in nnx.to_flat_state(nnx.state(model, nnx.Param))]))
    np.testing.assert_allclose(runs[0][0], runs[1][0], rtol=1e-5)
    for a, b in zip(runs[0][1], runs[1][1], strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_sft_of_one_architecture_shares_its_step_and_reads_its_own_frozen_weights(lake_legal):
    """LoRA models of one shape and other base weights (the untrained variables): the second
    ``train_sft`` reuses the first's jitted step (nothing compiled again) and trains on its
    own base weights (arguments of the step, not constants in it): the losses of a step
    compiled for it alone."""
    from ragen_jax.compilation import CompileWatch
    from ragen_jax.models.lora import add_lora
    from ragen_jax.sft import _sft_step

    def lora_model(seed):
        model = _micro_model(seed)
        add_lora(model, rank=2)
        return model

    data, _ = lake_legal
    kw = dict(steps=2, batch_size=8, lr=1e-3, seed=0, trainable=nnx.LoRAParam)
    first = train_sft(lora_model(0), data, **kw)
    watch = CompileWatch()
    shared = train_sft(lora_model(1), data, **kw)
    assert watch.take()["compile/count"] == 0
    _sft_step.cache_clear()
    alone = train_sft(lora_model(1), data, **kw)
    assert watch.take()["compile/count"] > 0  # its own step (the check above can fail)
    assert shared == alone and shared != first


def test_warmstart_data_does_not_depend_on_rl_windows_batches_or_validation(tok):
    """The scripted episodes and their rows are the same whatever window RL's prompts use,
    where scores sit, how RL's batches are grouped and how it validates: what lets the
    warm-start cache key leave those fields at their defaults. Each setting is compared with
    one collection at the defaults."""
    env, params = _sokoban()

    def collect(cfg):
        rows: dict = {}
        data = warmstart_data(env, params, tok, cfg, episodes=EPISODES, seed=0, solver_share=0.3,
                              observation_rows=rows, system_rows=True)
        return data | {f"rows/{k}": v for k, v in rows.items()}

    base = collect(SOKOBAN_CFG)
    for setting in (dict(window={"mode": "limited", "turns": 1}), dict(window={"mode": "single_turn"}),
                    dict(use_turn_scores=True), dict(env_groups=3, group_size=5),
                    dict(val={"env_groups": 7, "group_size": 2, "temperature": 0.9})):
        made = collect(SOKOBAN_CFG.replace(setting))
        assert made.keys() == base.keys(), setting
        for key in base:
            np.testing.assert_array_equal(made[key], base[key], err_msg=f"{setting}: {key}")
