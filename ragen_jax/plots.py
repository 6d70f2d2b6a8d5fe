"""Curves of one training run: ``python -m ragen_jax.plots RUN_DIR [--out FILE.png]``.

Reads ``RUN_DIR/metrics.jsonl`` and draws success (train and validation), score, policy
entropy and response length against the step; writes ``RUN_DIR/curves.png`` by default
(``launch.py`` does this at the end of every run).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ragen_jax.metrics import read_jsonl


def series(metrics: dict[int, dict[str, float]], key: str) -> tuple[list[int], list[float]]:
    steps = [s for s in sorted(metrics) if key in metrics[s]]
    return steps, [metrics[s][key] for s in steps]


def find_tag(metrics: dict[int, dict[str, float]]) -> str:
    for m in metrics.values():
        for k in m:
            if k.startswith("val-env/") and k.endswith("/success"):
                return k.split("/")[1]
    raise ValueError("no val-env/<tag>/success in the metrics")


def plot_run(run_dir: str | Path, out: str | Path | None = None, title: str | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    tag = find_tag(metrics)
    fig, axes = plt.subplots(1, 4, figsize=(17, 3.6))
    panels = [
        ("success", [(f"train/{tag}/success", "train (T=1)"), (f"val-env/{tag}/success", "validation")]
         + [(k, k.split("/")[1] + " val") for k in sorted({k for m in metrics.values() for k in m})
            if k.startswith("val-env/") and k.endswith("/success") and k.split("/")[1] != tag]),
        ("score (return + penalties)", [(f"train/{tag}/score", "train"), (f"val-env/{tag}/score", "validation")]),
        ("policy entropy (nats/token)", [("actor/entropy", "actor")]),
        ("response tokens per turn", [(f"train/{tag}/response_length_per_turn", "train")]),
    ]
    for ax, (name, keys) in zip(axes, panels, strict=True):
        for key, label in keys:
            x, y = series(metrics, key)
            if x:
                ax.plot(x, y, marker="o" if key.startswith("val-env") else None, ms=3, label=label)
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if len(keys) > 1:
            ax.legend(fontsize=8)
    fig.suptitle(title or f"{run_dir.name}: {tag}")
    fig.tight_layout()
    out = Path(out) if out else run_dir / "curves.png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m ragen_jax.plots", description=__doc__.split("\n")[0])
    p.add_argument("run_dir")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    print(f"wrote {plot_run(args.run_dir, args.out)}")


if __name__ == "__main__":
    main()
