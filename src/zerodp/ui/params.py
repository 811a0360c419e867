"""Request parameters of the web API: declared once, validated once, described to the page.

Each endpoint lists its :class:`Param` s. :func:`parse` turns a query string (one value per name)
into keyword arguments, or raises :class:`ApiError`, which the server answers with HTTP 422 and
``{"error": ..., "field": ..., "expected": ...}``. The same declarations are served by
``/api/schema`` so the page takes its starting values from here and nowhere else.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

from zerodp.plan._common import parse_quantity

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


class ApiError(ValueError):
    """A request the planner cannot answer: which field, what was wrong, what is expected."""

    def __init__(self, field_name: str | None, message: str, expected: str = ""):
        super().__init__(message)
        self.field = field_name
        self.message = message
        self.expected = expected

    def to_dict(self) -> dict:
        return {"error": self.message, "field": self.field, "expected": self.expected}


@dataclass(frozen=True)
class Param:
    """One query parameter.

    ``kind``: ``"quantity"`` (a number, suffixes allowed: 25MB, 4M, 7.5e9), ``"count"`` (an
    integer), ``"choice"`` (one of ``choices()``, resolved by ``resolve`` when given) or ``"flag"``.
    ``default`` is used when the parameter is missing; ``optional`` quantities and counts also
    accept ``""`` or ``"none"`` and then pass ``None`` to the planner.
    """

    name: str
    kind: str
    default: object
    label: str
    minimum: float | None = None
    allow_zero: bool = False
    optional: bool = False
    choices: Callable[[], list[str]] | None = None
    resolve: Callable[[str], object] | None = field(default=None, compare=False)

    def expected(self) -> str:
        if self.kind == "flag":
            text = "true or false"
        elif self.kind == "choice":
            text = "one of " + ", ".join(self.choices())
        elif self.kind == "count":
            text = f"an integer >= {self.minimum if self.minimum is not None else 1:g}"
        else:
            text = "a number >= 0" if self.allow_zero else "a number > 0"
            if self.minimum is not None:
                text = f"a number >= {self.minimum:g}"
            text += " (suffixes k, M, G, T allowed, e.g. 25MB)"
        return text + (" or empty for none" if self.optional else "")

    def describe(self) -> dict:
        d = {"name": self.name, "kind": self.kind, "default": self.default, "label": self.label,
             "expected": self.expected()}
        if self.choices is not None:
            d["choices"] = self.choices()
        return d

    def _fail(self, got: str) -> ApiError:
        return ApiError(self.name, f"{self.name}: got {got!r}, expected {self.expected()}",
                        self.expected())

    def parse(self, raw: str | None):
        """The typed value of ``raw`` (``None``: the default)."""
        if raw is None:
            return self.default
        text = raw.strip()
        if self.optional and text.lower() in ("", "none", "null"):
            return None
        if self.kind == "flag":
            if text.lower() in _TRUE:
                return True
            if text.lower() in _FALSE:
                return False
            raise self._fail(raw)
        if self.kind == "choice":
            if self.resolve is not None:
                try:
                    self.resolve(text)
                except (ValueError, FileNotFoundError):
                    raise self._fail(raw) from None
                return text
            if text not in self.choices():
                raise self._fail(raw)
            return text
        try:
            value = parse_quantity(text, self.name)
        except ValueError:
            raise self._fail(raw) from None
        if not math.isfinite(value):
            raise self._fail(raw)
        if self.kind == "count":
            if not value.is_integer():
                raise self._fail(raw)
            value = int(value)
        low = self.minimum if self.minimum is not None else (1 if self.kind == "count" else 0)
        if value < low or (value == 0 and self.kind == "quantity" and not self.allow_zero):
            raise self._fail(raw)
        return value


def parse(params: list[Param], query: dict[str, str]) -> dict:
    """Validated keyword arguments for ``params`` from ``query``; unknown names are errors too."""
    known = {p.name for p in params}
    unknown = sorted(set(query) - known)
    if unknown:
        raise ApiError(unknown[0], f"unknown parameter {unknown[0]!r}",
                       "one of " + ", ".join(sorted(known)))
    return {p.name: p.parse(query.get(p.name)) for p in params}


def field_of(message: str, params: list[Param]) -> str | None:
    """The parameter a planner error message is about: the first declared name it mentions
    (the longest one where names overlap: "experts_per_token" before "experts")."""
    hits = [(message.find(p.name), -len(p.name), p.name) for p in params if p.name in message]
    return min(hits)[2] if hits else None
