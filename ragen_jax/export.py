"""Export a training checkpoint as a Hugging Face folder: ``python -m ragen_jax.export``.

    python -m ragen_jax.export --checkpoint runs/sokoban-tiny --out exported/sokoban-tiny [--step N]

Reads the run's ``config.json`` and its orbax checkpoint (the last one, or ``--step``),
merges LoRA adapters into the base weights, and writes ``config.json``,
``model.safetensors`` and the tokenizer (with its chat template), which
``transformers.AutoModelForCausalLM`` / ``AutoTokenizer`` and vLLM load directly.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ml_collections import ConfigDict

from ragen_jax.models import save_pretrained
from ragen_jax.models.lora import merge_lora


def load_run_config(run_dir: str | Path) -> ConfigDict:
    """The resolved config a run saved, pointed at ``run_dir``."""
    run_dir = Path(run_dir)
    file = run_dir / "config.json"
    if not file.is_file():
        raise FileNotFoundError(f"--checkpoint: {run_dir} is not a run folder (no config.json)")
    config = ConfigDict(json.loads(file.read_text()))
    config.trainer.output_dir = str(run_dir)
    if isinstance(config.env.params.get("dim_room"), list):
        config.env.params.dim_room = tuple(config.env.params.dim_room)
    return config


def load_checkpoint(run_dir: str | Path, step: int | None = None) -> tuple[Any, Any, ConfigDict, int]:
    """``(actor, tokenizer, config, step)`` of a run's checkpoint (default: the last one)."""
    from ragen_jax.train import Trainer

    config = load_run_config(run_dir)
    config.model.lora_rank = int(config.model.lora_rank)
    trainer = Trainer(config)
    steps = trainer.store.all_steps()
    if not steps:
        raise FileNotFoundError(f"--checkpoint: no checkpoint under {trainer.store.path}")
    step = max(steps) if step is None else int(step)
    if step not in steps:
        raise FileNotFoundError(f"--checkpoint: no step {step} under {trainer.store.path} (have {steps})")
    state, _ = trainer.store.restore(step, trainer.state())
    trainer.load_state(state)
    trainer.store.close()
    return trainer.m.actor, trainer.m.tokenizer, config, step


def export(run_dir: str | Path, out: str | Path, step: int | None = None) -> Path:
    """Writes the Hugging Face folder; returns its path."""
    actor, tok, config, step = load_checkpoint(run_dir, step)
    if config.model.lora_rank:
        merge_lora(actor)
    out = Path(out)
    save_pretrained(actor, out)
    tok.save_pretrained(str(out))
    (out / "ragen_jax_export.json").write_text(json.dumps({"run": str(run_dir), "step": step}) + "\n")
    return out


def main(argv: Sequence[str] | None = None) -> Path:
    p = argparse.ArgumentParser(prog="python -m ragen_jax.export", description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", required=True, help="run folder (holds config.json, checkpoints/)")
    p.add_argument("--out", required=True, help="Hugging Face folder to write")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: last)")
    args = p.parse_args(argv)
    try:
        out = export(args.checkpoint, args.out, args.step)
    except (FileNotFoundError, ValueError) as e:
        raise SystemExit(f"ragen_jax.export: {e}") from None
    print(f"wrote {out}")
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
