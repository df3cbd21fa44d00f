"""Responses kept for `previous_response_id` and `GET /v1/responses/{id}` within the daemon's
lifetime (runs in the proxy): least recently used first out, bounded in count and in size."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import msgspec
from aiohttp import web

MAX_RESPONSES = 1000
MAX_BYTES = 64 * 2**20  # of stored conversations and responses, as JSON


@dataclass(frozen=True)
class Stored:
    conversation: list[dict]  # chat messages: its input (and what it continued) and its output
    response: dict  # the response object as it was sent
    size: int
    input_items: list[dict]  # its own input, as `input_items` lists it


class ResponseStore:
    def __init__(self, max_responses: int = MAX_RESPONSES, max_bytes: int = MAX_BYTES) -> None:
        self.max_responses, self.max_bytes = max_responses, max_bytes
        self._items: OrderedDict[str, Stored] = OrderedDict()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._items)

    def get(self, response_id: str) -> Stored | None:
        got = self._items.get(response_id)
        if got is not None:
            self._items.move_to_end(response_id)
        return got

    def put(self, response_id: str, conversation: list[dict], response: dict,
            input_items: list[dict] | None = None) -> None:
        items = input_items or []
        size = sum(len(msgspec.json.encode(x)) for x in (conversation, response, items))
        self.delete(response_id)
        if size > self.max_bytes:
            return  # larger than the whole store: kept by no one
        self._items[response_id] = Stored(conversation, response, size, items)
        self.bytes += size
        while len(self._items) > self.max_responses or self.bytes > self.max_bytes:
            _, old = self._items.popitem(last=False)
            self.bytes -= old.size

    def delete(self, response_id: str) -> bool:
        old = self._items.pop(response_id, None)
        if old is not None:
            self.bytes -= old.size
        return old is not None


RESPONSE_STORE = web.AppKey("response_store", ResponseStore)
