"""Hugging Face checkpoint folders (Qwen2/Qwen2.5, Llama, Qwen3) <-> the NNX model, both ways.

The names on either side are ``hf_convert.py``'s. Only safetensors are read (never pickle),
through ``safetensors.safe_open(..., framework="numpy")``, which reads each tensor out of a
memory map one at a time; the host holds at most one stacked variable (all layers of one
weight) while it is placed on the devices.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from safetensors import safe_open
from safetensors.numpy import save_file

from ragen_jax.models.hf_convert import (
    IGNORED_SUFFIXES,
    checkpoint_keys,
    config_from_hf,
    config_to_hf,
    is_stacked,
)
from ragen_jax.models.hf_folder import CheckpointError, describe_error, read_json
from ragen_jax.models.placement import param_shardings
from ragen_jax.models.qwen import Qwen2ForCausalLM
from ragen_jax.models.qwen_config import MODEL_TYPES, QwenConfig


def load_config(path: str | os.PathLike, *, dtype=jnp.float32, param_dtype=None,
                **options) -> QwenConfig:
    """Reads ``config.json`` of a model folder (``qwen_config.MODEL_TYPES``) into a ``QwenConfig`` (``dtype``, ``param_dtype``
    and ``options`` as in ``hf_convert.config_from_hf``)."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"model folder not found: {path}")
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(f"no config.json in {path}")
    d = read_json(cfg_file)
    archs = d.get("architectures") or []
    model_type = d.get("model_type")
    if model_type not in MODEL_TYPES or (archs and MODEL_TYPES[model_type] not in archs):
        supported = ", ".join(f"{a} ({t!r})" for t, a in MODEL_TYPES.items())
        raise CheckpointError(
            f"{path} holds model_type={model_type!r} architectures={archs}; "
            f"supported: {supported}"
        )
    try:
        return config_from_hf(d, dtype=dtype, param_dtype=param_dtype, **options)
    except (KeyError, ValueError) as e:
        raise CheckpointError(f"{cfg_file}: unsupported or incomplete config: {e}") from None


def _open(f: Path):
    """``safe_open`` of one weights file; a truncated file or a bad header is a
    ``CheckpointError`` naming the file."""
    try:
        return safe_open(f, framework="numpy")
    except Exception as e:  # safetensors raises its own SafetensorError, or OSError
        raise CheckpointError(f"{f}: not a readable safetensors file ({describe_error(e)})") from None


