"""Kubernetes quantities to bytes, and bytes to the whole MiB that enforcement works in.

Drivers, MPS and the toolkit hook take whole MiB, so every amount becomes MiB by ceiling: rounding down
would hand a container less than it asked for (``1000M`` is 953.67 MiB, so it becomes 954 MiB). Arithmetic
is exact (``Fraction``), because float rounding at a MiB boundary would break that promise.

An amount below 1 MiB is rejected rather than rounded up: in practice it is a bare number written as if
it were MiB (``"4096"`` is 4096 bytes), and silently granting 1 MiB would hide that mistake.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction

from gpufrac.contract.errors import (
    MAX_QUANTITY_CHARS,
    BelowMinimum,
    NotAQuantity,
    NotPositive,
    QuantityTooLong,
    TooLarge,
    UnknownQuantitySuffix,
)

MIB = 1 << 20
MAX_BYTES = (1 << 63) - 1  # what a Kubernetes quantity can hold as an int64 value

_BINARY_SUFFIXES = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "Pi": 1 << 50, "Ei": 1 << 60}
_DECIMAL_SUFFIXES: dict[str, Fraction] = {
    "m": Fraction(1, 1000),
    "": Fraction(1),
    "k": Fraction(10**3),
    "M": Fraction(10**6),
    "G": Fraction(10**9),
    "T": Fraction(10**12),
    "P": Fraction(10**15),
    "E": Fraction(10**18),
}
# ASCII digits only, as Kubernetes: Python's \d matches every Unicode digit, and Fraction() accepts them.
_NUMBER = re.compile(r"([+-]?)(\d+\.?\d*|\.\d+)(.*)", re.DOTALL | re.ASCII)
_EXPONENT = re.compile(r"[eE]([+-]?\d{1,6})", re.ASCII)
_LETTERS = re.compile(r"[A-Za-z]+", re.ASCII)
_MAX_EXPONENT = 40  # beyond this any non-zero number is below 1 byte or above MAX_BYTES


def parse_bytes(text: str, *, key: str) -> Fraction:
    """The exact number of bytes in a positive quantity; raises a ``RuleViolation`` naming ``key``."""
    value = text.strip()
    if len(value) > MAX_QUANTITY_CHARS:
        raise QuantityTooLong(key=key, value=text, detail=f"it has {len(value)}")
    if not value.isascii():
        raise NotAQuantity(key=key, value=text, detail="only the ASCII digits 0-9 are digits in a quantity")
    match = _NUMBER.fullmatch(value)
    if match is None:
        raise NotAQuantity(key=key, value=text)
    sign, digits, suffix = match.groups()
    number = Fraction(digits if not digits.endswith(".") else digits[:-1])
    if exponent := _EXPONENT.fullmatch(suffix):
        power = int(exponent.group(1))
        if number != 0 and power > _MAX_EXPONENT:
            raise TooLarge(key=key, value=text)
        multiplier = Fraction(10) ** max(power, -_MAX_EXPONENT)
    elif suffix in _BINARY_SUFFIXES:
        multiplier = Fraction(_BINARY_SUFFIXES[suffix])
    elif suffix in _DECIMAL_SUFFIXES:
        multiplier = _DECIMAL_SUFFIXES[suffix]
    elif _LETTERS.fullmatch(suffix):
        raise UnknownQuantitySuffix(key=key, value=text, detail=f'"{suffix}" is not one')
    else:
        raise NotAQuantity(key=key, value=text)
    amount = number * multiplier
    if sign == "-" and amount != 0:
        raise NotPositive(key=key, value=text, detail="it is negative")
    if amount == 0:
        raise NotPositive(key=key, value=text)
    if amount > MAX_BYTES:
        raise TooLarge(key=key, value=text)
    return amount


def bytes_to_mib(amount: int | Fraction) -> int:
    """Whole MiB holding ``amount`` bytes: rounded up, at least 1 (for any positive amount)."""
    if amount <= 0:
        raise ValueError(f"bytes_to_mib needs a positive amount, got {amount}")
    return max(1, math.ceil(Fraction(amount) / MIB))


def parse_mib(text: str, *, key: str) -> int:
    """A GPU memory quantity as whole MiB (ceiling); below 1 MiB is an error, not 1 MiB."""
    amount = parse_bytes(text, key=key)
    if amount < MIB:
        raise BelowMinimum(key=key, value=text)
    return bytes_to_mib(amount)


def format_mib(mib: int) -> str:
    """The quantity the contract writes for ``mib`` whole MiB (``40960Mi``)."""
    if mib < 1:
        raise ValueError(f"format_mib needs at least 1 MiB, got {mib}")
    return f"{mib}Mi"
