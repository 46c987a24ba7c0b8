"""What keeping the suffix corpus across restarts costs (``--suffix-corpus-dir``).

    source scripts/env.sh
    python benchmarks/bench_corpus_store.py

A full corpus of a million tokens (2000 documents of 500 random ids) for
SmolLM2-135M: the model fingerprint, one save, the file's size, and what a
new process pays to get it back (fingerprint, read, check, index again).
"""

import tempfile
import time

import numpy as np
from mlx_lm import load

from mlx_lm_ext import models
from mlx_lm_spec_decode import corpus_store
from mlx_lm_spec_decode import suffix as sx


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def main():
    model, tok = load(str(models.build("smollm2-135m-f32")))
    key = sx.tokenizer_key(tok)
    _, t_fp = timed(lambda: corpus_store.fingerprint(model, key))
    root = tempfile.mkdtemp()
    rng = np.random.default_rng(0)
    corpus = sx.corpus_for(model, key, 1_000_000, root)
    for _ in range(2000):
        corpus.add(rng.integers(0, 49152, 500).tolist())
    store = corpus.after_add.__self__
    _, t_save = timed(lambda: store.save(True))
    size = store.path.stat().st_size
    sx._CORPORA.clear()  # what a new process starts from
    again, t_load = timed(lambda: sx.corpus_for(model, key, 1_000_000, root))
    assert np.array_equal(again.tokens_in_order(), corpus.tokens_in_order())
    print("| corpus tokens | file MB | fingerprint s | save s | load + index s |")
    print("|---|---|---|---|---|")
    print(f"| {len(corpus)} | {size / 1e6:.2f} | {t_fp:.3f} | {t_save:.3f} | {t_load:.3f} |")


if __name__ == "__main__":
    main()
