"""README performance tables are generated from benchmarks/results (benchmarks/readme_tables.py)."""

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _tool():
    spec = importlib.util.spec_from_file_location(
        "readme_tables", ROOT / "benchmarks" / "readme_tables.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


tables = _tool()

RESULT = """Run at commit abc1234 on 2026-01-01: `python benchmarks/bench_x.py`

```json figures
{"name": "x-cpu", "columns": ["case", "time"], "rows": [["a", "1.00x"], ["b", "0.50x"]],
 "note": "Median of 5."}
```
"""

README = """# Demo

Before.

<!-- figures: x-cpu -->
| case | time |
|---|---|
| a | 9.99x |
<!-- /figures -->

After.
"""


def _tree(tmp_path, result=RESULT, readme=README):
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    (tmp_path / "benchmarks" / "results" / "x-cpu.md").write_text(result)
    (tmp_path / "plugins" / "p").mkdir(parents=True)
    (tmp_path / "plugins" / "p" / "README.md").write_text(readme)
    return tmp_path


def test_repository_readmes_match_their_results_files():
    assert tables.stale(ROOT) == [], "run: python benchmarks/readme_tables.py"


def test_every_marked_table_names_its_file_and_commit():
    figures = tables.read_figures(ROOT)
    for path in tables.readmes(ROOT):
        text = path.read_text(encoding="utf-8")
        for m in tables.MARKER.finditer(text):
            for name in m[2].split():
                block = figures[name]
                assert f"[`{block['file']}`](" in m[3]
                assert f"{block['file']}) at commit {block['commit']}" in m[3]


def test_a_stale_table_is_found_and_rewritten(tmp_path):
    root = _tree(tmp_path)
    assert tables.stale(root) == ["plugins/p/README.md"]
    assert tables.stale(root, write=True) == ["plugins/p/README.md"]
    text = (root / "plugins" / "p" / "README.md").read_text()
    assert "9.99x" not in text and "| b | 0.50x |" in text
    assert (
        "Median of 5. From [`benchmarks/results/x-cpu.md`](../../benchmarks/results/x-cpu.md)"
        in text
    )
    assert "at commit abc1234." in text and text.startswith("# Demo") and text.endswith("After.\n")
    assert tables.stale(root) == []


def test_a_changed_result_makes_the_readme_stale(tmp_path):
    root = _tree(tmp_path)
    tables.stale(root, write=True)
    path = root / "benchmarks" / "results" / "x-cpu.md"
    path.write_text(path.read_text().replace("0.50x", "0.40x").replace("abc1234", "def5678"))
    assert tables.stale(root) == ["plugins/p/README.md"]


def test_an_unknown_name_an_open_marker_and_an_unstamped_file_are_errors(tmp_path):
    root = _tree(tmp_path, readme=README.replace("x-cpu", "y-cpu"))
    with pytest.raises(tables.FiguresError, match="no results file has figures 'y-cpu'"):
        tables.stale(root)
    (root / "plugins" / "p" / "README.md").write_text(README.replace("<!-- /figures -->", ""))
    with pytest.raises(tables.FiguresError, match="not closed"):
        tables.stale(root)
    (root / "plugins" / "p" / "README.md").write_text(README)
    (root / "benchmarks" / "results" / "x-cpu.md").write_text(RESULT.split("\n", 1)[1])
    with pytest.raises(tables.FiguresError, match="names no commit"):
        tables.stale(root)
    assert tables.unstamped(root) == ["benchmarks/results/x-cpu.md"]


def test_a_summary_joins_blocks_and_names_each_file(tmp_path):
    other = (
        RESULT.replace("abc1234", "fedcba9")
        .replace("x-cpu", "z-cpu")
        .replace(', "note": "Median of 5."', "")
    )
    root = _tree(tmp_path, readme=README.replace("figures: x-cpu", "figures: x-cpu z-cpu"))
    (root / "benchmarks" / "results" / "z-cpu.md").write_text(other)
    tables.stale(root, write=True)
    text = (root / "plugins" / "p" / "README.md").read_text()
    assert text.count("| a | 1.00x |") == 2
    assert "x-cpu.md) at commit abc1234; [`benchmarks/results/z-cpu.md`]" in text
    assert "z-cpu.md) at commit fedcba9." in text
    (root / "benchmarks" / "results" / "z-cpu.md").write_text(other.replace('"time"', '"speed"'))
    with pytest.raises(tables.FiguresError, match="the columns differ"):
        tables.stale(root)


def test_a_quoted_marker_is_text_and_nothing_is_written_on_an_error(tmp_path):
    quoted = README + "\nWrite `<!-- figures: NAME -->` before a table.\n"
    root = _tree(tmp_path, readme=quoted)
    assert tables.stale(root, write=True) == ["plugins/p/README.md"]
    assert "`<!-- figures: NAME -->`" in (root / "plugins" / "p" / "README.md").read_text()
    (root / "README.md").write_text(README)  # stale, and sorted before the broken one
    (root / "plugins" / "p" / "README.md").write_text(README.replace("x-cpu", "y-cpu"))
    with pytest.raises(tables.FiguresError):
        tables.stale(root, write=True)
    assert (root / "README.md").read_text() == README
