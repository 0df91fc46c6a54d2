"""Kubernetes resource quantities as kube-apiserver reads and writes them: one home for the
grammar, the canonical form, and how Tessera reads a GPU memory quantity. Pure; no I/O.

Facts (API reference "Quantity"; k8s.io/apimachinery `resource.ParseQuantity`,
`Quantity.CanonicalizeBytes`, `suffix.go`), the code is ours:

- `<signedNumber><suffix>`; suffix one of the binary SI `Ki Mi Gi Ti Pi Ei`, the decimal SI
  `n u m "" k M G T P E`, or a decimal exponent `e<n>` / `E<n>` (`E` alone is exa). A parsed
  quantity remembers its format family (BinarySI, DecimalSI, DecimalExponent).
- Precision below 1n is rounded up (away from zero); a BinarySI value is capped at 2^63-1, and
  a BinarySI value between 0 and 1 becomes DecimalSI.
- Before it is serialised a quantity is put in canonical form: no fractional digits, no
  precision lost, the largest exponent (a multiple of 3) or suffix possible, the family kept —
  `3000` → `3k`, `1.5` → `1500m`, `1.5Gi` → `1536Mi`, `4096` stays `4096`, `1e3` stays `1e3`,
  `10000` → `10k`, `1e4` → `10e3`. A BinarySI value below 1024 in magnitude, or not a whole
  number, is written in DecimalSI (`512Ki`... stays; `0.5Ki` → `512`, `1.5Ki` → `1536`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum
from fractions import Fraction

REGEX_TEXT = "^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$"
FORMAT_MESSAGE = f"quantities must match the regular expression '{REGEX_TEXT}'"
_NUMBER = re.compile(r"^([+-]?)([0-9]*)(?:\.([0-9]*))?")
_DECIMAL_SUFFIXES = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12,
                     "P": 15, "E": 18}
_EXPONENT_SUFFIX = {exponent: suffix for suffix, exponent in _DECIMAL_SUFFIXES.items()}
_BINARY_SUFFIXES = {"Ki": 10, "Mi": 20, "Gi": 30, "Ti": 40, "Pi": 50, "Ei": 60}
_BINARY_BY_POWER = {power // 10: suffix for suffix, power in _BINARY_SUFFIXES.items()}
_NANO = Fraction(1, 10**9)
_MAX_BINARY = Fraction(2**63 - 1)
MAX_TEXT = 64  # longer texts are refused before any arithmetic (no quantity needs more)


PLAIN_DIGITS_MAX = 18  # a whole number that fits int64 whatever reads it next


def is_plain_digits(text: str) -> bool:
    """Whether `text` is a plain whole number: 1-18 ASCII digits, as kube-apiserver and Go's
    strconv (HAMi) read one. Not `str.isdigit`: that says yes to `²`, which `int()` refuses,
    to other scripts' digits (`١٦`), which `int()` reads as 16, and to more digits than `int()`
    converts (4300)."""
    return 0 < len(text) <= PLAIN_DIGITS_MAX and text.isascii() and text.isdigit()


class QuantityError(ValueError):
    """Not a quantity, or not one the reader can take; the message is a sentence."""


class Format(StrEnum):
    DECIMAL_SI = "DecimalSI"
    BINARY_SI = "BinarySI"
    DECIMAL_EXPONENT = "DecimalExponent"


@dataclass(frozen=True)
class Quantity:
    value: Fraction
    format: Format

    def canonical(self) -> str:
        return _canonical(self.value, self.format)


def _text_of(value: object) -> str:
    """The text of a quantity as it arrives in JSON: a string, or a number (kept as written
    when the decoder kept its text, see `JsonNumber`)."""
    if isinstance(value, bool) or value is None:
        raise QuantityError(FORMAT_MESSAGE)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        written = getattr(value, "text", None)
        if isinstance(written, str):
            return written
        if value != value or value in (float("inf"), float("-inf")):
            raise QuantityError(FORMAT_MESSAGE)
        return repr(value)
    if isinstance(value, str):
        return value.strip()
    raise QuantityError(FORMAT_MESSAGE)


class JsonNumber(float):
    """A JSON number that remembers how it was written (`json.loads(parse_float=JsonNumber.of)`)
    so `1e3` is read as Go reads it: exponent family, not `1000.0`."""

    text: str

    @classmethod
    def of(cls, text: str) -> JsonNumber:
        number = cls(text)
        number.text = text
        return number


def parse(value: object) -> Quantity:
    """A quantity as `resource.ParseQuantity` reads it; QuantityError with Go's messages."""
    text = _text_of(value)
    if not text or len(text) > MAX_TEXT:
        raise QuantityError(FORMAT_MESSAGE)
    match = _NUMBER.match(text)
    assert match is not None  # (every part optional)
    sign, whole, fraction = match.group(1), match.group(2), match.group(3)
    if not whole and not fraction:  # (Go reads "k" or "." as 0; kube-sim refuses them)
        raise QuantityError(FORMAT_MESSAGE)
    suffix = text[match.end():]
    if not re.fullmatch(r"[eEinumkKMGTP]*[-+]?[0-9]*", suffix):
        raise QuantityError(FORMAT_MESSAGE)
    number = Fraction(int((whole or "0") + (fraction or "")), 10 ** len(fraction or ""))
    if sign == "-":
        number = -number
    if suffix in _DECIMAL_SUFFIXES:
        fmt, amount = Format.DECIMAL_SI, number * Fraction(10) ** _DECIMAL_SUFFIXES[suffix]
    elif suffix in _BINARY_SUFFIXES:
        fmt, amount = Format.BINARY_SI, number * 2 ** _BINARY_SUFFIXES[suffix]
    elif len(suffix) > 1 and suffix[0] in "eE" and re.fullmatch(r"[-+]?[0-9]+", suffix[1:]):
        exponent = int(suffix[1:])
        if abs(exponent) > 10**3:
            raise QuantityError(FORMAT_MESSAGE)
        fmt, amount = Format.DECIMAL_EXPONENT, number * Fraction(10) ** exponent
    else:
        raise QuantityError("unable to parse quantity's suffix")
    amount = _round_up_to_nano(amount)
    if fmt is Format.BINARY_SI:
        if abs(amount) > _MAX_BINARY:
            amount = _MAX_BINARY if amount > 0 else -_MAX_BINARY
        if 0 < abs(amount) < 1:
            fmt = Format.DECIMAL_SI
    return Quantity(amount, fmt)


