"""Bandit (RAGEN's two named arms, one pull). Validation also runs on the held-out test
names (tag ``BanditTest``): with a pretrained model that measures transfer of the names'
priors; a random-init tiny model can only learn the training names, so its test-name
success is expected near chance.

``python launch.py --config configs/bandit.py[:preset]``.
"""

from configs import base


def get_config(preset: str = "tiny"):
    c = base.get_config(preset)
    c.env.name = "bandit"
    c.env.params = dict(split="train")
    c.env.val_extra = dict(BanditTest=dict(split="test"))
    # The training split's few levels (its name pairs x two orders) are all validation levels,
    # so validation replays them; BanditTest holds the test names out by split.
    c.rollout.val.held_out = False
    c.rollout.max_turn = 1  # one pull per episode
    c.rollout.max_actions_per_traj = 1
    c.rollout.max_actions_per_turn = 1
    if preset == "tiny":
        c.trainer.test_freq = 5
    elif preset not in base.CPU_PRESETS:
        c.rollout.response_length = 500  # RAGEN's _1_bandit.yaml (the CPU presets cut answers shorter: base.cpu_preset)
    if preset == "qwen2.5-0.5b-cpu":
        bandit_cpu(c)
    return c


def bandit_cpu(c) -> None:
    """A Qwen2.5-0.5B-Instruct folder on a CPU (LoRA), set to what learned the Bandit on 2 cores
    (experiments/results/real_models.md, "the names learned"). With 16-32 episodes a step the
    sign of the push on "first vs second arm" is mostly which levels and payoffs were drawn
    (a 1-in-4 payoff), and Adam steps as far on noise as on signal: the policy drifts onto a
    display position. So RAGEN's 128 episodes a step (8 levels x 16) in one optimizer step, a
    batch baseline (REINFORCE++: a policy that answers by position still gets pushed per level
    toward the better name; a group's mean gives it nothing), and answer-only turns (RAGEN's
    no-think regime): ~5 answer tokens instead of ~45 make 128 episodes cost what 16 did, and
    put the advantage on the choice."""
    c.rollout.prompt.enable_think = False
    c.rollout.response_length = 32
    c.rollout.env_groups, c.rollout.group_size = 8, 16
    c.rollout.val.env_groups = 16
    c.algorithm.adv_estimator = "reinforce_plus_plus"
    c.actor.ppo_mini_batch_size = 128
    c.actor.row_pad_multiple = 16  # answer rows of ~5 tokens
    c.actor.lr = 2e-5
    c.actor.warmup_steps = 3
    c.actor.recompute_logprobs = False  # float32 sampler and update: its log-probs are the old policy's
    c.trainer.total_steps = 20
    c.trainer.test_freq = 10
    c.diagnostics.compute_freq = 10
