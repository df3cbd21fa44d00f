"""Which images each engine process holds, as far as this proxy sent them (runs in the
proxy's event loop), so that a request's images that the engine holds travel by their content
hash alone (`ImageInput.pixels` empty)."""

from __future__ import annotations

from collections import OrderedDict

import msgspec

from mlxd.protocol.messages import ImageInput

# An image sent to an engine this recently is sent again by its content hash alone: the
# engine's image table keeps every image it was sent for IMAGE_TTL_S (300 s) from its last
# use (engine/kinds/vision/image_table.py), so this leaves a margin for the clocks and the
# time in flight.
SENT_KEEP_S = 240.0
SENT_KEEP = 512  # images remembered per engine at most


class SentImages:
    """Which images each engine process holds, as far as this proxy sent them: by engine id
    and epoch (a restarted engine holds none), each image's content hash and when it last went
    there. A request's image that the engine holds travels without its pixels (3 MB for a
    1280 x 800 screenshot, a few milliseconds of copying and socket time per request); an
    engine that answers `image_unknown` all the same is sent the whole request again."""

    def __init__(self, keep_s: float = SENT_KEEP_S, keep: int = SENT_KEEP) -> None:
        self.keep_s, self.keep = keep_s, keep
        self._sent: dict[tuple[str, int], OrderedDict[bytes, float]] = {}
        self.by_hash = 0  # images sent without their pixels (/stats)
        self.again = 0  # of those, sent again whole: the engine did not hold them

    def slim(self, engine_id: str, epoch: int, images: list[ImageInput], now: float
             ) -> list[ImageInput] | None:
        """`images` with the pixels of those the engine holds left out, or None where it
        holds none of them."""
        held = self._sent.get((engine_id, epoch))
        if not held:
            return None
        fresh = now - self.keep_s
        out = [msgspec.structs.replace(img, pixels=b"")
               if held.get(img.key, fresh - 1) >= fresh else img for img in images]
        slim = sum(1 for img in out if not img.pixels)
        self.by_hash += slim
        return out if slim else None

    def sent(self, engine_id: str, epoch: int, images: list[ImageInput], now: float) -> None:
        """The engine admitted a request with `images`: it holds them from `now`."""
        for k in [k for k in self._sent if k[0] == engine_id and k[1] != epoch]:
            del self._sent[k]  # an older process of that engine
        held = self._sent.setdefault((engine_id, epoch), OrderedDict())
        for img in images:
            held[img.key] = now
            held.move_to_end(img.key)
        while len(held) > self.keep:
            held.popitem(last=False)

    def forget(self, engine_id: str, epoch: int, images: list[ImageInput]) -> None:
        """The engine did not hold some of `images` (sent by hash): none of its are trusted."""
        self.again += sum(1 for img in images if not img.pixels)
        self._sent.pop((engine_id, epoch), None)
