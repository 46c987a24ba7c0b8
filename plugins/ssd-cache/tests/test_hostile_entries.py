"""Entries crafted by someone who can write to the cache directory.

Every header here is consistent (its hash is right), so only the checks
against the running model's cache layout stand between the file and mlx-lm.
Each crafted entry must be a miss, be set aside (``.rejected``), and leave a
valid entry beside it restorable.
"""

import json
import os

import mlx.core as mx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

from mlx_lm_ext import safefs
from mlx_lm_ssd_cache import SSDPromptCache, disk, fileformat, layout


def prefill(model, tokens):
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array(tokens)[None], cache=cache), [c.state for c in cache])
    return cache


@pytest.fixture
def stored(tiny, tmp_path):
    """A directory with one valid entry; returns what crafting needs."""
    model, _, path = tiny("llama")
    root = tmp_path / "cache"
    c = SSDPromptCache(10, directory=root, live_models=lambda key: [model])
    good = list(range(1, 31))
    c.insert_cache(str(path), good, prefill(model, good))
    c.close(30)
    (entry,) = root.glob("*/*/*.safetensors")
    header = fileformat.read_header(entry)
    return dict(
        model=model,
        key=str(path),
        root=root,
        space=entry.parent,
        good=good,
        fp=header.meta["fingerprint"],
        ns=header.meta["namespace"],
    )


def plant(s, tokens, caches, **meta):
    """Write ``caches`` as an entry for ``tokens`` with a valid header hash."""
    snap = fileformat.snapshot(caches)
    name = disk.entry_name(s["ns"], tokens)
    fields = {
        "tokens": fileformat.tokens_json(tokens),
        "fingerprint": s["fp"],
        "namespace": s["ns"],
        "model": "crafted",
        **meta,
    }
    fileformat.write(s["space"] / name, snap, fields)
    return s["space"] / name


def fresh(s):
    model = s["model"]
    return SSDPromptCache(10, directory=s["root"], live_models=lambda key: [model])


def assert_rejected(s, path, prompt):
    c = fresh(s)
    cache, rest = c.fetch_nearest_cache(s["key"], prompt)
    assert cache is None or len(rest) > 1 or len(prompt) - len(rest) <= len(s["good"])
    assert not path.exists() and path.with_name(path.name + ".rejected").exists()
    # the valid entry beside it still restores, and computes
    cache, rest = c.fetch_nearest_cache(s["key"], s["good"] + [5])
    assert rest == [5]
    mx.eval(s["model"](mx.array([[5]]), cache=cache))
    assert c.disk_stats()["removed_corrupt"] >= 1
    c.close()


def kv_like(cache, fn):
    """Copies of a model's caches with ``fn(keys, values) -> (keys, values)`` applied."""
    out = []
    for c in cache:
        k, v = fn(c.keys[..., : c.offset, :], c.values[..., : c.offset, :])
        x = KVCache()
        x.keys, x.values, x.offset = k, v, k.shape[-2]
        out.append(x)
    mx.eval([x.state for x in out])
    return out


@pytest.mark.parametrize(
    "lie",
    [
        "kv heads",
        "head dim",
        "dtype",
        "offset",
        "tokens",
        "class",
        "layers",
        "rank",
    ],
)
def test_a_lying_entry_is_a_miss_and_set_aside(stored, lie):
    s = stored
    toks = list(range(100, 140))
    base = prefill(s["model"], toks)
    caches, tokens = base, toks
    if lie == "kv heads":
        caches = kv_like(base, lambda k, v: (mx.concatenate([k, k], 1), mx.concatenate([v, v], 1)))
    elif lie == "head dim":
        caches = kv_like(base, lambda k, v: (k[..., :-2], v[..., :-2]))
    elif lie == "dtype":
        caches = kv_like(base, lambda k, v: (k.astype(mx.float16), v.astype(mx.float16)))
    elif lie == "offset":
        caches = kv_like(base, lambda k, v: (k, v))
        caches[-1].offset = 60  # its buffers hold 40 tokens
    elif lie == "tokens":
        tokens = toks + [7, 7, 7]  # three tokens the KV never saw
    elif lie == "class":
        r = RotatingKVCache(max_size=64)
        r.update_and_fetch(base[0].keys[..., :40, :], base[0].values[..., :40, :])
        caches = [r] + base[1:]
    elif lie == "layers":
        caches = base + [base[0]]
    elif lie == "rank":
        caches = kv_like(base, lambda k, v: (k[0], v[0]))
    path = plant(s, tokens, caches)
    assert_rejected(s, path, tokens + [9])


def test_a_sparse_file_that_claims_more_than_it_has_is_refused(stored):
    s = stored
    toks = list(range(200, 240))
    path = plant(s, toks, prefill(s["model"], toks))
    with open(path, "r+b") as f:  # punch the tensor data out: a file of holes
        n = int.from_bytes(f.read(8), "little")
        size = os.fstat(f.fileno()).st_size
        f.truncate(8 + n)
        f.truncate(size)
    if os.stat(path).st_blocks * 512 >= size // 2:
        pytest.skip("this file system does not make sparse files")
    assert_rejected(s, path, toks + [9])


