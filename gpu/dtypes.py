"""KV storage dtypes: float32, float16 and bfloat16, and how arrays carry them.

NumPy and CuPy have no bfloat16 dtype, so bfloat16 values travel as `uint16` arrays holding the
bit patterns (the top half of a float32). `Storage.encode` / `decode` convert from and to
float32 with round-to-nearest-even, on NumPy or CuPy arrays alike (pass the array module `xp`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

STORAGE_NAMES = ("float32", "float16", "bfloat16")


@dataclass(frozen=True)
class Storage:
    """One storage dtype: its name, the array dtype that holds it, and the conversions."""

    name: str
    array_dtype: np.dtype

    @property
    def itemsize(self) -> int:
        return self.array_dtype.itemsize

    def encode(self, xp, x):
        """Returns `x` rounded to this storage, as an array of `array_dtype`."""
        if self.name == "bfloat16":
            return bf16_from_float(xp, x)
        return xp.asarray(x).astype(self.array_dtype)

    def decode(self, xp, a):
        """Returns the stored values of `a` as float32."""
        if self.name == "bfloat16":
            return float_from_bf16(xp, a)
        return xp.asarray(a).astype(np.float32)


_STORAGES = {
    "float32": Storage("float32", np.dtype(np.float32)),
    "float16": Storage("float16", np.dtype(np.float16)),
    "bfloat16": Storage("bfloat16", np.dtype(np.uint16)),
}


def storage(name: str) -> Storage:
    """Returns the storage called `name`.

    Raises:
        ValueError: `name` is not one of STORAGE_NAMES.
    """
    try:
        return _STORAGES[name]
    except KeyError:
        raise ValueError(f"dtype {name!r} is not a KV storage dtype; use one of {', '.join(STORAGE_NAMES)}") from None


def storage_of(array) -> Storage:
    """Returns the storage an array holds: float32, float16, or bfloat16 bits in a uint16 array.

    Raises:
        ValueError: the array's dtype is none of those.
    """
    for s in _STORAGES.values():
        if array.dtype == s.array_dtype:
            return s
    raise ValueError(f"array dtype {array.dtype} is not a KV storage dtype (float32, float16, uint16 = bfloat16 bits)")


def bf16_from_float(xp, x):
    """Returns bfloat16 bit patterns (uint16) of `x`, rounded to nearest even; NaN stays NaN."""
    u = xp.ascontiguousarray(xp.asarray(x, dtype=np.float32)).view(np.uint32)
    rounded = ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(np.uint16)
    is_nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    return xp.where(is_nan, np.uint16(0x7FC0), rounded)


def float_from_bf16(xp, bits):
    """Returns the float32 values of bfloat16 bit patterns (exact)."""
    return (xp.asarray(bits).astype(np.uint32) << np.uint32(16)).view(np.float32)
