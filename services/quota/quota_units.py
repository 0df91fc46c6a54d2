"""The values users write in a ResourceQuota's `spec.hard` for GPU keys, read as HAMi users mean
them, or refused with a sentence (never read as "unlimited" by accident). Pure.

- Memory (`limits.` / `requests.nvidia.com/gpumem`): a number is MiB, as HAMi reads it, in
  every form the API server writes for one (`8000` is stored as `8k`, `160000` as `160k`,
  `1e3` stays `1e3`); a byte quantity (`160Gi`, `512Mi`, and `80G`: a `G`/`T`/`P`/`E` suffix
  would be at least 10^9 MiB, no namespace's GPU memory, so it is bytes as written) is
  converted to MiB (rounded down: a limit never grows by rounding). `160Gi` is 163840 MiB.
- Cores (percent of one GPU) and GPU counts: plain numbers; a fractional count rounds up as
  Kubernetes' Value() does. A unit on them is refused.
"""

from __future__ import annotations

from decimal import ROUND_CEILING

from tessera import quantity
from tessera.hami import RequestError, parse_quantity


class QuotaValueError(ValueError):
    """A spec.hard value that cannot be read as the GPU limit it names."""


def _text(value: object) -> str:
    return value.strip() if isinstance(value, str) else ""


def memory_mib(name: str, value: object) -> int:
    """MiB from a number (MiB) or a byte quantity (converted): `quantity.namespace_mib`."""
    try:
        return quantity.namespace_mib(value, name)
    except quantity.QuantityError as exc:
        raise QuotaValueError(str(exc)) from None


def plain_count(name: str, value: object, what: str) -> int:
    """Cores or GPUs: a number without a binary unit (`3k`, `1e3` are the API server's ways of
    writing 3000 and 1000)."""
    try:
        parsed = parse_quantity(value, name)
    except RequestError as exc:
        raise QuotaValueError(f"{name}: {value!r} is not a number ({what})") from exc
    if quantity.parse(value).format is quantity.Format.BINARY_SI or (
            _text(value).endswith("m") and parsed % 1):
        raise QuotaValueError(f"{name}: {value!r} has a unit; {what} is a plain number")
    return int(parsed.to_integral_value(rounding=ROUND_CEILING))
