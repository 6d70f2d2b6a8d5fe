"""Run plots from synthetic ``metrics.jsonl`` files: the curves (with and without collapse
metrics) and RAGEN V2's four-regime scatter, through the functions and the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from ragen_jax.plots import main, plot_regimes, plot_run


def _write_run(run_dir: Path, collapse: bool) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    with open(run_dir / "metrics.jsonl", "w") as f:
        for step in range(0, 21):
            m = {"step": step, "train/Bandit/success": float(rng.uniform()), "actor/entropy": 1.0 - step / 40}
            if step % 5 == 0:
                m["val-env/Bandit/success"] = step / 20
            if collapse and step % 5 == 1:
                for kind in ("first_turn_sample", "trajectory_sample"):
                    p = f"collapse_{kind}/"
                    m |= {p + "mi_estimate": 0.5 - step / 50, p + "conditional_entropy_est": 3.0 - step / 10,
                          p + "retrieval_accuracy": 0.6 - step / 50, p + "retrieval_chance_level": 0.125}
            f.write(json.dumps(m) + "\n")
    return run_dir


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def test_curves_gain_collapse_panels_when_the_run_logged_them(tmp_path):
    plain = plot_run(_write_run(tmp_path / "plain", collapse=False))
    with_collapse = plot_run(_write_run(tmp_path / "collapse", collapse=True))
    assert plain.name == "curves.png" and with_collapse.is_file()
    assert _png_size(with_collapse)[0] > _png_size(plain)[0] * 1.3  # 6 panels instead of 4


def test_regime_scatter_writes_a_png(tmp_path, capsys):
    run = _write_run(tmp_path / "run", collapse=True)
    out = plot_regimes(run)
    assert out == run / "collapse_regimes.png" and _png_size(out)[0] > 300
    main([str(run), "--regimes", "--pairs", "trajectory_sample", "--out", str(tmp_path / "t.png")])
    assert (tmp_path / "t.png").is_file() and "t.png" in capsys.readouterr().out
    plot_regimes(run, tmp_path / "fixed.png", thresholds=(2.0, 0.3))
    assert (tmp_path / "fixed.png").is_file()
    with pytest.raises(ValueError, match="collapse_first_turn_sample/conditional_entropy_est"):
        plot_regimes(_write_run(tmp_path / "none", collapse=False))
