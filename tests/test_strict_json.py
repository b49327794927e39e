"""strict_json: the nesting scan agrees with the parsed depth on any JSON, and the bounds hold."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pulsediff.io.strict_json import JsonError, loads, nesting_depth

# Strings full of the characters the scan must see through: brackets, colons, quotes, backslashes.
tricky_text = st.text(alphabet='[]{}:"\\ab\u00e9', max_size=8)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | tricky_text,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(tricky_text, inner, max_size=4),
    max_leaves=30,
)


def depth(value) -> int:
    if isinstance(value, dict):
        return 1 + max(map(depth, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(depth, value), default=0)
    return 0


@given(json_values, st.booleans())
def test_scan_depth_is_the_parsed_depth(value, ascii_only):
    data = json.dumps(value, ensure_ascii=ascii_only).encode()
    assert nesting_depth(data) == depth(value)
    assert loads(data, max_depth=64) == value


@given(st.text(alphabet="[]{}", max_size=80))
def test_depth_by_innermost_pairs_is_the_depth_counted_bracket_by_bracket(brackets):
    """strict_json._depth drops innermost pairs pass by pass; on any bracket text, balanced or not,
    it must say what the plain count says (one level deeper than allowed is what it refuses)."""
    from pulsediff.io import strict_json

    data = brackets.encode()
    assert strict_json._depth(data) == strict_json._depth_counted(data)
    nested = b"[{" * 20 + b"}]" * 20  # 40 levels: past MAX_DEPTH passes, counted
    assert strict_json._depth(nested) == strict_json._depth_counted(nested) == 40


def _containers_by_parity(data: bytes) -> bytes:
    """The brackets outside strings, by the plain rule: escapes dropped, then each bracket kept
    when an even number of quotes comes before it."""
    data = data.replace(b"\\\\", b"").replace(b'\\"', b"")
    out, quotes = [], 0
    for c in data:
        if c == ord('"'):
            quotes += 1
        elif c in b"[]{}" and quotes % 2 == 0:
            out.append(c)
    return bytes(out)


@given(st.text(alphabet='[]{}"\\a:', max_size=60))
def test_containers_are_the_brackets_outside_strings(text):
    from pulsediff.io import strict_json

    data = text.encode()
    assert strict_json._containers(data) == _containers_by_parity(data)


@pytest.mark.parametrize("data, reason", [
    (b"[" * 100_000 + b"]" * 100_000, "nested deeper"),
    (b'{"a": [[[[[1]]]]]}', "nested deeper"),  # 6 levels, 5 allowed below
    (b'{"k": 1, "k": 2}', "appears twice"),
    (b'"\xff"', "not UTF-8"),
    (b"[1" + b"0" * 5000 + b"]", "digits"),
    (b"{", "Expecting"),
])
def test_bounds(data, reason):
    with pytest.raises(JsonError, match=reason):
        loads(data, max_depth=5)


def test_scan_is_linear_with_escapes():
    """An unterminated string full of escaped quotes made the regex scan quadratic (41 s at 80 KB)."""
    import time

    data = b'"' + b'\\"' * 500_000
    t0 = time.perf_counter()
    assert nesting_depth(data) == 0
    assert time.perf_counter() - t0 < 5


@given(json_values, st.booleans(), st.integers(0, 1000))
def test_a_repeated_key_is_refused_at_any_depth(value, ascii_only, seed):
    """Duplicates are found by counting keys against the colons outside strings: a key repeated
    anywhere, among keys full of colons and quotes, is named; JSON without one parses as it is."""
    import random

    data = json.dumps(value, ensure_ascii=ascii_only)
    assert loads(data.encode(), max_depth=64) == value
    rng = random.Random(seed)
    objects = [i for i, c in enumerate(data) if c == "{" and _outside_strings(data, i)]
    if not objects:
        return
    at = rng.choice(objects) + 1
    key = json.dumps(rng.choice(["a", "b:", '"}', "\\:"]), ensure_ascii=ascii_only)
    twice = data[:at] + f"{key}: 1, {key}: 2" + ("," if data[at] != "}" else "") + data[at:]
    with pytest.raises(JsonError, match="appears twice"):
        loads(twice.encode(), max_depth=64)


def _outside_strings(text: str, index: int) -> bool:
    """Whether text[index] lies outside JSON string literals (a plain walk, as the parser reads)."""
    in_string = escaped = False
    for c in text[:index]:
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
    return not in_string


def test_container_bound():
    with pytest.raises(JsonError, match="arrays and objects"):
        loads(b"[" + b"{}," * 1000 + b"{}]", max_containers=100)
    assert len(loads(b"[" + b"{}," * 98 + b"{}]", max_containers=100)) == 99


def brackets_of(value) -> bytes:
    """The reference: the brackets json.dumps writes for `value`, from its structure alone."""
    if isinstance(value, dict):
        return b"{" + b"".join(brackets_of(v) for v in value.values()) + b"}"
    if isinstance(value, list):
        return b"[" + b"".join(brackets_of(v) for v in value) + b"]"
    return b""


@given(json_values, st.booleans(), st.integers(1, 9))
def test_containers_across_chunk_boundaries(value, ascii_only, chunk):
    """The scan reads a chunk at a time (of 256 KiB; here a few bytes, so that boundaries fall
    inside strings and between the two bytes of an escape): the brackets outside strings, exactly."""
    from unittest import mock

    from pulsediff.io import strict_json

    data = json.dumps(value, ensure_ascii=ascii_only).encode()
    with mock.patch.object(strict_json, "_CHUNK", chunk):
        assert strict_json._containers(data) == brackets_of(value)


@pytest.mark.parametrize("unit", [b'"', b"\\", b"\\xab", b'\\"', b'[\\"'])
def test_quotes_and_escapes_do_not_become_objects(unit):
    """Text of nothing but quotes (a header frame can declare 256 MiB of them) once became one
    Python object per quote: 64 MiB took 2.8 GB. A regex taking out escapes did the same per
    backslash (found by review). Now the scan holds a few copies at most, and a chunk's split."""
    import tracemalloc

    data = unit * ((8 << 20) // len(unit))
    tracemalloc.start()
    try:
        nesting_depth(data)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 32 << 20, peak
