"""A GGUF file's tokenizer, built from its ``tokenizer.*`` metadata with the ``tokenizers`` library.

Built here from llama.cpp's definitions (its vocabulary types and pre-tokenizer names,
``src/llama-vocab.cpp``), not through transformers' GGUF tokenizer builders: those are
internal, moved module in transformers 5.23 and changed what they return between releases
(5.17's returned the special tokens as keyword arguments too, so that passing them again
raised "got multiple values for keyword argument 'unk_token'", and named the bos token as
the eos token). The folder is written in the hub's own layout (``tokenizer.json`` and a
``tokenizer_config.json`` naming ``PreTrainedTokenizerFast``), which every transformers
release reads alike, so a folder converted under one release loads under another.

The two vocabulary types of ``llama``, ``qwen2`` and ``qwen3`` files (``tokenizer.ggml.model``):

- ``gpt2``, byte-level BPE (SmolLM2, Llama 3, Qwen2/2.5/3): the vocabulary and merges of the
  file; the text split as the original ``tokenizer.json`` split it, chosen by the file's
  pre-tokenizer name (``tokenizer.ggml.pre``, ``PRE_TOKENIZERS``): GPT-2's regex (``gpt2``,
  ``default`` or none), single digits first (``smollm`` and the other names llama.cpp gives
  that rule), Llama 3's regex, or Qwen2's pipeline (NFC, its regex). Any other name is refused
  in one line rather than split some other way.
- ``llama``, SentencePiece BPE (Llama 2, TinyLlama, Mistral 7B v0.1): the vocabulary, byte
  fallback through the ``<0xNN>`` tokens, merges recovered from the scores (ranked by the score
  of the token a merge makes, as transformers' SentencePiece converter ranks them), spaces as
  ``▁``, and llama.cpp's space prefix (``tokenizer.ggml.add_space_prefix``, default on) before
  the text and after each special token, as the hub's ``tokenizer.json`` of those models does.

Tokens marked control (and unknown) are special tokens, user-defined ones plain added tokens,
both matched whole in the text; bos / eos are added as ``tokenizer.ggml.add_bos_token`` /
``add_eos_token`` say (bos by default for ``llama`` vocabularies, as llama.cpp and
transformers do). The bos, eos, unk and pad tokens are the ones the metadata's ids name, given
once, in ``tokenizer_config.json`` with the chat template.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
)

from ragen_jax.models.hf_folder import CheckpointError, describe_error
from ragen_jax.models.tokenizer import QWEN2_SPLIT

GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# tokenizer.ggml.pre -> (normalize to NFC, the regexes that split the text in turn); the names
# are llama.cpp's, grouped as its llama-vocab.cpp groups them. "" is a file without the key.
PRE_TOKENIZERS: dict[str, tuple[bool, tuple[str, ...]]] = {
    **dict.fromkeys(("", "default", "gpt2"), (False, (GPT2_SPLIT,))),
    **dict.fromkeys(("smollm", "starcoder", "refact", "codeshell", "command-r", "exaone",
                     "minerva"), (False, (r"\p{N}", GPT2_SPLIT))),
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "dbrx", "smaug-bpe"),
                    (False, (LLAMA3_SPLIT,))),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "stablelm2"), (True, (QWEN2_SPLIT,))),
}

_SPECIAL_IDS = {"bos_token": "bos", "eos_token": "eos", "unk_token": "unknown",
                "pad_token": "padding"}


def build(path: Path, meta: dict[str, Any]) -> tuple[Tokenizer, dict[str, Any]]:
    """The file's tokenizer as a ``tokenizers.Tokenizer`` and the ``tokenizer_config.json``
    dict that goes with it (special tokens, chat template); anything this cannot build is a
    one-line ``CheckpointError``. ``meta``: the file's metadata (``gguf._metadata``)."""
    tokens = meta.get("tokenizer.ggml.tokens")
    if not tokens:
        raise CheckpointError(f"{path}: no tokenizer in the metadata (tokenizer.ggml.tokens)")
    kind = meta.get("tokenizer.ggml.model")
    types = meta.get("tokenizer.ggml.token_type") or [int(gguf.TokenType.NORMAL)] * len(tokens)
    if len(types) != len(tokens):
        raise CheckpointError(f"{path}: {len(tokens)} tokens but {len(types)} token types")
    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast",
                              "clean_up_tokenization_spaces": False}
    for name, key in _SPECIAL_IDS.items():
        token_id = meta.get(f"tokenizer.ggml.{key}_token_id")
        if token_id is not None and not 0 <= token_id < len(tokens):
            raise CheckpointError(f"{path}: tokenizer.ggml.{key}_token_id {token_id} is past "
                                  f"the {len(tokens)} tokens")
        config[name] = None if token_id is None else tokens[token_id]
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", kind == "llama"))
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    for flag, name in ((add_bos, "bos_token"), (add_eos, "eos_token")):
        if flag and config[name] is None:
            raise CheckpointError(f"{path}: the metadata adds a {name} but names none")
    try:
        if kind == "gpt2":
            tok = _byte_level(path, meta, tokens)
        elif kind == "llama":
            tok = _sentencepiece(meta, tokens, types, config["unk_token"])
        else:
            raise CheckpointError(f"{path}: tokenizer model {kind!r} is not supported "
                                  "(supported: gpt2, llama)")
        _add_tokens(tok, tokens, types)
        if add_bos or add_eos:
            tok.post_processor = _post_processor(tok, config, add_bos, add_eos)
    except CheckpointError:
        raise
    except Exception as e:  # tokenizers rejects a vocabulary or merges it cannot use
        raise CheckpointError(f"{path}: cannot build its tokenizer ({describe_error(e)})") from None
    if "tokenizer.chat_template" in meta:
        config["chat_template"] = meta["tokenizer.chat_template"]
    return tok, config


