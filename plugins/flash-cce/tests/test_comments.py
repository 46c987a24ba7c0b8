"""No measured figures in the package's comments and docstrings: they go stale silently.

Measurements live in ``benchmarks/results/`` (each file names its commit);
a comment points there instead.
"""

import ast
import io
import re
import tokenize
from pathlib import Path

import mlx_lm_flash_cce

PACKAGE = Path(mlx_lm_flash_cce.__file__).parent
# a time, a memory size or a throughput, or a speed ratio ("1.4x", "1.19-1.36x", "~10x")
FIGURE = re.compile(
    r"\b\d+(?:\.\d+)?(?:-\d+(?:\.\d+)?)?\s?(?:ms|s|MiB|GiB|GB|TFLOP/s)\b"
    r"|~?\b\d+(?:\.\d+)?(?:-\d+(?:\.\d+)?)?x\b"
)


def _prose(source):
    """The comments and docstrings of a module's source, with their line numbers."""
    out = [
        (tok.start[0], tok.string)
        for tok in tokenize.generate_tokens(io.StringIO(source).readline)
        if tok.type == tokenize.COMMENT
    ]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                out.append((node.body[0].lineno, doc))
    return out


def test_no_measured_figures_in_comments():
    found = []
    for path in sorted(PACKAGE.glob("*.py")):
        for line, text in _prose(path.read_text()):
            for m in FIGURE.finditer(text):
                found.append(f"{path.name}:{line}: {m.group(0)!r}")
    assert not found, "measured figures in comments (point to benchmarks/results/):\n" + "\n".join(
        found
    )
