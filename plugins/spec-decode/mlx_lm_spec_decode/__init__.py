"""mlx-lm-spec-decode: drafter-based speculative decoding for mlx-lm.

import mlx_lm_ext, mlx_lm_spec_decode
from mlx_lm import load, stream_generate

mlx_lm_ext.enable("spec-decode")
model, tokenizer = load(path)
for r in stream_generate(model, tokenizer, prompt,
                         draft_model=mlx_lm_spec_decode.NGramDrafter(),
                         num_draft_tokens=4):
    print(r.text, end="")
print(mlx_lm_spec_decode.last_stats().line())
"""

__version__ = "0.1.0"

from .draft_model import DraftModelDrafter, VocabularyMismatch, check_vocab
from .drafter import DraftContext, Drafter, DrafterProtocol
from .lookup import LookupFirst
from .loop import speculative_generate_step
from .ngram import NGramCache, NGramDrafter
from .stats import SpecStats
from .stats import last as last_stats
from .suffix import SuffixCache, SuffixCorpus, SuffixDrafter

__all__ = [
    "Drafter",
    "DrafterProtocol",
    "DraftContext",
    "NGramDrafter",
    "NGramCache",
    "SuffixDrafter",
    "SuffixCache",
    "SuffixCorpus",
    "DraftModelDrafter",
    "LookupFirst",
    "VocabularyMismatch",
    "check_vocab",
    "speculative_generate_step",
    "SpecStats",
    "last_stats",
]
