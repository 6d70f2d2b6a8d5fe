"""Runs one benchmark command in a git worktree of an earlier commit and in this checkout,
one after the other on the same machine, and writes both outputs side by side, so a
before/after speed claim is a ratio from one run.

    python -m experiments.benchmarks.compare_commits --before b4fe845 --out NAME.md -- \\
        $PWD/experiments/benchmarks/bench_sampler.py --skip-hf --sizes tiny --batches 1,8,32 --out /dev/null

The command is a Python script and its arguments (or ``-m MODULE ...``), run from each tree's
root with that tree first on ``PYTHONPATH`` and this checkout after it: a path relative to the
root runs each tree's own copy of the script; this checkout's absolute path runs the same
script against both trees' ``ragen_jax`` (its ``experiments`` helpers come from this checkout
where the earlier tree has none). Its stdout (the bench's printed table) is kept; ``--out``
names a file in ``experiments/results/``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from experiments.common import RESULTS, ROOT


def run_in(tree: Path, command: list[str]) -> str:
    """``python COMMAND`` from ``tree``'s root, ``tree`` first on the path; its stdout."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(dict.fromkeys([str(tree), str(ROOT)]))}
    proc = subprocess.run([sys.executable, *command], cwd=tree, env=env, capture_output=True,
                          text=True)
    tail = "" if proc.returncode == 0 else f"\n(exit {proc.returncode}: {proc.stderr[-800:]})"
    return proc.stdout + tail


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=True, help="git ref of the baseline")
    ap.add_argument("--out", required=True, help="file name under experiments/results/")
    ap.add_argument("command", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    tree = Path(tempfile.mkdtemp(prefix="compare_commits_")) / "tree"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), args.before],
                   check=True, capture_output=True)
    try:
        before = run_in(tree, command)
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)],
                       capture_output=True)
    now = run_in(ROOT, command)
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True).stdout.strip()
    text = (f"# {' '.join(command)}\n\n## before: {args.before}\n\n```\n{before.strip()}\n```\n\n"
            f"## now: working tree on {head}\n\n```\n{now.strip()}\n```\n")
    out = RESULTS / args.out
    out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
