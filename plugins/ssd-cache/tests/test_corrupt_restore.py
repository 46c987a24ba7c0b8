"""A stored entry whose tensor bytes were overwritten in place (same size, inode).

On the real SmolLM2-135M (float32), served as ``mlx_lm.server`` does: fetch
the nearest cache, prefill the rest and generate, insert prompt + output with
the extended cache. A corrupt entry must not change any later prompt's answer
(by default every restore checks the tensors' CRC32s), and nothing built on
it may be stored again with fresh checksums, with or without that check.
"""

import os

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

from mlx_lm_ssd_cache import SSDPromptCache, fileformat

pytestmark = pytest.mark.slow

SYSTEM = (
    "You answer questions about European geography in one short sentence. "
    "Be precise, name the country or the city, and do not add anything else."
)


def chat(tok, question):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    return tok.apply_chat_template(messages, add_generation_prompt=True)


def greedy(model, tokens, cache, n=10):
    steps = generate_step(mx.array(tokens), model, prompt_cache=cache, max_tokens=n)
    return [int(t) for t, _ in steps]


def serve(store, model, key, prompt):
    """One request as the server handles it: fetch, generate, insert."""
    cache, rest = store.fetch_nearest_cache(key, prompt)
    if cache is None:
        cache, rest = make_prompt_cache(model), prompt
    out = greedy(model, rest, cache)
    store.insert_cache(key, prompt + out, cache)
    return out


def corrupt_tensors(path):
    """Random bytes over every tensor byte, in place: same size, same inode."""
    raw = path.read_bytes()
    start = 8 + int.from_bytes(raw[:8], "little")
    ino = path.stat().st_ino
    with open(path, "r+b") as f:
        f.seek(start)
        f.write(os.urandom(len(raw) - start))
    assert path.stat().st_ino == ino and path.stat().st_size == len(raw)


def entries(root):
    return sorted(root.glob("*/*/*.safetensors"))


def assert_clean(model, path):
    """The file's KV equals a fresh prefill of the tokens it claims to hold."""
    header = fileformat.read_header(path)
    stored, _ = fileformat.load(header, verify=True)
    clean = make_prompt_cache(model)
    mx.eval(model(mx.array(header.tokens.tolist())[None], cache=clean))
    for s, c in zip(stored, clean, strict=True):
        assert s.offset == c.offset == len(header.tokens)
        for a, b in ((s.keys, c.keys), (s.values, c.values)):
            n = c.offset
            assert np.allclose(np.array(a[..., :n, :]), np.array(b[..., :n, :]), atol=1e-3)


@pytest.fixture(scope="module")
def smollm(smollm2_f32_path):
    model, tok = load(str(smollm2_f32_path))
    return model, tok, (str(smollm2_f32_path), None, None)


@pytest.fixture
def poisoned(smollm, tmp_path):
    """A directory whose one entry (a first conversation) has random tensor bytes."""
    model, tok, key = smollm
    root = tmp_path / "cache"
    first = SSDPromptCache(1, directory=root)
    serve(first, model, key, chat(tok, "Which country is Lyon in?"))
    assert first.close(60)
    (entry,) = entries(root)
    corrupt_tensors(entry)
    return root, entry


def test_corrupt_entry_changes_no_answer_and_nothing_poisoned_is_stored(smollm, poisoned):
    model, tok, key = smollm
    root, bad = poisoned
    questions = ["What is the capital of France?", "Which river flows through Vienna?"]
    prompts = [chat(tok, q) for q in questions]
    wants = [greedy(model, p, make_prompt_cache(model)) for p in prompts]

    store = SSDPromptCache(1, directory=root)  # a restart, default settings
    for prompt, want in zip(prompts, wants, strict=True):
        assert serve(store, model, key, prompt) == want
    assert store.close(60)
    assert store.disk_stats()["removed_corrupt"] == 1
    assert not bad.exists() and bad.with_name(bad.name + ".rejected").exists()
    stored = entries(root)
    assert len(stored) == 2
    for path in stored:
        assert_clean(model, path)


def test_without_verify_nothing_built_on_an_unchecked_restore_is_stored(smollm, poisoned):
    model, tok, key = smollm
    root, bad = poisoned
    prompt = chat(tok, "What is the capital of France?")

    store = SSDPromptCache(1, directory=root, verify=False)
    out = serve(store, model, key, prompt)  # restored unchecked: may be wrong
    assert store.disk_stats()["hits"] == 1
    follow = prompt + out + tok.encode("\nAnd of Spain?")  # extends it in memory
    serve(store, model, key, follow)
    assert store.close(60)
    assert entries(root) == [bad]  # neither extension was written

    # A restart with the check finds the corrupt entry and restores nothing.
    store = SSDPromptCache(1, directory=root)
    cache, rest = store.fetch_nearest_cache(key, prompt)
    assert cache is None and rest == prompt
    assert entries(root) == [] and store.disk_stats()["removed_corrupt"] == 1
    store.close()


def test_real_server_corrupt_entry_changes_no_later_answer(servers, smollm, tmp_path):
    """As filed: ``mlx_lm.server --prompt-cache-size 1``, every entry's tensors overwritten."""
    model, _, key = smollm

    def ask(server, question):
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
        reply = server.chat("", max_tokens=10, messages=messages)
        return reply["choices"][0]["message"]["content"]

    def run(directory, name, questions, *flags):
        flags = ["--prompt-cache-size", "1", *flags]
        s = servers(key[0], directory, tmp_path / f"{name}.log", extra=flags).wait_ready()
        answers = [ask(s, q) for q in questions]
        s.stop()  # Ctrl-C: pending writes are flushed at exit
        return answers

    later = ["What is the capital of France?", "Which river flows through Vienna?"]
    wants = run(tmp_path / "empty", "plain", later)  # nothing to restore: prefills only
    root = tmp_path / "cache"
    run(root, "first", ["Which country is Lyon in?"])
    bad = entries(root)
    assert bad
    for path in bad:
        corrupt_tensors(path)
    run(root, "unchecked", later, "--no-ssd-cache-verify")  # answers may be wrong
    assert entries(root) == bad  # but nothing built on them was stored
    assert run(root, "second", later) == wants
    assert run(root, "third", later[::-1]) == wants[::-1]  # what the second one stored
    assert not set(bad) & set(entries(root))
    for path in entries(root):
        assert_clean(model, path)
