"""Export a training checkpoint as a Hugging Face folder: ``python -m ragen_jax.export``.

    python -m ragen_jax.export --checkpoint runs/sokoban-tiny --out exported/sokoban-tiny [--step N]

Reads the run's ``config.json`` (``--config.<field>=value`` overrides apply to it, e.g. a
moved ``--config.model.path``) and the actor of its orbax checkpoint (the last one, or
``--step``) — no envs, samplers or optimizers are built — merges LoRA adapters into the
base weights, and writes ``config.json`` (with ``torch_dtype``), ``model.safetensors``,
``generation_config.json`` (the starting folder's, so its sampling defaults are kept, with
every end-of-sequence id the run stopped on) and the tokenizer with its chat template, which
``transformers.AutoModelForCausalLM`` / ``AutoTokenizer`` / ``GenerationConfig`` and vLLM
load directly. The starting folder is not needed: a run keeps a copy of its tokenizer and
configs (a LoRA run still reads the base weights from ``model.path``).

The weights are written in ``--dtype`` (float32 | bfloat16); by default in the dtype the
run's starting folder declares (bfloat16 for Qwen2.5), or the run's ``model.param_dtype``
for the tiny model — a run trains float32 master weights either way.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from ml_collections import ConfigDict

from ragen_jax.config.loading import load_config, load_run_config
from ragen_jax.config.schema import DTYPES
from ragen_jax.models import CheckpointError, hf_folder, save_pretrained
from ragen_jax.models.lora import merge_lora
from ragen_jax.models.weights import folder_dtype
from ragen_jax.policy import load_policy, stop_ids


def export(run_dir: str | Path, out: str | Path, step: int | None = None,
           config: ConfigDict | None = None, dtype: str | None = None) -> Path:
    """Writes the Hugging Face folder of the run's checkpoint (weights in ``dtype``, default
    as in the module docstring); returns its path."""
    actor, tok, run, step = load_policy(run_dir, step, config)
    if run.model.lora_rank:
        merge_lora(actor)
    if dtype is None:
        dtype = (folder_dtype(run.model.path) if run.model.path else None) or run.model.param_dtype
    if dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {tuple(DTYPES)}, got {dtype!r}")
    out = Path(out)
    save_pretrained(actor, out, dtype=DTYPES[dtype])
    tok.save_pretrained(str(out))
    eos = stop_ids(run.model) or (tok.eos_token_id,)
    hf_folder.write_generation_config(out, eos, source=run.model.path or None,
                                      bos=actor.config.bos_token_id, pad=tok.pad_token_id)
    (out / "ragen_jax_export.json").write_text(json.dumps({"run": str(run_dir), "step": step}) + "\n")
    return out


def main(argv: Sequence[str] | None = None) -> Path:
    p = argparse.ArgumentParser(prog="python -m ragen_jax.export", description=__doc__.split("\n")[0],
                                epilog="Other arguments: --config.<field>=value overrides of the run's config.")
    p.add_argument("--checkpoint", required=True, help="run folder (holds config.json, checkpoints/)")
    p.add_argument("--out", required=True, help="Hugging Face folder to write")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: last)")
    p.add_argument("--dtype", choices=tuple(DTYPES), default=None,
                   help="weights' dtype (default: the starting folder's, else model.param_dtype)")
    args, rest = p.parse_known_args(argv)
    try:
        config = load_config(rest, prog="ragen_jax.export", base=load_run_config(args.checkpoint))
        out = export(args.checkpoint, args.out, args.step, config, args.dtype)
    except (CheckpointError, FileNotFoundError, ValueError) as e:
        raise SystemExit(f"ragen_jax.export: {e}") from None
    print(f"wrote {out}")
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
