"""What an engine embeds with, and which kind of engine a model directory needs.

An encoder model (BERT-family and similar, loaded through mlx-embeddings) gets an engine of
its own kind that only embeds; a causal LM embeds beside generating, as the mean of its last
hidden states. Either way vectors are L2-normalized float32. `tokenize` runs on the embedding
lane, `forward` (or a long causal input's `begin`, `feed`, `pooled`) on the MLX thread;
`passes.py` (pure) says which inputs share a forward pass.
"""

from __future__ import annotations

import inspect
import json
import logging
from pathlib import Path
from typing import Any, Literal

import numpy as np

from mlxd.engine.admit.prepare import ClientError

log = logging.getLogger("mlxd.engine")

ModelUse = Literal["generate", "embed"]

# Model types mlx-embeddings loads as text encoders.
ENCODER_TYPES = frozenset({"bert", "xlm_roberta", "modernbert", "llama_bidirec"})
# A sentence-transformers directory holds an embedding model whatever its architecture
# (Qwen3-Embedding, EmbeddingGemma: decoder stacks trained to embed).
SENTENCE_TRANSFORMERS_FILES = ("config_sentence_transformers.json", "modules.json")

DEFAULT_WIDTH = 1024  # a hidden size to assume where a config names none (the hang pace's)
NO_EMBEDDINGS = ("embedding models need the packages mlx-embeddings and mlx-vlm: install "
                 "mlxd's embeddings extra (pip install -e '.[embeddings]' in mlxd's checkout)")


def model_use(model_dir: Path) -> ModelUse:
    """`embed` for an encoder or a sentence-transformers model, else `generate`."""
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return "generate"  # the loader says what is wrong with it
    if any((model_dir / name).is_file() for name in SENTENCE_TRANSFORMERS_FILES):
        return "embed"
    model_type = str(config.get("model_type", "")).replace("-", "_").lower()
    return "embed" if model_type in ENCODER_TYPES else "generate"