def _round_up_to_nano(amount: Fraction) -> Fraction:
    scaled = amount / _NANO
    if scaled.denominator == 1:
        return amount
    magnitude = -(-abs(scaled.numerator) // scaled.denominator)  # ceiling of |scaled|
    return Fraction(magnitude if amount > 0 else -magnitude) * _NANO


def _decimal_parts(value: Fraction) -> tuple[int, int]:
    """(mantissa, exponent): value = mantissa * 10**exponent, exponent a multiple of 3, the
    largest such that the mantissa is whole (value has at most 9 decimal places)."""
    scaled = value * 10**9
    assert scaled.denominator == 1
    mantissa, exponent = scaled.numerator, -9
    while mantissa and mantissa % 1000 == 0:
        mantissa //= 1000
        exponent += 3
    return mantissa, exponent


def _canonical(value: Fraction, fmt: Format) -> str:
    if value == 0:
        return "0"
    if fmt is Format.BINARY_SI and abs(value) >= 1024 and value.denominator == 1:
        mantissa, power = value.numerator, 0
        while mantissa % 1024 == 0 and power < 6:
            mantissa //= 1024
            power += 1
        return f"{mantissa}{_BINARY_BY_POWER.get(power, '')}"
    mantissa, exponent = _decimal_parts(value)
    if fmt is Format.DECIMAL_EXPONENT:
        return f"{mantissa}e{exponent}" if exponent else str(mantissa)
    if exponent > 18:  # beyond exa: keep the E suffix with a larger mantissa (nothing lost)
        mantissa, exponent = mantissa * 10 ** (exponent - 18), 18
    return f"{mantissa}{_EXPONENT_SUFFIX[exponent]}"


def canonical(value: object) -> str:
    """The text kube-apiserver writes back for `value` (QuantityError if it is none)."""
    return parse(value).canonical()


# --- how Tessera reads a GPU memory quantity ----------------------------------------------------

# Below this many MiB a memory request is implausible for a GPU program (a CUDA context alone
# takes a few hundred MiB): `gpumem: 4` is most likely someone meaning 4 GB.
IMPLAUSIBLE_MIB = 256


def whole_mib(value: object, resource: str, where: str = "") -> int:
    """A device-memory request in MiB as the user meant it, from any form the API server writes:
    `3000`, `3k`, `12M`, `1e3`, `3000000m` are exact whole numbers of MiB. A binary suffix
    (`4Gi`: bytes) or a fraction (`1.5`, `1500m`) is refused with what to write instead.
    `where` prefixes the message (`container c: `)."""
    try:
        quantity = parse(value)
    except QuantityError as exc:
        raise QuantityError(f"{where}{resource}: {value!r} is not a quantity ({exc})") from None
    amount = quantity.value
    if quantity.format is Format.BINARY_SI:
        mib = amount / 2**20
        instead = (f"write {resource}: {mib.numerator}" if mib.denominator == 1 and mib > 0
                   else "write a whole number of MiB")
        raise QuantityError(
            f"{where}{resource}: {value!r} is a binary (byte) quantity, but the value is a whole "
            f"number of MiB without a unit; {instead} (MiB)"
        )
    if amount.denominator != 1:
        raise QuantityError(
            f"{where}{resource}: {value!r} is {_plain(amount)} MiB, not a whole number of MiB; "
            f"write {resource}: {-(-amount.numerator // amount.denominator)} (MiB, rounded up)"
        )
    return amount.numerator


# A namespace's GPU memory limit: `G`, `T`, `P`, `E` would be at least 10^9 MiB (no namespace's
# memory), so with those suffixes the value is bytes as written (`80G`), as with a binary one.
_BYTES_SUFFIXES = ("G", "T", "P", "E")


def namespace_mib(value: object, resource: str) -> int:
    """A namespace's GPU memory total (ResourceQuota `limits.nvidia.com/gpumem`, `tessera quota
    set --memory`) in MiB: a number of MiB in every form the API server writes (`8000`, `8k`,
    `160k`, `1e3`), rounded up; bytes with a binary unit (`160Gi`) or `G`/`T`/`P`/`E` (`80G`),
    rounded down (a limit never grows by rounding). Thousandths are refused."""
    try:
        quantity = parse(value)
    except QuantityError as exc:
        raise QuantityError(f"{resource}: {value!r} is not a quantity (MiB, or bytes with a "
                            f"unit such as 160Gi): {exc}") from None
    amount, text = quantity.value, _text_of(value)
    if quantity.format is Format.BINARY_SI or text.endswith(_BYTES_SUFFIXES):
        return (amount / 2**20).__floor__()
    if amount.denominator != 1 and text.endswith("m"):
        raise QuantityError(f"{resource}: {value!r} is in thousandths; write MiB (e.g. 8000) or "
                            "bytes with a unit (e.g. 160Gi)")
    return amount.__ceil__()


def _plain(amount: Fraction) -> str:
    mantissa, exponent = _decimal_parts(amount)
    digits = str(abs(mantissa)).rjust(-exponent + 1, "0") if exponent < 0 else str(abs(mantissa))
    if exponent < 0:
        digits = f"{digits[:exponent]}.{digits[exponent:]}".rstrip("0").rstrip(".")
    else:
        digits += "0" * exponent
    return ("-" if mantissa < 0 else "") + digits


def implausibly_small(mib: int) -> bool:
    return 0 < mib < IMPLAUSIBLE_MIB