def save(folder: Path, tok: Tokenizer, config: dict[str, Any]) -> None:
    """Writes ``tokenizer.json`` and ``tokenizer_config.json`` into ``folder``."""
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False)
                                                  + "\n")


def _byte_level(path: Path, meta: dict[str, Any], tokens: list[str]) -> Tokenizer:
    pre = meta.get("tokenizer.ggml.pre") or ""
    if pre not in PRE_TOKENIZERS:
        known = ", ".join(sorted(p for p in PRE_TOKENIZERS if p))
        raise CheckpointError(f"{path}: pre-tokenizer {pre!r} (tokenizer.ggml.pre) is not "
                              f"supported (supported: {known})")
    nfc, splits = PRE_TOKENIZERS[pre]
    merges = [tuple(m.split(" ")) for m in meta.get("tokenizer.ggml.merges") or ()]
    if any(len(m) != 2 for m in merges):
        raise CheckpointError(f"{path}: a merge in tokenizer.ggml.merges is not two tokens")
    tok = Tokenizer(models.BPE(vocab=_vocab(tokens), merges=merges, fuse_unk=False,
                               byte_fallback=False))
    if nfc:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(s), behavior="isolated") for s in splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)  # GPT-2's own: no ids added
    return tok


def _sentencepiece(meta: dict[str, Any], tokens: list[str], types: list[int],
                   unk: str | None) -> Tokenizer:
    scores = meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
    vocab = _vocab(tokens)
    # Merges from the pieces of every ordinary token, best score first (ties: by the ids of
    # the two halves); only ordinary tokens take part, so no merge ever makes a control token.
    ordinary = {int(gguf.TokenType.NORMAL), int(gguf.TokenType.USER_DEFINED)}
    pieces = {t for t, k in zip(tokens, types, strict=True) if k in ordinary}
    ranked = []
    for token, kind, score in zip(tokens, types, scores, strict=True):
        if kind not in ordinary:
            continue
        for i in range(1, len(token)):
            left, right = token[:i], token[i:]
            if left in pieces and right in pieces:
                ranked.append((-score, vocab[left], vocab[right], left, right))
    merges = [(left, right) for *_, left, right in sorted(ranked)]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True,
                               byte_fallback=True))
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    tok.normalizer = normalizers.Sequence(
        ([normalizers.Prepend("▁")] if prefix else []) + [normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    return tok


def _vocab(tokens: list[str]) -> dict[str, int]:
    """token -> id; a token listed twice keeps its first id."""
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    return vocab


def _add_tokens(tok: Tokenizer, tokens: list[str], types: list[int]) -> None:
    """Control and unknown tokens as special tokens, user-defined ones as plain added tokens:
    both matched whole in the raw text (llama.cpp's ``parse_special``), at their own ids."""
    special = {int(gguf.TokenType.CONTROL), int(gguf.TokenType.UNKNOWN)}
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True)
                            for t, k in zip(tokens, types, strict=True) if k in special])
    tok.add_tokens([AddedToken(t, normalized=False, special=False)
                    for t, k in zip(tokens, types, strict=True)
                    if k == int(gguf.TokenType.USER_DEFINED)])


def _post_processor(tok: Tokenizer, config: dict[str, Any], add_bos: bool,
                    add_eos: bool) -> Any:
    """bos before and / or eos after each sequence, as the metadata asks."""
    bos, eos = config["bos_token"], config["eos_token"]

    def sequence(name: str, type_id: int) -> list[str]:
        return ([f"{bos}:{type_id}"] if add_bos else []) + [f"${name}:{type_id}"] + (
            [f"{eos}:{type_id}"] if add_eos else [])

    used = [t for t, on in ((bos, add_bos), (eos, add_eos)) if on]
    return processors.TemplateProcessing(
        single=sequence("A", 0), pair=sequence("A", 0) + sequence("B", 1),
        special_tokens=[(t, tok.token_to_id(t)) for t in dict.fromkeys(used)])
