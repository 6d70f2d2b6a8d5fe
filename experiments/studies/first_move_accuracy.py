"""Does a policy read the board? Its first moves against the BFS solver's, on validation levels.

    python -m experiments.studies.first_move_accuracy RUN/trajectories/val_step00000.jsonl [MORE.jsonl ...]

For every validation episode of a saved trajectories file (``trainer.save_trajectories``; the
env and its parameters come from the run's ``config.json`` beside the ``trajectories`` folder):
the level is reset from the episode's seed as the rollout resets it, the *optimal first moves*
are every action after which the env's BFS solver (``ragen_jax/envs/solvers.py``) needs one
move less to finish, and the first move the env executed for the policy's first answer (the
rollout's parser with the run's settings) is checked against them. Printed beside the policy's rate, on the same levels:

- *random legal*: the expected rate of a uniformly random move among those that change the
  state (``LegalActions``: the solver-mixture data's non-solver moves);
- *mixture data (share s)*: ``s + (1 - s) * random legal``, what the solver-mixture data the
  prior is supervised on score (``warmstart.solver_share``).

A policy that reads the board scores above *random legal*; one that has learnt the answer
format and which moves are common, but not where the player, box and target are, scores at
or below it. Levels the solver cannot finish are skipped. The episode's first answer was
sampled at the validation temperature (0.5 by default), not greedily.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ragen_jax.board_reading import first_move_accuracy


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("jsonl", nargs="+", type=Path)
    p.add_argument("--share", type=float, help="mixture share to compare with (default: the run's)")
    args = p.parse_args()
    print("| trajectories | levels | policy: optimal first move | random legal move | mixture data (share) |")
    print("|---|---:|---:|---:|---:|")
    for f in args.jsonl:
        r = first_move_accuracy(f, args.share)
        print(f"| {f} | {r['levels']} | {r['policy']:.3f} | {r['random_legal']:.3f} "
              f"| {r['mixture_data']:.3f} ({r['share']:g}) |")


if __name__ == "__main__":
    main()
