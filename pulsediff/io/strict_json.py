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

# A \u escape of a UTF-16 surrogate: the only way JSON text can spell one (the bytes are UTF-8).
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_CHUNK = 1 << 18  # a chunk of quotes splits into ~50 bytes per byte: 13 MB at most
_NOT_QUOTES_BRACKETS_COLONS = bytes(c for c in range(256) if c not in b'[]{}":')


class JsonError(ValueError):
    """Not JSON, or JSON outside the bounds a reader accepts."""


def _containers(data: bytes) -> bytes:
    """The brackets of `data` that lie outside string literals, in order."""
    return _outside_strings(data).replace(b":", b"")


def _outside_strings(data: bytes) -> bytes:
    """The brackets and colons of `data` that lie outside string literals, in order. Linear time, and memory
    within a small multiple of len(data): text of nothing but quotes (or backslashes) must not
    become one Python object per byte (64 MiB of quotes took 2.8 GB and 10 s), so the quotes split
    a chunk at a time.

    Escapes go first: pairs of backslashes, then a backslash before a quote. In a string, a run of
    backslashes pairs up from its start as the parser reads it, and what remains before a quote
    escapes it. Outside a string JSON has no backslash, so the parser stops there, and what it
    nests before that point is counted the same. Counting from the start, each quote left then
    opens or closes a string.
    """
    if b"\\" in data:
        data = data.replace(b"\\\\", b"").replace(b'\\"', b"")
    # Only quotes and brackets matter. Two quotes side by side then are a string with no bracket
    # in it, or one string's end and the next one's start: dropping them leaves every bracket
    # with the same parity of quotes before it. Most strings go this way, at C speed.
    data = data.translate(None, _NOT_QUOTES_BRACKETS_COLONS).replace(b'""', b"")
    out = []
    in_string = False
    for start in range(0, len(data), _CHUNK):
        parts = data[start:start + _CHUNK].split(b'"')
        out.append(b"".join(parts[1 if in_string else 0::2]))
        in_string ^= len(parts) % 2 == 0  # an odd number of quotes in the chunk
    return b"".join(out)


_ONE_KIND = bytes.maketrans(b"[{]}", b"(())")  # the count below does not tell the kinds apart either


def _depth(brackets: bytes) -> int:
    """How deep `brackets` nest, as _depth_counted counts them. Each pass drops every innermost
    pair (a C-speed replace, which does not look again at a pair it forms), and so one level of
    balanced brackets (any JSON text); other text, or more than MAX_DEPTH passes, is counted
    bracket by bracket."""
    rest = brackets.translate(_ONE_KIND)
    for passes in range(MAX_DEPTH + 1):
        if not rest:
            return passes
        shorter = rest.replace(b"()", b"")
        if len(shorter) == len(rest):
            break
        rest = shorter
    return _depth_counted(brackets)


def _depth_counted(brackets: bytes) -> int:
    depth = deepest = 0
    for c in brackets:
        if c in b"[{":
            depth += 1
            deepest = max(deepest, depth)
        else:
            depth -= 1
    return deepest


def nesting_depth(data: bytes) -> int:
    """How deep arrays and objects nest in `data` (brackets inside strings do not count)."""
    return _depth(_containers(data))


def _members(obj: object) -> int:
    """How many members the objects in `obj` hold, all together."""
    total, stack = 0, [obj]
    while stack:
        node = stack.pop()
        if type(node) is dict:
            total += len(node)
            node = node.values()
        elif type(node) is not list:
            continue
        for value in node:
            kind = type(value)
            if kind is dict or kind is list:
                stack.append(value)
    return total


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise JsonError(f"key {dup[:64]!r} appears twice in one object")
    return obj


def loads(data: bytes, *, max_depth: int = MAX_DEPTH, max_containers: int | None = None) -> object:
    """Parse UTF-8 JSON that nests at most `max_depth` levels, holds at most `max_containers` arrays
    and objects (each costs ~20x its two bytes once parsed), and repeats no key; JsonError otherwise."""
    outside = _outside_strings(data)
    brackets = outside.replace(b":", b"")
    if max_containers is not None and brackets.count(b"[") + brackets.count(b"{") > max_containers:
        raise JsonError(f"more than {max_containers} arrays and objects")
    if _depth(brackets) > max_depth:
        raise JsonError(f"nested deeper than {max_depth} levels")
    try:
        text = data.decode("utf-8")
        obj = json.loads(text)
        # Each member of an object has one colon outside strings: where the objects parsed hold
        # fewer members, a key came twice. Parsed again to name it (a hook per object costs a
        # third of the parse; the count, a tenth).
        if _members(obj) != len(outside) - len(brackets):
            json.loads(text, object_pairs_hook=_no_duplicates)
            raise JsonError("a key appears twice in one object")  # not reached: the hook names it
    except UnicodeDecodeError:
        raise JsonError("not UTF-8") from None
    except JsonError:
        raise
    except ValueError as exc:  # JSONDecodeError, or an integer of more than 4300 digits
        raise JsonError(str(exc).split("\n")[0][:200]) from None
    except MemoryError:  # within the size bound, small values can still cost ~5x their bytes once parsed
        raise JsonError("too large to parse in the memory this process may use") from None
    # JSON may escape a lone surrogate ("\ud800"); Python keeps it in a str that no UTF-8 encoder (a
    # digest, a file name) accepts. Pairs (an escaped emoji) decode to one character and pass.
    if _SURROGATE_ESCAPE.search(data):
        try:
            json.dumps(obj, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise JsonError("a string holds a lone surrogate, which is not Unicode text") from None
    return obj
