"""Curves of one training run: ``python -m ragen_jax.plots RUN_DIR [--out FILE.png]``.

Reads ``RUN_DIR/metrics.jsonl`` and draws success (train and validation), score, policy
entropy and response length against the step, plus, when the run logged RAGEN V2's collapse
diagnostics, two collapse panels (I(X;Z) and H(Z|X); retrieval acc@1 against chance); writes
``RUN_DIR/curves.png`` by default (``launch.py`` does this at the end of every run).

``python -m ragen_jax.plots RUN_DIR --regimes [--pairs trajectory_sample]`` draws RAGEN V2's
four-regime scatter instead: H(Z|X) (x) against I(X;Z) (y) at every diagnostics step, points
coloured by step, to ``RUN_DIR/collapse_regimes.png``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ragen_jax.metrics import read_jsonl

PAIR_KINDS = ("first_turn_sample", "trajectory_sample")  # collapse_<kind>/* metric prefixes
# RAGEN V2's regimes by (H(Z|X) high?, I(X;Z) high?): within-input diversity x input dependence
REGIMES = {(True, True): "diverse reasoning", (True, False): "template collapse",
           (False, True): "compressed reasoning", (False, False): "low-entropy collapse"}


def series(metrics: dict[int, dict[str, float]], key: str) -> tuple[list[int], list[float]]:
    steps = [s for s in sorted(metrics) if key in metrics[s]]
    return steps, [metrics[s][key] for s in steps]


def find_tag(metrics: dict[int, dict[str, float]]) -> str:
    for m in metrics.values():
        for k in m:
            if k.startswith("val-env/") and k.endswith("/success"):
                return k.split("/")[1]
    raise ValueError("no val-env/<tag>/success in the metrics")


def _collapse_panels(metrics: dict[int, dict[str, float]]) -> list[tuple[str, list[tuple[str, str]]]]:
    """The collapse panels for the pair kinds the run logged (none if it logged none)."""
    kinds = [k for k in PAIR_KINDS if series(metrics, f"collapse_{k}/mi_estimate")[0]]
    if not kinds:
        return []
    short = {"first_turn_sample": "first turn", "trajectory_sample": "trajectory"}
    info = [(f"collapse_{k}/{m}", f"{name} ({short[k]})") for k in kinds
            for m, name in (("mi_estimate", "I(X;Z)"), ("conditional_entropy_est", "H(Z|X)"))]
    retrieval = [(f"collapse_{k}/{m}", f"{name} ({short[k]})") for k in kinds
                 for m, name in (("retrieval_accuracy", "acc@1"), ("retrieval_chance_level", "chance"))]
    return [("collapse: I(X;Z), H(Z|X) (nats)", info), ("collapse: retrieval acc@1 vs chance", retrieval)]


def plot_run(run_dir: str | Path, out: str | Path | None = None, title: str | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    tag = find_tag(metrics)
    panels = [
        ("success", [(f"train/{tag}/success", "train (T=1)"), (f"val-env/{tag}/success", "validation")]
         + [(k, k.split("/")[1] + " val") for k in sorted({k for m in metrics.values() for k in m})
            if k.startswith("val-env/") and k.endswith("/success") and k.split("/")[1] != tag]),
        ("score (return + penalties)", [(f"train/{tag}/score", "train"), (f"val-env/{tag}/score", "validation")]),
        ("policy entropy (nats/token)", [("actor/entropy", "actor")]),
        ("response tokens per turn", [(f"train/{tag}/response_length_per_turn", "train")]),
    ] + _collapse_panels(metrics)
    fig, axes = plt.subplots(1, len(panels), figsize=(4.25 * len(panels), 3.6))
    for ax, (name, keys) in zip(axes, panels, strict=True):
        for key, label in keys:
            x, y = series(metrics, key)
            if x:
                dashed = "chance" in label
                ax.plot(x, y, marker="o" if key.startswith(("val-env", "collapse")) else None, ms=3,
                        ls="--" if dashed else "-", label=label)
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if len(keys) > 1 and ax.get_lines():
            ax.legend(fontsize=8)
    fig.suptitle(title or f"{run_dir.name}: {tag}")
    fig.tight_layout()
    out = Path(out) if out else run_dir / "curves.png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_regimes(run_dir: str | Path, out: str | Path | None = None, pairs: str = "first_turn_sample",
                 thresholds: tuple[float, float] | None = None, title: str | None = None) -> Path:
    """RAGEN V2's four-regime scatter of one run: H(Z|X) (x) vs I(X;Z) (y), one point per
    diagnostics step coloured by step, joined in order. ``thresholds = (h, mi)`` split the
    plane into the regimes (default: the run's medians, so the quadrants are relative to this
    run). ``pairs``: ``first_turn_sample`` or ``trajectory_sample``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    if pairs not in PAIR_KINDS:
        raise ValueError(f"pairs must be one of {PAIR_KINDS}, got {pairs!r}")
    run_dir = Path(run_dir)
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    h_key, mi_key = f"collapse_{pairs}/conditional_entropy_est", f"collapse_{pairs}/mi_estimate"
    steps = [s for s in sorted(metrics) if h_key in metrics[s] and mi_key in metrics[s]]
    if not steps:
        raise ValueError(f"no {h_key} and {mi_key} in {run_dir / 'metrics.jsonl'}")
    h = np.array([metrics[s][h_key] for s in steps])
    mi = np.array([metrics[s][mi_key] for s in steps])
    h_cut, mi_cut = thresholds if thresholds is not None else (float(np.median(h)), float(np.median(mi)))

    fig, ax = plt.subplots(figsize=(6.4, 5.2))
    ax.plot(h, mi, color="0.75", lw=0.8, zorder=1)
    points = ax.scatter(h, mi, c=steps, cmap="viridis", s=28, zorder=2)
    fig.colorbar(points, ax=ax, label="step")
    ax.axvline(h_cut, color="0.5", ls="--", lw=0.8)
    ax.axhline(mi_cut, color="0.5", ls="--", lw=0.8)
    for (high_h, high_mi), name in REGIMES.items():  # label each quadrant in its corner
        ax.text(0.98 if high_h else 0.02, 0.97 if high_mi else 0.03, name, transform=ax.transAxes,
                ha="right" if high_h else "left", va="top" if high_mi else "bottom",
                fontsize=8, color="0.3")
    ax.set_xlabel("H(Z|X) estimate (nats): within-input diversity")
    ax.set_ylabel("I(X;Z) estimate (nats): input dependence")
    cut = "run medians" if thresholds is None else "given thresholds"
    ax.set_title(title or f"{run_dir.name}: {pairs} pairs (split at {cut})", fontsize=10)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    out = Path(out) if out else run_dir / "collapse_regimes.png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m ragen_jax.plots", description=__doc__.split("\n")[0])
    p.add_argument("run_dir")
    p.add_argument("--out", default=None)
    p.add_argument("--regimes", action="store_true",
                   help="draw the H(Z|X) vs I(X;Z) scatter (collapse_regimes.png) instead of the curves")
    p.add_argument("--pairs", default="first_turn_sample", choices=PAIR_KINDS,
                   help="which collapse pairs the scatter uses")
    args = p.parse_args(argv)
    if args.regimes:
        print(f"wrote {plot_regimes(args.run_dir, args.out, args.pairs)}")
    else:
        print(f"wrote {plot_run(args.run_dir, args.out)}")


if __name__ == "__main__":
    main()
