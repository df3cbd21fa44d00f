"""Admission of requests with images to a vision engine (on an admission lane, never the MLX
thread): the prompt rendered with the processor's image marker where each image goes, each
marker expanded into the image's token ids (see `model.py`), the image's pixel values
computed by the model's image processor and its features by the vision tower (here, beside
the decode steps), registered for the MLX thread. The proxy decoded
the images and checked their limits; here the pixels' size and content hash are checked again
(a request can never make the engine read past its buffer or reuse another image's cache).
Requests without images go through the text engine's admission unchanged."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import msgspec

from mlxd.engine.admit import prepare as admission
from mlxd.engine.admit.prepare import Admitted, Answered, ClientError
from mlxd.engine.batch.messages import AddRequest
from mlxd.engine.kinds.base import Lookup
from mlxd.engine.kinds.vision.image_table import VIRTUAL_BASE, pixels_key
from mlxd.engine.kinds.vision.model import VisionParts
from mlxd.engine.state import LoadedModel
from mlxd.protocol.messages import Delta, Generate, ImageInput

log = logging.getLogger("mlxd.engine")

# Tiles a request's images may take in a tiling family (idefics3, smolvlm), each image's global
# view included: the vision tower's work (and memory) for one request, which runs on an
# admission lane (at SmolVLM's 17 tiles for a large image, three large images and more).
MAX_TILES = 64


class VisionAdmission:
    def __init__(self, parts: VisionParts) -> None:
        self.parts = parts

    def prepare(self, msg: Generate, model: LoadedModel, lookup: Lookup,
                received_at: float) -> Admitted | Answered:
        if not msg.images:
            return admission.prepare(msg, model, lookup.restore, received_at)
        try:
            return self._prepare(msg, model, lookup, received_at)
        except ClientError as e:
            return Answered([Delta(msg.request_id, finish_reason="error", error=str(e),
                                   error_code=e.code)])
        except Exception as e:  # a bad request must never hurt the engine
            log.exception("request %s (with images) could not be prepared", msg.request_id)
            return Answered([Delta(msg.request_id, finish_reason="error", error=f"invalid "
                                   f"request: {str(e)[:500]}", error_code="invalid_request")])

    def _prepare(self, msg: Generate, model: LoadedModel, lookup: Lookup,
                 received_at: float) -> Admitted | Answered:
        from mlxd.engine.admit.sampling import make_request_sampler
        rid, tok, parts = msg.request_id, model.tokenizer, self.parts
        if msg.prompt_token_ids is not None or msg.suffix is not None:
            raise ClientError("images go with chat messages or a text prompt, not with token "
                              "ids or fill-in-the-middle", "invalid_request")
        admission.check_prompt_size(msg, model.context_length, model.max_token_bytes)
        msg = msgspec.structs.replace(msg, images=[self._held(i, img)
                                                   for i, img in enumerate(msg.images)])
        if parts.tiles is not None:
            tiles = sum(parts.tiles(img.width, img.height) for img in msg.images)
            if tiles > MAX_TILES:
                raise ClientError(f"the request's images take {tiles} tiles (the global views "
                                  f"included); at most {MAX_TILES} are accepted a request",
                                  "image_too_large")
        layouts = ([parts.layout(img.width, img.height) for img in msg.images]
                   if parts.layout is not None else None)
        marked = self._marked_tokens(msg, tok, layouts)
        # An image is one image token in `marked` (llava: the marker) or one per position (a
        # family whose processor lays the image out in the prompt's text: gemma3, mistral3).
        sizes = [parts.tokens_per_image] * len(msg.images) if layouts is None \
            else [n for _, n in layouts]
        marks = sum(1 for t in marked if t == parts.image_token_id)
        if layouts is None and marks != len(msg.images):
            raise ClientError(f"the prompt holds {marks} image markers ({parts.image_token!r}) "
                              f"for {len(msg.images)} images", "invalid_request")
        if layouts is not None and marks != sum(sizes):  # image tokens typed into the text
            raise ClientError(f"the prompt holds {marks} image tokens where its images take "
                              f"{sum(sizes)}", "invalid_request")
        ids = [parts.images.ids_for(img, n, parts.grid(img.width, img.height)
                                    if parts.grid is not None else None)
               for img, n in zip(msg.images, sizes, strict=True)]
        prompt: list[int] = []
        ends: list[int] = []  # where each image's tokens end
        k = j = 0  # image k's j-th position comes next
        for t in marked:
            if t != parts.image_token_id:
                prompt.append(t)
            elif layouts is None:
                prompt.extend(ids[k])
                ends.append(len(prompt))
                k += 1
            else:
                prompt.append(ids[k][j])
                j += 1
                if j == len(ids[k]):
                    ends.append(len(prompt))
                    k, j = k + 1, 0
        if prompt[-1] >= VIRTUAL_BASE:
            raise ClientError("the prompt ends with an image: add text after it",
                              "invalid_request")
        admission.check_logit_bias(msg, len(tok))
        if msg.count_only:
            return Answered([Delta(rid, prompt_tokens=len(prompt)),
                             Delta(rid, finish_reason="length", prompt_tokens=len(prompt))])
        p = msg.sampling
        max_tokens = max(1, min(p.max_tokens, admission.room_for(prompt, model.context_length)))
        resumed = list(msg.resume_token_ids)
        shown = [t if t < VIRTUAL_BASE else parts.image_token_id for t in prompt]
        out = admission.request_output(tok, msg, shown, model.eos_ids)
        if resumed:
            out.prime(resumed, msg.resume_text_len)
            max_tokens -= len(resumed)
            prompt = prompt + resumed
            if max_tokens < 1:
                return Answered([Delta(rid, prompt_tokens=out.prompt_tokens),
                                 Delta(rid, finish_reason="length",
                                       prompt_tokens=out.prompt_tokens,
                                       completion_tokens=out.completion_tokens)])
        # An image a cache covers needs no pixel values: the processor runs only for the rest.
        restored = lookup.restore(prompt)
        cached = max(lookup.peek(prompt), restored.tokens if restored is not None else 0)
        for img, n, end in zip(msg.images, sizes, ends, strict=True):
            values = None if end <= cached or parts.images.encoded_image(img.key) \
                else parts.images.preprocess(img)
            parts.images.register(img, n, values, parts.grid(img.width, img.height)
                                  if parts.grid is not None else None)
            if values is not None:
                parts.images.encode_now(img.key)
        request = AddRequest(rid, prompt, max_tokens,
                             make_request_sampler(p, start_position=len(resumed)),
                             _real_ids(admission.processors(
                                 msg, model.grammar_tokenizer, resumed, max_tokens,
                                 admission.default_tool_grammar(tok, msg)),
                                       parts.image_token_id),
                             restored=restored, received_at=received_at,
                             logprobs=p.logprobs, group=msg.prefill_group,
                             group_size=msg.group_size, snapshot_at=tuple(ends),
                             speculate=False)
        return Admitted(out, request, Delta(rid, prompt_tokens=out.prompt_tokens))

    def _held(self, i: int, img: ImageInput) -> ImageInput:
        """The image checked, or, sent without its pixels, as the image table holds it: its
        pixels where it holds them, else (its features held) as sent."""
        if img.pixels:
            _check(i, img)
            return img
        held = self.parts.images.held(img.key)
        if held is None:
            raise ClientError(f"image {i} came without its pixels and this engine does not hold "
                              "it (the proxy sends it again whole)", "image_unknown")
        return held if held.pixels else img

    def _marked_tokens(self, msg: Generate, tok: Any,
                       layouts: list[tuple[str, int]] | None) -> list[int]:
        """The prompt's tokens, each image's positions held by the image token."""
        marked = self._with_markers(msg, tok)
        if layouts is None:
            return admission.prompt_tokens(tok, marked)
        # As the family's processor does: each marker in the rendered text replaced by its
        # image's text, then the whole tokenized (its newlines may merge with the text around).
        if marked.messages is not None:
            text = str(admission.render_chat(tok, marked, tokenize=False))
        else:
            text = marked.prompt or ""
        pieces = text.split(self.parts.image_token)
        if len(pieces) != len(layouts) + 1:
            raise ClientError(f"the prompt holds {len(pieces) - 1} image markers "
                              f"({self.parts.image_token!r}) for {len(layouts)} images",
                              "invalid_request")
        text = pieces[0] + "".join(t + p for (t, _), p in zip(layouts, pieces[1:], strict=True))
        return list(tok.encode(text, add_special_tokens=False))

    def _with_markers(self, msg: Generate, tok: Any) -> Generate:
        """The request as text: each image part becomes the processor's image marker (inside
        the messages' text for templates that take strings; as an image part for templates
        that render parts themselves); with a plain prompt, the images come first."""
        marker = self.parts.image_token
        if msg.messages is None:
            return msgspec.structs.replace(msg, prompt=marker * len(msg.images)
                                           + (msg.prompt or ""))
        takes_parts = "image" in str(getattr(tok, "chat_template", None) or "")
        messages = []
        for m in msg.messages:
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, list):
                if takes_parts:
                    content = [{"type": "image"} if c.get("type") == "image" else c
                               for c in content]
                else:
                    content = "".join(marker if c.get("type") == "image"
                                      else str(c.get("text") or "") for c in content)
                m = {**m, "content": content}
            messages.append(m)
        return msgspec.structs.replace(msg, messages=messages)



def _check(i: int, img: ImageInput) -> None:
    """The pixels fit the size, and the content hash is theirs."""
    if img.width < 1 or img.height < 1 or len(img.pixels) != img.width * img.height * 3:
        raise ClientError(f"image {i}: its pixels do not match its size", "invalid_request")
    if pixels_key(img.width, img.height, img.pixels) != img.key:
        raise ClientError(f"image {i}: its content hash does not match its pixels",
                          "invalid_request")


def _real_ids(processors: list, image_token_id: int) -> list:
    """Logits processors that see real token ids in their context (penalties index the
    logits by the context's ids; an image's ids are beyond the vocabulary)."""
    def wrap(p: Callable[[mx.array, mx.array], mx.array]) -> Callable[[mx.array, mx.array],
                                                                       mx.array]:
        def real(tokens: mx.array, logits: mx.array) -> mx.array:
            if tokens is not None:
                tokens = mx.where(tokens >= VIRTUAL_BASE, image_token_id, tokens)
            return p(tokens, logits)
        return real
    return [wrap(p) for p in processors]
