"""Write a random-weight model directory of a given family and shape: a real model directory
(config.json, model.safetensors, tokenizer.json, a ChatML chat template) that loads through
the same code as any model. Used by the tests and the benchmarks; no weights are downloaded.
Families: llama (the default), and for caches other than a plain KVCache: gemma3_text and
gpt_oss (sliding-window attention), qwen3_next and lfm2 (recurrent and attention layers),
mamba2 (recurrent only).

    python tests/support/random_model.py OUT_DIR [--family llama --hidden 64 --layers 2 ...]
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
                    extra_special: tuple[str, ...] = (), extra_tokens: tuple[str, ...] = ()
                    ) -> int:
    """Train a small byte-level BPE on a fixed corpus; return the real vocabulary size.
    `extra_special`: more special tokens (fill-in-the-middle markers, say); `extra_tokens`:
    added tokens that are text, not special (as Qwen's `<tool_call>`)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size,
                                  special_tokens=[*SPECIAL, *extra_special],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    if extra_tokens:
        tok.add_tokens(list(extra_tokens))
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None,
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": None,
        "add_bos_token": False, "clean_up_tokenization_spaces": False,
        "chat_template": chat_template}))
    return tok.get_vocab_size()


def _llama(s: dict) -> dict:
    return {"model_type": "llama", "hidden_size": s["hidden"], "num_hidden_layers": s["layers"],
            "intermediate_size": s["intermediate"], "num_attention_heads": s["heads"],
            "num_key_value_heads": s["kv_heads"], "rms_norm_eps": 1e-5,
            "vocab_size": s["vocab"], "rope_theta": 10000.0,
            "max_position_embeddings": s["context"], "tie_word_embeddings": False}


def _gemma3_text(s: dict) -> dict:
    """Sliding-window attention: layers 0, 2, ... see the last 16 tokens (RotatingKVCache),
    layers 1, 3, ... everything (KVCache)."""
    head_dim = s["hidden"] // s["heads"]
    return {"model_type": "gemma3_text", "hidden_size": s["hidden"],
            "num_hidden_layers": s["layers"], "intermediate_size": s["intermediate"],
            "num_attention_heads": s["heads"], "num_key_value_heads": s["kv_heads"],
            "head_dim": head_dim, "query_pre_attn_scalar": head_dim, "rms_norm_eps": 1e-6,
            "vocab_size": s["vocab"], "rope_theta": 1_000_000.0, "rope_local_base_freq": 10000.0,
            "sliding_window": 16, "sliding_window_pattern": 2,
            "max_position_embeddings": s["context"]}


