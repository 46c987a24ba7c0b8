import sys
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm import load

# Tests share helpers by importing each other by name (e.g. test_sampling).
sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session")
def tiny_llama(tiny_model):
    """(model, tokenizer) of a tiny random llama, and a second one to draft."""
    return load(str(tiny_model("llama")))


@pytest.fixture(scope="session")
def tiny_draft(tiny_model):
    return load(str(tiny_model("llama", seed=1, num_hidden_layers=1)))[0]


@pytest.fixture(scope="session")
def repetitive_prompt():
    def make(tokenizer, n=3):
        text = "one two three four five six seven eight nine ten. " * n
        return mx.array(tokenizer.encode(text))

    return make
