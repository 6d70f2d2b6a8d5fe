"""A stand-in trainer for ``test_code_sandbox``'s end-to-end test (run as ``python -m
tests.envs.escape_trainer OUT PID``): a DeepCoder run's trainer on the micro model (its envs in
their worker processes, the host-env pool training uses) plays two training steps' rollouts in
which every answer is a program that asks the kernel to SIGKILL, as a pipe's owner, either this
trainer's whole process group (even rows) or the unrelated process ``PID`` (odd rows). The
update is not run: it never sees the programs (the answers are scripted, training changes
nothing), and a step's update is tests/test_train.py's. It prints each step's rollout metrics
as JSON lines when it lives to the end."""

from __future__ import annotations

import json
import sys

ESCAPE = """import fcntl, os
r, w = os.pipe()
fcntl.fcntl(r, fcntl.F_SETOWN, {target})
fcntl.fcntl(r, 10, 9)  # F_SETSIG: SIGKILL instead of SIGIO
fcntl.fcntl(r, fcntl.F_SETFL, fcntl.fcntl(r, fcntl.F_GETFL) | os.O_ASYNC)
os.write(w, b'x')
print('signalled')"""


def main(out: str, unrelated_pid: int) -> None:
    # Imported here, not at the top: the env's worker processes start by importing this
    # module (multiprocessing's spawn re-imports the main module), and jax, flax and
    # transformers in each of them took ~40 s of a loaded 2-core machine.
    import ragen_jax.train as train
    from ragen_jax import distributed as dist
    from ragen_jax.config.loading import from_config_dict
    from ragen_jax.policy import load_tokenizer
    from ragen_jax.rollout import ScriptedPolicy
    from ragen_jax.rollout.mix import collect_train, tag_metrics
    from ragen_jax.rollout.scripted import answer_text
    from tests.test_train import micro_config

    class EscapingPolicy(ScriptedPolicy):
        """The sampler's stand-in: the escape program as every answer."""

        def update(self, model) -> None:
            del model

    config = micro_config(out, steps=2, env="deepcoder", extra=(
        "--config.rollout.response_length=384", "--config.rollout.max_model_len=1024",
        "--config.warmstart.steps=0", "--config.trainer.val_before_train=False",
        "--config.diagnostics.compute_freq=0"))
    run = from_config_dict(config)
    tok = load_tokenizer(run.model)
    targets = ["-os.getpgid(os.getppid())", str(unrelated_pid)]  # the trainer's group; a stranger
    policy = EscapingPolicy.from_texts(tok, lambda row, call: answer_text(
        [ESCAPE.format(target=targets[row % 2])], run.rollout.context))
    train.Sampler.for_rollout = staticmethod(lambda model, rollout, pad_id=0: policy)
    trainer = train.Trainer(run)
    for step in range(run.trainer.total_steps):  # as Trainer.train_step's rollout
        batch = collect_train(trainer.slots, trainer.sampler, trainer.plan.rollout, step,
                              trainer._key(0, step), share=dist.share)
        metrics = tag_metrics(batch.metrics, trainer.rollouts, "train/")
        print(json.dumps({"step": step + 1} | {k: float(v) for k, v in metrics.items()}),
              flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
