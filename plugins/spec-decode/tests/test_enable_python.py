"""``mlx_lm_ext.enable("spec-decode", ...)`` from Python does what
``--plugin spec-decode`` does on the command line: ``mlx_lm.generate`` and
``mlx_lm.stream_generate`` draft with the drafter the options name, the
options are checked as the command line checks its flags, and ``disable``
gives stock decoding back."""

import ast
import pathlib
import sysconfig

import pytest

import mlx_lm_ext
from mlx_lm_ext import PluginError
from mlx_lm_spec_decode import SuffixDrafter, last_stats

N = 40  # the answer starts copying the function after some twenty tokens


@pytest.fixture(scope="module")
def smollm2(smollm2_f32_path):
    import mlx_lm

    model, tok = mlx_lm.load(str(smollm2_f32_path))
    src = pathlib.Path(sysconfig.get_paths()["stdlib"], "textwrap.py").read_text()
    code = next(
        ast.get_source_segment(src, n)
        for n in ast.parse(src).body
        if getattr(n, "name", "") == "indent"
    )
    text = f"Here is a function:\n\n{code}\n\nRewrite it with `prefix` renamed to `margin`."
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True
    )
    stock = mlx_lm.generate(model, tok, prompt, max_tokens=N)
    return model, tok, prompt, stock


@pytest.fixture
def off():
    yield
    for name in mlx_lm_ext.enabled():
        mlx_lm_ext.disable(name)


@pytest.mark.slow
@pytest.mark.parametrize("options", [{}, {"drafter": "ngram", "draft_max": 6}])
def test_enabled_generate_drafts_the_same_text(smollm2, off, options):
    import mlx_lm

    model, tok, prompt, stock = smollm2
    before = last_stats()
    mlx_lm_ext.enable("spec-decode", **options)
    assert mlx_lm.generate(model, tok, prompt, max_tokens=N) == stock
    st = last_stats()
    assert st is not before and st.drafter == "ngram"
    assert st.drafted > 0 and st.accepted > 0 and st.emitted == N


@pytest.mark.slow
def test_stream_generate_named_after_enable_drafts_and_disable_gives_stock_back(smollm2, off):
    model, tok, prompt, stock = smollm2
    mlx_lm_ext.enable("spec-decode", drafter="ngram")
    from mlx_lm import stream_generate

    assert "".join(r.text for r in stream_generate(model, tok, prompt, max_tokens=N)) == stock
    drafted = last_stats()
    assert drafted.drafted > 0

    mlx_lm_ext.disable("spec-decode")
    import mlx_lm

    assert mlx_lm.generate(model, tok, prompt, max_tokens=N) == stock
    assert (
        "".join(r.text for r in mlx_lm.stream_generate(model, tok, prompt, max_tokens=N)) == stock
    )
    assert last_stats() is drafted  # stock decoding: no speculative request since


@pytest.mark.slow
def test_a_draft_model_passed_to_the_call_wins(smollm2, off):
    import mlx_lm

    model, tok, prompt, stock = smollm2
    mlx_lm_ext.enable("spec-decode", drafter="ngram")
    own = SuffixDrafter(tokenizer=tok)
    assert mlx_lm.generate(model, tok, prompt, max_tokens=N, draft_model=own) == stock
    assert last_stats().drafter == "suffix"


@pytest.mark.parametrize(
    "options, message",
    [
        ({"drafter": "ngrams"}, r"drafter='ngrams': must be one of ngram, suffix"),
        ({"draft_max": "many"}, r"draft_max='many': must be an integer"),
        ({"draft_max": 2.5}, r"draft_max=2.5: must be an integer"),
        ({"draft_max": 0}, r"--draft-max must be a positive integer"),
        ({"no_auto_off": "yes"}, r"no_auto_off='yes': must be True or False"),
        ({"draft_tree": "on"}, r"draft_tree='on': must be one of auto, off"),
        ({"draftmax": 4}, r"has no option 'draftmax' \(options: draft_lookup, draft_max"),
    ],
)
def test_bad_options_are_refused_as_the_command_line_refuses_them(off, options, message):
    with pytest.raises(PluginError, match=message):
        mlx_lm_ext.enable("spec-decode", **options)
    assert mlx_lm_ext.enabled() == []


def test_option_text_goes_through_the_flag_type_as_on_the_command_line(off):
    from mlx_lm_ext.integration import option_values

    given = {"drafter": "ngram", "draft_max": "6", "ngram_min": "3", "no_auto_off": True}
    assert option_values("spec-decode", given) == dict(given, draft_max=6, ngram_min=3)
    mlx_lm_ext.enable("spec-decode", **given)
    assert mlx_lm_ext.enabled() == ["spec-decode"]