def normalized(vectors: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(vectors, axis=-1, keepdims=True)
    return (vectors / np.maximum(norms, 1e-12)).astype(np.float32)


def check_token_ids(inputs: list[list[int]], vocab: int, max_tokens: int,
                    truncate: bool) -> list[list[int]]:
    """Token-id inputs as given: each non-empty, within the vocabulary and the length."""
    out = []
    for i, ids in enumerate(inputs):
        if not ids:
            raise ClientError(f"input[{i}] is empty", "invalid_request")
        if vocab and max(ids) >= vocab:
            raise ClientError(f"input[{i}] holds token id {max(ids)}, outside this model's "
                              f"vocabulary of {vocab}", "invalid_token")
        out.append(_fit(ids, i, max_tokens, truncate))
    return out


def _fit(ids: list[int], i: int, max_tokens: int, truncate: bool) -> list[int]:
    if len(ids) <= max_tokens:
        return ids
    if truncate:
        return ids[:max_tokens]
    raise ClientError(f"input[{i}] is {len(ids)} tokens, more than the {max_tokens} this model "
                      "embeds at once", "context_length_exceeded")


class EncoderEmbedder:
    """An mlx-embeddings model: its own pooling (`text_embeds`), or the mean of its last
    hidden states where it has none."""

    def __init__(self, model: Any, tokenizer: Any, config: dict, stream: Any) -> None:
        self.model, self.tokenizer, self.stream = model, tokenizer, stream
        limits = [config.get("max_position_embeddings") or 0,
                  getattr(tokenizer, "model_max_length", 0) or 0]
        sane = [n for n in limits if isinstance(n, int) and 0 < n < 10**7]
        self.max_tokens = min(sane) if sane else 512
        self.vocab = int(config.get("vocab_size") or 0)
        self.width = _int(config.get("hidden_size") or config.get("d_model"), DEFAULT_WIDTH)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.pad_left = getattr(tokenizer, "padding_side", "right") == "left"
        self.dimensions = 0  # known after the first forward pass
        # A cross-encoder: a sequence-classification head with one label (mlx-embeddings builds
        # it as `classifier` and gives sigmoid(logit) as `pooler_output`), so it can rerank
        self.ranks = getattr(model, "classifier", None) is not None \
            and getattr(model, "num_labels", 0) == 1

    def tokenize(self, texts: list[str], truncate: bool) -> list[list[int]]:
        ids = self.tokenizer(texts, truncation=truncate,
                             max_length=self.max_tokens if truncate else None)["input_ids"]
        return [_fit(list(x), i, self.max_tokens, truncate) for i, x in enumerate(ids)]

    def tokenize_pairs(self, query: str, documents: list[str]) -> list[list[int]]:
        """(query, document) pairs as the model's tokenizer frames them; a document too long
        for the model is cut (the query never is), as rerank APIs do."""
        query_tokens = len(self.tokenizer(query)["input_ids"])
        if query_tokens + 2 > self.max_tokens:  # a separator and one document token at least
            raise ClientError(f"the query is {query_tokens} tokens; this model takes "
                              f"{self.max_tokens} for the query and a document together",
                              "context_length_exceeded")
        ids = self.tokenizer([query] * len(documents), documents, truncation="only_second",
                             max_length=self.max_tokens)["input_ids"]
        return [_fit(list(x), i, self.max_tokens, False) for i, x in enumerate(ids)]

    def score(self, batch: list[list[int]]) -> np.ndarray:
        """Each pair's relevance, as the classifier head gives it: (inputs, 1) float32."""
        import mlx.core as mx
        ids, mask = _padded(batch, self.pad_id, self.pad_left)
        extra = {}
        if getattr(self.model, "uses_token_types", False):
            extra["token_type_ids"] = mx.array(_second_segment(ids, self.tokenizer.sep_token_id))
        with mx.stream(self.stream):
            out = self.model(mx.array(ids), attention_mask=mx.array(mask), **extra)
            return np.array(out.pooler_output.astype(mx.float32)).reshape(len(batch), 1)

    def forward(self, batch: list[list[int]]) -> np.ndarray:
        import mlx.core as mx
        ids, mask = _padded(batch, self.pad_id, self.pad_left)
        with mx.stream(self.stream):
            out = self.model(mx.array(ids), attention_mask=mx.array(mask))
            pooled = out.text_embeds
            if pooled is None:
                pooled = _mean(out.last_hidden_state, mx.array(mask))
            vectors = np.array(pooled.astype(mx.float32))
        self.dimensions = vectors.shape[-1]
        return normalized(vectors)


class CausalLMEmbedder:
    """A causal LM's mean-pooled last hidden states (after its final norm). Inputs are
    right-padded: a causal mask keeps the padding out of every real position."""

    def __init__(self, model: Any, tokenizer: Any, context_length: int, vocab: int,
                 stream: Any) -> None:
        inner = getattr(model, "model", None)
        self.hidden = inner if callable(inner) else None  # the transformer without its head
        self._model = model  # its caches, for a long input embedded a chunk a pass
        # a long input goes through in chunks where the transformer takes a KV cache
        self.chunks = self.hidden is not None and _takes_cache(self.hidden)
        self.tokenizer, self.stream = tokenizer, stream
        self.max_tokens = context_length
        self.vocab = vocab
        self.width = _int(getattr(getattr(model, "args", None), "hidden_size", None),
                          DEFAULT_WIDTH)
        self.dimensions = 0

    def tokenize(self, texts: list[str], truncate: bool) -> list[list[int]]:
        return [_fit(list(self.tokenizer.encode(t)), i, self.max_tokens, truncate)
                for i, t in enumerate(texts)]

    def forward(self, batch: list[list[int]]) -> np.ndarray:
        import mlx.core as mx
        if self.hidden is None:
            raise ClientError("this model's architecture gives no hidden states to embed with",
                              "invalid_request")
        ids, mask = _padded(batch, 0, pad_left=False)
        with mx.stream(self.stream):
            h = self.hidden(mx.array(ids))
            vectors = np.array(_mean(h, mx.array(mask)).astype(mx.float32))
        self.dimensions = vectors.shape[-1]
        return normalized(vectors)

    def begin(self) -> _Running:
        """A long input's embedding, to be fed a chunk a pass (`chunks` is true)."""
        from mlx_lm.models.cache import make_prompt_cache
        return _Running(make_prompt_cache(self._model))

    def feed(self, running: _Running, ids: list[int]) -> None:
        """The input's next tokens: their hidden states attend to those before them in the
        cache, as in one pass over the whole input."""
        import mlx.core as mx
        assert self.hidden is not None
        with mx.stream(self.stream):
            h = self.hidden(mx.array([ids]), cache=running.cache)
            part = h[0].astype(mx.float32).sum(axis=0)
            running.total = part if running.total is None else running.total + part
            mx.eval(running.total, [c.state for c in running.cache])
        running.count += len(ids)

    def pooled(self, running: _Running) -> np.ndarray:
        """The fed input's vector: the mean of its hidden states, normalized."""
        import mlx.core as mx
        with mx.stream(self.stream):
            vector = np.array((running.total / running.count).astype(mx.float32))
        self.dimensions = vector.shape[-1]
        return normalized(vector[None])[0]


class _Running:
    """A long input part-way through: its KV caches, and the sum of its hidden states so far
    (float32, on the device)."""

    def __init__(self, cache: list[Any]) -> None:
        self.cache = cache
        self.total: Any = None
        self.count = 0


def _takes_cache(transformer: Any) -> bool:
    try:
        return "cache" in inspect.signature(transformer.__call__).parameters
    except (TypeError, ValueError):
        return False


def _padded(batch: list[list[int]], pad_id: int, pad_left: bool
            ) -> tuple[np.ndarray, np.ndarray]:
    longest = max(len(x) for x in batch)
    ids = np.full((len(batch), longest), pad_id, dtype=np.int32)
    mask = np.zeros((len(batch), longest), dtype=np.int32)
    for row, x in enumerate(batch):
        where = slice(longest - len(x), longest) if pad_left else slice(0, len(x))
        ids[row, where] = x
        mask[row, where] = 1
    return ids, mask


def _second_segment(ids: np.ndarray, sep_id: int) -> np.ndarray:
    """BERT's token types for right-padded pairs: 1 after the first separator (the document
    and its closing separator), as its tokenizer gives them; padding is masked anyway."""
    is_sep = ids == sep_id
    after_first = np.cumsum(is_sep, axis=1) - is_sep > 0
    return after_first.astype(np.int32)


def _mean(hidden: Any, mask: Any) -> Any:
    import mlx.core as mx
    m = mask[..., None].astype(mx.float32)
    return (hidden.astype(mx.float32) * m).sum(axis=1) / mx.maximum(m.sum(axis=1), 1.0)


def load_encoder(model_dir: Path, dtype: str, stream: Any) -> EncoderEmbedder:
    """Load an encoder through mlx-embeddings (ModelLoadError if it cannot be)."""
    from mlxd.engine.load.loader import ModelLoadError, _cast_for_device
    try:
        import mlx_embeddings
    except ImportError as e:
        raise ModelLoadError(f"{NO_EMBEDDINGS} ({e})") from e
    from mlxd.engine.embeddings.cross_encoder import head_architecture, load_cross_encoder
    try:
        config = json.loads((model_dir / "config.json").read_text())
        if head_architecture(config):  # a head mlx-embeddings lacks: this module adds it
            model, tokenizer = load_cross_encoder(model_dir, config)
        else:
            model, tokenizer = mlx_embeddings.load(str(model_dir))
        _cast_for_device(model, dtype)
    except Exception as e:  # any failure here means the model cannot load
        raise ModelLoadError(f"cannot load embedding model from {model_dir}: {e}") from e
    return EncoderEmbedder(model, tokenizer, config, stream)


def _int(value: Any, default: int) -> int:
    return value if isinstance(value, int) and value > 0 else default
