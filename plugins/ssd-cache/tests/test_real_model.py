"""Restores on the real SmolLM2-135M (float32): greedy output is unchanged."""

import os
import sysconfig

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

from mlx_lm_ssd_cache import SSDPromptCache

pytestmark = pytest.mark.slow

LICENSE = os.path.join(sysconfig.get_paths()["stdlib"], "LICENSE.txt")


def chat(tok, question, chars=2000):
    with open(LICENSE) as f:
        doc = f.read()[:chars]
    return tok.apply_chat_template(
        [
            {"role": "system", "content": "Answer from this document:\n" + doc},
            {"role": "user", "content": question},
        ],
        add_generation_prompt=True,
    )


def greedy(model, tokens, cache, n=24):
    out = []
    for t, _ in generate_step(mx.array(tokens), model, prompt_cache=cache, max_tokens=n):
        out.append(int(t))
    return out


@pytest.fixture(scope="module")
def smollm(smollm2_f32_path):
    return load(str(smollm2_f32_path))


def test_restored_cache_gives_token_identical_greedy_output(smollm, smollm2_f32_path, tmp_path):
    model, tok = smollm
    key = (str(smollm2_f32_path), None, None)
    first = chat(tok, "Who holds the copyright of Python?")
    second = chat(tok, "Which license covers this software?")
    assert len(first) > 500

    # As the server does: generate, then store prompt + output with its cache
    # (the cache holds one token less than that; the tier stores what it holds).
    cache = make_prompt_cache(model)
    wants = {id(first): greedy(model, first, cache)}
    store = SSDPromptCache(10, directory=tmp_path / "cache")
    store.insert_cache(key, first + wants[id(first)], cache)
    assert store.close(60)
    wants[id(second)] = greedy(model, second, make_prompt_cache(model))  # fresh prefill

    for prompt in (first, second):  # a repeat, and a shared document prefix
        restarted = SSDPromptCache(10, directory=tmp_path / "cache")
        restored, rest = restarted.fetch_nearest_cache(key, prompt)
        n = len(prompt) - len(rest)
        common = int(np.argmin(np.array(first[: len(second)]) == np.array(second[: len(first)])))
        assert n == (len(prompt) - 1 if prompt is first else common) and n > 400
        assert restarted.disk_stats()["hits"] == 1
        assert greedy(model, rest, restored) == wants[id(prompt)]
        restarted.close()
