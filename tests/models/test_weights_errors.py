"""Bad model folders give one-line CheckpointErrors."""

import json

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from ragen_jax.models import CheckpointError, from_pretrained


@pytest.fixture
def folder(make_hf):
    return make_hf(seed=11, num_hidden_layers=1)[1]


def _rewrite(folder, fn):
    path = folder / "model.safetensors"
    tensors = load_file(path)
    fn(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def _check(folder, pattern):
    with pytest.raises(CheckpointError, match=pattern) as info:
        from_pretrained(folder)
    assert "\n" not in str(info.value)


def test_missing_folder(tmp_path):
    _check(tmp_path / "nope", "model folder not found")


def test_missing_config(folder):
    (folder / "config.json").unlink()
    _check(folder, "no config.json")


def test_no_safetensors(folder):
    (folder / "model.safetensors").unlink()
    _check(folder, r"no \*\.safetensors")


def test_missing_key(folder):
    _rewrite(folder, lambda t: t.pop("model.layers.0.mlp.up_proj.weight"))
    _check(folder, "missing keys.*up_proj")


def test_unexpected_key(folder):
    _rewrite(folder, lambda t: t.update({"model.layers.0.extra.weight": np.zeros(3, np.float32)}))
    _check(folder, "unexpected keys.*extra")


def test_shape_mismatch(folder):
    def bad(t):
        t["model.norm.weight"] = np.ones(65, np.float32)

    _rewrite(folder, bad)
    _check(folder, r"shape mismatch for model.norm.weight: checkpoint \(65,\), model \(64,\)")


def test_unsupported_architecture(folder):
    cfg = json.loads((folder / "config.json").read_text())
    cfg["model_type"], cfg["architectures"] = "gemma", ["GemmaForCausalLM"]
    (folder / "config.json").write_text(json.dumps(cfg))
    _check(folder, "model_type='gemma'.*supported: Qwen2ForCausalLM")


def test_architecture_and_model_type_disagree(folder):
    """A llama model_type naming a Qwen2 class (a hand-edited config) is refused, not
    loaded as llama with the Qwen2 weights' q/k/v biases unexpected."""
    cfg = json.loads((folder / "config.json").read_text())
    cfg["model_type"] = "llama"
    (folder / "config.json").write_text(json.dumps(cfg))
    _check(folder, "model_type='llama' architectures=\\['Qwen2ForCausalLM'\\]")
