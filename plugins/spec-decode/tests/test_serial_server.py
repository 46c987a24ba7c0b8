"""Where mlx-lm serves every request one at a time (``--kv-bits``), the
batched drafters (ngram, suffix) draft on the serial path instead of not at
all (the offline SmolLM2, float32)."""

from test_batch_server import CODE, ask, start, stop

PROMPT = "Repeat this code exactly, renaming width to w:\n" + CODE


def test_kv_bits_server_drafts_serially(smollm2_f32_path):
    base, proc = start(smollm2_f32_path, "--kv-bits", "8")
    try:
        stock = ask(base, PROMPT, 32)
    finally:
        stop(proc)
    base, proc = start(smollm2_f32_path, "--plugin", "spec-decode", "--kv-bits", "8")
    try:
        out = ask(base, PROMPT, 32)
    finally:
        log = stop(proc)
    text = out["choices"][0]["message"]["content"]
    assert text == stock["choices"][0]["message"]["content"]
    spec = out["usage"].get("speculative_decoding")
    assert spec is not None, log[-3000:]
    assert spec["drafter"] == "ngram" and spec["drafted"] > 0
    assert "Speculative decoding (ngram)" in log
