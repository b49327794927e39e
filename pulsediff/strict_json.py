"""JSON read from files pulsediff does not trust: bounded before it is parsed.

Python's `json` recurses once per nesting level, so a header of ten thousand
`[` raises RecursionError from inside the parser; and it keeps the last of two
equal keys, so two readers of one file could disagree. `loads` measures the
nesting depth first (a scan that skips string literals) and refuses duplicate
keys, raising `JsonError` (a ValueError) with a reason the caller wraps in its
own PulsediffError.
"""

from __future__ import annotations

import json
import re

MAX_DEPTH = 32  # our formats nest 5 levels at most; safetensors headers 3

# A JSON string literal: escapes may hide a quote, nothing else can (written unrolled: 2x faster).
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKETS = bytes(c for c in range(256) if c not in b"[]{}")


class JsonError(ValueError):
    """Not JSON, or JSON outside the bounds a reader accepts."""


def nesting_depth(data: bytes) -> int:
    """How deep arrays and objects nest in `data` (brackets inside strings do not count)."""
    if b"\\" in data:
        outside = _STRING.sub(b"", data)
    else:  # no escapes: every other quote opens a string, and splitting is C speed (20x the regex)
        outside = b"".join(data.split(b'"')[::2])
    brackets = outside.translate(None, _NOT_BRACKETS)
    depth = deepest = 0
    for c in brackets:
        if c in b"[{":
            depth += 1
            deepest = max(deepest, depth)
        else:
            depth -= 1
    return deepest


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise JsonError(f"key {dup[:64]!r} appears twice in one object")
    return obj


def loads(data: bytes, *, max_depth: int = MAX_DEPTH) -> object:
    """Parse UTF-8 JSON that nests at most `max_depth` levels and repeats no key; JsonError otherwise."""
    if nesting_depth(data) > max_depth:
        raise JsonError(f"nested deeper than {max_depth} levels")
    try:
        return json.loads(data.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except UnicodeDecodeError:
        raise JsonError("not UTF-8") from None
    except JsonError:
        raise
    except ValueError as exc:  # JSONDecodeError, or an integer of more than 4300 digits
        raise JsonError(str(exc).split("\n")[0][:200]) from None
