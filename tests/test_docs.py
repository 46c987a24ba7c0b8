"""The docs name only code that exists, and link only to what exists.

Every backticked ``module.name`` in the READMEs and ``docs/`` whose module is
one of ours (by its last part, e.g. ``integration.enable``, or dotted,
``mlx_lm_ext.integration.enable``) must name a function, class or variable
defined there; every ``mlx_lm.module.name`` must exist in the installed
mlx-lm. The code is read with ``ast`` (ours) or imported (mlx-lm's).

Every relative link ``[text](path#anchor)`` must point to an existing file
and, with an anchor, to a heading of that file (GitHub's anchors); and
``docs/architecture.md`` stays a short map.
"""

import ast
import re
from pathlib import Path

import pytest

from mlx_lm_ext.testing import resolve

ROOT = Path(__file__).resolve().parents[1]
DOCS = [
    ROOT / "README.md",
    ROOT / "benchmarks" / "README.md",
    *sorted(ROOT.glob("docs/*.md")),
    *sorted(ROOT.glob("plugins/*/README.md")),
]
PACKAGES = [ROOT / "mlx_lm_ext", *sorted(ROOT.glob("plugins/*/mlx_lm_*"))]
# `a.b` or `a.b.c` in backticks, optionally called: `integration.enable()`.
REF = re.compile(r"`((?:[A-Za-z_][A-Za-z0-9_]*\.)+[A-Za-z_][A-Za-z0-9_]*)(?:\([^`]*\))?`")
FILE_SUFFIXES = {
    "py", "md", "json", "jsonl", "toml", "sh", "txt", "yaml", "yml", "npz",
    "safetensors", "gguf", "cuh", "pth", "tmp", "lock", "rejected",
}  # fmt: skip
# Module names that the docs also use as plain words for mlx-lm objects
# (`cache.offset` is a KV cache's attribute, not ssd-cache's cache module).
GENERIC = {"cache"}