@pytest.mark.parametrize(
    "field,value",
    [
        ("tokens", "[1, 99999999999999999999]"),  # out of range
        ("tokens", "[1, -3]"),
        ("tokens", '{"a": 1}'),
        ("spec", "not json"),
        ("spec", '[{"class": "KVCache", "state": {"t": 10**6}}]'),
        ("spec", '[{"class": "LRUPromptCache", "state": null}]'),
        ("trimmable", "yes"),
        ("tensor_crc32", "[]"),
        ("n_tokens", "12"),
        ("extras", '[{"class": "NGramCache", "state": {"t": 0}, "meta_state": [1]}]'),
    ],
)
def test_a_malformed_field_is_a_corrupt_file_not_a_disabled_tier(stored, field, value):
    s = stored
    toks = list(range(300, 330))
    path = plant(s, toks, prefill(s["model"], toks))
    rewrite(path, lambda meta, tensors: meta.__setitem__(field, value))
    with pytest.raises(fileformat.Corrupt):
        fileformat.read_header(path)
    assert_rejected(s, path, toks + [9])


def rewrite(path, change):
    """Change a header's fields and re-sign it (a valid hash, a lying body)."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    meta = header.pop("__metadata__")
    change(meta, header)
    meta["header_sha256"] = fileformat._header_hash(meta, header)
    blob = fileformat._header_bytes(meta, header)
    path.write_bytes(len(blob).to_bytes(8, "little") + blob + raw[8 + n :])


def test_a_symlinked_namespace_is_never_entered(stored, tmp_path):
    s = stored
    victim = tmp_path / "weights"
    victim.mkdir()
    (victim / ("c" * 32 + ".safetensors")).write_bytes(b"model weights")
    s["space"].rename(s["space"].with_name("moved"))
    s["space"].symlink_to(victim)
    c = fresh(s)
    assert c.fetch_nearest_cache(s["key"], s["good"] + [5])[0] is None
    c.close()
    assert sorted(p.name for p in victim.iterdir()) == ["c" * 32 + ".safetensors"]
    assert (victim / ("c" * 32 + ".safetensors")).read_bytes() == b"model weights"


def test_an_untagged_directory_of_other_files_is_refused(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(safefs.NotACache):
        safefs.make_root(tmp_path)
    assert not (tmp_path / safefs.TAG).exists()
    safefs.make_root(tmp_path / "new")
    assert safefs.has_tag(tmp_path / "new")


def test_reference_without_the_loaded_model_still_checks_shapes(stored):
    s = stored
    ref = layout.reference([s["model"]], exact_dtype=False)
    header = fileformat.read_header(next(s["root"].glob("*/*/*.safetensors")))
    layout.validate(header, ref)
    toks = list(range(100, 140))
    bad = plant(
        s, toks, kv_like(prefill(s["model"], toks), lambda k, v: (k[..., :-2], v[..., :-2]))
    )
    with pytest.raises(fileformat.Corrupt, match="shape"):
        layout.validate(fileformat.read_header(bad), ref)


# ---------------------------------------------------------- property-based

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_fuzzed_headers_are_entries_or_corrupt(stored, data):
    """Whatever a signed header holds: a ``Header`` that validates, or ``Corrupt``."""
    s = stored
    src = next(s["root"].glob("*/*/*.safetensors"))
    path = s["space"] / "fuzz.safetensors"
    path.write_bytes(src.read_bytes())
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    meta = header["__metadata__"]
    target = data.draw(st.sampled_from(["meta", "tensor", "spec"]))
    value = data.draw(json_values)
    if target == "meta":
        key = data.draw(st.sampled_from(sorted(meta) + ["extras"]))
        meta[key] = json.dumps(value) if data.draw(st.booleans()) else value
    elif target == "tensor":
        key = data.draw(st.sampled_from(sorted(k for k in header if k != "__metadata__")))
        field = data.draw(st.sampled_from(["shape", "dtype", "data_offsets"]))
        header[key][field] = value
    else:
        spec = json.loads(meta["spec"])
        layer = data.draw(st.integers(0, len(spec) - 1))
        spec[layer]["state"] = {"tuple": [{"t": 0}, {"t": 1}, value]}
        meta["spec"] = json.dumps(spec)
    rewrite(
        path,
        lambda m, t: (
            m.clear(),
            m.update(meta),
            t.clear(),
            t.update({k: v for k, v in header.items() if k != "__metadata__"}),
        ),
    )
    ref = layout.reference([s["model"]])
    try:
        h = fileformat.read_header(path)
    except fileformat.Corrupt:
        return
    try:
        layout.validate(h, ref)
    except fileformat.Corrupt:
        return