def tensor_files(path: Path) -> dict[str, Path]:
    """Maps every tensor name to the safetensors file that holds it."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: not a safetensors index ({type(e).__name__}: {e})") from None
        files = {k: path / f for k, f in weight_map.items()}
        for f in set(files.values()):
            if not f.is_file():
                raise CheckpointError(f"{index.name} names {f.name}, which is missing in {path}")
        return files
    single = path / "model.safetensors"
    candidates = [single] if single.is_file() else sorted(path.glob("*.safetensors"))
    if not candidates:
        raise CheckpointError(f"no *.safetensors weights in {path} (pickle .bin is not read)")
    files = {}
    for f in candidates:
        with _open(f) as fh:
            for k in fh.keys():
                files[k] = f
    return files


def from_pretrained(
    path: str | os.PathLike, *, dtype=jnp.float32, param_dtype=None, mesh: Mesh | None = None,
    **options,
) -> Qwen2ForCausalLM:
    """Loads a Hugging Face Qwen2/Qwen2.5, Llama or Qwen3 folder (config.json +
    safetensors) into NNX.

    ``dtype`` is the compute dtype and ``param_dtype`` the storage dtype of the parameters
    (default: ``dtype``; train with float32 storage, see ``QwenConfig``); ``options`` are
    the config fields the folder does not hold (``remat``, ``scan_layers``). With a ``mesh``, each
    tensor is put straight onto its ``NamedSharding`` (from the parameters' partition specs);
    without, onto the default device. Raises ``CheckpointError`` with a one-line message for a
    missing folder, config or weights, an unsupported architecture, missing or unexpected keys
    and shape mismatches.
    """
    path = Path(path)
    config = load_config(path, dtype=dtype, param_dtype=param_dtype, **options)
    files = tensor_files(path)

    abstract = nnx.eval_shape(lambda: Qwen2ForCausalLM(config, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    flat = nnx.to_flat_state(state)
    n = config.num_hidden_layers
    keys = {tuple(p): checkpoint_keys(p, n) for p, _ in flat}
    expected = {k: var for p, var in flat for k in keys[tuple(p)]}

    present = {k for k in files if not k.endswith(IGNORED_SUFFIXES)}
    if config.tie_word_embeddings:
        present.discard("lm_head.weight")  # some tied checkpoints still store it
    missing = sorted(set(expected) - present)
    unexpected = sorted(present - set(expected))
    if missing:
        raise CheckpointError(f"{path}: missing keys {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    if unexpected:
        raise CheckpointError(
            f"{path}: unexpected keys {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}"
        )

    shardings = param_shardings(state, mesh) if mesh is not None else None
    flat_shardings = dict(nnx.to_flat_state(shardings)) if shardings is not None else {}

    with contextlib.ExitStack() as stack:
        handles = {f: stack.enter_context(_open(f))
                   for f in sorted(set(files[k] for k in expected), key=str)}

        def read(k: str, shape) -> np.ndarray:
            try:
                arr = handles[files[k]].get_tensor(k)
            except Exception as e:  # a file cut short after a valid header
                raise CheckpointError(f"{files[k]}: cannot read {k} ({describe_error(e)})") from None
            if tuple(arr.shape) != tuple(shape):
                raise CheckpointError(f"{path}: shape mismatch for {k}: checkpoint "
                                      f"{tuple(arr.shape)}, model {tuple(shape)}")
            return arr.astype(jnp.dtype(config.param_dtype))

        for p, var in flat:
            p = tuple(p)
            names = keys[p]
            if not is_stacked(p):
                arr = read(names[0], var.shape)
            else:  # the layers into one host array
                arr = np.empty(var.shape, jnp.dtype(config.param_dtype))
                for i, k in enumerate(names):
                    arr[i] = read(k, var.shape[1:])
            if mesh is not None:
                sh = flat_shardings[p]
                sh = sh.value if isinstance(sh, nnx.Variable) else sh
                var.set_value(jax.device_put(arr, sh))
            else:
                var.set_value(jnp.asarray(arr))
            del arr

    model = nnx.merge(graphdef, nnx.from_flat_state(flat))
    if mesh is not None:
        model.model.activation_sharding = NamedSharding(mesh, PartitionSpec(("data", "fsdp")))
    return model


def folder_dtype(path: str | os.PathLike) -> str | None:
    """The weights' dtype a Hugging Face folder declares (``torch_dtype`` or ``dtype`` of its
    ``config.json``), e.g. ``"bfloat16"`` for Qwen2.5; None if it declares none."""
    d = read_json(Path(path) / "config.json")
    dtype = d.get("torch_dtype") or d.get("dtype")
    return dtype if isinstance(dtype, str) else None


def save_pretrained(model: Qwen2ForCausalLM, path: str | os.PathLike, *, dtype=None) -> None:
    """Writes ``config.json`` and ``model.safetensors`` loadable by ``transformers``.

    Tensors are written in ``dtype`` (default: the model's parameter dtype), and
    ``config.json`` declares it. Sharded parameters are gathered to the host one at a time.
    """
    if nnx.state(model, nnx.LoRAParam):
        raise ValueError("save_pretrained: the model has LoRA adapters; call "
                         "ragen_jax.models.lora.merge_lora(model) first")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = model.config.replace(param_dtype=jnp.dtype(dtype or model.config.param_dtype))
    tensors = {}
    for p, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        array = np.asarray(jax.device_get(var[...].astype(config.param_dtype)))
        names = checkpoint_keys(p, config.num_hidden_layers)
        if not is_stacked(p):
            tensors[names[0]] = np.ascontiguousarray(array)
        else:
            tensors.update((k, np.ascontiguousarray(array[i])) for i, k in enumerate(names))
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config_to_hf(config), indent=2) + "\n")
