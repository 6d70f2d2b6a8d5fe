"""A Hugging Face model folder's files besides the weights: the tokenizer's, ``config.json``
and ``generation_config.json``; what a run reads from them, and the copy a run folder keeps.

A training run copies these files (``snapshot``) into ``<output_dir>/model/``, so that
export, evaluation and resume still find the tokenizer, the chat template, the architecture
and the end-of-sequence ids after the original folder is moved or deleted (the trained
weights are in the run's checkpoints; only a LoRA run still needs the base weights).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path


class CheckpointError(ValueError):
    """A model folder that cannot be loaded; the message is one line that says why."""


def describe_error(e: BaseException) -> str:
    """``"<type>: <first line of the message>"`` (at most 200 characters of it), for wrapping
    a library's exception into a one-line ``CheckpointError``."""
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0][:200] if lines else ''}"


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt",
                   "special_tokens_map.json", "added_tokens.json", "chat_template.jinja",
                   "chat_template.json", "tokenizer.model")
METADATA_FILES = ("config.json", "generation_config.json", *TOKENIZER_FILES)
SNAPSHOT_MARKER = "ragen_jax_snapshot.json"


def read_json(path: Path) -> dict:
    """The JSON object in ``path``; a file that cannot be read, is not UTF-8 (random bytes),
    is not JSON (or nests too deeply to parse) or not an object is a ``CheckpointError``
    naming the file."""
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:  # ValueError: UnicodeDecodeError and JSONDecodeError
        raise CheckpointError(f"{path} is not readable JSON ({describe_error(e)})") from None
    except RecursionError:  # arrays or objects nested deeper than Python's parser recurses
        raise CheckpointError(f"{path} is not readable JSON (nested too deeply to "
                              f"parse)") from None
    if not isinstance(d, dict):
        raise CheckpointError(f"{path} is not a JSON object")
    return d


def unreadable_file(path: str | os.PathLike) -> str | None:
    """One line naming the first of the folder's tokenizer and config files that cannot be
    read (a ``.json`` that is not a JSON object, a text file that is not UTF-8), else None:
    what a tokenizer that failed to load says instead of the library's error, which names
    no file."""
    for name in METADATA_FILES:
        f = Path(path) / name
        if not f.is_file() or name == "tokenizer.model":  # sentencepiece's model is binary
            continue
        try:
            if name.endswith(".json"):
                read_json(f)
            else:
                f.read_text(encoding="utf-8")
        except CheckpointError as e:
            return str(e)
        except (OSError, ValueError) as e:
            return f"{f} is not readable text ({describe_error(e)})"
    return None


def check_tokenizer_files(path: str | os.PathLike) -> None:
    """Raises ``CheckpointError`` unless ``path`` holds a loadable set of tokenizer files
    (``tokenizer.json``, or ``vocab.json`` with ``merges.txt``). Without this check
    transformers 5 builds a one-token tokenizer from an empty folder, silently."""
    path = Path(path)
    if (path / "tokenizer.json").is_file():
        return
    if (path / "vocab.json").is_file() and (path / "merges.txt").is_file():
        return
    raise CheckpointError(f"{path}: no tokenizer files (tokenizer.json, or vocab.json and "
                          "merges.txt); copy them from the model's Hugging Face repository")


def eos_ids(path: str | os.PathLike) -> tuple[int, ...]:
    """Every end-of-sequence id the folder declares, in order and without repeats:
    ``generation_config.json``'s ``eos_token_id`` (an int or a list; Qwen2.5-Instruct lists
    ``<|im_end|>`` and ``<|endoftext|>``), then ``config.json``'s. These are the ids vLLM and
    ``transformers.generate`` stop on."""
    path = Path(path)
    ids: list[int] = []
    for name in ("generation_config.json", "config.json"):
        f = path / name
        if not f.is_file():
            continue
        value = read_json(f).get("eos_token_id")
        for i in value if isinstance(value, list) else [value]:
            if isinstance(i, int) and i not in ids:
                ids.append(i)
    return tuple(ids)


def snapshot(src: str | os.PathLike, dst: str | os.PathLike) -> Path:
    """Copies ``src``'s ``METADATA_FILES`` (never weights) into ``dst`` and records where they
    came from; returns ``dst``. A snapshot already there is refreshed."""
    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    for name in METADATA_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, dst / name)
    (dst / SNAPSHOT_MARKER).write_text(json.dumps({"source": str(src.resolve())}) + "\n")
    return dst


def is_snapshot(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a run folder's copy of a model folder (no weights in it)."""
    return (Path(path) / SNAPSHOT_MARKER).is_file()


def write_generation_config(path: str | os.PathLike, eos: tuple[int, ...], *,
                            source: str | os.PathLike | None = None,
                            bos: int | None = None, pad: int | None = None) -> None:
    """Writes ``generation_config.json`` into an exported folder: the source folder's own
    (its sampling defaults kept) with ``eos_token_id`` set to ``eos``, else a minimal one."""
    d = {}
    if source is not None and (Path(source) / "generation_config.json").is_file():
        d = read_json(Path(source) / "generation_config.json")
    d["eos_token_id"] = list(eos) if len(eos) != 1 else eos[0]
    if bos is not None:
        d.setdefault("bos_token_id", bos)
    if pad is not None:
        d.setdefault("pad_token_id", pad)
    (Path(path) / "generation_config.json").write_text(json.dumps(d, indent=2) + "\n")
