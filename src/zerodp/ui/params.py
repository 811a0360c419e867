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

from zerodp.plan._common import fmt_bound as _num
from zerodp.plan._common import parse_quantity, range_sentence

#: longest text parameter (a pasted config.json); a URL of this size still fits a GET
MAX_TEXT = 20_000
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


class ApiError(ValueError):
    """A request the planner cannot answer: which field, what was wrong, what is expected; with
    ``message_zh`` the same sentence in Chinese (the page shows the one of its language)."""

    def __init__(self, field_name: str | None, message: str, expected: str = "",
                 message_zh: str | None = None):
        super().__init__(message)
        self.field = field_name
        self.message = message
        self.expected = expected
        self.message_zh = message_zh

    def to_dict(self) -> dict:
        return {"error": self.message, "field": self.field, "expected": self.expected,
                "error_zh": self.message_zh}


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
    maximum: float | None = None
    why: str = ""
    count_units: bool = False  # a lone "B" means billion (8B parameters), not bytes
    choices: Callable[[], list[str]] | None = None
    resolve: Callable[[str], object] | None = field(default=None, compare=False)

    def low(self) -> float:
        return self.minimum if self.minimum is not None else (1 if self.kind == "count" else 0)

    def expected(self) -> str:
        if self.kind == "flag":
            text = "true or false"
        elif self.kind == "choice":
            text = "one of " + ", ".join(self.choices())
        elif self.kind == "text":
            text = "text"
        elif self.maximum is not None:
            whole = "a whole number" if self.kind == "count" else "a number"
            low = "> 0" if self.kind == "quantity" and self.low() == 0 and not self.allow_zero \
                else f">= {_num(self.low())}"
            text = f"{whole} {low} and <= {_num(self.maximum)}"
            if self.why:
                text += f" ({self.why})"
        elif self.kind == "count":
            text = f"an integer >= {self.low():g}"
        else:
            text = "a number >= 0" if self.allow_zero else "a number > 0"
            if self.minimum is not None:
                text = f"a number >= {self.minimum:g}"
        if self.kind == "quantity":
            text += "; suffixes k, M, G, T allowed, e.g. 25MB"
        return text + (", or empty for none" if self.optional else "")

    def expected_zh(self) -> str:
        if self.kind == "flag":
            return "true 或 false"
        if self.kind == "choice":
            return "以下之一：" + "、".join(self.choices())
        if self.kind == "text":
            return "文本"
        whole = "整数" if self.kind == "count" else "数"
        low = "大于 0" if self.kind == "quantity" and self.low() == 0 and not self.allow_zero \
            else f"不小于 {_num(self.low())}"
        text = f"{low}的{whole}"
        if self.maximum is not None:
            text = f"{low} 且不大于 {_num(self.maximum)} 的{whole}"
        if self.kind == "quantity":
            text += "（可带 k、M、G、T 后缀，如 25MB）"
        return text + ("，或留空" if self.optional else "")

    def describe(self) -> dict:
        d = {"name": self.name, "kind": self.kind, "default": self.default, "label": self.label,
             "expected": self.expected()}
        if self.choices is not None:
            d["choices"] = self.choices()
        return d

    def _fail(self, got: str) -> ApiError:
        return ApiError(self.name, f"{self.name} must be {self.expected()}, got {got!r}",
                        self.expected(), f"{self.name} 应为{self.expected_zh()}，收到的是 {got!r}")

    def parse(self, raw: str | None):
        """The typed value of ``raw`` (``None``: the default)."""
        if raw is None:
            return self.default
        text = raw.strip()
        if self.optional and text.lower() in ("", "none", "null"):
            return None
        if self.kind == "text":
            if len(raw) > MAX_TEXT:
                raise ApiError(self.name, f"{self.name} is {len(raw):,} characters; at most "
                               f"{MAX_TEXT:,} (a config.json is a few kB)", "text",
                               f"{self.name} 有 {len(raw):,} 个字符，最多 {MAX_TEXT:,}")
            return raw
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
            value = parse_quantity(text, self.name, count=self.count_units or self.kind == "count")
        except ValueError:
            raise self._fail(raw) from None
        if not math.isfinite(value):
            raise self._fail(raw)
        if self.kind == "count":
            if not value.is_integer():
                raise ApiError(self.name, f"{self.name} must be a whole number, got {raw!r}",
                               self.expected(), f"{self.name} 必须是整数，收到的是 {raw!r}")
            value = int(value)
        low = self.low()
        low_open = self.kind == "quantity" and low == 0 and not self.allow_zero
        if value < low or (value == low and low_open) or (
                self.maximum is not None and value > self.maximum):
            # the CLI's sentence for the same range (zerodp.plan._common.range_sentence)
            sentence = range_sentence(self.name, low, self.maximum, self.why, raw, low_open)
            raise ApiError(self.name, sentence, self.expected(),
                           f"{self.name} 应为{self.expected_zh()}，收到的是 {raw!r}")
        return value


def parse(params: list[Param], query: dict[str, str]) -> dict:
    """Validated keyword arguments for ``params`` from ``query``; unknown names are errors too."""
    known = {p.name for p in params}
    unknown = sorted(set(query) - known)
    if unknown:
        raise ApiError(unknown[0], f"unknown parameter {unknown[0]!r}: use "
                       + ", ".join(sorted(known)), "one of " + ", ".join(sorted(known)),
                       f"未知参数 {unknown[0]!r}")
    return {p.name: p.parse(query.get(p.name)) for p in params}


def field_of(message: str, params: list[Param]) -> str | None:
    """The parameter a planner error message is about: the first declared name it mentions
    (the longest one where names overlap: "experts_per_token" before "experts")."""
    hits = [(message.find(p.name), -len(p.name), p.name) for p in params if p.name in message]
    return min(hits)[2] if hits else None
