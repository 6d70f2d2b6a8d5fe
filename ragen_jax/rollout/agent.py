"""The multi-turn agent loop (RAGEN's Environment State Manager + Agent Proxy).

One ``AgentRollout.collect`` call plays ``groups x group_size`` episodes of one env:

* **Groups.** Every env of a group is reset from the same key (``jax.random.key(seed)``), so
  a group shares its initial state; ``train_seeds(cfg, iteration)`` advances every iteration
  (RAGEN: ``10000 + counter``, counter += env_groups), ``val_seeds(cfg)`` is fixed (RAGEN:
  123, 124, ...). Seeds are a pure function of the iteration, so a resumed run continues as
  the uninterrupted one would.
* **Device / host split.** Envs are reset and stepped by an env driver
  (``rollout.env_driver``): a JAX env is batched with ``vmap`` and jitted once per env object
  (reset, and a ``lax.scan`` over the turn's action slots); a host env (``envs.host.family``: Python,
  free-text actions) runs one instance per row on worker threads, and a row whose env raises
  or hangs past its timeout ends as a recorded failure (``env_error``) while the others play
  on. Generation is the sampler's jitted prefill + ``while_loop``. The host only does small string work: it renders states,
  tokenises the inserted chunks, decodes and parses answers, and assembles the batch (per
  row, never per token).
* **One token sequence per trajectory, KV cache across turns** (``rollout.window.mode=
  full``, the default). Turn k prefills only its new chunk (``ChatFormat.first_chunk`` /
  ``next_chunk``) into the cache the previous turn left, then decodes. ``reuse_cache=False``
  re-encodes the whole history each turn instead (the benchmark's baseline; same tokens,
  same batch). The ``limited`` and ``single_turn`` windows (``rollout/window.py``) rebuild each
  turn's prompt on the host; a turn whose prompts do not all extend the rows' previous
  sequences prefills the whole prompts into a fresh cache.
* **Stop strings** (``rollout.sampling.stop_strings``, off by default; ``</answer>`` in the real-model
  presets): besides the stop ids, a turn ends with the sampled token that completes one of
  them (``rollout/stop_strings.py``: a per-token automaton in the jitted decode loop), so an
  answer that goes on after ``</answer>`` does not hold the batch to the token budget.
* **Budgets** (RAGEN's): at most ``max_turn`` LLM calls, ``max_actions_per_traj`` env actions
  per episode, ``max_actions_per_turn`` per turn; a turn's valid actions run in order until
  the env is done; the turn reward is their sum; a turn with a format error adds
  ``format_penalty`` once; with no valid action the env is not stepped but the turn is
  consumed and the next prompt carries the warning. An episode ends when the env terminates
  or truncates (its ``max_steps``), when the action budget is spent (truncated), after
  ``max_turn`` turns (unfinished), or when the turn's prompt plus a full response would not
  fit ``max_model_len`` real tokens (truncated, counted in ``rollout/length_truncated``), unless
  ``rollout.window.overlong=truncate`` drops the oldest turns from the prompt instead.
  ``success`` = terminated, not truncated, and the env's ``info["success"]`` on the last step
  (for Sokoban terminated already means solved; FrozenLake also terminates in a hole).
* **Policies** (``Policy``): the ``Sampler``, or a scripted policy
  (``ragen_jax.rollout.scripted``). Each turn a policy gets the prompt token ids and this
  turn's env states (``env_states``, which a model ignores and a script may read).

The batch (``RolloutBatch``: token arrays, masks, log-probs, rewards, per-episode records and
metrics) is assembled by ``ragen_jax.rollout.batch``, whose docstring describes its layout.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from ragen_jax.rollout.batch import Episode, Piece, RolloutBatch, assemble_batch
from ragen_jax.rollout.config import RolloutConfig
from ragen_jax.rollout.context import (
    ChatFormat,
    ParsedTurn,
    parse_response,
    system_message,
    user_message,
)
from ragen_jax.rollout.env_driver import (
    EnvDriver,
    JaxEnvDriver,
    StepOutcome,
    TurnActions,
    row_state,
)
from ragen_jax.rollout.sampling import SampleOutput, SamplingParams
from ragen_jax.rollout.stop_strings import StopAutomaton, stop_automaton
from ragen_jax.rollout.window import ContextWindow, WindowPrompt

log = logging.getLogger(__name__)


def train_seeds(cfg: RolloutConfig, iteration: int) -> np.ndarray:
    """The group seeds of training iteration ``iteration`` (fresh every iteration)."""
    return cfg.train_seed + iteration * cfg.env_groups + np.arange(cfg.env_groups)


def val_seeds(cfg: RolloutConfig) -> np.ndarray:
    """The fixed validation group seeds."""
    return cfg.val.seed + np.arange(cfg.val.env_groups)


class Policy(Protocol):
    """What the loop calls each turn: ``Sampler`` or a scripted policy.

    ``prompts``: per row the token ids to prefill (empty for inactive rows); ``key``: one
    key per row; ``stop_tokens``: the ids that end an answer; ``stop_strings``: the rollout's
    compiled stop strings (None: none), ending an answer with the token that completes one;
    ``active``: ``[B]`` bool, the rows to answer; ``cache``: the previous turn's returned cache
    (None on the first turn or without cache reuse); ``env_states``: the host numpy pytree of
    this turn's batched env states (row ``b`` is row ``b``'s state).
    """

    def __call__(self, prompts: Sequence[Sequence[int]], *, key: jax.Array,
                 params: SamplingParams, stop_tokens: Any, stop_strings: StopAutomaton | None,
                 active: Any, cache: Any, env_states: Any) -> SampleOutput: ...


# ----------------------------------------------------------------------------------------------
# The loop
# ----------------------------------------------------------------------------------------------


class _Prompts(NamedTuple):
    """One turn's prompt chunks: the live episodes that still fit ``max_model_len``."""

    turn: int
    chunks: dict[int, list[int]]  # row -> the transcript chunk's token ids
    prompts: dict[int, WindowPrompt]  # row -> the prompt the model reads (its context window)
    action_names: dict[int, tuple[str, ...]]  # row -> the action names of its state


