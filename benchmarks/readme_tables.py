"""README performance tables, generated from ``benchmarks/results/`` so they cannot drift.

A results file names its run on its first line (``Run at commit abc1234 ...``
or, for a file whose run predates the stamp, ``Recorded at commit abc1234
...``) and carries the tables a README shows as fenced blocks::

    ```json figures
    {"name": "flash-cce-heads-cpu", "columns": ["N", "V", ...], "rows": [["2048", ...]],
     "note": "optional line printed under the table"}
    ```

(``benchmarks/common.py``'s ``figures_block`` writes one). A README holds
each table between markers, ``<!-- figures: NAME -->`` and ``<!-- /figures
-->``; this script rewrites what lies between them: the table, then a line
naming the results file and the commit. ``<!-- figures: a b -->`` joins the
rows of blocks that share their columns (a summary across plugins). A block may carry its own
``"commit"`` when its run is not the file's first line's.

    python benchmarks/readme_tables.py          # rewrite the READMEs
    python benchmarks/readme_tables.py --check  # exit 1 if one is out of date
"""

import argparse
import json
import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = "benchmarks/results"
READMES = ("README.md", "benchmarks/README.md", "plugins/*/README.md", "docs/*.md")
STAMP = re.compile(r"^(?:Run|Recorded) at commit ([0-9a-f]{7,40}(?:\+dirty)?)\b")
BLOCK = re.compile(r"^```json figures\n(.*?)^```$", re.S | re.M)
# A marker starts its line (one quoted in running text is not a marker).
MARKER = re.compile(r"^(<!-- figures: ([\w. -]+?) -->\n)(.*?)^(<!-- /figures -->)", re.S | re.M)
OPEN = re.compile(r"^<!-- figures: ", re.M)


class FiguresError(Exception):
    """A results file or README that cannot be rendered: says which and why."""


def stamp(path: Path) -> str | None:
    """The commit a results file's first line names, or None."""
    with open(path, encoding="utf-8") as f:
        m = STAMP.match(f.readline())
    return m[1] if m else None


def read_figures(root: Path = ROOT) -> dict:
    """``{name: block}`` of every figures block under ``benchmarks/results`` (not history)."""
    figures = {}
    for path in sorted((root / RESULTS).glob("*.md")):
        text = path.read_text(encoding="utf-8")
        blocks = BLOCK.findall(text)
        if not blocks:
            continue
        commit = stamp(path)
        rel = path.relative_to(root).as_posix()
        for raw in blocks:
            try:
                block = json.loads(raw)
                name, columns, rows = block["name"], block["columns"], block["rows"]
            except (ValueError, KeyError, TypeError) as e:
                raise FiguresError(f"{rel}: a figures block is not valid ({e})") from None
            if any(len(r) != len(columns) for r in rows):
                raise FiguresError(f"{rel}: figures {name!r}: a row's length is not the columns'")
            if name in figures:
                raise FiguresError(f"figures {name!r} in both {figures[name]['file']} and {rel}")
            block.setdefault("commit", commit)
            if not block["commit"]:
                raise FiguresError(f"{rel}: the first line names no commit ('Run at commit X')")
            figures[name] = {**block, "file": rel}
    return figures


def render(blocks: list, readme: Path, root: Path = ROOT) -> str:
    """The markdown between a README's markers: one table, then where each part came from.

    Several blocks (``<!-- figures: a b -->``) must share their columns; their
    rows are joined in order.
    """
    columns = blocks[0]["columns"]
    if any(b["columns"] != columns for b in blocks):
        raise FiguresError(f"figures {[b['name'] for b in blocks]}: the columns differ")
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(row) + " |" for b in blocks for row in b["rows"]]
    notes = " ".join(b["note"] for b in blocks if b.get("note"))
    sources = []
    for b in blocks:
        link = os.path.relpath(root / b["file"], readme.parent).replace(os.sep, "/")
        source = f"[`{b['file']}`]({link}) at commit {b['commit']}"
        if source not in sources:
            sources.append(source)
    where = "From " + "; ".join(sources) + "."
    return "\n".join(lines) + "\n\n" + (f"{notes} " if notes else "") + where + "\n"


def update(text: str, readme: Path, figures: dict, root: Path = ROOT) -> str:
    """``text`` with every marked table regenerated; unknown names raise FiguresError."""

    def one(m):
        names = m[2].split()
        for name in names:
            if name not in figures:
                rel = readme.relative_to(root).as_posix()
                raise FiguresError(f"{rel}: no results file has figures {name!r}")
        return m[1] + render([figures[n] for n in names], readme, root) + m[4]

    if len(OPEN.findall(text)) != len(MARKER.findall(text)):
        raise FiguresError(f"{readme.relative_to(root).as_posix()}: a figures marker is not closed")
    return MARKER.sub(one, text)


def readmes(root: Path = ROOT) -> list:
    return sorted({p for pattern in READMES for p in root.glob(pattern)})


def stale(root: Path = ROOT, write: bool = False) -> list:
    """READMEs whose tables differ from the results (rewritten when ``write``)."""
    figures = read_figures(root)
    changed = {}
    for path in readmes(root):  # every README is checked before one is written
        text = path.read_text(encoding="utf-8")
        new = update(text, path, figures, root)
        if new != text:
            changed[path] = new
    if write:
        for path, new in changed.items():
            path.write_text(new, encoding="utf-8")
    return [path.relative_to(root).as_posix() for path in changed]


def unstamped(root: Path = ROOT) -> list:
    """Results files whose first line names no commit."""
    return [
        p.relative_to(root).as_posix()
        for p in sorted((root / RESULTS).glob("*.md"))
        if stamp(p) is None
    ]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--check", action="store_true", help="change nothing; exit 1 if out of date")
    p.add_argument("--stamps", action="store_true", help="also list results files with no commit")
    a = p.parse_args()
    try:
        changed = stale(write=not a.check)
    except FiguresError as e:
        print(f"readme_tables: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    for name in changed:
        print(f"{'out of date' if a.check else 'rewrote'}: {name}")
    missing = unstamped() if a.stamps else []
    for name in missing:
        print(f"no commit on its first line: {name}")
    raise SystemExit(1 if (a.check and changed) or missing else 0)


if __name__ == "__main__":
    main()
