"""The safetensors element types pulsediff knows, and how to view their bits.

pulsediff compares and patches *bit patterns*: every element is handled as an
unsigned integer of its own width, so NaNs, signed zeros and every other
special value survive bit for bit and no floating-point arithmetic is ever
done on weights (except the BF16 cast of `--precision bf16`, which torch does).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np



@dataclass(frozen=True)
class DType:
    name: str  # safetensors spelling, e.g. "BF16"
    itemsize: int  # bytes per element
    is_float: bool  # cast to BF16 under --precision bf16
    torch_name: str | None  # attribute of `torch` (None: torch lacks it)

    @property
    def bits_dtype(self) -> np.dtype:
        """The unsigned integer type whose values are this type's bit patterns."""
        found = _BITS_DTYPES.get(self.itemsize)
        if found is None:
            import numpy as np  # not at import: reading a header needs no numpy

            found = _BITS_DTYPES[self.itemsize] = np.dtype(f"<u{self.itemsize}")
        return found


_BITS_DTYPES: dict = {}  # itemsize -> its unsigned NumPy dtype (asked for per tensor: a microsecond each)


_ALL = [
    DType("BOOL", 1, False, "bool"),
    DType("U8", 1, False, "uint8"),
    DType("I8", 1, False, "int8"),
    DType("F8_E5M2", 1, True, "float8_e5m2"),
    DType("F8_E4M3", 1, True, "float8_e4m3fn"),
    DType("F8_E8M0", 1, True, "float8_e8m0fnu"),
    DType("I16", 2, False, "int16"),
    DType("U16", 2, False, "uint16"),
    DType("F16", 2, True, "float16"),
    DType("BF16", 2, True, "bfloat16"),
    DType("I32", 4, False, "int32"),
    DType("U32", 4, False, "uint32"),
    DType("F32", 4, True, "float32"),
    DType("I64", 8, False, "int64"),
    DType("U64", 8, False, "uint64"),
    DType("F64", 8, True, "float64"),
]

DTYPES: dict[str, DType] = {d.name: d for d in _ALL}
BF16 = DTYPES["BF16"]


def lookup(name: str) -> DType | None:
    return DTYPES.get(name)