class _Generated(NamedTuple):
    """The policy's answers, on the host (``[B, N]`` arrays, ``lengths`` ``[B]``)."""

    tokens: np.ndarray
    lengths: np.ndarray
    logprobs: np.ndarray
    model_logprobs: np.ndarray


class _Timer:
    """Wall time per phase (``generate_s``, ``env_s``, ...) and the host's share."""

    def __init__(self):
        self.start = time.perf_counter()
        self.spent = {"generate_s": 0.0, "env_s": 0.0}

    @contextlib.contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.spent[phase] = self.spent.get(phase, 0.0) + time.perf_counter() - t0

    def summary(self) -> dict[str, float]:
        """Phase times plus ``total_s`` and ``host_s`` (all but generation and env calls)."""
        total = time.perf_counter() - self.start
        host = total - self.spent["generate_s"] - self.spent["env_s"]
        return {**self.spent, "total_s": total, "host_s": host}


def make_driver(env: Any, env_params: Any, max_actions_per_turn: int,
                anchors: bool = False) -> EnvDriver:
    """The driver of ``env``: ``HostEnvDriver`` for a host env (``envs.host.family.HostEnvFamily``),
    else ``JaxEnvDriver`` (its turn step ``max_actions_per_turn`` slots wide: one compile;
    ``anchors``: it hashes each new state too, ``StepOutcome.anchors``)."""
    # Imported here: importing ragen_jax.rollout must not start JAX's backend (launch.py
    # reads the config before jax.distributed), whatever an env module does at import.
    from ragen_jax.envs.host.family import HostEnvFamily

    if isinstance(env, HostEnvFamily):
        from ragen_jax.rollout.host_driver import HostEnvDriver

        return HostEnvDriver(env)
    return JaxEnvDriver(env, env_params, max_actions_per_turn, anchors=anchors)


