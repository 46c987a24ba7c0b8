"""Greedy parity with stock mlx-lm on the real SmolLM2-135M (float32).

Run with OpenBLAS preloaded for speed:
LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 pytest -m slow ...
"""

import inspect
import textwrap

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

from mlx_lm_spec_decode import (
    DraftModelDrafter,
    NGramDrafter,
    last_stats,
    speculative_generate_step,
)

N = 40

PROMPTS = [
    "Here is a function:\n\n"
    + inspect.getsource(textwrap.dedent)[:900]
    + "\nRewrite it with the variable `margin` renamed to `common`. Output the code only.",
    "Passage: The Python Software Foundation is a non-profit organization devoted to the Python "
    "programming language. It manages the open source licensing for Python.\n"
    "Question: what does the foundation manage? Quote the passage.",
    "Write a haiku about autumn rain.",
    "List three uses of a paperclip.",
]


@pytest.fixture(scope="module")
def smollm2(smollm2_f32_path, smollm2_path):
    model, tok = load(str(smollm2_f32_path))
    draft, _ = load(str(smollm2_path))
    return model, tok, draft


@pytest.mark.slow
def test_greedy_token_identical_on_every_prompt(smollm2):
    model, tok, draft = smollm2
    for text in PROMPTS:
        prompt = mx.array(
            tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        )
        ref = [
            int(t)
            for t, _ in zip(
                (t for t, _ in generate_step(prompt, model, max_tokens=N)), range(N), strict=False
            )
        ]
        for drafter in (NGramDrafter(), DraftModelDrafter(draft, auto_off=False)):
            cache = make_prompt_cache(model) + drafter.make_cache()
            out = [
                t
                for t, _, _ in speculative_generate_step(
                    prompt, model, drafter, num_draft_tokens=3, max_tokens=N, prompt_cache=cache
                )
            ]
            assert out == ref, (drafter.name, text[:40], tok.decode(out), tok.decode(ref))
            assert cache[0].offset == prompt.size + N
            if drafter.name == "draft-model":
                assert last_stats().accepted > 0
