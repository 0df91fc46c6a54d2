"""Kubernetes resource quantities (`100m`, `1Gi`, `2`, `1e3`) as exact fractions."""

from __future__ import annotations

import re
from fractions import Fraction

_SUFFIXES = {
    "": Fraction(1), "n": Fraction(1, 10**9), "u": Fraction(1, 10**6), "m": Fraction(1, 1000),
    "k": Fraction(10**3), "M": Fraction(10**6), "G": Fraction(10**9), "T": Fraction(10**12),
    "P": Fraction(10**15), "E": Fraction(10**18),
    "Ki": Fraction(2**10), "Mi": Fraction(2**20), "Gi": Fraction(2**30), "Ti": Fraction(2**40),
    "Pi": Fraction(2**50), "Ei": Fraction(2**60),
}
_PATTERN = re.compile(r"^([+-]?[0-9.]+)([eE][+-]?[0-9]+|[a-zA-Z]*)$")


class QuantityError(ValueError):
    pass


def parse(value: object) -> Fraction:
    text = str(value).strip()
    match = _PATTERN.match(text)
    if not match:
        raise QuantityError(
            f"quantities must match the regular expression "
            f"'^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$': {text!r}"
        )
    number, suffix = match.groups()
    try:
        base = Fraction(number)
    except ValueError as exc:
        raise QuantityError(f"invalid quantity {text!r}") from exc
    if suffix[:1] in ("e", "E"):
        return base * Fraction(10) ** int(suffix[1:])
    if suffix not in _SUFFIXES:
        raise QuantityError(f"unable to parse quantity's suffix {suffix!r}")
    return base * _SUFFIXES[suffix]


def text(value: Fraction) -> str:
    """A compact canonical form (integers plain, else milli)."""
    if value.denominator == 1:
        return str(value.numerator)
    return f"{round(value * 1000)}m"