def _names(path):
    """Top-level names a module defines or imports, and its classes' members."""
    tree = ast.parse(path.read_text())
    out = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
            if isinstance(node, ast.ClassDef):
                out |= {f"{node.name}.{n}" for n in _class_members(node)}
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                out |= {n.id for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            out |= {(a.asname or a.name).split(".")[0] for a in node.names}
    for node in tree.body:  # names served lazily through __getattr__ and __all__
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            out |= {c.value for c in ast.walk(node.value) if isinstance(c, ast.Constant)}
    return out


def _class_members(cls):
    out = set()
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            out |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    for node in ast.walk(cls):  # attributes set in methods: self.x = ...
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if node.value.id == "self" and isinstance(node.ctx, ast.Store):
                out.add(node.attr)
    return out


def our_modules():
    """``{dotted name: defined names}``, keyed by full and by last part(s)."""
    full = {}
    for pkg in PACKAGES:
        for path in pkg.rglob("*.py"):
            parts = list(path.relative_to(pkg.parent).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            full[".".join(parts)] = _names(path)
    return full


def references(text):
    for m in REF.finditer(text):
        ref = m.group(1)
        if ref.rsplit(".", 1)[1] in FILE_SUFFIXES:
            continue  # a file name such as `loop.py`
        yield ref


def check(ref, modules):
    """None if ``ref`` resolves, else why not; references to others' code pass."""
    parts = ref.split(".")
    if "X" in parts:
        return None  # a placeholder: `mlx_lm.X`
    if ref.startswith("mlx_lm."):
        return _check_mlx_lm(ref)
    if any(m == ref or m.endswith("." + ref) for m in modules):
        return None  # a module: `mlx_lm_ext.plugins`
    for cut in range(len(parts) - 1, 0, -1):
        mod, name = ".".join(parts[:cut]), parts[cut]
        owners = [m for m in modules if m == mod or m.endswith("." + mod)]
        if not owners:
            continue
        # `Class.method` and `module.OBJECT.attr`: the first name after the
        # module must exist; a class's own members are checked too.
        member = ".".join(parts[cut : cut + 2])
        if any(name in modules[m] for m in owners):
            if cut + 1 < len(parts) and any(member in modules[m] for m in owners):
                return None
            if cut + 1 == len(parts) or not any(f"{name}." in " ".join(modules[m]) for m in owners):
                return None
            return f"{member} is not a member in {', '.join(owners)}"
        if cut == 1 and mod in GENERIC:
            return None
        return f"{name} is not defined in {', '.join(owners)}"
    return None  # not a module of ours (e.g. `args.model`)


def _check_mlx_lm(ref):
    try:
        resolve(ref)
    except (ImportError, AttributeError):
        return f"mlx-lm has no {ref}"
    return None


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_docs_name_only_existing_code(doc):
    modules = our_modules()
    bad = sorted(
        {f"`{r}`: {why}" for r in references(doc.read_text()) if (why := check(r, modules))}
    )
    assert bad == [], "\n".join(bad)


def test_a_stale_name_is_caught():
    modules = our_modules()
    assert check("integration.enable", modules) is None
    assert check("integration.no_such_function", modules) is not None
    assert check("batch.SpecBatchGenerator", modules) is None
    assert check("batch.SpecBatchGenerator.no_such_method", modules) is not None
    assert check("mlx_lm_ext.plugins", modules) is None
    assert check("mlx_lm.generate.stream_generate", modules) is None
    assert check("mlx_lm.generate.no_such_function", modules) is not None


# ------------------------------------------------------------------- links

# `[text](target)`, the text possibly over several lines; not images' `![`.
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
ARCH_MAX_LINES = 320


def _strip_fences(text):
    return re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)


def _without_code(text):
    """The text with fenced code blocks and inline code removed."""
    return re.sub(r"`[^`\n]*`", "", _strip_fences(text))


def anchors(text):
    """The anchors GitHub makes for a markdown file's headings."""
    out, seen = set(), {}
    for m in re.finditer(r"^#{1,6}\s+(.*?)\s*#*\s*$", _strip_fences(text), re.M):
        slug = m.group(1).strip().lower()
        slug = re.sub(r"[^\w\- ]", "", slug).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def bad_links(doc):
    """Why each relative link of ``doc`` does not resolve."""
    bad = []
    for target in LINK.findall(_without_code(doc.read_text())):
        if re.match(r"[a-z]+:", target):
            continue  # http:, https:, mailto:
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        if not dest.exists():
            bad.append(
                f"{target}: no file {dest.relative_to(ROOT) if ROOT in dest.parents else dest}"
            )
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text()):
            bad.append(f"{target}: no heading #{anchor} in {dest.name}")
    return bad


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_to_existing_files_and_headings(doc):
    assert bad_links(doc) == []


def test_a_broken_link_is_caught(tmp_path):
    (tmp_path / "other.md").write_text("# Other\n\n## A `code` heading: here\n")
    doc = tmp_path / "doc.md"
    doc.write_text(
        "# Doc\n[fine](other.md#a-code-heading-here) [self](#doc) [web](https://x.org/a)\n"
        "[gone](missing.md) [no heading](other.md#nowhere) [no anchor](#other)\n"
        "`[in code](missing.md)`\n"
    )
    assert [b.split(":")[0] for b in bad_links(doc)] == [
        "missing.md",
        "other.md#nowhere",
        "#other",
    ]
    assert anchors("## Start-up: `mlx_lm_ext.pth` -> `_boot`\n## X\n## X\n") == {
        "start-up-mlx_lm_extpth---_boot",
        "x",
        "x-1",
    }


def test_the_architecture_doc_stays_a_short_map():
    lines = (ROOT / "docs" / "architecture.md").read_text().count("\n")
    assert lines <= ARCH_MAX_LINES, (
        f"docs/architecture.md has {lines} lines (at most {ARCH_MAX_LINES})"
    )