def _turn_keys(key: jax.Array, turn: int, row_ids: jax.Array) -> jax.Array:
    """One key per row for ``turn``: ``key`` folded with the turn, then with each row id."""
    return jax.vmap(jax.random.fold_in, (None, 0))(jax.random.fold_in(key, turn), row_ids)


class AgentRollout:
    """Plays batched multi-turn episodes of one env with a policy (see the module docstring).

    ``eos_ids``: ids that end a turn besides the chat template's end-of-turn token and the
    tokenizer's eos token (a model folder's ``generation_config.json`` list; see
    ``ChatFormat``). ``config.sampling.stop_strings`` are compiled for ``tokenizer`` here, once
    (``stop_strings.stop_automaton`` caches them per tokenizer). ``record_anchors``: each turn
    record gets the anchor id of the state the turn acted from (``"anchor"``: a JAX state's
    ``envs.levels.anchor_hash``, computed on device with the step, or a host env's text id),
    which GiGPO groups turns by (``starpo.anchors``); off, a JAX env compiles no hash.
    """

    def __init__(self, env: Any, env_params: Any, tokenizer: Any, config: RolloutConfig, *,
                 tag: str | None = None, eos_ids: Sequence[int] = (),
                 record_anchors: bool = False):
        self.env = env
        self.env_params = env_params
        self.tokenizer = tokenizer
        self.config = config
        self.tag = tag or env.name
        self.chat = ChatFormat(tokenizer, config.context, eos_ids=eos_ids,
                               stop_strings=config.sampling.stop_strings)
        self.stop_strings = (stop_automaton(tokenizer, config.sampling.stop_strings)
                             if config.sampling.stop_strings else None)
        self.record_anchors = record_anchors
        self.driver = make_driver(env, env_params, config.max_actions_per_turn, record_anchors)
        self.window = ContextWindow(self.chat, mode=config.window.mode,
                                    window_turns=config.window.turns, overlong=config.window.overlong,
                                    max_model_len=config.max_model_len,
                                    response_length=config.response_length)

    def collect(self, policy: Policy, group_seeds: Sequence[int] | np.ndarray, key: jax.Array,
                *, group_size: int | None = None, reuse_cache: bool = True,
                sampling: SamplingParams | None = None, row_offset: int = 0,
                held_out: bool = True) -> RolloutBatch:
        """Plays ``len(group_seeds) x group_size`` episodes and returns the batch.

        Resets the envs (the rows of group ``g`` from ``group_seeds[g]``), then plays turns
        until every episode has ended or ``max_turn`` turns are done. Each turn it builds the
        live episodes' prompt chunks (ending those whose chunk plus a full response would
        not fit ``max_model_len``), generates the answers, records and parses them, and steps
        the envs with the parsed actions. Finally it assembles the batch.

        ``key`` drives sampling and env randomness (slips, payoffs), not the initial states,
        which come from ``group_seeds`` only. Each episode draws from ``key`` folded with its
        row index plus ``row_offset``, so a process playing rows ``[offset, offset + n)`` of a
        larger batch plays them exactly as one process playing the whole batch would.
        ``sampling`` defaults to ``config.sampling_params()``. ``held_out``: skip the levels given to
        ``hold_out`` (training and prior data; validation passes False).
        """
        cfg, timer = self.config, _Timer()
        gs = cfg.group_size if group_size is None else int(group_size)
        seeds = np.asarray(group_seeds, np.int64).reshape(-1)
        group_ids = np.repeat(np.arange(seeds.size, dtype=np.int32), gs)
        row_ids = jnp.asarray(np.arange(group_ids.size, dtype=np.uint32) + np.uint32(row_offset))
        k_sample, k_env = jax.random.split(key)
        sp = sampling or cfg.sampling_params()
        with timer("env_s"):
            reset = self.driver.reset(seeds[group_ids], held_out=held_out)
        states, host, errors, anchors = reset.states, reset.host, reset.errors, reset.anchors
        eps = [Episode(level=int(level), redraws=int(n),
                       text_anchors=self.record_anchors and anchors is None)
               for level, n in zip(reset.levels, reset.redraws, strict=True)]
        for i, error in errors.items():  # a host env that failed to reset: no turn is played
            eps[i].truncated, eps[i].env_error = True, error
        cache = None
        for turn in range(1, cfg.max_turn + 1):
            prompts = self._build_prompts(eps, host, anchors, turn)
            if not prompts.chunks:
                break
            with timer("generate_s"):
                gen, cache = self._generate(policy, eps, prompts, host, sp, cache, reuse_cache,
                                            _turn_keys(k_sample, turn, row_ids))
            parsed = self._record_answers(eps, prompts, gen)
            with timer("env_s"):
                states, host, outcome = self._step_envs(states, eps, prompts, parsed,
                                                        _turn_keys(k_env, turn, row_ids))
            self._record_outcomes(eps, prompts, parsed, outcome)
            anchors = outcome.anchors
        with timer("assemble_s"):
            batch = self._assemble(eps, seeds, group_ids, gs, host)
        batch.timing = timer.summary()
        return batch

    def reset_envs(self, seeds: Sequence[int] | np.ndarray) -> tuple[Any, Any]:
        """One env per seed (a JAX env reset from ``jax.random.key(seed)``, a host env from
        ``seed``): ``(states, host copy)``."""
        reset = self.driver.reset(seeds)
        return reset.states, reset.host

    def hold_out(self, ids: np.ndarray) -> None:
        """Every later reset skips the levels whose held-out id is in ``ids`` (``holdout_ids``,
        ``EnvDriver.hold_out``)."""
        self.driver.hold_out(ids)

    def level_ids(self, seeds: Sequence[int] | np.ndarray, *, held_out: bool = True) -> np.ndarray:
        """``[N] uint64``: the level id of each seed's reset (after any held-out redraws if
        ``held_out``; 0 where a host env's reset failed)."""
        return self.driver.reset(seeds, held_out=held_out).levels

    def holdout_ids(self, seeds: Sequence[int] | np.ndarray, *, held_out: bool = True) -> np.ndarray:
        """``[N] uint64``: the held-out id of each seed's reset (``envs.levels.holdout_hash``:
        the level's, or the room's for Sokoban), what ``hold_out`` takes; otherwise as
        ``level_ids``."""
        return self.driver.reset(seeds, held_out=held_out).holdout

    # -- the phases of a turn ------------------------------------------------------------------

    def _build_prompts(self, eps: list[Episode], host: Any, anchors: np.ndarray | None,
                       turn: int) -> _Prompts:
        """Opens turn ``turn`` of every live episode, tokenises its transcript chunk and builds
        its prompt (``rollout/window.py``); an episode whose prompt plus a full response would
        exceed ``max_model_len`` (after dropping turns, with ``overlong=truncate``) ends
        instead. ``anchors [B] uint64``: the rows' anchor ids (None: each row's rendered
        state text is its anchor, when the rollout records anchors)."""
        rows = [i for i, ep in enumerate(eps) if not ep.done]
        names, texts = {}, []
        for i in rows:
            names[i], text = self._open_turn(eps[i], row_state(host, i), turn,
                                             None if anchors is None else int(anchors[i]))
            texts.append(text)
        chunks = dict(zip(rows, self.chat.encode(texts), strict=True))
        prompts = self.window.prompts(eps, chunks, turn)
        for i in rows:
            if i not in prompts:
                ep = eps[i]
                ep.truncated = ep.length_truncated = True
                ep.messages.pop()  # the turn is not played: no user message, no turn record
                ep.turns.pop()
                ep.blocks.pop()
                del chunks[i]
        return _Prompts(turn, chunks, prompts, names)

    def _open_turn(self, ep: Episode, state: Any, turn: int,
                   anchor: int | None) -> tuple[tuple[str, ...], str]:
        """Records the turn's user message (after the system message on turn 1) and, when
        the rollout records anchors, its anchor id (``anchor``, or the id of the rendered state
        text when None), and returns ``(the state's action names, the chunk text to
        insert)``."""
        cfg, ctx = self.config, self.config.context
        names = tuple(self.env.action_names_for(state))
        state_text = self.env.render_text(state)
        user = user_message(ctx, turn=turn, state=state_text,
                            actions_left=cfg.max_actions_per_traj - ep.num_actions,
                            warning=ep.warning, prev_reward=ep.prev_reward)
        ep.blocks.append(user_message(ctx, turn=turn, state=state_text,
                                      actions_left=cfg.max_actions_per_traj - ep.num_actions,
                                      warning=ep.warning))
        if turn == 1:
            system = ep.system = system_message(self.env, names, ctx)
            ep.messages.append({"role": "system", "content": system})
            chunk = self.chat.first_chunk(system, user)
        else:
            chunk = self.chat.next_chunk(user, emitted_eot=ep.emitted_eot)
        ep.messages.append({"role": "user", "content": user})
        ep.turns.append({"turn": turn, "state": state_text, "prompt": chunk})
        if self.record_anchors:
            if anchor is None:
                from ragen_jax.envs.levels import text_level_id  # here: no env module at import

                anchor = int(text_level_id(state_text))
            ep.turns[-1]["anchor"] = anchor
        return names, chunk

    def _generate(self, policy: Policy, eps: list[Episode], prompts: _Prompts, host: Any,
                  sampling: SamplingParams, cache: Any, reuse_cache: bool,
                  keys: jax.Array) -> tuple[_Generated, Any]:
        """Asks ``policy`` for the answers of the prompted rows: ``(answers, the cache to
        continue next turn)``. When every prompt extends its row's previous sequence, only the
        new chunks are sent, continuing ``cache``; otherwise (a window that slid or was cut,
        a ``single_turn`` summary, or no cache reuse) the whole prompts, into a fresh cache."""
        n = len(eps)
        active = np.zeros(n, bool)
        active[list(prompts.chunks)] = True
        continued = reuse_cache and all(p.continues for p in prompts.prompts.values())
        if continued:
            ids = [prompts.chunks.get(i, []) for i in range(n)]
        else:
            ids = [prompts.prompts[i].ids if active[i] else [] for i in range(n)]
            cache = None
        for i in prompts.chunks:
            eps[i].turns[-1]["prefill_tokens"] = len(ids[i])
        out = policy(ids, key=keys, params=sampling, stop_tokens=self.chat.stop_ids,
                     stop_strings=self.stop_strings, active=active, cache=cache,
                     env_states=host)
        gen = _Generated(*(np.asarray(x) for x in jax.device_get(
            (out.tokens, out.lengths, out.logprobs, out.model_logprobs))))
        return gen, (out.cache if reuse_cache else None)

    def _record_answers(self, eps: list[Episode], prompts: _Prompts,
                        gen: _Generated) -> dict[int, ParsedTurn]:
        """Appends each prompted row's chunk and answer to its token sequence and its answer
        text to its chat; returns the parsed answers."""
        ctx = self.config.context
        parsed = {}
        for i, chunk in prompts.chunks.items():
            ep, k = eps[i], int(gen.lengths[i])
            answer = gen.tokens[i, :k]
            ep.pieces.append(Piece(np.asarray(chunk, np.int32), False, None, None, prompts.turn))
            ep.pieces.append(Piece(answer.astype(np.int32), True, gen.logprobs[i, :k],
                                   gen.model_logprobs[i, :k], prompts.turn))
            ep.length += len(chunk) + k
            window = prompts.prompts[i]
            ep.turn_prompts.append(np.asarray(window.ids, np.int32))
            ep.window_start = window.start
            ep.turns[-1].update(window_start=window.start, prompt_tokens=len(window.ids))
            out = self.chat.generated_text(answer)
            ep.emitted_eot = self.chat.emitted_eot(answer)
            ep.turns[-1]["stopped"] = out.stopped
            text = ctx.answer_prefix + out.text
            parsed[i] = parse_response(text, prompts.action_names[i], ctx,
                                       special_inside=out.special_inside)
            ep.messages.append({"role": "assistant", "content": text})
        return parsed

    def _step_envs(self, states: Any, eps: list[Episode], prompts: _Prompts,
                   parsed: dict[int, ParsedTurn], keys: jax.Array) -> tuple[Any, Any, StepOutcome]:
        """Runs each answer's valid actions (within the episode's action budget) in the
        envs: ``(new states, their host copy, the outcome)``."""
        cfg = self.config
        actions = {}
        for i, p in parsed.items():
            ids = p.action_ids[: cfg.max_actions_per_traj - eps[i].num_actions]
            names = prompts.action_names[i] or p.actions  # free text: the answer's parts
            actions[i] = TurnActions(ids, [names[a] for a in ids])
        return self.driver.step(states, actions, keys)

    def _record_outcomes(self, eps: list[Episode], prompts: _Prompts,
                         parsed: dict[int, ParsedTurn], outcome: StepOutcome) -> None:
        """Completes each played turn's record (answer, actions, reward, penalty) and ends
        the episodes the env, its failure or the action budget ended."""
        cfg = self.config
        for i, p in parsed.items():
            ep, executed = eps[i], int(outcome.executed[i])
            ep.num_actions += executed
            ep.num_effective += int(outcome.effective[i])
            ep.turns[-1].update(
                response=ep.messages[-1]["content"], think=p.think, answer=p.answer,
                actions=p.actions,
                executed=[(prompts.action_names[i] or p.actions)[a]
                          for a in p.action_ids[:executed]],
                reward=float(outcome.reward[i]),
                penalty=cfg.context.format_penalty if p.format_error else 0.0,
                format_error=p.reason, num_effective=int(outcome.effective[i]),
                last_effective=bool(outcome.last_effective[i]),
                num_tokens=len(ep.pieces[-1].ids))
            if i in outcome.errors:  # a host env failed: the episode ends, the run goes on
                ep.truncated, ep.env_error = True, outcome.errors[i]
                ep.turns[-1]["env_error"] = outcome.errors[i]
            elif outcome.terminated[i]:
                ep.terminated = True
                ep.success = bool(outcome.success[i])
            elif outcome.truncated[i] or ep.num_actions >= cfg.max_actions_per_traj:
                ep.truncated = True

    def _assemble(self, eps: list[Episode], seeds: np.ndarray, group_ids: np.ndarray,
                  group_size: int, host: Any) -> RolloutBatch:
        cfg = self.config
        final = [self.env.render_text(row_state(host, b)) for b in range(len(eps))]
        batch = assemble_batch(eps, seeds=seeds, group_ids=group_ids, group_size=group_size,
                               final_states=final, tag=self.tag, pad_id=self.chat.pad_id,
                               pad_multiple=cfg.sampler.prompt_pad_multiple, use_turn_scores=cfg.use_turn_scores,
                               penalties=not cfg.use_turn_scores or cfg.turn_scores_penalty)
        n_len = batch.metrics["rollout/length_truncated"]
        if n_len:
            log.warning("%d of %d episodes ended at max_model_len=%d", n_len, len(eps),
                        cfg.max_model_len)
        return batch


def collect(policy: Policy, env: Any, env_params: Any, tokenizer: Any,
            group_seeds: Sequence[int] | np.ndarray, key: jax.Array,
            config: RolloutConfig | None = None, **kw: Any) -> RolloutBatch:
    """A one-shot ``AgentRollout(env, env_params, tokenizer, config).collect(...)``.

    The jitted env functions are cached per env object and the chat pieces are cheap, so a
    fresh ``AgentRollout`` per call costs nothing measurable; keep one to skip even that.
    """
    return AgentRollout(env, env_params, tokenizer, config or RolloutConfig()).collect(policy, group_seeds, key, **kw)
