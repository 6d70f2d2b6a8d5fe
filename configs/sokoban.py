"""Sokoban (RAGEN's ``SimpleSokoban``: 6x6, one box, 10 actions over at most 5 turns).

``python launch.py --config configs/sokoban.py[:preset]``. A random tiny model starts from a
solver-mixture prior (``base.solver_mixture_prior``; docs/models.md, "Starting policy").
"""

from configs import base


def get_config(preset: str = "tiny"):
    c = base.get_config(preset)
    c.env.name = "sokoban"
    c.env.params = dict(dim_room=(6, 6), num_boxes=1, max_steps=100)
    if preset == "tiny":
        base.solver_mixture_prior(c)
        # A random model cannot read RAGEN's ~260-token instructions: one line instead, which
        # the single-turn rows start with. The rows teach reading the board: the solver's moves
        # (share 1) on 4096 levels of their own (the mixture's groups repeat ~1000 levels).
        c.rollout.prompt.system_template = "Sokoban: push the box X onto the target O. Answer with {actions}."
        c.warmstart.turns.solver_share = 1.0
        c.warmstart.turns.episodes = 4096
        c.warmstart.turns.system_prompt = True
        # The board is the whole state (Sokoban is fully observable): each turn shows the
        # system line and the current board only (RAGEN's limited_multi_turn, k=1), the
        # prompts the rows above trained on, and trains one row per turn (128 episodes x at
        # most 5 a batch, in the mini-batches below). Whole transcripts, RAGEN's 4 x 32 rows:
        # --config.rollout.window.mode=full --config.rollout.window.turns=0
        # --config.algorithm.sample_unit=trajectory --config.actor.ppo_mini_batch_size=32
        c.rollout.window.mode = "limited"
        c.rollout.window.turns = 1
        c.algorithm.sample_unit = "turn"
        # RAGEN's batch: 8 levels x 16 episodes a step (the tiny presets' 8 x 8 otherwise):
        # more episodes a level steady the group baseline (docs/results.md, "Preset choices").
        c.rollout.group_size = 16
        # RAGEN's four optimizer steps a rollout: the batch's turn rows (at most 8 x 16 x 5)
        # in four mini-batches, which gained more than one at the same step cost.
        c.actor.ppo_mini_batch_size = c.rollout.env_groups * c.rollout.group_size * c.rollout.max_turn // 4
        # A turn row is ~65 tokens after the shared system line: cutting rows at a multiple of
        # 16 (width 80, not 128) is exact and makes the update ~40% cheaper.
        c.actor.row_pad_multiple = 16
        # Decayed to 0 at the end: a constant lr 3e-4 lets one large gradient collapse the
        # policy on long runs (past ~350 steps). 200 steps: about 16 minutes on 2 cores.
        c.actor.lr_schedule = "cosine"
        c.trainer.total_steps = 200
    return c