def _gpt_oss(s: dict) -> dict:
    """Attention sinks, sliding (16) and full layers in turn, a mixture of 4 experts, 2 a token."""
    return {"model_type": "gpt_oss", "hidden_size": s["hidden"], "num_hidden_layers": s["layers"],
            "intermediate_size": s["intermediate"], "num_attention_heads": s["heads"],
            "num_key_value_heads": s["kv_heads"], "head_dim": s["hidden"] // s["heads"],
            "num_local_experts": 4, "num_experts_per_tok": 2, "rms_norm_eps": 1e-5,
            "vocab_size": s["vocab"], "rope_theta": 150000, "sliding_window": 16,
            # Plain RoPE (no rope_scaling). transformers reads config.json at load too, and its
            # gpt_oss default (YaRN) would warn at this context length: say it there as well.
            "rope_parameters": {"rope_type": "default", "rope_theta": 150000.0},
            "layer_types": ["sliding_attention", "full_attention"] * (s["layers"] // 2)
                           + ["sliding_attention"] * (s["layers"] % 2),
            "max_position_embeddings": s["context"]}


def _qwen3_next(s: dict) -> dict:
    """Gated delta-net layers (ArraysCache) with full attention every second layer (KVCache);
    every layer's MLP a mixture of 4 experts, 2 a token, plus a shared expert."""
    head_dim = s["hidden"] // s["heads"]
    return {"model_type": "qwen3_next", "hidden_size": s["hidden"],
            "num_hidden_layers": s["layers"], "intermediate_size": s["intermediate"],
            "num_attention_heads": s["heads"], "num_key_value_heads": s["kv_heads"],
            "head_dim": head_dim, "linear_num_value_heads": s["heads"],
            "linear_num_key_heads": s["kv_heads"], "linear_key_head_dim": head_dim,
            "linear_value_head_dim": head_dim, "linear_conv_kernel_dim": 4,
            "num_experts": 4, "num_experts_per_tok": 2, "decoder_sparse_step": 1,
            "mlp_only_layers": [], "moe_intermediate_size": s["intermediate"] // 4,
            "shared_expert_intermediate_size": s["intermediate"] // 2, "norm_topk_prob": True,
            "rms_norm_eps": 1e-6, "vocab_size": s["vocab"], "rope_theta": 10000.0,
            "partial_rotary_factor": 0.25, "full_attention_interval": 2,
            "max_position_embeddings": s["context"], "tie_word_embeddings": False}


def _qwen3_5(s: dict) -> dict:
    """Qwen3.5 as its checkpoints ship: one config for a multimodal model, the language
    model's (gated delta-net layers with full attention every second layer) under
    `text_config`; mlx-lm serves the language model alone."""
    head_dim = s["hidden"] // s["heads"]
    text = {"model_type": "qwen3_5_text", "hidden_size": s["hidden"],
            "num_hidden_layers": s["layers"], "intermediate_size": s["intermediate"],
            "num_attention_heads": s["heads"], "num_key_value_heads": s["kv_heads"],
            "head_dim": head_dim, "linear_num_value_heads": s["heads"],
            "linear_num_key_heads": s["kv_heads"], "linear_key_head_dim": head_dim,
            "linear_value_head_dim": head_dim, "linear_conv_kernel_dim": 4,
            "full_attention_interval": 2, "rms_norm_eps": 1e-6, "vocab_size": s["vocab"],
            "max_position_embeddings": s["context"], "tie_word_embeddings": False,
            "rope_parameters": {"type": "default", "mrope_section": [2, 1, 1],
                                "rope_theta": 10000.0, "partial_rotary_factor": 0.5}}
    return {"model_type": "qwen3_5", "text_config": text,
            "vision_config": {"model_type": "qwen3_5", "hidden_size": 32, "depth": 1,
                              "num_heads": 2, "patch_size": 16, "spatial_merge_size": 2,
                              "out_hidden_size": s["hidden"]}}


def _lfm2(s: dict) -> dict:
    """Short-convolution layers (ArraysCache) and attention layers (KVCache) in turn. Its
    output head is always the (tied) embedding."""
    return {"model_type": "lfm2", "hidden_size": s["hidden"], "num_hidden_layers": s["layers"],
            "num_attention_heads": s["heads"], "num_key_value_heads": s["kv_heads"],
            "block_dim": s["hidden"], "block_ff_dim": s["intermediate"],
            "block_multiple_of": 32, "block_ffn_dim_multiplier": 1.0,
            "block_auto_adjust_ff_dim": False, "conv_bias": False, "conv_L_cache": 3,
            "norm_eps": 1e-5, "vocab_size": s["vocab"], "rope_theta": 1_000_000.0,
            "layer_types": ["conv", "full_attention"] * (s["layers"] // 2)
                           + ["conv"] * (s["layers"] % 2),
            "max_position_embeddings": s["context"], "tie_embedding": True}


def _mamba2(s: dict) -> dict:
    """Recurrent only: every layer a Mamba-2 block (ArraysCache: conv state, SSM state)."""
    head_dim = s["hidden"] // s["heads"]
    return {"model_type": "mamba2", "hidden_size": s["hidden"], "num_hidden_layers": s["layers"],
            "intermediate_size": s["intermediate"], "num_heads": s["intermediate"] // head_dim,
            "head_dim": head_dim, "state_size": 16, "n_groups": 1, "conv_kernel": 4,
            "use_bias": False, "use_conv_bias": True, "layer_norm_epsilon": 1e-5,
            "time_step_limit": [0.001, 100.0], "time_step_rank": "auto",
            "vocab_size": s["vocab"], "max_position_embeddings": s["context"],
            "tie_word_embeddings": False}


# family (mlx-lm model type) -> (its config, its default number of layers)
FAMILIES = {"llama": (_llama, 2), "gemma3_text": (_gemma3_text, 4), "gpt_oss": (_gpt_oss, 4),
            "qwen3_next": (_qwen3_next, 4), "qwen3_5": (_qwen3_5, 4), "lfm2": (_lfm2, 4),
            "mamba2": (_mamba2, 4)}


def random_weights(config: dict, seed: int = 0) -> dict:
    """The parameters (name -> array, as `load` expects them) of a random model of `config`,
    the row of its output head for `config["eos_token_id"]` damped."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    mx.random.seed(seed)
    model_class, args_class = _get_classes(config)
    weights = dict(tree_flatten(model_class(args_class.from_dict(config)).parameters()))
    # gpt-oss's attention sinks start at zero (no sink); random ones exercise the sink path.
    for name in [k for k in weights if k.endswith(".sinks")]:
        weights[name] = mx.random.normal(weights[name].shape)
    # Random weights make every token roughly equally likely, EOS included; damp EOS's output
    # row so that greedy generations run to max_tokens and tests are not at the mercy of chance.
    # lfm2 has no separate head: its output row is the embedding's, whose scale lfm2's first
    # norm mostly undoes on input.
    eos = config["eos_token_id"]
    heads = [k for k in weights if k.endswith("lm_head.weight")] or \
        [k for k in weights if k.endswith("embed_tokens.weight")]
    head = heads[0]
    rows = weights[head]
    weights[head] = mx.concatenate([rows[:eos], rows[eos:eos + 1] * 0.01, rows[eos + 1:]])
    return weights


def write_random_model(out: Path, *, family: str = "llama", hidden: int = 64,
                       layers: int | None = None, heads: int = 4, kv_heads: int = 2,
                       intermediate: int = 128, vocab: int = 512, context: int = 512,
                       dtype: str = "float32", seed: int = 0, chat_template: str = CHATML,
                       extra_special: tuple[str, ...] = (),
                       extra_tokens: tuple[str, ...] = ()) -> Path:
    """`family`: the mlx-lm model type (see FAMILIES); `layers` defaults to 2 for llama and to
    4 for the others (the hybrids need at least 2: one layer of each kind)."""
    import mlx.core as mx

    make_config, default_layers = FAMILIES[family]
    layers = default_layers if layers is None else layers
    if family not in ("llama", "mamba2") and layers < 2:
        raise ValueError(f"{family} needs at least 2 layers, one of each kind")
    out.mkdir(parents=True, exist_ok=True)
    real_vocab = write_tokenizer(out, vocab, chat_template, extra_special, extra_tokens)
    from tokenizers import Tokenizer
    eos = Tokenizer.from_file(str(out / "tokenizer.json")).token_to_id("<|im_end|>")
    assert eos is not None, "the tokenizer lacks <|im_end|>"
    config = make_config({"hidden": hidden, "layers": layers, "heads": heads,
                          "kv_heads": kv_heads, "intermediate": intermediate,
                          "vocab": real_vocab, "context": context})
    config["eos_token_id"] = eos
    weights = random_weights(config, seed)
    target = getattr(mx, dtype)
    weights = {k: v.astype(target) for k, v in weights.items()}
    # What is saved is already in mlx-lm's layout (conv weights (out, kernel, in), experts
    # stacked), which each family's sanitize passes through unchanged.
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--family", choices=sorted(FAMILIES), default="llama")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=None,
                    help="default: 2 for llama, 4 for the others")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--intermediate", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    write_random_model(a.out, family=a.family, hidden=a.hidden, layers=a.layers, heads=a.heads,
                       kv_heads=a.kv_heads, intermediate=a.intermediate, vocab=a.vocab,
                       context=a.context, dtype=a.dtype, seed=a.seed)
    print(a.out)


if __name__ == "__main__":
    main()
