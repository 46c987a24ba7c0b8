"""`mlx-lm-ext ssd-cache clear|ls|stats` on a cache directory an attacker can write.

Each case drives the real CLI against a hand-built tagged cache directory and
a "victim" folder outside it (model weights, a build file, an entry-named
file, an empty folder) that links inside the cache point at. Whatever the
case, every file outside the cache directory is byte-for-byte unchanged.
"""

import hashlib
import json
import os
import pty
import subprocess
import sys
from pathlib import Path

import pytest

from mlx_lm_ext import safefs

CLI = Path(sys.executable).with_name("mlx-lm-ext")
FP, FP2 = "a" * 16, "b" * 16
NS = "ns-" + "1" * 16
ENTRY = "c" * 32 + ".safetensors"
ENTRY2 = "d" * 32 + ".safetensors"
TEMP = f".{ENTRY2}.host.123.abcd.tmp"
REJECTED = ENTRY2 + ".rejected"


def run(*argv, stdin=subprocess.DEVNULL):
    return subprocess.run(
        [str(CLI), "ssd-cache", *argv], stdin=stdin, capture_output=True, text=True, timeout=120
    )


def snapshot(top: Path) -> dict:
    """Every path below ``top`` (links not followed): kind, size, mtime, content hash."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(top):
        for name in dirnames + filenames:
            p = Path(dirpath, name)
            st = p.lstat()
            if p.is_symlink():
                out[str(p)] = ("link", os.readlink(p))
            elif p.is_dir():
                out[str(p)] = ("dir",)
            else:
                out[str(p)] = (
                    "file",
                    st.st_size,
                    st.st_mtime_ns,
                    hashlib.sha256(p.read_bytes()).hexdigest(),
                )
    return out


def tier_files(space: Path) -> list:
    """Write one of each of the tier's own file kinds into ``space``."""
    space.mkdir(parents=True, exist_ok=True)
    paths = [space / ENTRY, space / TEMP, space / REJECTED]
    for p in paths:
        p.write_bytes(b"entry bytes " * 100)
    return paths


@pytest.fixture
def world(tmp_path):
    """``(cache root, victim, tier files)``: a tagged cache with two spaces, a victim beside it."""
    victim = tmp_path / "victim"
    (victim / "empty").mkdir(parents=True)
    (victim / "model.safetensors").write_bytes(b"weights" * 1000)
    (victim / "x.tmp").write_bytes(b"build file")
    (victim / ENTRY).write_bytes(b"not the cache's")
    (victim / TEMP).write_bytes(b"not the cache's either")
    (victim / safefs.INFO).write_text("{}")
    root = tmp_path / "cache"
    safefs.make_root(root)
    own = tier_files(root / FP / "base") + tier_files(root / FP2 / NS)
    (root / FP / safefs.INFO).write_text('{"model": "m"}')
    # a note and the temp file of a note writer that died: both go with FP2
    (root / FP2 / safefs.INFO).write_text(json.dumps({"model": "\x1b[2Jmodel"}))
    (root / FP2 / f".{safefs.INFO}.host.123.abcd.tmp").write_text("{}")
    return root, victim, own


def outside(tmp_path: Path, root: Path) -> dict:
    return {k: v for k, v in snapshot(tmp_path).items() if not k.startswith(str(root) + os.sep)}


def refused(r) -> None:
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mlx-lm-ext ssd-cache: error: "), r.stderr


# ------------------------------------------------------------- links inside


@pytest.mark.parametrize("where", ["namespace", "fingerprint", "entry"])
def test_clear_never_follows_a_link(tmp_path, world, where):
    root, victim, own = world
    if where == "namespace":
        link = root / FP / ("ns-" + "2" * 16)
        link.symlink_to(victim, target_is_directory=True)
    elif where == "fingerprint":
        link = root / ("e" * 16)
        link.symlink_to(victim, target_is_directory=True)
    else:
        link = root / FP / "base" / ("e" * 32 + ".safetensors")
        link.symlink_to(victim / ENTRY)
        (root / FP / "base" / f".{'e' * 32}.safetensors.h.1.ab.tmp").symlink_to(victim / "x.tmp")
    before = outside(tmp_path, root)
    r = run("clear", "--dir", str(root), "--yes")
    assert r.returncode == 0, r.stderr
    assert outside(tmp_path, root) == before
    assert not any(p.exists() for p in own)
    assert link.is_symlink()  # links are neither followed nor removed
    assert "symbolic link" in r.stdout and "removed 6 files" in r.stdout


def test_clear_refuses_a_link_as_root(tmp_path, world):
    root, victim, own = world
    for target in (root, victim):
        link = tmp_path / f"link-to-{target.name}"
        link.symlink_to(target, target_is_directory=True)
        before = snapshot(tmp_path)
        refused(run("clear", "--dir", str(link), "--yes"))
        refused(run("clear", "--dir", str(link) + "/", "--yes"))
        assert snapshot(tmp_path) == before


# ------------------------------------------------------- not a cache directory


def test_clear_refuses_untagged_directories(tmp_path, world):
    root, victim, own = world
    home = tmp_path / "home"
    (home / ".cache").mkdir(parents=True)
    (home / "notes.tmp").write_text("mine")
    (home / "weights.safetensors").write_bytes(b"w")
    # tier-shaped but never tagged: looks like a cache, still not one
    lookalike = tmp_path / "lookalike"
    tier_files(lookalike / FP / "base")
    before = snapshot(tmp_path)
    for d in (tmp_path, victim, home, lookalike, victim / "model.safetensors"):
        refused(run("clear", "--dir", str(d), "--yes"))
    assert snapshot(tmp_path) == before
    r = run("clear", "--dir", str(tmp_path / "missing"), "--yes")
    assert r.returncode == 0 and "nothing to clear" in r.stdout
    assert not (tmp_path / "missing").exists()


