"""Rows of a local data file (JSONL or parquet) for the host envs that read one.

``read_rows(path)`` returns the file's rows as dicts, read once per version of the file (the
cache key holds its modification time, so an edited file is read again). JSONL: one JSON
object per non-blank line. Parquet: through pyarrow (``pip install 'ragen_jax[parquet]'``).
A malformed file is a one-line ``ValueError`` naming the file and the line; an env checks its
own fields (``require``).
"""

from __future__ import annotations

import functools
import json
import os
import random
from pathlib import Path
from typing import Any


def _parquet_rows(path: str) -> list[Any]:
    """The rows of a parquet file (``pyarrow``: ``pip install 'ragen_jax[parquet]'``)."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError(f"reading {path} needs pyarrow: pip install 'ragen_jax[parquet]' "
                          f"(or give a JSONL file)") from None
    try:
        return pq.read_table(path).to_pylist()
    except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid is a ValueError
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"{path}: not a readable parquet file ({first})") from None


def _jsonl_rows(path: str) -> list[Any]:
    rows = []
    for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path} line {n}: not JSON ({e})") from None
    return rows


@functools.lru_cache(maxsize=16)
def _read(path: str, mtime: float) -> tuple[Any, ...]:
    del mtime  # part of the cache key only
    rows = _parquet_rows(path) if Path(path).suffix.lower() == ".parquet" else _jsonl_rows(path)
    if not rows:
        raise ValueError(f"{path} holds no row")
    return tuple(rows)


def read_rows(path: str | os.PathLike) -> tuple[Any, ...]:
    """The rows of a JSONL or parquet file (each a dict when the file is well formed; callers
    check with ``require``). Raises ``ValueError`` for an empty or malformed file."""
    path = os.fspath(path)
    return _read(path, os.path.getmtime(path))


def require(row: Any, fields: tuple[str, ...], where: str) -> dict[str, Any]:
    """``row`` as a dict holding every one of ``fields`` (not None); else a one-line
    ``ValueError`` naming ``where`` (file and row) and the missing field."""
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected an object with {', '.join(map(repr, fields))}, "
                         f"got {type(row).__name__}")
    for field in fields:
        if row.get(field) is None:
            raise ValueError(f"{where}: no '{field}' (need {', '.join(map(repr, fields))})")
    return row


def row_for_seed(seed: int, rows: int) -> int:
    """The row RAGEN's data envs pick for ``seed`` (its ``all_seed(seed)`` then
    ``random.randint(0, rows - 1)``), so a file in the same row order plays the same rows."""
    return random.Random(seed).randint(0, rows - 1)
