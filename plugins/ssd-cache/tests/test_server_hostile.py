"""A hostile cache directory against real ``mlx_lm.server --plugin ssd-cache`` processes.

Entries crafted with valid header hashes, a namespace that is a link to a
folder of model files, and the n-gram drafter's cache riding after the
model's (``--plugin spec-decode``). Each case: nothing outside the cache
directory changes, the server answers every request, valid entries restore.
"""

import hashlib
import json
import shutil
import time
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache, make_prompt_cache

from mlx_lm_ssd_cache import disk, fileformat

PROMPTS = [
    f"Question {i}: " + f"why is the sky blue over the hill number {i}? " * 5 for i in range(4)
]


def text(r):
    return r["choices"][0]["message"]["content"]


def restored(r):
    u = r["usage"]
    return u["prompt_tokens_details"]["cached_tokens"] == u["prompt_tokens"] - 1


def entries(d):
    return sorted(Path(d).glob("*/*/*.safetensors"))


def wait_entries(d, n, timeout=60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if len(entries(d)) >= n and not list(Path(d).glob("*/*/.*.tmp")):
            return
        time.sleep(0.2)
    raise TimeoutError(f"{len(entries(d))} entries, wanted {n}")


def tree_digest(root):
    """Names, kinds and contents of everything under ``root`` (links not followed)."""
    out = {}
    for p in sorted(Path(root).rglob("*")):
        if p.is_symlink():
            out[str(p)] = "link:" + str(p.readlink())
        elif p.is_file():
            out[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest()
        else:
            out[str(p)] = "dir"
    return out


@pytest.fixture
def model(tiny_model, tmp_path):
    dst = tmp_path / "model"
    shutil.copytree(tiny_model("llama"), dst)
    return dst


def prompt_tokens(model_dir, content):
    from mlx_lm.utils import load_tokenizer

    tok = load_tokenizer(model_dir)
    return tok.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True
    )


def craft(model_dir, like, tokens, change):
    """An entry for ``tokens`` next to ``like`` whose caches ``change`` bent."""
    from mlx_lm import load

    model, _ = load(str(model_dir))
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array(tokens)[None], cache=cache), [c.state for c in cache])
    cache = change(cache)
    h = fileformat.read_header(like)
    ns = h.meta["namespace"]
    path = like.parent / disk.entry_name(ns, tokens)
    fileformat.write(
        path,
        fileformat.snapshot(cache),
        {
            "tokens": fileformat.tokens_json(tokens),
            "fingerprint": h.meta["fingerprint"],
            "namespace": ns,
            "model": "crafted",
        },
    )
    return path


def doubled_heads(cache):
    out = []
    for c in cache:
        k, v = c.keys[..., : c.offset, :], c.values[..., : c.offset, :]
        x = KVCache()
        x.keys, x.values = mx.concatenate([k, k], 1), mx.concatenate([v, v], 1)
        x.offset = c.offset
        out.append(x)
    return out


def test_crafted_entries_never_stop_the_server(servers, model, tmp_path):
    d = tmp_path / "cache"
    s = servers(model, d, tmp_path / "1.log").wait_ready()
    s.chat(PROMPTS[0])
    warm = text(s.chat(PROMPTS[0]))
    s.stop()
    wait_entries(d, 1)
    like = entries(d)[0]
    # lies with a valid hash: KV heads that the model does not have, and a
    # header field that is not the JSON it should be
    bad1 = craft(model, like, prompt_tokens(model, PROMPTS[1]), doubled_heads)
    bad2 = craft(model, like, prompt_tokens(model, PROMPTS[2]), lambda c: c)
    raw = bad2.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    header["__metadata__"]["spec"] = '{"not": "a list"}'
    meta = header.pop("__metadata__")
    meta["header_sha256"] = fileformat._header_hash(meta, header)
    blob = fileformat._header_bytes(meta, header)
    bad2.write_bytes(len(blob).to_bytes(8, "little") + blob + raw[8 + n :])

    for round_ in range(2):  # and again after a restart: the files were set aside
        s2 = servers(model, d, tmp_path / f"{round_ + 2}.log").wait_ready()
        r0 = s2.chat(PROMPTS[0])
        got = [s2.chat(p) for p in PROMPTS[1:3]]
        assert all(r["choices"] for r in got)
        # answered from no lie: the only disk restore is the valid entry's;
        # after a restart the answers' own entries restore too
        assert s2.text().count("tokens from disk") == (1 if round_ == 0 else 3)
        assert s2.healthy() and s2.chat(PROMPTS[3])["choices"]
        if round_ == 0:
            assert restored(r0) and text(r0) == warm  # the valid entry beside them
        assert "generation thread died" not in s2.text()
        assert "- disk: " in s2.text()  # the tier's line under mlx-lm's cache log
        s2.stop()
    assert bad1.with_name(bad1.name + ".rejected").exists()
    assert bad2.with_name(bad2.name + ".rejected").exists()


def test_a_namespace_linked_to_model_files_is_left_alone(servers, model, tmp_path):
    d = tmp_path / "cache"
    s = servers(model, d, tmp_path / "1.log").wait_ready()
    s.chat(PROMPTS[0])
    s.stop()
    wait_entries(d, 1)
    space = entries(d)[0].parent
    victim = tmp_path / "weights"
    victim.mkdir()
    (victim / "model.safetensors").write_bytes(b"weights")
    (victim / ("d" * 32 + ".safetensors")).write_bytes(b"looks like an entry")
    (victim / f".{'e' * 32}.safetensors.{disk.HOST}.1.ab.tmp").write_bytes(b"a dead write")
    shutil.rmtree(space)
    space.symlink_to(victim)
    before = tree_digest(victim)
    s2 = servers(model, d, tmp_path / "2.log").wait_ready()
    for p in PROMPTS[:3]:
        assert text(s2.chat(p)) is not None
    assert s2.healthy()
    s2.stop()
    assert tree_digest(victim) == before


def test_stored_and_restored_with_spec_decode_on(servers, model, tmp_path):
    d = tmp_path / "cache"
    both = ["--plugin", "spec-decode", "--drafter", "ngram"]
    s = servers(model, d, tmp_path / "1.log", extra=both).wait_ready()
    first = s.chat(PROMPTS[0], max_tokens=16)
    s.stop()
    wait_entries(d, 1)
    headers = [fileformat.read_header(p) for p in entries(d)]
    # The n-gram drafter runs on the batched path, whose entries are the
    # model's caches only, as stock's (each row rebuilds its index).
    assert not any(x["class"] == "NGramCache" for h in headers for x in h.extras)
    s2 = servers(model, d, tmp_path / "2.log", extra=both).wait_ready()
    again = s2.chat(PROMPTS[0], max_tokens=16)
    assert restored(again) and text(again) == text(first)
    assert "speculative_decoding" in again["usage"]  # the plugin's usage fields
    assert again["usage"]["completion_tokens_details"]["accepted_prediction_tokens"] >= 0
    s2.stop()
    plain = servers(model, d, tmp_path / "3.log").wait_ready()  # without the drafter
    r = plain.chat(PROMPTS[0], max_tokens=16)
    assert restored(r) and text(r) == text(first)
    plain.stop()
