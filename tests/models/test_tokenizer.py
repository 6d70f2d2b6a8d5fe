"""The built-in tiny tokenizer and folder loading."""

import pytest

from ragen_jax.models import tokenizer as tk

ENV_TEXT = [
    "######\n#___O#\n#_X√_#\n#__P_#\n#S___#\n######",
    "P___\n_O__\n___X\nO__G",
    "<think>The box is left of the target, so I push it Right.</think>"
    "<answer>Right || Up || Down</answer>",
    "\nTurn 3:\nState:\nP_O\nYou have 7 actions left. Always output: <think> [Your thoughts] "
    "</think> <answer> [your answer] </answer> with no extra text.\n",
    "Reward:\n-0.1\nTeacher: 0.1 points\nTrader: 1.0 points",
    "Text never in the corpus: Zürich, 日本, 12345678, {}[]",
]


@pytest.fixture(scope="module")
def tok():
    return tk.load(None)


@pytest.mark.parametrize("text", ENV_TEXT)
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert max(ids) < tk.TINY_VOCAB_SIZE
    assert tok.decode(ids) == text


def test_specials_and_tags(tok):
    assert len(tok) <= tk.TINY_VOCAB_SIZE
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    for s in tk.SPECIAL_TOKENS + tk.TAG_TOKENS:
        ids = tok.encode(s)
        assert len(ids) == 1, (s, ids)
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>") and ids[-1] == tok.eos_token_id
    assert tok.decode(ids, skip_special_tokens=True) == "user\nhi"
    # Grid cells are one token each, so a cell's neighbours sit at fixed token offsets.
    for row in ("#_X√_#\n", "#__P_#\n", "#____#\n", "######\n", "_O_G\n"):  # one token a cell
        assert [tok.decode([i]) for i in tok.encode(row)] == list(row), row


def test_chat_template(tok):
    msgs = [{"role": "system", "content": "You're a helpful assistant."},
            {"role": "user", "content": "Turn 1:\nState:\nP_G"},
            {"role": "assistant", "content": "<answer>Right</answer>"}]
    text = tok.apply_chat_template(msgs[:2], tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>system\nYou're a helpful assistant.<|im_end|>\n"
                    "<|im_start|>user\nTurn 1:\nState:\nP_G<|im_end|>\n<|im_start|>assistant\n")
    ids = tok.apply_chat_template(msgs, tokenize=True, return_dict=False)
    assert tok.decode(ids) == tok.apply_chat_template(msgs, tokenize=False)


def test_deterministic(tok):
    tk._trained_json.cache_clear()
    again = tk.load("tiny")
    assert again.get_vocab() == tok.get_vocab()
    assert again.encode(ENV_TEXT[2]) == tok.encode(ENV_TEXT[2])


def test_folder_round_trip(tok, tmp_path):
    tok.save_pretrained(tmp_path)
    loaded = tk.load(tmp_path)
    assert loaded.encode(ENV_TEXT[0]) == tok.encode(ENV_TEXT[0])
    assert loaded.chat_template == tok.chat_template
    with pytest.raises(FileNotFoundError):
        tk.load(tmp_path / "missing")


def test_tiny_preset_covers_tokenizer(tok):
    import jax.numpy as jnp
    from flax import nnx

    from ragen_jax.models import Qwen2ForCausalLM, QwenConfig

    cfg = QwenConfig.tiny()
    assert cfg.vocab_size == tk.TINY_VOCAB_SIZE >= len(tok) and 128 <= cfg.hidden_size <= 256
    model = Qwen2ForCausalLM(cfg, rngs=nnx.Rngs(0))
    ids = jnp.asarray([tok.encode(ENV_TEXT[2])])
    logits, _ = model(ids, jnp.arange(ids.shape[1])[None])
    assert logits.shape == (1, ids.shape[1], cfg.vocab_size)
    assert bool(jnp.isfinite(logits).all())


def test_a_tokenizer_json_nested_too_deeply_is_one_line_naming_it(tmp_path):
    """A deeply nested ``tokenizer.json`` (the report's was 40 MB) was a RecursionError
    traceback from reading the folder's files to name the broken one; now that line."""
    from ragen_jax.models import CheckpointError

    (tmp_path / "tokenizer.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(CheckpointError) as e:
        tk.load(tmp_path)
    assert str(e.value) == f"{tmp_path / 'tokenizer.json'} is not readable JSON (nested too deeply to parse)"
