"""The multi-turn agent loop (RAGEN's Environment State Manager + Agent Proxy) over JAX envs.

One ``AgentRollout.collect`` call plays ``groups x group_size`` episodes of one env:

* **Groups.** Every env of a group is reset from the same key (``jax.random.key(seed)``), so
  a group shares its initial state; ``train_seeds(cfg, iteration)`` advances every iteration
  (RAGEN: ``10000 + counter``, counter += env_groups), ``val_seeds(cfg)`` is fixed (RAGEN:
  123, 124, ...). Seeds are a pure function of the iteration, so a resumed run continues as
  the uninterrupted one would.
* **Device / host split** (DESIGN decision 8). Envs are batched with ``vmap`` and jitted once
  per env object (reset, and a ``lax.scan`` over the turn's action slots); generation is the
  sampler's jitted prefill + ``while_loop``. The host only renders states, tokenises the
  inserted chunks, decodes and parses answers, and assembles the batch (per row, never per
  token).
* **One token sequence per trajectory, KV cache across turns** (decisions 2 and 3). Turn k
  prefills only its new chunk (``ChatFormat.first_chunk`` / ``next_chunk``) into the cache the
  previous turn left, then decodes. ``reuse_cache=False`` re-encodes the whole history each
  turn instead (the benchmark's baseline; same tokens, same batch).
* **Budgets** (RAGEN §5): at most ``max_turn`` LLM calls, ``max_actions_per_traj`` env actions
  per episode, ``max_actions_per_turn`` per turn (``ContextConfig``); a turn's valid actions
  run in order until the env is done; the turn reward is their sum; a turn with a format
  error adds ``format_penalty`` once; with no valid action the env is not stepped but the turn
  is consumed and the next prompt carries the warning. An episode ends when the env
  terminates or truncates (its ``max_steps``), when the action budget is spent (truncated),
  after ``max_turn`` turns (unfinished), or when the next chunk plus a full response would not
  fit ``max_model_len`` real tokens (truncated, counted in ``rollout/length_truncated``).
  ``success`` = terminated, not truncated, and the env's ``info["success"]`` on the last step
  (for Sokoban terminated already means solved; FrozenLake also terminates in a hole).

Batch layout (``RolloutBatch``, numpy): each trajectory's tokens are left-aligned in a
``[B, L]`` array (``L`` rounded up to ``pad_multiple``) with ``attention_mask`` marking real
tokens (a prefix), so ``positions_from_mask(attention_mask)`` is ``arange``. ``loss_mask`` is 1
exactly on sampled tokens (the end-of-turn token the model emitted included; the template,
the env text and an end-of-turn token *inserted* after a budget-truncated answer are 0).
``logprobs[b, j]`` / ``model_logprobs[b, j]`` belong to the token at ``j`` (predicted by the
logits at ``j - 1``, which is always a real slot). ``token_rewards`` holds the trajectory score
(env rewards + penalties) on the last sampled token, or with ``use_turn_scores`` each turn's
score on that turn's last sampled token. The sampler's cache keeps padding slots between turns;
the batch is compacted (padding removed), which changes nothing in the math (masked slots get
exactly zero attention weight and positions count real tokens), and the log-prob test checks
that to 1e-4.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from ragen_jax.rollout.context import (
    ChatFormat,
    ContextConfig,
    ParsedTurn,
    parse_response,
    system_message,
    user_message,
)
from ragen_jax.rollout.sampler import SampleOutput, SamplingParams, pad_prompts

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """Groups, budgets, lengths and sampling of a rollout (defaults: RAGEN's V2 base config).

    ``response_length``: max new tokens per turn. ``max_model_len``: max real tokens of a
    trajectory. ``val_groups`` x ``val_group_size`` envs are used for validation (RAGEN: 512 x
    1; smaller here by default). ``pad_multiple``: the batch length is rounded up to it.
    """

    env_groups: int = 8
    group_size: int = 16
    max_turn: int = 5
    max_actions_per_traj: int = 10
    response_length: int = 400
    max_model_len: int = 3600
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    use_turn_scores: bool = False
    train_seed: int = 10000
    val_seed: int = 123
    val_groups: int = 64
    val_group_size: int = 1
    pad_multiple: int = 64
    context: ContextConfig = ContextConfig()

    def __post_init__(self):
        for name in ("env_groups", "group_size", "max_turn", "max_actions_per_traj",
                     "response_length", "max_model_len", "pad_multiple"):
            if getattr(self, name) < 1:
                raise ValueError(f"RolloutConfig.{name} must be >= 1")

    @property
    def max_actions_per_turn(self) -> int:
        return self.context.max_actions_per_turn

    def sampling(self, temperature: float | None = None) -> SamplingParams:
        t = self.temperature if temperature is None else temperature
        return SamplingParams(max_new_tokens=self.response_length, temperature=t,
                              top_k=self.top_k, top_p=self.top_p)


def train_seeds(cfg: RolloutConfig, iteration: int) -> np.ndarray:
    """The group seeds of training iteration ``iteration`` (fresh every iteration)."""
    return cfg.train_seed + iteration * cfg.env_groups + np.arange(cfg.env_groups)


def val_seeds(cfg: RolloutConfig) -> np.ndarray:
    """The fixed validation group seeds."""
    return cfg.val_seed + np.arange(cfg.val_groups)


class Policy(Protocol):
    """What the loop calls each turn: ``Sampler`` or a scripted stand-in."""

    def __call__(self, prompts: Sequence[Sequence[int]], *, key: jax.Array,
                 params: SamplingParams, stop_tokens: Any, active: Any,
                 cache: Any) -> SampleOutput: ...


@dataclasses.dataclass
class RolloutBatch:
    """A finished rollout: training arrays (numpy), per-env records, metrics, timings."""

    input_ids: np.ndarray  # [B, L] int32, pad_id after the end
    attention_mask: np.ndarray  # [B, L] bool, real tokens (a prefix)
    position_ids: np.ndarray  # [B, L] int32
    loss_mask: np.ndarray  # [B, L] bool, sampled tokens
    logprobs: np.ndarray  # [B, L] float32, sampling-distribution log-prob of the token at j
    model_logprobs: np.ndarray  # [B, L] float32, log_softmax(logits / T) of the token at j
    token_rewards: np.ndarray  # [B, L] float32, scores placed on sampled tokens
    turn_ids: np.ndarray  # [B, L] int16, 1-based turn of each token, 0 on padding
    scores: np.ndarray  # [B] float32, episodic return + penalties
    episodic_return: np.ndarray  # [B] float32, env rewards only
    success: np.ndarray  # [B] bool
    num_actions: np.ndarray  # [B] int32, env actions executed
    num_turns: np.ndarray  # [B] int32
    group_ids: np.ndarray  # [B] int32
    env_ids: np.ndarray  # [B] int32
    seeds: np.ndarray  # [B] int64
    metrics: dict[str, float]
    trajectories: list[dict[str, Any]]
    timing: dict[str, float]


# ----------------------------------------------------------------------------------------------
# Device-side env functions (jitted once per env object)
# ----------------------------------------------------------------------------------------------

_ENV_FNS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def env_functions(env: Any) -> tuple[Callable, Callable]:
    """``(reset, step_turn)`` for ``env``, batched with vmap and jitted (cached per env).

    ``reset(keys[N], params) -> (obs, states)``.
    ``step_turn(states, params, actions[N, A], n_act[N], keys[N])`` runs each env's first
    ``n_act`` actions in order (``step_env``: no auto-reset), stopping at terminated or
    truncated, and returns ``(states, reward_sum, n_executed, n_effective, terminated,
    truncated, success)``.
    """
    if env in _ENV_FNS:
        return _ENV_FNS[env]
    reset = jax.jit(jax.vmap(env.reset_env, in_axes=(0, None)))

    def one(state, params, acts, n, key):
        def body(carry, i):
            state, done, rew, n_exec, n_eff, term, trunc, succ = carry
            do = (i < n) & ~done
            _, nxt, r, t, info = env.step_env(jax.random.fold_in(key, i), state, acts[i], params)
            t = jnp.asarray(t, bool)
            tr = jnp.asarray(env.is_truncated(nxt, params), bool) & ~t
            state = jax.tree.map(lambda a, b: jnp.where(do, a, b), nxt, state)
            carry = (
                state,
                done | (do & (t | tr)),
                rew + jnp.where(do, r, 0.0).astype(jnp.float32),
                n_exec + do.astype(jnp.int32),
                n_eff + (do & jnp.asarray(info["action_is_effective"], bool)).astype(jnp.int32),
                term | (do & t),
                trunc | (do & tr),
                jnp.where(do, jnp.asarray(info["success"], bool), succ),
            )
            return carry, None

        f, i0 = jnp.bool_(False), jnp.int32(0)
        init = (state, f, jnp.float32(0.0), i0, i0, f, f, f)
        (state, _, rew, n_exec, n_eff, term, trunc, succ), _ = jax.lax.scan(
            body, init, jnp.arange(acts.shape[0]))
        return state, rew, n_exec, n_eff, term, trunc, succ

    step_turn = jax.jit(jax.vmap(one, in_axes=(0, None, 0, 0, 0)))
    _ENV_FNS[env] = (reset, step_turn)
    return reset, step_turn


# ----------------------------------------------------------------------------------------------
# Scripted stand-in policy (tests)
# ----------------------------------------------------------------------------------------------


class ScriptedPolicy:
    """Emits chosen token streams through the sampler's interface (for tests).

    ``script(row, call_index, prompt_ids) -> token ids`` gives row ``row``'s response at the
    policy's ``call_index``-th call (0-based). The emitted tokens are cut after the first stop
    token and at the token budget, exactly like the sampler. ``logprob`` is reported for every
    emitted token. Every call's prompts are recorded in ``calls`` (list of lists of id lists).
    """

    def __init__(self, script: Callable[[int, int, list[int]], Sequence[int]], *,
                 pad_id: int = 0, logprob: float = -1.0):
        self.script = script
        self.pad_id = int(pad_id)
        self.logprob = float(logprob)
        self.calls: list[list[list[int]]] = []

    @classmethod
    def from_texts(cls, tokenizer: Any, texts: Callable[[int, int], str], *,
                   end: bool = True, **kw) -> ScriptedPolicy:
        """Scripts from strings: ``texts(row, call) -> str``, encoded as plain text (special
        token strings in it become special tokens), followed by the eos (end-of-turn) token
        when ``end``."""
        eos = tokenizer.eos_token_id

        def script(row, call, _prompt):
            ids = tokenizer(texts(row, call), add_special_tokens=False)["input_ids"]
            return list(ids) + ([eos] if end else [])

        return cls(script, pad_id=tokenizer.pad_token_id or 0, **kw)

    def __call__(self, prompts, *, key=None, params: SamplingParams = SamplingParams(),
                 stop_tokens=(), max_new=None, active=None, cache=None, mask=None,
                 bucket=None) -> SampleOutput:
        del key, cache, mask
        rows = [list(map(int, p)) for p in prompts]
        call = len(self.calls)
        self.calls.append(rows)
        b, n = len(rows), params.max_new_tokens
        act = np.ones(b, bool) if active is None else np.asarray(active, bool)
        budget = np.full(b, n) if max_new is None else np.minimum(np.asarray(max_new), n)
        stops = set(np.asarray(stop_tokens).reshape(-1).tolist())
        tokens = np.full((b, n), self.pad_id, np.int32)
        lengths = np.zeros(b, np.int32)
        for i in range(b):
            if not act[i]:
                continue
            out = [int(t) for t in self.script(i, call, rows[i])][: int(budget[i])]
            for j, t in enumerate(out):
                if t in stops:
                    out = out[: j + 1]
                    break
            tokens[i, : len(out)] = out
            lengths[i] = len(out)
        mask = np.arange(n)[None, :] < lengths[:, None]
        lp = np.where(mask, self.logprob, 0.0).astype(np.float32)
        ptok, pmask = pad_prompts(rows, bucket=bucket, pad_id=self.pad_id) if any(rows) else (
            np.zeros((b, 1), np.int32), np.zeros((b, 1), bool))
        return SampleOutput(tokens=tokens, mask=mask, logprobs=lp, model_logprobs=lp,
                            lengths=lengths, steps=np.int32(lengths.max(initial=0)),
                            prompt_tokens=ptok, prompt_mask=pmask, cache=None)


# ----------------------------------------------------------------------------------------------
# The loop
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Episode:
    """Host-side bookkeeping of one env's episode."""

    pieces: list[tuple[np.ndarray, bool, Any, Any, int]] = dataclasses.field(
        default_factory=list)  # (ids, sampled, logprobs, model_logprobs, turn)
    length: int = 0  # real tokens so far
    done: bool = False
    terminated: bool = False
    truncated: bool = False
    length_truncated: bool = False
    success: bool = False
    num_actions: int = 0
    num_effective: int = 0
    turns: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    messages: list[dict[str, str]] = dataclasses.field(default_factory=list)
    emitted_eot: bool = True
    warning: bool = False
    prev_reward: float | None = None


class AgentRollout:
    """Plays batched multi-turn episodes of one env with a policy (see the module docstring)."""

    def __init__(self, env: Any, env_params: Any, tokenizer: Any, config: RolloutConfig, *,
                 tag: str | None = None):
        self.env = env
        self.env_params = env_params
        self.tokenizer = tokenizer
        self.config = config
        self.tag = tag or type(env).__name__
        self.chat = ChatFormat(tokenizer, config.context)
        self._reset, self._step = env_functions(env)
        self.turn_states = None  # host env states of the turn being generated (see collect)

    def collect(self, policy: Policy, group_seeds: Sequence[int] | np.ndarray, key: jax.Array,
                *, group_size: int | None = None, reuse_cache: bool = True,
                sampling: SamplingParams | None = None, row_offset: int = 0) -> RolloutBatch:
        """Plays ``len(group_seeds) x group_size`` episodes and returns the batch.

        ``key`` drives sampling and env randomness (slips, payoffs), not the initial states,
        which come from ``group_seeds`` only. Each episode draws from ``key`` folded with its
        row index plus ``row_offset``, so a process playing rows ``[offset, offset + n)`` of a
        larger batch plays them exactly as one process playing the whole batch would.
        """
        cfg, ctx, chat = self.config, self.config.context, self.chat
        t_start = time.perf_counter()
        timing = {"generate_s": 0.0, "env_s": 0.0}
        gs = cfg.group_size if group_size is None else int(group_size)
        seeds = np.asarray(group_seeds, np.int64).reshape(-1)
        group_ids = np.repeat(np.arange(seeds.size, dtype=np.int32), gs)
        n = group_ids.size
        sp = sampling or cfg.sampling()
        k_sample, k_env = jax.random.split(key)
        row_ids = jnp.arange(n, dtype=jnp.uint32) + np.uint32(row_offset)
        per_row = jax.vmap(jax.random.fold_in, (None, 0))

        t0 = time.perf_counter()
        keys = jax.vmap(jax.random.key)(jnp.asarray(seeds[group_ids], jnp.uint32))
        _, states = self._reset(keys, self.env_params)
        host = jax.device_get(states)
        timing["env_s"] += time.perf_counter() - t0

        eps = [_Episode() for _ in range(n)]
        cache = None
        for turn in range(1, cfg.max_turn + 1):
            # ---- build this turn's inserted chunk (host) ----
            texts, rows, names = [], [], {}
            for i, ep in enumerate(eps):
                if ep.done:
                    continue
                state_i = jax.tree.map(lambda x, i=i: x[i], host)
                names[i] = tuple(self.env.action_names_for(state_i))
                state_text = self.env.render_text(state_i)
                user = user_message(ctx, turn=turn, state=state_text,
                                    actions_left=cfg.max_actions_per_traj - ep.num_actions,
                                    warning=ep.warning, prev_reward=ep.prev_reward)
                if turn == 1:
                    system = system_message(self.env, names[i], ctx)
                    ep.messages.append({"role": "system", "content": system})
                    texts.append(chat.first_chunk(system, user))
                else:
                    texts.append(chat.next_chunk(user, emitted_eot=ep.emitted_eot))
                ep.messages.append({"role": "user", "content": user})
                ep.turns.append({"turn": turn, "state": state_text})
                rows.append(i)
            chunk_ids = dict(zip(rows, chat.encode(texts), strict=True))
            for i in rows:  # would the chunk plus a full response overflow max_model_len?
                ep = eps[i]
                if ep.length + len(chunk_ids[i]) + cfg.response_length > cfg.max_model_len:
                    ep.done = ep.truncated = ep.length_truncated = True
                    ep.messages.pop()
                    ep.turns.pop()
                    del chunk_ids[i]
            active = np.zeros(n, bool)
            active[list(chunk_ids)] = True
            if not active.any():
                break

            # ---- generate (device) ----
            t0 = time.perf_counter()
            if reuse_cache:
                prompts = [chunk_ids.get(i, []) for i in range(n)]
            else:  # baseline: the whole history plus the chunk, no cache
                prompts = [self._history(eps[i]) + chunk_ids[i] if active[i] else []
                           for i in range(n)]
            self.turn_states = host  # host copy of this turn's env states (scripted policies)
            out = policy(prompts, key=per_row(jax.random.fold_in(k_sample, turn), row_ids), params=sp,
                         stop_tokens=chat.stop_ids, active=active,
                         cache=cache if reuse_cache else None)
            if reuse_cache:
                cache = out.cache
            gen, lengths, lp, mlp = (np.asarray(x) for x in jax.device_get(
                (out.tokens, out.lengths, out.logprobs, out.model_logprobs)))
            timing["generate_s"] += time.perf_counter() - t0

            # ---- record and parse (host) ----
            actions = np.zeros((n, ctx.max_actions_per_turn), np.int32)
            n_act = np.zeros(n, np.int32)
            parsed: dict[int, ParsedTurn] = {}
            for i in chunk_ids:
                ep, k = eps[i], int(lengths[i])
                g = gen[i, :k]
                ep.pieces.append((np.asarray(chunk_ids[i], np.int32), False, None, None, turn))
                ep.pieces.append((g.astype(np.int32), True, lp[i, :k], mlp[i, :k], turn))
                ep.length += len(chunk_ids[i]) + k
                text, ep.emitted_eot, special = chat.generated_text(g)
                text = ctx.answer_prefix + text
                p = parse_response(text, names[i], ctx, special_inside=special)
                parsed[i] = p
                ids = p.action_ids[: cfg.max_actions_per_traj - ep.num_actions]
                actions[i, : len(ids)] = ids
                n_act[i] = len(ids)
                ep.messages.append({"role": "assistant", "content": text})

            # ---- step the envs (device) ----
            t0 = time.perf_counter()
            step_keys = per_row(jax.random.fold_in(k_env, turn), row_ids)
            res = self._step(states, self.env_params, jnp.asarray(actions), jnp.asarray(n_act),
                             step_keys)
            states = res[0]
            host, rew, n_exec, n_eff, term, trunc, succ = jax.device_get(
                (states, *res[1:]))
            timing["env_s"] += time.perf_counter() - t0

            for i, p in parsed.items():
                ep = eps[i]
                r = float(rew[i])
                ep.num_actions += int(n_exec[i])
                ep.num_effective += int(n_eff[i])
                penalty = ctx.format_penalty if p.format_error else 0.0
                ep.turns[-1].update(
                    response=ep.messages[-1]["content"], think=p.think, answer=p.answer,
                    actions=p.actions, executed=[names[i][a] for a in p.action_ids[: int(n_exec[i])]],
                    reward=r, penalty=penalty, format_error=p.reason,
                    num_effective=int(n_eff[i]), num_tokens=int(lengths[i]))
                ep.prev_reward = r
                ep.warning = not p.action_ids
                if term[i]:
                    ep.done = ep.terminated = True
                    ep.success = bool(succ[i])
                elif trunc[i] or ep.num_actions >= cfg.max_actions_per_traj:
                    ep.done = ep.truncated = True
                if turn == cfg.max_turn:
                    ep.done = True

        t0 = time.perf_counter()
        batch = self._assemble(eps, seeds, group_ids, gs, host)
        timing["assemble_s"] = time.perf_counter() - t0
        timing["total_s"] = time.perf_counter() - t_start
        timing["host_s"] = timing["total_s"] - timing["generate_s"] - timing["env_s"]
        batch.timing = timing
        return batch

    @staticmethod
    def _history(ep: _Episode) -> list[int]:
        return [int(t) for ids, *_ in ep.pieces for t in ids]

    # ------------------------------------------------------------------------------------------

    def _assemble(self, eps: list[_Episode], seeds: np.ndarray, group_ids: np.ndarray, gs: int,
                  host_states: Any) -> RolloutBatch:
        cfg = self.config
        n = len(eps)
        longest = max((ep.length for ep in eps), default=0)
        width = max(cfg.pad_multiple, -(-longest // cfg.pad_multiple) * cfg.pad_multiple)
        ids = np.full((n, width), self.chat.pad_id, np.int32)
        attn = np.zeros((n, width), bool)
        loss = np.zeros((n, width), bool)
        lp = np.zeros((n, width), np.float32)
        mlp = np.zeros((n, width), np.float32)
        rewards = np.zeros((n, width), np.float32)
        turn_ids = np.zeros((n, width), np.int16)
        scores = np.zeros(n, np.float32)
        returns = np.zeros(n, np.float32)
        trajectories = []
        unplaced = 0
        for b, ep in enumerate(eps):
            pos, last_sampled = 0, -1
            turn_end: dict[int, int] = {}
            for tok, sampled, plp, pmlp, turn in ep.pieces:
                k = len(tok)
                ids[b, pos:pos + k] = tok
                turn_ids[b, pos:pos + k] = turn
                if sampled:
                    loss[b, pos:pos + k] = True
                    lp[b, pos:pos + k] = plp
                    mlp[b, pos:pos + k] = pmlp
                    if k:
                        last_sampled = pos + k - 1
                turn_end[turn] = last_sampled
                pos += k
            attn[b, :pos] = True
            turn_scores = [t.get("reward", 0.0) + t.get("penalty", 0.0) for t in ep.turns]
            returns[b] = sum(t.get("reward", 0.0) for t in ep.turns)
            scores[b] = sum(turn_scores)
            if cfg.use_turn_scores:
                for t, s in zip(ep.turns, turn_scores, strict=True):
                    at = turn_end.get(t["turn"], -1)
                    if at >= 0:
                        rewards[b, at] += s
                    else:
                        unplaced += 1
            elif last_sampled >= 0:
                rewards[b, last_sampled] = scores[b]
            elif ep.turns:
                unplaced += 1
            final = self.env.render_text(jax.tree.map(lambda x, b=b: x[b], host_states))
            trajectories.append({
                "env_id": b, "group_id": int(group_ids[b]), "seed": int(seeds[group_ids[b]]),
                "tag": self.tag, "messages": ep.messages, "turns": ep.turns,
                "final_state": final, "success": ep.success, "terminated": ep.terminated,
                "truncated": ep.truncated, "length_truncated": ep.length_truncated,
                "num_actions": ep.num_actions, "episodic_return": float(returns[b]),
                "score": float(scores[b]), "num_tokens": ep.length,
            })
        position_ids = np.maximum(np.cumsum(attn, axis=1) - 1, 0).astype(np.int32)
        success = np.array([ep.success for ep in eps], bool)
        num_actions = np.array([ep.num_actions for ep in eps], np.int32)
        num_turns = np.array([len(ep.turns) for ep in eps], np.int32)
        metrics = self._metrics(eps, success, num_actions, num_turns, returns, scores,
                                loss, group_ids, gs)
        metrics["rollout/unplaced_scores"] = float(unplaced)
        n_len = metrics["rollout/length_truncated"]
        if n_len:
            log.warning("%d of %d episodes ended at max_model_len=%d", n_len, n, cfg.max_model_len)
        return RolloutBatch(
            input_ids=ids, attention_mask=attn, position_ids=position_ids, loss_mask=loss,
            logprobs=lp, model_logprobs=mlp, token_rewards=rewards, turn_ids=turn_ids,
            scores=scores, episodic_return=returns, success=success, num_actions=num_actions,
            num_turns=num_turns, group_ids=group_ids, env_ids=np.arange(n, dtype=np.int32),
            seeds=seeds[group_ids], metrics=metrics, trajectories=trajectories, timing={})

    def _metrics(self, eps, success, num_actions, num_turns, returns, scores, loss, group_ids,
                 gs) -> dict[str, float]:
        """RAGEN-named per-tag metrics (``{tag}/...``) plus ``rollout/...`` counters.

        ``action_is_valid``: per episode the fraction of turns without a format error;
        ``action_is_effective``: per episode effective / executed actions (0 if none); both
        then averaged over episodes. ``format_error_rate``: over all turns of the batch.
        """
        tag = self.tag
        turns = [t for ep in eps for t in ep.turns]
        errors = [bool(t.get("format_error")) for t in turns]
        valid = [np.mean([not t.get("format_error") for t in ep.turns]) if ep.turns else 0.0
                 for ep in eps]
        effective = [ep.num_effective / ep.num_actions if ep.num_actions else 0.0 for ep in eps]
        groups = success.reshape(-1, gs) if success.size else success.reshape(0, 1)
        resp = loss.sum(axis=1)
        f = lambda x: float(np.mean(x)) if len(x) else 0.0  # noqa: E731
        return {
            f"{tag}/success": f(success),
            f"{tag}/num_actions": f(num_actions),
            f"{tag}/num_turns": f(num_turns),
            f"{tag}/action_is_effective": f(effective),
            f"{tag}/action_is_valid": f(valid),
            f"{tag}/format_error_rate": f(errors),
            f"{tag}/pass@{gs}": f(groups.any(axis=1)),
            f"{tag}/response_length": f(resp),
            f"{tag}/response_length_per_turn": float(resp.sum() / max(len(turns), 1)),
            f"{tag}/episodic_return": f(returns),
            f"{tag}/score": f(scores),
            "rollout/length_truncated": float(sum(ep.length_truncated for ep in eps)),
            "rollout/truncated": float(sum(ep.truncated for ep in eps)),
            "rollout/num_trajectories": float(len(eps)),
            "rollout/num_groups": float(len(set(group_ids.tolist()))),
            "rollout/tokens": float(sum(ep.length for ep in eps)),
            "rollout/sampled_tokens": float(resp.sum()),
        }


def collect(policy: Policy, env: Any, env_params: Any, tokenizer: Any,
            group_seeds: Sequence[int] | np.ndarray, key: jax.Array,
            config: RolloutConfig = RolloutConfig(), **kw: Any) -> RolloutBatch:
    """DESIGN's ``rollout.collect(actor, env, tok, seeds)``: a one-shot ``AgentRollout``.

    The jitted env functions are cached per env object and the chat pieces are cheap, so a
    fresh ``AgentRollout`` per call costs nothing measurable; keep one to skip even that.
    """
    return AgentRollout(env, env_params, tokenizer, config).collect(policy, group_seeds, key, **kw)
