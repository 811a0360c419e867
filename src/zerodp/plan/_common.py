"""Shared plumbing for the planner: units, number parsing, validation, and the ``to_dict`` mixin.

Every size in the planner is in bytes and every time in seconds; "GB" means 1e9 bytes, as in the
guide (§2.4, §8: "16 GB", "120 GB").
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re

KB = 1e3
BF16 = 2  # bytes per bf16 (and fp16) element: the planner's 16-bit unit
MB = 1e6
GB = 1e9
TB = 1e12
MIB = 1 << 20  # binary units: bucket sizes (DDP's bucket_cap_mb counts mebibytes) and measured memory

_SUFFIX = {
    "": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "p": 1e15,
    "ki": 2.0**10, "mi": 2.0**20, "gi": 2.0**30, "ti": 2.0**40,
}
_QUANTITY = re.compile(r"^\s*([-+]?[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]{0,3})\s*$")

def fmt_mib(n: float) -> str:
    """Bytes in binary units: ``512 B``, ``3.40 MiB``, ``1.25 GiB``."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", MIB), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"



def parse_quantity(text: str | float | int, what: str = "value", count: bool = False) -> float:
    """Parse ``"16e9"``, ``"25MB"``, ``"4M"``, ``"16GiB"`` or a number into a float.

    Suffixes k/M/G/T/P are decimal (1e3...), Ki/Mi/Gi/Ti binary; a trailing ``B`` is allowed and
    means bytes. With ``count=True`` (parameters, tokens) a lone ``B`` means billion (``8B`` =
    8e9), as model names use it.
    """
    if isinstance(text, (int, float)):
        return float(text)
    m = _QUANTITY.match(str(text))
    suffix = m.group(2).lower() if m else ""
    if count and suffix == "b":
        suffix = "g"
    if suffix not in _SUFFIX and suffix.endswith("b"):
        suffix = suffix[:-1]
    if not m or suffix not in _SUFFIX:
        raise ValueError(
            f"cannot read {what} {text!r}: expected a number with an optional suffix "
            "k/M/G/T (x1e3...) or Ki/Mi/Gi (x1024...), e.g. 16e9, 25MB, 4M, 16GiB")
    return float(m.group(1)) * _SUFFIX[suffix]


class InputError(ValueError):
    """A ValueError about one input: ``field`` names it (the API's parameter name), so the page
    can show the sentence next to that field."""

    def __init__(self, message: str, field: str | None = None, message_zh: str | None = None):
        super().__init__(message)
        self.field = field
        self.message_zh = message_zh


def check_positive(name: str, value: float, allow_zero: bool = False) -> float:
    """Raise ValueError unless ``value`` is a finite number > 0 (or >= 0 with ``allow_zero``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be {bound}, got {value!r}")
    return value


def check_count(name: str, value: int, minimum: int = 1) -> int:
    """Raise ValueError unless ``value`` is an integer >= ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int) and not (
            isinstance(value, float) and value.is_integer()):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value!r}")
    return int(value)


def _jsonable(value):
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return value.to_dict() if hasattr(value, "to_dict") else {
            f.name: _jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, float) and not math.isfinite(value):
        return None  # JSON has no inf/nan
    return value


class ToDict:
    """Mixin for result dataclasses: ``to_dict()`` gives JSON-ready values under the field names."""

    def to_dict(self) -> dict:
        return {f.name: _jsonable(getattr(self, f.name)) for f in dataclasses.fields(self)}


def fmt_bytes(n: float) -> str:
    """Human bytes in decimal units (GB = 1e9)."""
    for unit, scale in (("TB", TB), ("GB", GB), ("MB", MB), ("kB", KB)):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


def fmt_time(s: float) -> str:
    """Human seconds: s, ms or µs."""
    if abs(s) >= 1:
        return f"{s:.3g} s"
    if abs(s) >= 1e-3:
        return f"{s * 1e3:.3g} ms"
    return f"{s * 1e6:.3g} µs"


def fmt_count(n: float) -> str:
    """Human count: 8.8M, 40.5M, 1.0T, 2,475 (three significant digits, at least one decimal
    below 100, never an exponent)."""
    for scale, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M")):
        if abs(n) >= scale:
            v = n / scale
            if abs(v) >= 1000:
                return f"{v:,.0f}{unit}"
            text = f"{v:.3g}"
            if "." not in text and abs(v) < 100:
                text = f"{v:.1f}"
            return text + unit
    return f"{n:,.0f}"


def fmt_bound(x: float) -> str:
    """A range's end in an error sentence: 1,000,000; 10.0M; 1,000T; 0.5."""
    if float(x).is_integer() and abs(x) < 1e7:
        return f"{x:,.0f}"
    return fmt_count(x) if abs(x) >= 1e6 else f"{x:g}"


def range_sentence(name: str, low: float, high: float | None, why: str, got: str,
                   low_open: bool = False) -> str:
    """The one sentence the CLI and the API both use for a number out of its range."""
    if high is None:
        bound = f"> {fmt_bound(low)}" if low_open else f">= {fmt_bound(low)}"
    elif low_open:
        bound = f"> {fmt_bound(low)} and <= {fmt_bound(high)}"
    else:
        bound = f"between {fmt_bound(low)} and {fmt_bound(high)}"
    return f"{name} must be {bound}{f' ({why})' if why else ''}, got {got!r}"


def plural(n: float, word: str, words: str | None = None) -> str:
    """``1 rank``, ``8 ranks``, ``1,024 GPUs``."""
    return f"{n:,.0f} {word if n == 1 else (words or word + 's')}"


def table(headers: list[str], rows: list[list], title: str | None = None, align: str | None = None) -> str:
    """A plain-text table. ``align``: one letter per column, "l" or "r" (default: first column
    left, the rest right)."""
    cells = [[str(c) for c in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    align = align or "l" + "r" * (len(headers) - 1)

    def line(r):
        return "  ".join(c.ljust(w) if a == "l" else c.rjust(w)
                         for c, w, a in zip(r, widths, align)).rstrip()

    out = [title] if title else []
    out += [line(cells[0]), "  ".join("-" * w for w in widths)] + [line(r) for r in cells[1:]]
    return "\n".join(out)


def read_json(path: str, what: str, missing: str, invalid: str):
    """The JSON document at ``path`` (a ``what``: "profile", "trace"). A missing file raises
    ``FileNotFoundError`` and bad JSON ``ValueError``, each one line ending in the given hint."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"{what} {path!r} not found: {missing}")
    with open(path) as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not valid JSON ({exc}); {invalid}") from None
