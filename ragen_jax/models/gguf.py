"""GGUF files (llama.cpp's format) as a model source: ``convert`` writes a Hugging Face folder.

Everything in ragen_jax reads Hugging Face folders (``config.json``, safetensors weights,
tokenizer files). A GGUF file holds the same model in another layout, often quantized, with
its config and tokenizer as metadata. Rather than teach every reader a second format, a GGUF
file is converted once into a folder, and ``model.path=FILE.gguf`` runs from that folder
(``cached_folder``, which the config's ``model.path`` check calls).

What the conversion does, and which library does it:

- reading and dequantizing: the ``gguf`` package (``GGUFReader``, ``gguf.quants.dequantize``),
  the reference Python implementation maintained in llama.cpp's repository; no dequantization
  kernel is written here. Quantized tensors come out float32 (rounding them to a narrower
  float would add a second error on top of the quantization's).
- tensor names: ``gguf.get_tensor_name_map``, the table llama.cpp's own converter uses in the
  other direction, asked for the GGUF name of each Hugging Face parameter.
- llama.cpp's converter permutes the rows of the query and key projections of the ``llama``
  architecture (its rotary kernel pairs dimension ``2i`` with ``2i+1``; Hugging Face's pairs
  ``i`` with ``i + head_dim/2``); that permutation is undone here, as transformers' GGUF loader
  does. ``qwen2`` and ``qwen3`` files are written without it.
- the config: built from the ``<arch>.*`` metadata keys for ``llama``, ``qwen2`` and ``qwen3``.
- the tokenizer and chat template: built from the ``tokenizer.*`` metadata with the
  ``tokenizers`` library (``gguf_tokenizer``, which says why not with transformers' GGUF
  tokenizer builders) and written in the hub's layout, which every transformers release loads.

Anything else (another architecture, a tensor type ``gguf`` cannot dequantize, a tensor with
no Hugging Face counterpart, a truncated file) is a one-line ``CheckpointError``.

Command line: ``python -m ragen_jax.models.gguf FILE.gguf OUT_DIR``.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from ragen_jax.models import gguf_tokenizer
from ragen_jax.models.hf_folder import CheckpointError, describe_error, write_generation_config

# GGUF ``general.architecture`` -> the Hugging Face class its folder declares.
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}

# llama.cpp writes norms as float32 whatever the file type; only these decide the folder's dtype.
_WIDTHS = {"F16": "float16", "BF16": "bfloat16"}
# Weights past this size are written in shards (the hub's own shards are 2-5 GB).
SHARD_BYTES = 2 << 30


def _open(path: Path) -> Any:
    """``gguf.GGUFReader`` of ``path``; a missing, truncated or foreign file is a CheckpointError."""
    if not path.is_file():
        raise CheckpointError(f"{path}: no such GGUF file")
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # the reader raises ValueError / IndexError on a damaged file
        raise CheckpointError(f"{path}: not a complete GGUF file ({describe_error(e)})") from None
    for t in reader.tensors:  # the reader maps a short tail without complaint in some layouts
        if t.data.nbytes != t.n_bytes:
            raise CheckpointError(f"{path}: truncated (tensor {t.name} has {t.data.nbytes} of "
                                  f"{t.n_bytes} bytes)")
    return reader


def _metadata(reader: Any) -> dict[str, Any]:
    """Every metadata key as a Python value (strings, numbers, lists). A float32 scalar comes
    back as its shortest decimal (1e-05, not 9.999999747378752e-06: the value the original
    config.json held before llama.cpp stored it as float32)."""
    meta = {}
    for k, f in reader.fields.items():
        if k.startswith("GGUF."):
            continue
        value = f.contents()
        if f.types == [gguf.GGUFValueType.FLOAT32]:
            value = float(str(np.float32(value)))
        meta[k] = value
    return meta


def _rope_scaling(path: Path, arch: str, meta: dict[str, Any], rope_freqs: np.ndarray | None,
                  theta: float, head_dim: int) -> dict[str, Any] | None:
    """The Hugging Face ``rope_scaling`` of the file, or None for plain rope.

    llama.cpp states linear and YaRN scaling as metadata, but writes Llama 3's ``llama3``
    scaling only as a ``rope_freqs`` tensor of per-frequency divisors. Those are matched
    against the ``llama3`` formula with llama.cpp's converter's defaults (low 1, high 4,
    original context 8192; every Llama 3.1/3.2 release uses them) and the largest divisor as
    the factor; a tensor that does not match is refused rather than approximated.
    """
    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    factor = meta.get(f"{arch}.rope.scaling.factor")
    if rope_freqs is not None:
        factor = float(str(rope_freqs.max()))  # its shortest decimal, as for the metadata's floats
        if factor == 1.0:  # divisors of one: plain rope
            return None
        expected = _llama3_rope_divisors(theta, head_dim, factor, 1.0, 4.0, 8192)
        if rope_freqs.shape != expected.shape or not np.allclose(rope_freqs, expected, rtol=1e-5):
            raise CheckpointError(f"{path}: its rope_freqs tensor is not llama3 rope scaling with "
                                  f"low_freq_factor 1, high_freq_factor 4 and original context "
                                  f"8192; not supported")
        return {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    if kind in ("none", None) or factor in (None, 1.0):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    if kind == "yarn":
        scaling = {"rope_type": "yarn", "factor": float(factor)}
        original = meta.get(f"{arch}.rope.scaling.original_context_length")
        if original is not None:
            scaling["original_max_position_embeddings"] = int(original)
        return scaling
    raise CheckpointError(f"{path}: rope scaling type {kind!r} is not supported "
                          "(supported: linear, yarn, llama3)")


def _llama3_rope_divisors(theta: float, head_dim: int, factor: float, low: float, high: float,
                          original: int) -> np.ndarray:
    """The ``rope_freqs`` llama.cpp's converter writes for ``llama3`` rope scaling (one divisor
    per rotary frequency; the same formula as transformers' ``_compute_llama3_parameters``)."""
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / freqs
    smooth = np.clip((original / wavelen - low) / (high - low), 0.0, 1.0)
    divisors = 1.0 / ((1 - smooth) / factor + smooth)
    return divisors.astype(np.float32)


