"""End to end: the openai client against ``mlx_lm.server --plugin ssd-cache``.

Real SmolLM2-135M (float32), real server processes: the second server run
answers the same long request with the prompt cache restored from disk.
"""

import os
import sysconfig

import pytest

pytestmark = pytest.mark.slow

LICENSE = os.path.join(sysconfig.get_paths()["stdlib"], "LICENSE.txt")


def ask(server):
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=600)
    with open(LICENSE) as f:
        doc = f.read()[:4000]
    return client.chat.completions.create(
        model="default_model",
        messages=[
            {"role": "system", "content": "Answer from this document:\n" + doc},
            {"role": "user", "content": "Who holds the copyright of Python?"},
        ],
        max_tokens=24,
        temperature=0.0,
    )


def test_restart_restores_the_prompt_cache_from_disk(servers, smollm2_f32_path, tmp_path):
    d = tmp_path / "cache"
    cold_server = servers(smollm2_f32_path, d, tmp_path / "cold.log").wait_ready(300)
    cold = ask(cold_server)
    assert cold.usage.prompt_tokens > 900
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    cold_server.stop()  # Ctrl-C: pending writes are flushed at exit

    warm_server = servers(smollm2_f32_path, d, tmp_path / "warm.log").wait_ready(300)
    warm = ask(warm_server)
    assert warm.usage.prompt_tokens_details.cached_tokens == warm.usage.prompt_tokens - 1
    assert warm.choices[0].message.content == cold.choices[0].message.content
    log = warm_server.text()
    assert "restored" in log and "from disk" in log
    assert "- disk: 1 entry," in log
