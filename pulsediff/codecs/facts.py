"""What a patch's header says about each codec, known without loading the codec's kernels.

Reading a header (`stats PATCH`, catch-up's check of a file, a manifest's plan) needs, per
section: whether its codec patches a base, how many changed elements its params claim, and how
many of its bytes carry positions. Those facts live here, in plain Python, so that reading a
header never imports Numba (~0.5 s at a command's start); the codecs themselves (get_codec) are
loaded on first use. Each codec class takes its header-level answers from its entry here.
"""

from __future__ import annotations

from dataclasses import dataclass

from pulsediff.errors import UnknownCodecError


def uint_param(params: dict, key: str, default: int | None = None) -> int:
    """A params field as a non-negative int, or -1 when it is missing or not one (callers refuse -1).

    Header-level methods (changed_count, index_bytes) run before any section
    is decoded, on params nobody has checked yet: JSON may hold a string, a
    float, true or a list where a count belongs.
    """
    value = params.get(key, default)
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else -1


@dataclass(frozen=True)
class CodecFacts:
    id: str
    needs_base: bool  # patches a base (sparse), or carries a whole tensor
    count_key: str | None  # the params field holding the changed elements, when it is stated
    index_keys: tuple[str, ...]  # the params fields whose sum is the bytes that carry positions

    def changed_count(self, params: dict) -> int | None:
        """Changed elements the section carries, when its params say (-1: said badly)."""
        return uint_param(params, self.count_key) if self.count_key else None

    def index_bytes(self, params: dict) -> int:
        """Bytes of the section that carry positions (-1: a size said badly)."""
        sizes = [uint_param(params, key) for key in self.index_keys]
        return -1 if any(size < 0 for size in sizes) else sum(sizes)


FACTS: dict[str, CodecFacts] = {f.id: f for f in (
    CodecFacts("gap-zstd", True, "count", ("gap_bytes",)),
    CodecFacts("ctx-rans", True, "count", ("table_bytes", "position_bytes")),
    CodecFacts("ctx-ac", True, "count", ("position_bytes",)),
    CodecFacts("full-zstd", False, None, ()),
)}


def facts_of(codec_id: object) -> CodecFacts:
    facts = FACTS.get(codec_id) if isinstance(codec_id, str) else None
    if facts is None:
        raise UnknownCodecError(str(codec_id))
    return facts
