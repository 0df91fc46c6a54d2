"""The values users write in a ResourceQuota's `spec.hard` for GPU keys, read as HAMi users mean
them, or refused with a sentence (never read as "unlimited" by accident). Pure.

- Memory (`limits.` / `requests.nvidia.com/gpumem`): a plain number is MiB, as HAMi reads it;
  a byte quantity (`160Gi`, `80G`, `512Mi`) is converted to MiB (rounded down: a limit never
  grows by rounding). `160Gi` is 163840 MiB, not 160 Gi-MiB.
- Cores (percent of one GPU) and GPU counts: plain numbers; a fractional count rounds up as
  Kubernetes' Value() does. A unit on them is refused.
"""

from __future__ import annotations

from decimal import ROUND_CEILING, ROUND_FLOOR, Decimal

from tessera.hami import RequestError, parse_quantity

MIB = Decimal(2) ** 20
_BYTE_UNITS = ("Ki", "Mi", "Gi", "Ti", "Pi", "Ei", "k", "M", "G", "T", "P", "E")


class QuotaValueError(ValueError):
    """A spec.hard value that cannot be read as the GPU limit it names."""


def _text(value: object) -> str:
    return value.strip() if isinstance(value, str) else ""


def memory_mib(name: str, value: object) -> int:
    """MiB from a plain number (MiB) or a byte quantity (converted)."""
    text = _text(value)
    try:
        parsed = parse_quantity(value, name)
    except RequestError as exc:
        raise QuotaValueError(f"{name}: {value!r} is not a quantity (MiB, or bytes with a unit "
                              "such as 160Gi)") from exc
    if text.endswith("m") and not text.endswith(("Mi", "M")):
        raise QuotaValueError(f"{name}: {value!r} is in thousandths; write MiB (e.g. 8000) or "
                              "bytes with a unit (e.g. 160Gi)")
    if text.endswith(_BYTE_UNITS):
        return int((parsed / MIB).to_integral_value(rounding=ROUND_FLOOR))
    return int(parsed.to_integral_value(rounding=ROUND_CEILING))


def plain_count(name: str, value: object, what: str) -> int:
    """Cores or GPUs: a number without a unit."""
    text = _text(value)
    if text and text[-1].isalpha() and text[-1] not in "eE":
        raise QuotaValueError(f"{name}: {value!r} has a unit; {what} is a plain number")
    try:
        parsed = parse_quantity(value, name)
    except RequestError as exc:
        raise QuotaValueError(f"{name}: {value!r} is not a number ({what})") from exc
    return int(parsed.to_integral_value(rounding=ROUND_CEILING))
