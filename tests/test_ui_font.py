"""The page's CJK glyphs ship with it (tools/make_cjk_subset.py): the subset covers every CJK
character the page and the API's Chinese messages contain, stays small, carries its license, and
style.css loads it. (That Chromium draws the Chinese text with it, on a machine without any CJK
font, is tests/test_ui_browser.py::test_chinese_renders_with_the_shipped_glyphs.)"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STATIC = ROOT / "src" / "zerodp" / "ui" / "static"


def _tool():
    spec = importlib.util.spec_from_file_location("make_cjk_subset", ROOT / "tools" / "make_cjk_subset.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_subset_covers_every_character_the_page_shows():
    tool = _tool()
    covered = set((STATIC / "zerodp-cjk-chars.txt").read_text(encoding="utf-8").strip())
    missing = sorted(tool.page_characters() - covered)
    assert not missing, (f"{''.join(missing)}: not in zerodp-cjk.woff2; run "
                         "'.venv/bin/python tools/make_cjk_subset.py' (docs/ui.md)")
    assert "中" in covered and "文" in covered  # the English page's language link


def test_the_font_is_small_licensed_and_loaded_by_the_style():
    font = STATIC / "zerodp-cjk.woff2"
    assert font.read_bytes()[:4] == b"wOF2" and font.stat().st_size < 300 * 1024
    license_text = (STATIC / "zerodp-cjk-OFL.txt").read_text(encoding="utf-8")
    assert "SIL OPEN FONT LICENSE Version 1.1" in license_text and "Noto Sans CJK SC" in license_text
    css = (STATIC / "style.css").read_text(encoding="utf-8")
    face = re.search(r"@font-face\s*{([^}]*)}", css).group(1)
    assert 'url("/static/zerodp-cjk.woff2")' in face and '"zerodp CJK"' in face
    assert f"unicode-range: {_tool().unicode_range()};" in face
    body = re.search(r"\bbody\s*{[^}]*font:[^;]*", css).group(0)
    assert '"zerodp CJK"' in body
