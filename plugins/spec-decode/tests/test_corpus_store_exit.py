"""The suffix corpus is saved at exit, and never written through a link.

A real ``mlx_lm.server --drafter suffix --suffix-corpus-dir`` on the offline
SmolLM2 (float32) serves two requests and is stopped by SIGTERM or Ctrl-C
(SIGINT) long before the 30-second save is due: the stored corpus holds both
requests. A fingerprint folder swapped for a link to a folder outside is
never written through: one warning, and the corpus goes on in memory.
"""

import logging
import os
import signal
import subprocess

import pytest
from mlx_lm import load
from test_batch_server import ask, start

from mlx_lm_spec_decode import corpus_store
from mlx_lm_spec_decode import suffix as sx

PROMPTS = [
    "Repeat exactly: the violet giraffe counts seventeen lanterns by the harbour.",
    "Repeat exactly: a copper kettle whistles twice before the tram departs.",
]


def contains(tokens, part):
    n = len(part)
    return any(tokens[i : i + n] == part for i in range(len(tokens) - n + 1))


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_the_server_saves_the_corpus_at_exit(smollm2_f32_path, tmp_path, sig):
    root = tmp_path / "corpus"
    flags = ["--plugin", "spec-decode", "--drafter", "suffix", "--suffix-corpus-dir", str(root)]
    base, proc = start(smollm2_f32_path, *flags, "--no-status")
    try:
        for p in PROMPTS:
            ask(base, p, 8)
    except BaseException:
        proc.kill()
        raise
    proc.send_signal(sig)
    try:
        out = proc.communicate(timeout=120)[0]
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    (path,) = root.glob("*/suffix-corpus.npz")
    corpus = sx.SuffixCorpus(10_000)
    docs = corpus_store.load(path.read_bytes(), path.parent.name, corpus, 49152)
    assert docs == 2, out
    _, tok = load(str(smollm2_f32_path), lazy=True)
    saved = corpus.tokens_in_order().tolist()
    for p in PROMPTS:
        ids = tok.encode(p, add_special_tokens=False)
        assert contains(saved, ids[1:-1]), out  # boundaries may merge with the template's


def test_a_folder_swapped_for_a_link_is_never_written_through(tiny_model, tmp_path, caplog):
    model, _ = load(str(tiny_model("llama")))
    root, outside = tmp_path / "corpus", tmp_path / "outside"
    outside.mkdir()
    sx._CORPORA.clear()
    corpus = sx.corpus_for(model, "t", 1000, str(root))
    store = corpus.after_add.__self__
    corpus.add([5, 6, 7, 8, 9])
    store.save(True)
    folder = store.path.parent
    assert store.path.is_file()
    for name in os.listdir(folder):
        os.unlink(folder / name)
    folder.rmdir()
    folder.symlink_to(outside)  # an attacker's link, between two saves
    with caplog.at_level(logging.WARNING, logger="mlx_lm_spec_decode"):
        corpus.add([5, 6, 7, 10, 11])
        store.save(True)
        corpus.add([20, 21, 22, 23])
        corpus_store.flush()  # what exit runs
    assert os.listdir(outside) == []
    assert sum("stays in memory only" in r.message for r in caplog.records) == 1
    assert corpus.candidates([1, 5, 6, 7]) != []  # still drafting from memory

    # A new process that finds the link at start: the same, from the outset.
    caplog.clear()
    sx._CORPORA.clear()
    with caplog.at_level(logging.WARNING, logger="mlx_lm_spec_decode"):
        again = sx.corpus_for(model, "t", 1000, str(root))
        again.add([5, 6, 7, 8, 9])
        again.after_add.__self__.save(True)
        corpus_store.flush()
    assert os.listdir(outside) == []
    assert sum("stays in memory only" in r.message for r in caplog.records) == 1
    assert again.candidates([1, 5, 6, 7]) != []
    corpus_store.flush(forget=True)


def test_saved_when_the_plugin_is_deactivated_or_the_model_dropped(tiny_model, tmp_path):
    import gc

    import mlx_lm_ext

    model, _ = load(str(tiny_model("llama")))
    root = tmp_path / "corpus"
    mlx_lm_ext.enable("spec-decode")
    sx._CORPORA.clear()
    corpus = sx.corpus_for(model, "t", 1000, str(root))
    corpus.add([5, 6, 7, 8, 9])  # the 30 s save is not due
    path = corpus.after_add.__self__.path
    assert not path.exists()
    mlx_lm_ext.disable("spec-decode")
    assert path.is_file()

    other, _ = load(str(tiny_model("llama", seed=1)))
    corpus = sx.corpus_for(other, "t", 1000, str(root))
    corpus.add([1, 2, 3, 4])
    path = corpus.after_add.__self__.path
    del other
    gc.collect()
    assert path.is_file()
    stored = sx.SuffixCorpus(1000)
    corpus_store.load(path.read_bytes(), path.parent.name, stored)
    assert stored.tokens_in_order().tolist() == corpus.tokens_in_order().tolist()
