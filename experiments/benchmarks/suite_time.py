"""Times README's test command in this checkout, alone or beside a CPU-bound job, as a user's
busy laptop would run it.

    python -m experiments.benchmarks.suite_time                 # the machine as it is
    python -m experiments.benchmarks.suite_time --busy 2        # beside two busy processes

``--busy N`` starts N processes that spin in a loop (a CPU-bound job of N processes) before
the suite and stops them after it. Prints the wall time, the CPU seconds the suite's
processes spent (its own and its reaped children's), pytest's summary line and its slowest
tests; ``--out FILE`` also writes them as Markdown, and pytest's whole output beside it
(``FILE`` with ``.log`` for its suffix). Run it in a fresh clone whose venv CI's
way made (``bash .ci/run`` does the install, then times nothing), so the numbers are a
user's first run: JAX's compilation cache starts empty.
"""

from __future__ import annotations

import argparse
import re
import resource
import subprocess
import sys
import time
from pathlib import Path

import psutil

from experiments.common import ROOT

SPIN = "while True:\n    pass"


def readme_test_command() -> list[str]:
    """The test command README.md shows (the part after the last ``&&`` of its test line)."""
    text = (ROOT / "README.md").read_text()
    line = next(row for row in text.splitlines() if "python -m pytest" in row and "pip install" in row)
    pytest = line.split("&&")[-1].strip().split()
    return [sys.executable, *pytest[1:]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--busy", type=int, default=0, help="CPU-bound processes beside the suite")
    ap.add_argument("--out", type=Path, help="also write the figures to this Markdown file")
    args = ap.parse_args()
    command = readme_test_command()
    spinners = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(args.busy)]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.monotonic()
    spun = 0.0
    try:
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    finally:
        for p in spinners:
            spun += sum(psutil.Process(p.pid).cpu_times()[:2])
            p.kill()
            p.wait()
    wall = time.monotonic() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    # The spinners are reaped children too: their own CPU time is taken out.
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime) - spun
    lines = done.stdout.splitlines()
    summary = next((row for row in reversed(lines) if re.search(r"\d+ (passed|failed)", row)), "no summary")
    slowest = [row for row in lines if re.match(r"^\d+\.\d+s (call|setup|teardown) ", row)][:15]
    failed = [row for row in lines if row.startswith(("FAILED", "ERROR"))]
    report = [f"`{' '.join(command[1:])}` beside {args.busy} busy process(es): exit {done.returncode}, "
              f"**{wall / 60:.1f} min** wall ({wall:.0f} s), {cpu:.0f} CPU-s (the busy ones' "
              f"{spun:.0f} CPU-s apart)",
              "", summary.strip("= "), "", *[f"- {row}" for row in failed],
              "", "Slowest:", "", *[f"- {row}" for row in slowest]]
    print("\n".join(report))
    if args.out:
        args.out.write_text("\n".join(report) + "\n")
        args.out.with_suffix(".log").write_text(done.stdout + done.stderr)  # the failures' text
    sys.exit(done.returncode)


if __name__ == "__main__":
    main()