def test_clear_leaves_files_that_are_not_the_tiers(tmp_path, world):
    root, victim, own = world
    space = root / FP / "base"
    foreign = [
        root / "notes.txt",
        root / "model.safetensors",
        root / FP / "other.bin",
        space / "model.safetensors",
        space / "x.tmp",
        space / "README",
        space / (ENTRY + ".bak"),
        space / ("C" * 32 + ".safetensors"),
    ]
    for p in foreign:
        p.write_bytes(b"keep me")
    (space / ("e" * 32 + ".safetensors")).mkdir()  # an entry name that is a folder
    (root / "somedir").mkdir()
    before = outside(tmp_path, root)
    r = run("clear", "--dir", str(root), "--yes")
    assert r.returncode == 0, r.stderr
    assert outside(tmp_path, root) == before
    assert all(p.read_bytes() == b"keep me" for p in foreign)
    assert (space / ("e" * 32 + ".safetensors")).is_dir() and (root / "somedir").is_dir()
    assert not any(p.exists() for p in own) and not (root / FP2).exists()
    assert (root / safefs.TAG).exists()


# --------------------------------------------------------------- confirmation


def test_clear_without_a_tty_needs_yes(tmp_path, world):
    root, victim, own = world
    before = snapshot(tmp_path)
    r = run("clear", "--dir", str(root))
    refused(r)
    assert "--yes" in r.stderr
    assert snapshot(tmp_path) == before


def test_clear_dry_run_deletes_nothing(tmp_path, world):
    root, victim, own = world
    before = snapshot(tmp_path)
    r = run("clear", "--dir", str(root), "--dry-run", "--fingerprint", FP[:4])
    assert r.returncode == 0, r.stderr
    assert f"{FP}/base" in r.stdout and FP2 not in r.stdout and "total: 3 files" in r.stdout
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("answer", ["n", "y"])
def test_clear_asks_on_a_tty(tmp_path, world, answer):
    root, victim, own = world
    before_out, before_all = outside(tmp_path, root), snapshot(tmp_path)
    master, slave = pty.openpty()
    try:
        os.write(master, answer.encode() + b"\n")
        r = run("clear", "--dir", str(root), stdin=slave)
    finally:
        os.close(slave)
        os.close(master)
    assert "Delete 6 files" in r.stderr and "[y/N]" in r.stderr
    if answer == "n":
        assert r.returncode == 1 and "nothing deleted" in r.stdout
        assert snapshot(tmp_path) == before_all
    else:
        assert r.returncode == 0 and "removed 6 files" in r.stdout, r.stderr
        assert not any(p.exists() for p in own)
        assert outside(tmp_path, root) == before_out


# -------------------------------------------------------------- ls and stats


def test_ls_and_stats_do_not_list_through_links(tmp_path, world):
    root, victim, own = world
    (root / FP / ("ns-" + "2" * 16)).symlink_to(victim, target_is_directory=True)
    (root / ("e" * 16)).symlink_to(victim, target_is_directory=True)
    before = snapshot(tmp_path)
    ls = run("ls", "--dir", str(root))
    assert ls.returncode == 0, ls.stderr
    assert "2" * 16 not in ls.stdout and "e" * 16 not in ls.stdout
    assert ls.stdout.count("rejected") == 2 and ls.stdout.count("corrupt") == 2
    assert "2 unfinished writes" in ls.stdout and "skipped 2 symbolic links" in ls.stdout
    stats = run("stats", "--dir", str(root))
    assert stats.returncode == 0, stats.stderr
    assert "2 entries" in stats.stdout and "2" * 16 not in stats.stdout
    assert "?[2Jmodel" in stats.stdout  # no terminal escapes from a note
    assert snapshot(tmp_path) == before


def test_ls_and_stats_say_when_untagged(tmp_path, world):
    root, victim, own = world
    lookalike = tmp_path / "lookalike"
    tier_files(lookalike / FP / "base")
    link = tmp_path / "link"
    link.symlink_to(root, target_is_directory=True)
    for d, says, entries in (
        (lookalike, "not a tagged", "1 entry,"),
        (link, "symbolic link", "0 entries,"),
    ):
        r = run("stats", "--dir", str(d))
        assert r.returncode == 0 and says in r.stdout and entries in r.stdout, r
        r = run("ls", "--dir", str(d))
        assert r.returncode == 0 and says in r.stdout, r


def test_clear_leaves_a_write_a_running_server_holds(tmp_path, world, write_under_way):
    root, victim, own = world
    space = root / FP / "base"
    live = space / f".{'f' * 32}.safetensors.{safefs.HOST}.1.abcd.tmp"
    with write_under_way(live):
        r = run("clear", "--dir", str(root), "--yes")
        assert r.returncode == 0, r.stderr
        assert live.exists() and "left 1 unfinished write" in r.stdout
        assert not any(p.exists() for p in own)  # the rest is cleared
    r = run("clear", "--dir", str(root), "--yes")  # its writer is gone
    assert r.returncode == 0, r.stderr
    assert not live.exists()