def hf_config(path: Path, meta: dict[str, Any], shapes: dict[str, tuple[int, ...]], *,
              rope_freqs: np.ndarray | None = None, dtype: str = "float32") -> dict[str, Any]:
    """The ``config.json`` dict of the GGUF file's model, from its metadata and tensor shapes
    (``shapes``: GGUF tensor name -> numpy shape); ``dtype`` is the weights' dtype it states.
    Written the way hub folders write it (top-level ``rope_theta``, ``rope_scaling``), which
    every reader of real folders handles."""
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise CheckpointError(f"{path}: GGUF architecture {arch!r} is not supported "
                              f"(supported: {', '.join(ARCHITECTURES)})")

    def key(name: str, default: Any = KeyError) -> Any:
        value = meta.get(f"{arch}.{name}", default)
        if value is KeyError:
            raise CheckpointError(f"{path}: metadata key {arch}.{name} is missing")
        return value

    def count(name: str, default: Any = KeyError) -> int:
        """A size the metadata states, which must be a positive integer: a zero head count
        divided by zero, and the layer loops below run to whatever ``block_count`` says."""
        value = key(name, default)
        whole = (isinstance(value, int) and not isinstance(value, bool)
                 or isinstance(value, float) and value.is_integer())  # not nan, inf or 1.5
        if not whole or value < 1:
            raise CheckpointError(f"{path}: metadata {arch}.{name}={value!r} must be a "
                                  f"positive integer")
        return int(value)

    hidden, heads = count("embedding_length"), count("attention.head_count")
    blocks = count("block_count")
    # llama.cpp states head_dim as the key length when it differs from hidden / heads (Qwen3
    # always); older llama files state it only as the rotary width.
    head_dim = next((count(name) for name in ("attention.key_length", "rope.dimension_count")
                     if key(name, None)), hidden // heads)
    if head_dim < 1:
        raise CheckpointError(f"{path}: metadata {arch}.attention.head_count={heads} exceeds "
                              f"{arch}.embedding_length={hidden} (no head dimension left)")
    if int(key("attention.value_length", head_dim)) != head_dim:
        raise CheckpointError(f"{path}: attention value length differs from key length; "
                              "not supported")
    if "token_embd.weight" not in shapes:
        raise CheckpointError(f"{path}: no token_embd.weight tensor")
    theta = float(key("rope.freq_base", 10000.0))
    tokenizer_id = lambda name: meta.get(f"tokenizer.ggml.{name}_token_id")  # noqa: E731
    config: dict[str, Any] = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": shapes["token_embd.weight"][0],  # the embedding, not the token list, sizes the model
        "hidden_size": hidden,
        "intermediate_size": count("feed_forward_length"),
        "num_hidden_layers": blocks,
        "num_attention_heads": heads,
        "num_key_value_heads": count("attention.head_count_kv", heads),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": count("context_length"),
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon")),
        "rope_theta": theta,
        "rope_scaling": _rope_scaling(path, arch, meta, rope_freqs, theta, head_dim),
        # llama.cpp writes the output projection only when it is not the embedding matrix
        "tie_word_embeddings": "output.weight" not in shapes,
        "bos_token_id": tokenizer_id("bos"),
        "eos_token_id": tokenizer_id("eos"),
        "pad_token_id": tokenizer_id("padding"),
        "torch_dtype": dtype,
    }
    if arch in ("llama", "qwen3"):
        config["attention_bias"] = False
    if arch == "llama":
        config["mlp_bias"] = False
    if arch == "qwen2":
        config["use_sliding_window"] = False
        if head_dim == hidden // heads:  # Qwen2 folders on the hub have no head_dim key
            del config["head_dim"]
    return config


