"""Write a random-weight Llama model directory of a given shape: a real model directory
(config.json, model.safetensors, tokenizer.json, a ChatML chat template) that loads through
the same code as any model. Used by the tests and the benchmarks; no weights are downloaded.

    python tests/support/random_model.py OUT_DIR [--hidden 64 --layers 2 ...]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
          "message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")

_CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "What is the capital of France? The capital of France is Paris.",
    "Hello, how are you today? I am fine, thank you for asking.",
    "def main():\n    print('hello world')\n    return 0\n",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 1000",
    "Local models run on a Mac as a background service for chat apps and agents.",
]
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def write_tokenizer(out: Path, vocab_size: int, chat_template: str = CHATML,
                    extra_special: tuple[str, ...] = ()) -> int:
    """Train a small byte-level BPE on a fixed corpus; return the real vocabulary size.
    `extra_special`: more special tokens (fill-in-the-middle markers, say)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size,
                                  special_tokens=[*SPECIAL, *extra_special],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None,
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": None,
        "add_bos_token": False, "clean_up_tokenization_spaces": False,
        "chat_template": chat_template}))
    return tok.get_vocab_size()


def write_random_model(out: Path, *, hidden: int = 64, layers: int = 2, heads: int = 4,
                       kv_heads: int = 2, intermediate: int = 128, vocab: int = 512,
                       context: int = 512, dtype: str = "float32", seed: int = 0,
                       chat_template: str = CHATML, extra_special: tuple[str, ...] = ()) -> Path:
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    out.mkdir(parents=True, exist_ok=True)
    real_vocab = write_tokenizer(out, vocab, chat_template, extra_special)
    from tokenizers import Tokenizer
    eos = Tokenizer.from_file(str(out / "tokenizer.json")).token_to_id("<|im_end|>")
    assert eos is not None, "the tokenizer lacks <|im_end|>"
    config = {
        "model_type": "llama", "hidden_size": hidden, "num_hidden_layers": layers,
        "intermediate_size": intermediate, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "rms_norm_eps": 1e-5, "vocab_size": real_vocab,
        "rope_theta": 10000.0, "max_position_embeddings": context,
        "tie_word_embeddings": False, "eos_token_id": eos,
    }
    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    weights = dict(tree_flatten(model.parameters()))
    # Random weights make every token roughly equally likely, EOS included; damp EOS's output
    # row so that greedy generations run to max_tokens and tests are not at the mercy of chance.
    head = weights["lm_head.weight"]
    weights["lm_head.weight"] = mx.concatenate([head[:eos], head[eos:eos + 1] * 0.01,
                                                head[eos + 1:]])
    target = getattr(mx, dtype)
    weights = {k: v.astype(target) for k, v in weights.items()}
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--intermediate", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    write_random_model(a.out, hidden=a.hidden, layers=a.layers, heads=a.heads,
                       kv_heads=a.kv_heads, intermediate=a.intermediate, vocab=a.vocab,
                       context=a.context, dtype=a.dtype, seed=a.seed)
    print(a.out)


if __name__ == "__main__":
    main()
