"""Shared helpers: tiny random Hugging Face Qwen2 models saved to temporary folders."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def _hf_config(**kw):
    base = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        attn_implementation="eager",
    )
    base.update(kw)
    return transformers.Qwen2Config(**base)


@pytest.fixture
def make_hf(tmp_path_factory):
    """``make_hf(seed=0, **config) -> (hf_model, folder)``: random tiny Qwen2, saved."""

    def make(seed=0, **kw):
        torch.manual_seed(seed)
        model = transformers.Qwen2ForCausalLM(_hf_config(**kw)).eval()
        # Random (not zero) biases, so a wrong bias mapping cannot hide.
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("bias") or "norm" in name:
                    p.add_(0.1 * torch.randn_like(p))
        folder = tmp_path_factory.mktemp("hf")
        model.save_pretrained(folder)
        return model, folder

    return make


def _hf_logits(model, tokens, mask=None, positions=None):
    """Logits of a transformers model as numpy float32."""
    kw = {}
    if mask is not None:
        kw["attention_mask"] = torch.tensor(np.asarray(mask), dtype=torch.long)
    if positions is not None:
        kw["position_ids"] = torch.tensor(np.asarray(positions), dtype=torch.long)
    with torch.no_grad():
        return model(torch.tensor(np.asarray(tokens), dtype=torch.long), **kw).logits.float().numpy()


@pytest.fixture
def hf_logits():
    """``hf_logits(model, tokens, mask=None, positions=None) -> np.ndarray`` (float32)."""
    return _hf_logits
