"""The suffix corpus kept across restarts (``corpus_store``): a new process
finds what the last one learnt, only for the same model and tokenizer; a
damaged, foreign or linked file is ignored with one warning and replaced
by the next save; a smaller corpus keeps the newest documents."""

import logging

import numpy as np
import pytest
from mlx_lm import load

from mlx_lm_spec_decode import SuffixDrafter, corpus_store
from mlx_lm_spec_decode import suffix as sx

DOCS = [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22, 23, 24], [5, 6, 7, 30, 31, 32]]


@pytest.fixture(scope="module")
def models(tiny_model):
    a, _ = load(str(tiny_model("llama")))
    b, _ = load(str(tiny_model("llama", seed=1)))
    return a, b


def fresh(model, root, cap=1000, tok="t1"):
    """The corpus a new process would get (this process's table cleared)."""
    sx._CORPORA.clear()
    return sx.corpus_for(model, tok, cap, str(root))


def saved(model, root, docs=DOCS, cap=1000):
    corpus = fresh(model, root, cap)
    for d in docs:
        corpus.add(d)
    store = corpus.after_add.__self__  # saves on add when due; now, here
    store.save(True)
    return corpus, store.path


def test_a_new_process_finds_the_corpus(models, tmp_path):
    a, _ = models
    before, path = saved(a, tmp_path)
    assert path.is_file() and path.parent.parent == tmp_path
    after = fresh(a, tmp_path)
    assert np.array_equal(after.tokens_in_order(), before.tokens_in_order())
    assert after.candidates([1, 5, 6, 7]) == before.candidates([1, 5, 6, 7]) != []


def test_saved_when_due_and_at_exit(models, tmp_path, monkeypatch):
    a, _ = models
    corpus = fresh(a, tmp_path)
    store = corpus.after_add.__self__
    corpus.add(DOCS[0])
    assert not store.path.exists()  # not due yet
    monkeypatch.setattr(corpus_store, "SAVE_SECONDS", 0.0)
    corpus.add(DOCS[1])
    assert store.path.is_file()
    corpus.add(DOCS[2])
    store.save(True)  # what the exit handler runs
    assert len(fresh(a, tmp_path)) == len(corpus)


def test_other_models_and_tokenizers_never_share(models, tmp_path):
    a, b = models
    saved(a, tmp_path)
    assert len(fresh(b, tmp_path)) == 0
    sx._CORPORA.clear()
    assert len(sx.corpus_for(a, "another-tokenizer", 1000, str(tmp_path))) == 0
    assert len(fresh(a, tmp_path)) > 0


@pytest.mark.parametrize("damage", ["garbage", "truncated", "checksum", "ids", "link"])
def test_a_damaged_file_is_ignored_with_one_warning(models, tmp_path, caplog, damage):
    a, _ = models
    _, path = saved(a, tmp_path)
    good = path.read_bytes()
    if damage == "garbage":
        path.write_bytes(b"not a corpus" * 100)
    elif damage == "truncated":
        path.write_bytes(good[: len(good) // 2])
    elif damage in ("checksum", "ids"):
        with np.load(path) as z:
            toks, header = z["tokens"].copy(), z["header"].copy()
        toks[-1] = 7 if damage == "checksum" else 10**6
        if damage == "ids":  # a consistent file whose ids the model does not have
            import hashlib
            import json

            head = json.loads(bytes(header).decode())
            head["sha256"] = hashlib.sha256(toks.tobytes()).hexdigest()
            header = np.frombuffer(json.dumps(head).encode(), np.uint8)
        with open(path, "wb") as f:
            np.savez(f, tokens=toks, header=header)
    else:
        target = tmp_path / "elsewhere.npz"
        target.write_bytes(good)
        path.unlink()
        path.symlink_to(target)
    with caplog.at_level(logging.WARNING, logger="mlx_lm_spec_decode"):
        corpus = fresh(a, tmp_path)
    assert len(corpus) == 0
    assert sum("ignoring the stored suffix corpus" in r.message for r in caplog.records) == 1
    corpus.add(DOCS[0])
    corpus.after_add.__self__.save(True)  # the next save replaces it
    assert not path.is_symlink() and len(fresh(a, tmp_path)) == len(DOCS[0]) + 1
    if damage == "link":
        assert (tmp_path / "elsewhere.npz").read_bytes() == good  # never written through


def test_a_smaller_corpus_keeps_the_newest(models, tmp_path):
    a, _ = models
    saved(a, tmp_path)
    small = fresh(a, tmp_path, cap=14)
    assert small.tokens_in_order().tolist()[-6:] == DOCS[2]
    assert len(small) <= 14


def test_drafter_and_flag(tiny_model, tmp_path):
    model, tok = load(str(tiny_model("llama")))
    d = SuffixDrafter(tokenizer=tok, corpus_dir=str(tmp_path))
    sx._CORPORA.clear()
    corpus = d.corpus_of(model)
    assert corpus.after_add is not None
    from mlx_lm_spec_decode.plugin import PluginError, _corpus_dir

    class Args:
        suffix_corpus_dir = str(tmp_path / "file")

    (tmp_path / "file").write_text("x")
    with pytest.raises(PluginError, match="must be a folder"):
        _corpus_dir(Args)