def _folder_dtype(tensors: list[Any]) -> str:
    """float16 / bfloat16 when every matrix of the file is stored in it (the file's float
    width), else float32 (quantized files, float32 files)."""
    types = {t.tensor_type.name for t in tensors if len(t.shape) >= 2}
    if len(types) == 1 and (only := types.pop()) in _WIDTHS:
        return _WIDTHS[only]
    return "float32"


def _hf_parameters(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every parameter of ``config``'s Hugging Face model with its shape, in load order."""
    hidden, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    arch = config["model_type"]
    params = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        params |= {p + "input_layernorm.weight": (hidden,),
                   p + "self_attn.q_proj.weight": (q, hidden),
                   p + "self_attn.k_proj.weight": (kv, hidden),
                   p + "self_attn.v_proj.weight": (kv, hidden),
                   p + "self_attn.o_proj.weight": (hidden, q),
                   p + "post_attention_layernorm.weight": (hidden,),
                   p + "mlp.gate_proj.weight": (inter, hidden),
                   p + "mlp.up_proj.weight": (inter, hidden),
                   p + "mlp.down_proj.weight": (hidden, inter)}
        if arch == "qwen2":
            params |= {p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                       p + "self_attn.v_proj.bias": (kv,)}
        if arch == "qwen3":
            params |= {p + "self_attn.q_norm.weight": (head_dim,),
                       p + "self_attn.k_norm.weight": (head_dim,)}
    params["model.norm.weight"] = (hidden,)
    if not config["tie_word_embeddings"]:
        params["lm_head.weight"] = (vocab, hidden)
    return params


def _gguf_names(arch: str, config: dict[str, Any], hf_names: list[str]) -> dict[str, str]:
    """GGUF tensor name -> Hugging Face parameter name, from ``gguf``'s tensor-name table."""
    arch_enum = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    table = gguf.get_tensor_name_map(arch_enum, config["num_hidden_layers"])
    names = {}
    for hf in hf_names:
        module, suffix = hf.rsplit(".", 1)
        name = table.get_name(module)
        if name is None:  # a gguf release whose table lacks a module of these architectures
            raise CheckpointError(f"the installed gguf package has no GGUF name for {hf}")
        names[f"{name}.{suffix}"] = hf
    return names


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's ``LlamaModel.permute`` (rows regrouped from rotary pairs
    ``(2i, 2i+1)`` back to halves ``(i, i + head_dim/2)``), per head; transformers' GGUF loader
    does the same (``LlamaTensorProcessor``)."""
    return (w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def _check_layers(path: Path, config: dict[str, Any], shapes: dict[str, tuple[int, ...]]) -> None:
    """Raises unless the file holds tensors (``blk.<i>.*``) for as many layers as its metadata
    declares. Checked before anything loops over the layers: a 437 KB file declaring
    ``block_count=1e9`` grew past 3 GB building the names of its parameters."""
    layers = {name.split(".")[1] for name in shapes if name.startswith("blk.")}
    declared = config["num_hidden_layers"]
    if declared > len(layers):
        raise CheckpointError(f"{path}: metadata {config['model_type']}.block_count={declared} "
                              f"but the file holds the tensors of {len(layers)} layers")


def _check_types(path: Path, tensors: list[Any]) -> None:
    """Raises for the first tensor type ``gguf.quants.dequantize`` cannot read, before any
    tensor is converted (probing one zero block of each type the file uses)."""
    for qtype in dict.fromkeys(t.tensor_type for t in tensors):
        block = np.zeros((1, gguf.GGML_QUANT_SIZES[qtype][1]), np.uint8)
        try:
            gguf.quants.dequantize(block, qtype)
        except NotImplementedError:
            name = next(t.name for t in tensors if t.tensor_type == qtype)
            raise CheckpointError(f"{path}: tensor {name} has type {qtype.name}, which the gguf "
                                  "package cannot dequantize; not supported") from None


def _plan(path: Path, reader: Any, config: dict[str, Any]) -> list[tuple[Any, str]]:
    """Each GGUF tensor with the Hugging Face parameter it becomes, checked before anything is
    dequantized or written: every tensor has a place, every parameter a tensor, and each shape
    is the one the config implies (a ggml shape is the numpy shape reversed)."""
    shapes = _hf_parameters(config)
    names = _gguf_names(config["model_type"], config, list(shapes))
    plan = []
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":  # read into config.rope_scaling, not a parameter
            continue
        hf = names.get(t.name)
        if hf is None:
            raise CheckpointError(f"{path}: tensor {t.name} has no counterpart in "
                                  f"{config['architectures'][0]}; not supported")
        shape = tuple(int(d) for d in reversed(t.shape))
        if shape != shapes[hf]:
            raise CheckpointError(f"{path}: tensor {t.name} has shape {shape} but the "
                                  f"metadata implies {shapes[hf]} for {hf}")
        plan.append((t, hf))
    planned = {hf for _, hf in plan}
    missing = [n for n in shapes if n not in planned]
    if missing:
        gguf_name = next(g for g, h in names.items() if h == missing[0])
        raise CheckpointError(f"{path}: no tensor {gguf_name} (for {missing[0]}); "
                              f"{len(missing)} missing")
    return plan


def _dequantized(plan: list[tuple[Any, str]], config: dict[str, Any]
                 ) -> Iterator[tuple[str, np.ndarray]]:
    """The Hugging Face parameters one at a time (so that only one shard is ever in memory):
    dequantized, (llama) unpermuted, in the folder's dtype."""
    dtype = {"float32": np.float32, "float16": np.float16}.get(config["torch_dtype"])
    if dtype is None:  # bfloat16: numpy's own types lack it; ml_dtypes (a jax dependency) has it
        import ml_dtypes
        dtype = ml_dtypes.bfloat16
    for t, hf in plan:
        w = gguf.quants.dequantize(t.data, t.tensor_type)
        if config["model_type"] == "llama" and hf.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config["num_attention_heads" if "q_proj" in hf else "num_key_value_heads"]
            w = _unpermute(w, heads)
        yield hf, np.ascontiguousarray(w, dtype=dtype)


