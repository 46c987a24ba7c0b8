"""What keeping the suffix corpus across restarts costs (``--suffix-corpus-dir``).

    source scripts/env.sh
    python benchmarks/bench_corpus_store.py

A full corpus of a million tokens (2000 documents of 500 random ids) for
SmolLM2-135M: the model fingerprint, a save, the file's size, and what a
new process pays to get it back (fingerprint, read, check, index again).
Each timed save follows one fresh document (added untimed), so that every
repeat writes the whole corpus: a save with nothing new returns at once.
"""

import argparse
import tempfile
import time

import common
import numpy as np
from mlx_lm import load

from mlx_lm_ext import models
from mlx_lm_spec_decode import corpus_store
from mlx_lm_spec_decode import suffix as sx

VOCAB, DOC = 49152, 500


def timed_saves(store, corpus, rng, repeats):
    """``repeats`` saves, each of a corpus changed by one fresh document since the last."""
    corpus.after_add = None  # else an add may save the change first (every 30 s)
    times = []
    for _ in range(repeats):
        corpus.add(rng.integers(0, VOCAB, DOC).tolist())
        tic = time.perf_counter()
        store.save(True)
        times.append(time.perf_counter() - tic)
        if store.saved_end != corpus.end:
            raise SystemExit("a timed save did not write the corpus")
    corpus.after_add = store.save
    return common.Timing(times, 0)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3, help="timed runs of each step (median)")
    a = p.parse_args()
    common.print_header()
    model, tok = load(str(models.build("smollm2-135m-f32")))
    key = sx.tokenizer_key(tok)
    t_fp, _ = common.timed(corpus_store.fingerprint, model, key, repeats=a.repeats, warmup=0)
    root = tempfile.mkdtemp()
    rng = np.random.default_rng(0)
    corpus = sx.corpus_for(model, key, 1_000_000, root)
    for _ in range(2000):
        corpus.add(rng.integers(0, VOCAB, DOC).tolist())
    store = corpus.after_add.__self__
    t_save = timed_saves(store, corpus, rng, a.repeats)
    size = store.path.stat().st_size

    def load_again():
        sx._CORPORA.clear()  # what a new process starts from
        return sx.corpus_for(model, key, 1_000_000, root)

    t_load, again = common.timed(load_again, repeats=a.repeats, warmup=0)
    assert np.array_equal(again.tokens_in_order(), corpus.tokens_in_order())
    print(f"seconds: {t_load.statistic}")
    cols = ["corpus tokens", "file MB", "fingerprint s", "save s", "load + index s"]
    row = [len(corpus), f"{size / 1e6:.2f}", f"{t_fp.median:.3f}", f"{t_save.median:.3f}"]
    print(common.table(cols, [row + [f"{t_load.median:.3f}"]]))


if __name__ == "__main__":
    main()
