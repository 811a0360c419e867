"""Make the page's CJK font: the glyphs ``zerodp ui`` shows in Chinese, cut from Noto Sans CJK SC.

The page (src/zerodp/ui/static/) must read in Chinese on a machine without any CJK font, so it
ships the few hundred glyphs it uses instead of asking for a system font. This script collects
every character in the CJK ranges of :data:`RANGES` from the page's files and from the planner's
Chinese messages (the ``*_zh`` texts the API sends), cuts them out of Debian's ``fonts-noto-cjk``
(SIL Open Font License 1.1) with fontTools, renames the family (a Modified Version under the OFL)
and writes ``static/zerodp-cjk.woff2`` next to the license text ``static/zerodp-cjk-OFL.txt`` and
the list of the characters it covers, ``static/zerodp-cjk-chars.txt``.

Run it again whenever a new Chinese string is added (tests/test_ui_font.py fails until then)::

    apt-get install -y fonts-noto-cjk          # once; uninstall again afterwards if you like
    .venv/bin/pip install fonttools brotli      # brotli: the woff2 compression
    .venv/bin/python tools/make_cjk_subset.py
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STATIC = ROOT / "src" / "zerodp" / "ui" / "static"
OUT = STATIC / "zerodp-cjk.woff2"
LICENSE = STATIC / "zerodp-cjk-OFL.txt"
CHARS = STATIC / "zerodp-cjk-chars.txt"  # what the font covers (tests/test_ui_font.py compares)
SOURCE = Path("/usr/share/fonts/opentype/noto/NotoSansCJK-Regular.ttc")
SOURCE_INDEX_NAME = "Noto Sans CJK SC"
FAMILY = "zerodp CJK"
#: the characters the shipped font covers (the @font-face unicode-range in style.css)
RANGES = [(0x2E80, 0x9FFF), (0xF900, 0xFAFF), (0xFE30, 0xFE4F), (0xFF00, 0xFFEF)]
#: files whose text the page shows: its own, and the planner's Chinese messages the API sends
SOURCES = [STATIC / "i18n.json", STATIC / "i18n.js", STATIC / "index.html", STATIC / "app.js",
           *sorted((ROOT / "src" / "zerodp" / "ui").glob("*.py")),
           *sorted((ROOT / "src" / "zerodp" / "plan").glob("*.py"))]


def in_ranges(ch: str) -> bool:
    return any(lo <= ord(ch) <= hi for lo, hi in RANGES)


def page_characters(paths=SOURCES) -> set[str]:
    """Every character in :data:`RANGES` that the page's sources contain."""
    chars: set[str] = set()
    for path in paths:
        chars.update(c for c in Path(path).read_text(encoding="utf-8") if in_ranges(c))
    return chars


def unicode_range() -> str:
    """The CSS unicode-range of :data:`RANGES`."""
    return ", ".join(f"U+{lo:X}-{hi:X}" for lo, hi in RANGES)


def _license_text() -> str:
    copyright_file = Path("/usr/share/doc/fonts-noto-cjk/copyright").read_text(encoding="utf-8")
    body = copyright_file.split("License: SIL-1.1\n")[-1]
    lines = []
    for line in body.splitlines():
        if line and not line.startswith(" "):  # the next stanza
            break
        lines.append("" if line.strip() == "." else line[1:])
    return "\n".join(lines).strip() + "\n"


def make(source: Path = SOURCE, out: Path = OUT) -> tuple[int, int]:
    from fontTools import subset
    from fontTools.ttLib import TTCollection

    chars = page_characters()
    collection = TTCollection(str(source))
    font = next(f for f in collection.fonts if f["name"].getDebugName(4) == SOURCE_INDEX_NAME)
    notice = font["name"].getDebugName(0)
    options = subset.Options()
    options.flavor = "woff2"
    options.layout_features = ["*"]
    options.name_IDs = [0, 1, 2, 3, 4, 5, 6, 13, 14]
    options.hinting = False
    sub = subset.Subsetter(options)
    sub.populate(unicodes=sorted(ord(c) for c in chars))
    sub.subset(font)
    names = font["name"]
    for rec in list(names.names):  # a Modified Version: a family name of its own
        if rec.nameID in (1, 4, 16):
            rec.string = FAMILY
        elif rec.nameID == 6:
            rec.string = FAMILY.replace(" ", "") + "-Regular"
        elif rec.nameID == 3:
            rec.string = f"{FAMILY}: {len(chars)} glyphs of {SOURCE_INDEX_NAME} for zerodp ui"
    font.flavor = "woff2"
    font.save(str(out))
    CHARS.write_text("".join(sorted(chars)) + "\n", encoding="utf-8")
    LICENSE.write_text(
        f"{out.name}: the {len(chars)} CJK characters zerodp ui shows, cut from {SOURCE_INDEX_NAME} "
        f"Regular (Debian fonts-noto-cjk) by tools/make_cjk_subset.py and renamed '{FAMILY}'.\n"
        f"{notice}\n\n" + _license_text(), encoding="utf-8")
    return len(chars), out.stat().st_size


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--source", type=Path, default=SOURCE, help="NotoSansCJK-Regular.ttc")
    args = p.parse_args(argv)
    if not args.source.exists():
        print(f"{args.source} is missing: apt-get install -y fonts-noto-cjk", file=sys.stderr)
        return 1
    n, size = make(args.source)
    print(f"wrote {OUT.relative_to(ROOT)}: {n} characters, {size / 1024:.0f} KiB; "
          f"unicode-range {unicode_range()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