def _save_weights(tensors: Iterator[tuple[str, np.ndarray]], out: Path) -> None:
    """Writes ``model.safetensors``, or, past ``SHARD_BYTES``, the sharded layout of the hub
    (``model-0000i-of-0000N.safetensors`` and ``model.safetensors.index.json``): safetensors
    serializes a whole file in memory, so shards bound the memory a 7B file needs."""
    import safetensors.numpy

    files: list[Path] = []
    weight_map: dict[str, int] = {}
    shard: dict[str, np.ndarray] = {}
    size = total = 0

    def flush() -> None:
        files.append(out / f"shard-{len(files)}.safetensors")
        safetensors.numpy.save_file(shard, str(files[-1]), metadata={"format": "pt"})
        shard.clear()

    for name, array in tensors:
        if shard and size + array.nbytes > SHARD_BYTES:
            flush()
            size = 0
        shard[name], weight_map[name] = array, len(files)
        size += array.nbytes
        total += array.nbytes
    flush()
    if len(files) == 1:
        files[0].rename(out / "model.safetensors")
        return
    final = [out / f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))]
    for f, name in zip(files, final, strict=True):
        f.rename(name)
    index = {"metadata": {"total_size": total},
             "weight_map": {k: final[i].name for k, i in weight_map.items()}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def eos_ids(meta: dict[str, Any]) -> tuple[int, ...]:
    """The end-of-generation ids the metadata names: eos, then end-of-turn and end-of-message
    (llama.cpp stops on each), without repeats."""
    ids = (meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom"))
    return tuple(dict.fromkeys(int(i) for i in ids if i is not None))


def convert(gguf_path: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """Writes the Hugging Face folder of a GGUF file into ``out_dir`` and returns it:
    ``config.json``, ``model.safetensors`` (float32, or float16 / bfloat16 when every matrix
    of the file is stored so; sharded past ``SHARD_BYTES``), the tokenizer files with the chat
    template, and ``generation_config.json`` with the metadata's eos ids. Everything that can
    be refused is checked before the folder is made."""
    path, out = Path(gguf_path), Path(out_dir)
    reader = _open(path)
    meta = _metadata(reader)
    shapes = {t.name: tuple(int(d) for d in reversed(t.shape)) for t in reader.tensors}
    rope = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    rope_freqs = None if rope is None else gguf.quants.dequantize(rope.data, rope.tensor_type)
    config = hf_config(path, meta, shapes, rope_freqs=rope_freqs,
                       dtype=_folder_dtype(reader.tensors))
    _check_layers(path, config, shapes)
    _check_types(path, reader.tensors)
    tok = gguf_tokenizer.build(path, meta)  # before the weights: fails in a second, not a minute
    plan = _plan(path, reader, config)
    out.mkdir(parents=True, exist_ok=True)
    _save_weights(_dequantized(plan, config), out)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    gguf_tokenizer.save(out, *tok)
    write_generation_config(out, eos_ids(meta), bos=config["bos_token_id"],
                            pad=config["pad_token_id"])
    return out


# ----------------------------------------------------------------------------------------------
# model.path=FILE.gguf: one conversion per file, kept in a cache
# ----------------------------------------------------------------------------------------------

_RESOLVED: dict[tuple[str, int, int], Path] = {}  # this process's answers, so it says so once


def cache_root() -> Path:
    """Where converted folders are kept: ``$RAGEN_JAX_CACHE/gguf`` (the cache root
    ``warmstart.cache_dir`` uses too), default ``~/.cache/ragen_jax/gguf``."""
    return Path(os.environ.get("RAGEN_JAX_CACHE") or Path.home() / ".cache" / "ragen_jax") / "gguf"


def cached_folder(gguf_path: str | os.PathLike) -> Path:
    """The Hugging Face folder of a GGUF file: converted on first use into ``cache_root()``,
    under a name made of the file's name, size and modification time (so a changed file is
    converted again), then reused. Prints one line saying which folder the run uses.

    The conversion is written to a temporary folder and renamed into place, so a run killed
    mid-way, or several processes of one job converting at once, never leave a partial folder
    that a later run would take for a finished one."""
    path = Path(gguf_path).expanduser()
    try:
        st = path.stat()
    except OSError:
        raise CheckpointError(f"{path}: no such GGUF file") from None
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if key in _RESOLVED:
        return _RESOLVED[key]
    folder = cache_root() / f"{path.stem}-{st.st_size}-{st.st_mtime_ns}"
    if folder.is_dir():  # only a finished conversion is renamed into place
        print(f"model.path {path}: using its converted Hugging Face folder {folder}",
              file=sys.stderr, flush=True)
    else:
        t0 = time.perf_counter()
        tmp = folder.with_name(f"{folder.name}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            convert(path, tmp)
            try:
                tmp.rename(folder)
            except OSError:  # another process finished first; its folder is the same
                shutil.rmtree(tmp, ignore_errors=True)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        print(f"model.path {path}: converted to the Hugging Face folder {folder} in "
              f"{time.perf_counter() - t0:.1f} s (reused while the file is unchanged)",
              file=sys.stderr, flush=True)
    _RESOLVED[key] = folder
    return folder


def main(argv: list[str]) -> None:
    """``python -m ragen_jax.models.gguf FILE.gguf OUT_DIR``."""
    if len(argv) != 2 or argv[0] in ("-h", "--help"):
        raise SystemExit("usage: python -m ragen_jax.models.gguf FILE.gguf OUT_DIR\n"
                         "writes the Hugging Face folder (config, float weights, tokenizer, chat "
                         "template, generation config) of a llama / qwen2 / qwen3 GGUF file")
    t0 = time.perf_counter()
    try:
        out = convert(argv[0], argv[1])
    except CheckpointError as e:
        raise SystemExit(f"error: {e}") from None
    print(f"wrote {out} in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main(sys.argv[1:])
