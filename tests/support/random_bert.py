"""Write a random-weight BERT embedding model directory (config.json, model.safetensors, a
WordPiece tokenizer.json): a real model directory that mlx-embeddings loads like any BERT; or
a ModernBERT cross-encoder (a reranker) the same way. Used by the embedding and rerank tests;
no weights are downloaded.

    python tests/support/random_bert.py OUT_DIR [--hidden 64 --layers 2 ...]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "What is the capital of France? The capital of France is Paris.",
    "Hello, how are you today? I am fine, thank you for asking.",
    "Local models run on a Mac as a background service for chat apps and agents.",
    "Embeddings map sentences to vectors: similar meanings, nearby vectors.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 1000",
]
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def write_wordpiece_tokenizer(out: Path, vocab_size: int, max_length: int) -> int:
    """A lower-casing WordPiece tokenizer that frames inputs as [CLS] ... [SEP], as BERT's
    does; returns the real vocabulary size."""
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.train_from_iterator(_CORPUS, trainers.WordPieceTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL, show_progress=False))
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B [SEP]",
        special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "BertTokenizer", "do_lower_case": True,
        "model_max_length": max_length, "pad_token": "[PAD]", "unk_token": "[UNK]",
        "cls_token": "[CLS]", "sep_token": "[SEP]", "mask_token": "[MASK]"}))
    return tok.get_vocab_size()


def write_random_bert(out: Path, *, hidden: int = 64, layers: int = 2, heads: int = 4,
                      intermediate: int = 128, vocab: int = 400, max_length: int = 128,
                      seed: int = 0) -> Path:
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_embeddings.models import bert

    out.mkdir(parents=True, exist_ok=True)
    real_vocab = write_wordpiece_tokenizer(out, vocab, max_length)
    config = {"architectures": ["BertModel"], "model_type": "bert", "hidden_size": hidden,
              "num_hidden_layers": layers, "num_attention_heads": heads,
              "intermediate_size": intermediate, "max_position_embeddings": max_length,
              "vocab_size": real_vocab, "type_vocab_size": 2, "layer_norm_eps": 1e-12,
              "pad_token_id": 0}
    (out / "config.json").write_text(json.dumps(config))
    mx.random.seed(seed)
    model = bert.Model(bert.ModelArgs.from_dict(config))
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())))
    return out


def write_random_cross_encoder(out: Path, *, family: str = "modernbert", hidden: int = 64,
                               layers: int = 2, heads: int = 4, intermediate: int = 128,
                               vocab: int = 400, max_length: int = 128, seed: int = 0) -> Path:
    """A cross-encoder reranker: a one-label sequence-classification head on a ModernBERT
    (shaped like gte-reranker-modernbert-base), a BERT (like ms-marco-MiniLM) or an XLM-RoBERTa
    (like bge-reranker), with Hugging Face's config fields and weight names."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_embeddings.models import bert, modernbert, xlm_roberta

    out.mkdir(parents=True, exist_ok=True)
    real_vocab = write_wordpiece_tokenizer(out, vocab, max_length)
    config = {"model_type": family, "hidden_size": hidden, "num_hidden_layers": layers,
              "num_attention_heads": heads, "intermediate_size": intermediate,
              "max_position_embeddings": max_length, "vocab_size": real_vocab,
              "id2label": {"0": "LABEL_0"}, "label2id": {"LABEL_0": 0}, "pad_token_id": 0}
    mx.random.seed(seed)
    if family == "modernbert":
        config |= {"architectures": ["ModernBertForSequenceClassification"],
                   "global_attn_every_n_layers": 2, "local_attention": 16,
                   "classifier_pooling": "mean"}
        weights = dict(tree_flatten(modernbert.Model(
            modernbert.ModelArgs.from_dict(config)).parameters()))
    elif family == "bert":
        config |= {"architectures": ["BertForSequenceClassification"], "type_vocab_size": 2}
        encoder = bert.Model(bert.ModelArgs.from_dict(config))
        weights = {"bert." + k: v for k, v in dict(tree_flatten(encoder.parameters())).items()}
        weights |= {"classifier.weight": mx.random.normal((1, hidden)),
                    "classifier.bias": mx.random.normal((1,))}
    else:  # XLM-RoBERTa: positions count from the padding id, so two more of them
        config |= {"architectures": ["XLMRobertaForSequenceClassification"],
                   "max_position_embeddings": max_length + 2, "type_vocab_size": 1}
        args = xlm_roberta.ModelArgs.from_dict({**config, "add_pooling_layer": False})
        weights = {"roberta." + k: v
                   for k, v in dict(tree_flatten(xlm_roberta.Model(args).parameters())).items()}
        weights |= {"classifier.dense.weight": mx.random.normal((hidden, hidden)) * 0.3,
                    "classifier.dense.bias": mx.zeros((hidden,)),
                    "classifier.out_proj.weight": mx.random.normal((1, hidden)) * 0.3,
                    "classifier.out_proj.bias": mx.zeros((1,))}
    (out / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--max-length", type=int, default=128)
    args = ap.parse_args()
    print(write_random_bert(args.out, hidden=args.hidden, layers=args.layers, heads=args.heads,
                            max_length=args.max_length))
