"""The cross-encoders mlx-embeddings 0.1.0 has no head for: BERT and XLM-RoBERTa
`*ForSequenceClassification` directories (ms-marco-MiniLM, bge-reranker). mlx-embeddings' own
encoder runs each pair and its loader reads the weights (by Hugging Face's names); this module
adds only Hugging Face's classifier head on top, and gives what mlx-embeddings' ModernBERT
classifier gives: the head's output as `pooler_output`, the sigmoid of the one logit (softmax
across labels where there are more). Runs on the MLX thread (`__call__`) and at load."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

# Hugging Face architecture -> (mlx-embeddings module, the encoder's weight prefix)
HEADS = {"BertForSequenceClassification": ("bert", "bert."),
         "XLMRobertaForSequenceClassification": ("xlm_roberta", "roberta.")}


def head_architecture(config: dict) -> str | None:
    """The architecture this module gives a head to, if the config names one."""
    return next((a for a in config.get("architectures") or [] if a in HEADS), None)


def num_labels(config: dict) -> int:
    return len(config.get("id2label") or {}) or int(config.get("num_labels") or 2)


class _RobertaHead(nn.Module):
    """Hugging Face's `RobertaClassificationHead`: the first token, dense, tanh, out_proj."""

    def __init__(self, hidden: int, labels: int) -> None:
        super().__init__()
        self.dense = nn.Linear(hidden, hidden)
        self.out_proj = nn.Linear(hidden, labels)

    def __call__(self, hidden_states: mx.array) -> mx.array:
        return self.out_proj(mx.tanh(self.dense(hidden_states[:, 0])))


def _model_class(arch: str, labels: int) -> type[nn.Module]:
    module_name, prefix = HEADS[arch]
    encoder_module = importlib.import_module(f"mlx_embeddings.models.{module_name}")
    bert = module_name == "bert"

    class CrossEncoder(nn.Module):
        uses_token_types = bert  # BERT tells the query from the document by token type

        def __init__(self, args: Any) -> None:
            super().__init__()
            if not bert:  # Hugging Face's RoBERTa classifier has no pooler
                args.add_pooling_layer = False
            self.num_labels = labels
            self.model = encoder_module.Model(args)
            # BERT's head reads the encoder's pooler (dense and tanh on the first token)
            self.classifier = nn.Linear(args.hidden_size, labels) if bert \
                else _RobertaHead(args.hidden_size, labels)

        def __call__(self, input_ids: mx.array, attention_mask: mx.array | None = None,
                     token_type_ids: mx.array | None = None) -> Any:
            out = self.model(input_ids, attention_mask=attention_mask,
                             token_type_ids=token_type_ids)
            logits = self.classifier(out.pooler_output if bert else out.last_hidden_state)
            out.pooler_output = mx.sigmoid(logits) if labels == 1 \
                else mx.softmax(logits, axis=-1)
            return out

        def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
            encoder = {k[len(prefix):]: v for k, v in weights.items() if k.startswith(prefix)}
            out = {"model." + k: v for k, v in self.model.sanitize(encoder).items()}
            out |= {k: v for k, v in weights.items() if k.startswith("classifier.")}
            return out

    return CrossEncoder


def load_cross_encoder(model_dir: Path, config: dict) -> tuple[Any, Any]:
    """The model and its tokenizer (mlx-embeddings' loader, with this module's class)."""
    from mlx_embeddings.tokenizer_utils import load_tokenizer
    from mlx_embeddings.utils import load_model
    arch = head_architecture(config)
    assert arch is not None
    cls = _model_class(arch, num_labels(config))
    encoder_args = importlib.import_module(f"mlx_embeddings.models.{HEADS[arch][0]}").ModelArgs
    model = load_model(model_dir, get_model_classes=lambda config: (cls, encoder_args, None, None))
    return model, load_tokenizer(model_dir)
