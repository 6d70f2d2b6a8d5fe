"""The multi-turn loop: masks, penalties, budgets, truncation, groups/seeds, log-prob parity."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ragen_jax.envs import make
from ragen_jax.models import positions_from_mask
from ragen_jax.rollout import Sampler, SamplingParams, ScriptedPolicy
from ragen_jax.rollout.agent import AgentRollout, collect, train_seeds, val_seeds
from ragen_jax.rollout.config import PromptConfig, RolloutConfig, SamplingConfig, ValidationConfig
from ragen_jax.rollout.context import ContextConfig, format_reward
from ragen_jax.rollout.env_driver import env_functions
from ragen_jax.starpo.token_scores import token_logprobs

CFG = RolloutConfig(env_groups=2, group_size=2, response_length=32)
SEEDS = np.array([3, 4])


def _rollout(sokoban, tok, **kw):
    env, params = sokoban
    return AgentRollout(env, params, tok, dataclasses.replace(CFG, **kw))


def _script(tok, texts, end=True):
    """All rows answer ``texts[call]`` (the empty string after the list ends)."""
    return ScriptedPolicy.from_texts(
        tok, lambda row, call: texts[call] if call < len(texts) else "", end=end)


@pytest.fixture(scope="module")
def ref(sokoban):
    """The 4 initial states (the loop's own jitted batched reset) and a jitted unbatched step,
    for replaying a trajectory independently of the loop."""
    env, params = sokoban
    keys = jax.vmap(jax.random.key)(jnp.asarray(np.repeat(SEEDS, 2), jnp.uint32))
    _, states = env_functions(env)[0](keys, params)
    return sokoban, jax.device_get(states), jax.jit(env.step_env)


def _reference(ref, row, per_turn_ids, budget):
    """Replays the valid actions of each turn with the unbatched env: [(executed, reward, done)]."""
    (env, params), states, step = ref
    state = jax.tree.map(lambda x: jnp.asarray(x[row]), states)
    out, total = [], 0
    for ids in per_turn_ids:
        ids = ids[: budget - total]
        executed, reward, done = 0, 0.0, False
        for a in ids:
            _, state, r, term, _ = step(jax.random.key(0), state, a, params)
            executed, reward, total = executed + 1, reward + float(r), total + 1
            if bool(term):
                done = True
                break
        out.append((executed, reward, done))
        if done or total >= budget:
            break
    return out


TEXTS = [
    "nothing useful",  # no tags: penalty, env not stepped
    "x</think><answer>Up || Jump</answer>",  # one unknown name: penalty, Up runs
    "y</think><answer>Left || Right || Down</answer>",  # first two kept, both run
    "z</think> <answer>down</answer>",
    "",  # empty answer: penalty
]
VALID = [[], [0], [2, 3], [1], []]
PENALTY = [True, True, False, False, True]


def test_turn_by_turn_penalties_rewards_and_prompts(sokoban, tok, ref):
    ro = _rollout(sokoban, tok)
    policy = _script(tok, TEXTS)
    batch = ro.collect(policy, SEEDS, jax.random.key(0))
    for b, traj in enumerate(batch.trajectories):
        expect = _reference(ref, b, VALID, CFG.max_actions_per_traj)
        turns = traj["turns"]
        assert len(turns) == len(expect)
        score = 0.0
        for k, (t, (executed, reward, _)) in enumerate(zip(turns, expect, strict=True)):
            assert bool(t["format_error"]) == PENALTY[k], (k, t)
            assert len(t["executed"]) == executed
            assert t["reward"] == pytest.approx(reward, abs=1e-5)
            assert t["penalty"] == (-0.1 if PENALTY[k] else 0.0)
            score += reward + t["penalty"]
        assert batch.scores[b] == pytest.approx(score, abs=1e-5)
        assert batch.num_actions[b] == sum(e for e, _, _ in expect)
        assert batch.success[b] == expect[-1][2]
        # The score sits on the last sampled token, nowhere else.
        last = np.flatnonzero(batch.loss_mask[b])[-1]
        assert batch.token_rewards[b, last] == pytest.approx(score, abs=1e-5)
        assert np.count_nonzero(batch.token_rewards[b]) <= 1
    # Prompts, turn by turn: only the new chunk is sent; reward, warning, actions left.
    p1 = tok.decode(policy.calls[1][0])
    assert p1.startswith("\n<|im_start|>user\nReward:\n0\n\nTurn 2:\nState:\n")
    assert "No valid action provided previously" in p1 and "You have 10 actions left" in p1
    assert p1.endswith("<|im_start|>assistant\n<think>")
    p2 = tok.decode(policy.calls[2][0])
    assert "No valid action" not in p2 and "You have 9 actions left" in p2
    assert "Reward:\n" + format_reward(batch.trajectories[0]["turns"][1]["reward"]) in p2
    first = tok.decode(policy.calls[0][0])
    assert first.startswith("<|im_start|>system\nYou're a helpful assistant.")
    m = batch.metrics
    assert m["rollout/length_truncated"] == 0
    if (batch.num_turns == 5).all():  # (no random level was solved on the way)
        assert m["Sokoban/format_error_rate"] == pytest.approx(3 / 5)
        assert m["Sokoban/turns_without_format_error"] == pytest.approx(2 / 5)
        assert m["Sokoban/action_is_valid"] == pytest.approx(3 / 5)  # RAGEN's: turns 2-4 ran an action


# Levels where a turn's first action moves the player and its second does not: RAGEN's rule
# (the turn's last action) then differs from "any action of the turn".
METRIC_SEEDS = np.array([34, 21])
METRIC_TEXTS = [
    "nothing useful",  # no tags: nothing runs
    "x</think><answer>Up || Jump</answer>",  # a format error, but Up runs
    "y</think><answer>Left || Left</answer>",
    "z</think><answer>Down || Down</answer>",
    "",  # empty answer: nothing runs
]
METRIC_VALID = [[], [0], [2, 2], [1, 1], []]
METRIC_ERRORS = [True, True, False, False, True]


def _ragen_episode_metrics(sokoban, step, state, per_turn_ids, budget):
    """RAGEN's ``es_manager`` over one episode, written out: the turn's actions (cut to the
    actions left) run with the unbatched env until done, each one's ``info`` (RAGEN's grid
    envs': ``action_is_effective``, ``action_is_valid=True``, ``success``) updating the
    turn's (the last one's wins; a turn that runs nothing records ``{}``); then each key but
    ``success`` summed over the turns and divided by the turns played (``len(history) - 1``).
    Also our per-action rate and, for contrast, the share of turns with any effective action."""
    _, params = sokoban
    history, total, effective, any_effective = [], 0, 0, 0
    for ids in per_turn_ids:
        turn_info, done, moved = {}, False, False
        for a in ids[: budget - total]:
            _, state, _, term, info = step(jax.random.key(0), state, a, params)
            turn_info.update({"action_is_effective": bool(info["action_is_effective"]),
                              "action_is_valid": True, "success": bool(info["success"])})
            total, effective = total + 1, effective + bool(info["action_is_effective"])
            moved |= bool(info["action_is_effective"])
            if bool(term):
                done = True
                break
        history.append(turn_info)
        any_effective += moved
        if done or total >= budget:
            break
    sums = {}
    for info in history:
        for k, v in info.items():
            if k != "success":
                sums[k] = sums.get(k, 0.0) + float(v)
    out = {k: sums.get(k, 0.0) / len(history) for k in ("action_is_valid", "action_is_effective")}
    return out | {"effective_action_rate": effective / total if total else 0.0,
                  "any_effective": any_effective / len(history)}


def test_action_metrics_are_ragens_under_ragens_names(sokoban, tok):
    """``action_is_valid`` / ``action_is_effective`` as RAGEN's es_manager computes them from
    the same episodes (replayed independently), ours under our names. On this script and these
    levels every alternative differs (a turn with an unknown name still runs its valid action;
    a turn whose first action moved and whose last did not counts 0 in RAGEN's), so a swap
    would fail."""
    batch = _rollout(sokoban, tok).collect(_script(tok, METRIC_TEXTS), METRIC_SEEDS,
                                           jax.random.key(0))
    env, params = sokoban
    step = jax.jit(env.step_env)
    episodes = [_ragen_episode_metrics(sokoban, step, env.reset_env(jax.random.key(int(s)), params)[1],
                                       METRIC_VALID, CFG.max_actions_per_traj)
                for s in np.repeat(METRIC_SEEDS, 2)]  # a group's two rows play one level
    ragen = {key: np.mean([e[key] for e in episodes]) for key in episodes[0]}
    ours_valid = np.mean([np.mean([not e for e in METRIC_ERRORS[: len(t["turns"])]])
                          for t in batch.trajectories])
    m = batch.metrics
    for key in ("action_is_valid", "action_is_effective", "effective_action_rate"):
        assert m[f"Sokoban/{key}"] == pytest.approx(ragen[key]), key
    assert m["Sokoban/turns_without_format_error"] == pytest.approx(ours_valid)
    assert ragen["action_is_valid"] != pytest.approx(ours_valid)
    assert len({round(ragen[k], 6) for k in ("action_is_effective", "effective_action_rate",
                                             "any_effective")}) == 3, ragen
    for traj in batch.trajectories:  # the per-turn records hold each turn's last action's
        assert [t["last_effective"] for t in traj["turns"]] != [t["num_effective"] > 0
                                                                for t in traj["turns"]]


def test_masks_cover_exactly_the_sampled_tokens(sokoban, tok):
    ro = _rollout(sokoban, tok, max_turn=3)
    policy = _script(tok, TEXTS)
    batch = ro.collect(policy, SEEDS, jax.random.key(1))
    for b, traj in enumerate(batch.trajectories):
        real = batch.attention_mask[b]
        assert real[: real.sum()].all() and not real[real.sum():].any()  # a prefix
        ids = batch.input_ids[b, real]
        loss = batch.loss_mask[b, real]
        # Sampled tokens = exactly what the policy emitted, in order (eot included).
        emitted = []
        for call in range(len(traj["turns"])):
            emitted += tok(TEXTS[call], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        assert ids[loss].tolist() == emitted
        # Inserted tokens = exactly the chunks the policy was prompted with.
        assert ids[~loss].tolist() == sum((c[b] for c in policy.calls), [])
        # The whole sequence is the chat template of the conversation (no re-tokenisation).
        text = tok.apply_chat_template(traj["messages"], tokenize=False)
        assert tok.decode(ids.tolist()) + "\n" == text
        np.testing.assert_array_equal(batch.logprobs[b, real][loss], -1.0)
        assert not batch.logprobs[b][~batch.loss_mask[b]].any()
        assert set(np.unique(batch.turn_ids[b, real])) == {1, 2, 3}
    assert batch.input_ids.shape[1] % CFG.sampler.prompt_pad_multiple == 0
    np.testing.assert_array_equal(batch.position_ids[0, :5], np.arange(5))
    np.testing.assert_array_equal(batch.group_ids, [0, 0, 1, 1])
    np.testing.assert_array_equal(batch.env_ids, [0, 1, 2, 3])


def test_inserted_end_of_turn_after_a_cut_answer(sokoban, tok):
    """A response cut by the token budget gets the end-of-turn token inserted (mask 0)."""
    ro = _rollout(sokoban, tok, max_turn=2, response_length=4)
    policy = _script(tok, ["a b c d e f g h i j"] * 2, end=False)
    batch = ro.collect(policy, SEEDS, jax.random.key(2))
    ids, loss = batch.input_ids[0], batch.loss_mask[0]
    sampled = np.flatnonzero(loss)
    assert len(sampled) == 8
    after = sampled[3] + 1
    assert ids[after] == tok.eos_token_id and not loss[after]
    assert tok.decode(policy.calls[1][0]).startswith("<|im_end|>\n<|im_start|>user\n")
    assert batch.metrics["Sokoban/format_error_rate"] == 1.0


def test_action_budget_truncates(sokoban, tok, ref):
    ro = _rollout(sokoban, tok, max_actions_per_traj=3)
    policy = _script(tok, ["a</think><answer>Up || Down</answer>"] * 5)
    batch = ro.collect(policy, SEEDS, jax.random.key(3))
    for b, traj in enumerate(batch.trajectories):
        expect = _reference(ref, b, [[0, 1]] * 5, 3)
        assert len(traj["turns"]) == len(expect)
        assert batch.num_actions[b] == sum(e for e, _, _ in expect)
        if not expect[-1][2]:  # not solved: truncated by the budget after 2 turns, 2 + 1 actions
            assert traj["truncated"] and not batch.success[b]
            assert [len(t["executed"]) for t in traj["turns"]] == [2, 1]
    assert len(policy.calls) == 2


def test_turn_scores_option(sokoban, tok):
    ro = _rollout(sokoban, tok, use_turn_scores=True, max_turn=3)
    batch = ro.collect(_script(tok, TEXTS), SEEDS, jax.random.key(4))
    for b, traj in enumerate(batch.trajectories):
        placed = batch.token_rewards[b]
        for t in traj["turns"]:
            k = t["turn"]
            last = np.flatnonzero(batch.loss_mask[b] & (batch.turn_ids[b] == k))[-1]
            assert placed[last] == pytest.approx(t["reward"] + t["penalty"], abs=1e-6)
        assert placed.sum() == pytest.approx(batch.scores[b], abs=1e-5)
    # RAGEN's use_turn_scores: each turn's env reward alone, the penalties nowhere.
    ragen = _rollout(sokoban, tok, use_turn_scores=True, turn_scores_penalty=False, max_turn=3)
    plain = ragen.collect(_script(tok, TEXTS), SEEDS, jax.random.key(4))
    assert any(t["penalty"] for traj in plain.trajectories for t in traj["turns"])
    for b, traj in enumerate(plain.trajectories):
        for t in traj["turns"]:
            last = np.flatnonzero(plain.loss_mask[b] & (plain.turn_ids[b] == t["turn"]))[-1]
            assert plain.token_rewards[b, last] == pytest.approx(t["reward"], abs=1e-6)
        assert plain.scores[b] == pytest.approx(sum(t["reward"] for t in traj["turns"]), abs=1e-5)


def test_max_model_len_ends_episodes_without_crashing(sokoban, tok, caplog):
    first = _script(tok, TEXTS)
    _rollout(sokoban, tok, max_turn=1).collect(first, SEEDS, jax.random.key(5))
    n_first = max(len(p) for p in first.calls[0])
    ro = _rollout(sokoban, tok, max_model_len=n_first + 32 + 40)
    policy = _script(tok, TEXTS)
    batch = ro.collect(policy, SEEDS, jax.random.key(5))
    assert batch.metrics["rollout/length_truncated"] == 4
    assert all(t["length_truncated"] and t["truncated"] for t in batch.trajectories)
    assert (batch.num_turns == 1).all() and len(policy.calls) == 1
    assert "max_model_len" in caplog.text
    # Not even the first prompt fits: empty trajectories, still no crash.
    tiny = _rollout(sokoban, tok, max_model_len=50).collect(_script(tok, TEXTS), SEEDS,
                                                           jax.random.key(5))
    assert not tiny.attention_mask.any() and (tiny.num_turns == 0).all()
    assert tiny.metrics["rollout/length_truncated"] == 4


def test_random_tokens_never_crash(sokoban, tok):
    rng = np.random.default_rng(0)
    streams = {(r, c): rng.integers(0, len(tok), size=rng.integers(0, 40)).tolist()
               for r in range(4) for c in range(5)}
    streams[(0, 0)] = [tok.convert_tokens_to_ids("<|im_start|>")] + streams[(0, 0)]
    policy = ScriptedPolicy(lambda r, c, _prompt, _state: streams[(r, c)])
    batch = _rollout(sokoban, tok).collect(policy, SEEDS, jax.random.key(6))
    assert batch.trajectories[0]["turns"][0]["format_error"]
    assert np.isfinite(batch.scores).all()


def test_groups_share_initial_states_and_seeds(sokoban, tok):
    cfg = dataclasses.replace(CFG, max_turn=1)
    s0, s1 = train_seeds(cfg, 0), train_seeds(cfg, 1)
    np.testing.assert_array_equal(s0, [10000, 10001])
    np.testing.assert_array_equal(s1, [10002, 10003])
    np.testing.assert_array_equal(val_seeds(cfg), val_seeds(cfg))
    assert val_seeds(cfg)[0] == 123
    ro = _rollout(sokoban, tok, max_turn=1)
    a = ro.collect(_script(tok, TEXTS), s0, jax.random.key(7))
    b = ro.collect(_script(tok, TEXTS), s1, jax.random.key(7))
    c = collect(_script(tok, TEXTS), *sokoban, tok, s0, jax.random.key(8), cfg)  # one-shot API
    state = lambda batch, i: batch.trajectories[i]["turns"][0]["state"]  # noqa: E731
    assert state(a, 0) == state(a, 1) and state(a, 2) == state(a, 3)
    assert state(a, 0) != state(a, 2)
    assert {state(a, i) for i in range(4)} != {state(b, i) for i in range(4)}
    assert [state(a, i) for i in range(4)] == [state(c, i) for i in range(4)]
    np.testing.assert_array_equal(a.seeds, [10000, 10000, 10001, 10001])


def test_policies_receive_the_turns_env_states(sokoban, tok, ref):
    """Each turn the policy gets this turn's env states as an argument (``env_states``); a
    script gets its row's: the reset state on turn 1, then the state its answers led to."""
    (env, params), initial, step = ref
    seen = {}

    def script(row, call, _prompt, state):
        seen[(row, call)] = state
        return tok("a</think><answer>Up</answer>", add_special_tokens=False)["input_ids"] + [
            tok.eos_token_id]

    batch = _rollout(sokoban, tok, max_turn=2).collect(ScriptedPolicy(script), SEEDS,
                                                      jax.random.key(12))
    assert (batch.num_turns == 2).any()
    for row, traj in enumerate(batch.trajectories):
        first = jax.tree.map(lambda x, row=row: x[row], initial)
        jax.tree.map(np.testing.assert_array_equal, seen[(row, 0)], first)
        _, after, *_ = step(jax.random.key(0), jax.tree.map(jnp.asarray, first), 0, params)
        for call, turn in enumerate(traj["turns"]):
            assert env.render_text(seen[(row, call)]) == turn["state"]
        if len(traj["turns"]) == 2:
            jax.tree.map(np.testing.assert_array_equal, seen[(row, 1)], jax.device_get(after))


def test_rollout_config_is_the_run_config_section():
    cfg = RolloutConfig()
    assert cfg.val.env_groups == 256 and cfg.val.temperature == 0.5 and cfg.prompt.turn_template == ""
    ragen = ContextConfig.__dataclass_fields__["turn_template"].default
    assert cfg.context.turn_template == ragen  # "" turn_template: RAGEN's wording
    assert (cfg.context.max_tokens_hint, cfg.context.enable_think) == (400, True)
    custom = RolloutConfig(max_actions_per_turn=1, prompt=PromptConfig(
        enable_think=False, format_penalty=-1.0, turn_template="T{turn} {state}\n"))
    assert custom.context == dataclasses.replace(
        cfg.context, enable_think=False, max_actions_per_turn=1, format_penalty=-1.0,
        turn_template="T{turn} {state}\n")
    assert cfg.sampling_params() == SamplingParams(max_new_tokens=400, temperature=1.0)
    assert cfg.sampling_params(temperature=0.0).temperature == 0.0
    assert cfg.val_sampling_params() == SamplingParams(max_new_tokens=400, temperature=0.5)
    with pytest.raises(TypeError):
        RolloutConfig(8)  # keyword-only
    for bad, message in [(lambda: RolloutConfig(group_size=0), "rollout.group_size must be >= 1, got 0"),
                         (lambda: RolloutConfig(max_actions_per_turn=0), "rollout.max_actions_per_turn must be"),
                         (lambda: ValidationConfig(env_groups=0), "rollout.val.env_groups must be"),
                         (lambda: ValidationConfig(group_size=0), "rollout.val.group_size must be"),
                         (lambda: SamplingConfig(temperature=-1.0), "rollout.sampling.temperature must be >= 0"),
                         (lambda: SamplingConfig(top_p=0.0), "rollout.sampling.top_p must be in"),
                         (lambda: SamplingConfig(top_p=1.5), "rollout.sampling.top_p must be in")]:
        with pytest.raises(ValueError) as err:
            bad()
        assert str(err.value).startswith(message)


# ---------------------------------------------------------------------------------- tiny model



@jax.jit
def _full_logprobs(graphdef, state, tokens, mask):
    """The trainer's recomputation (``starpo.optimizer_step.token_logprobs``), token j at slot j."""
    logp, _ = token_logprobs(nnx.merge(graphdef, state), tokens, mask, positions_from_mask(mask))
    return logp[:, 1:]


def test_logprobs_match_a_full_forward(sokoban, tok, tiny_model):
    """Stored sampling log-probs == one fresh forward over the batch (proves cache reuse)."""
    ro = _rollout(sokoban, tok, max_turn=3, response_length=12)
    sampler = Sampler(tiny_model, pad_id=tok.pad_token_id)
    batch = ro.collect(sampler, SEEDS, jax.random.key(9))
    assert (batch.num_turns == 3).all()  # random text: format errors, no env step, 3 turns
    full = np.asarray(_full_logprobs(*nnx.split(tiny_model), jnp.asarray(batch.input_ids),
                                     jnp.asarray(batch.attention_mask)))
    loss = batch.loss_mask[:, 1:]
    assert loss.sum() > 30
    np.testing.assert_allclose(batch.logprobs[:, 1:][loss], full[loss], atol=1e-4)
    np.testing.assert_allclose(batch.model_logprobs[:, 1:][loss], full[loss], atol=1e-4)
    assert not batch.loss_mask[:, 0].any()
    # Greedy with the cache and greedy re-encoding the history sample the same tokens.
    greedy = ro.config.sampling_params(temperature=0.0)
    kept = ro.collect(sampler, SEEDS, jax.random.key(9), sampling=greedy)
    redo = ro.collect(sampler, SEEDS, jax.random.key(9), sampling=greedy, reuse_cache=False)
    np.testing.assert_array_equal(kept.input_ids, redo.input_ids)
    np.testing.assert_allclose(kept.logprobs, redo.logprobs, atol=1e-4)


def test_bandit_state_dependent_action_names(tok):
    """Bandit arm names come from each state (``action_names_for``); answering with the name
    shown in the prompt pulls that arm and ends the episode."""
    env, params = make("bandit")
    ro = AgentRollout(env, params, tok, dataclasses.replace(CFG, max_turn=2))

    def script(row, call, prompt, _state):
        text = tok.decode(prompt)
        names = text.split("Your available actions are:\n")[1].split("\n")[0].split(", ")
        pick = names[row % 2]
        return tok(f"a</think><answer>{pick.upper()}</answer>",
                   add_special_tokens=False)["input_ids"] + [tok.eos_token_id]

    batch = ro.collect(ScriptedPolicy(script), SEEDS, jax.random.key(10))
    for traj in batch.trajectories:
        assert len(traj["turns"]) == 1 and traj["terminated"]
        t = traj["turns"][0]
        assert not t["format_error"] and len(t["executed"]) == 1
        assert t["executed"][0].upper() == t["actions"][0]
    assert batch.metrics["Bandit/num_actions"] == 1.0
    # Same group, same names and order; the two rows of a group pulled different arms.
    t = [tr["turns"][0] for tr in batch.trajectories]
    assert t[0]["state"] == t[1]["state"] and t[0]["executed"] != t[1]["executed"]
    assert batch.success[0] != batch.success[1]


def test_frozenlake_hole_terminates_without_success(tok):
    """``success`` needs the env's success, not only termination: stepping into a hole ends
    the episode (terminated) as a failure; stepping onto the goal is a success."""
    env, params = make("frozenlake", is_slippery=False)
    ro = AgentRollout(env, params, tok, dataclasses.replace(CFG, max_turn=1))
    moves = {"Left": (0, -1), "Down": (1, 0), "Right": (0, 1), "Up": (-1, 0)}
    target = {}

    def script(row, call, prompt, _state):
        grid = tok.decode(prompt).split("State:\n")[1].split("\nYou have")[0].split("\n")
        r, c = next((i, line.index("P")) for i, line in enumerate(grid) if "P" in line)
        around = {}
        for name, (dr, dc) in moves.items():
            if 0 <= r + dr < len(grid) and 0 <= c + dc < len(grid[0]):
                around.setdefault(grid[r + dr][c + dc], name)
        cell = next((x for x in ("G", "O", "_") if x in around), None)
        target[row] = cell
        return tok(f"a</think><answer>{around[cell]}</answer>",
                   add_special_tokens=False)["input_ids"] + [tok.eos_token_id]

    batch = ro.collect(ScriptedPolicy(script), np.arange(32), jax.random.key(11), group_size=1)
    assert "O" in target.values()
    for row, cell in target.items():
        traj = batch.trajectories[row]
        assert traj["terminated"] == (cell in "GO") and not traj["truncated"]
        assert batch.success[row] == (cell == "G")
        assert batch.episodic_return[row] == (1.0 if cell == "G" else 0.0)
