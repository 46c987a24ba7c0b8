"""The assistant drafter on tiny random models: it reads the target's own
cache (no copies), its training forward computes exactly what drafting
computes, its state stays consistent with the target's through every
rollback, greedy output is stock greedy output, and a folder only loads for
the model it was made for."""

import json
from argparse import Namespace

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import pytest
from mlx.utils import tree_flatten
from mlx_lm import load
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import KVCache, make_prompt_cache

from mlx_lm_spec_decode import DraftContext, last_stats, speculative_generate_step
from mlx_lm_spec_decode import assistant as A
from mlx_lm_spec_decode import target as target_mod
from mlx_lm_spec_decode import tree as tree_mod
from mlx_lm_spec_decode.assistant.recording import RecordingDrafter
from mlx_lm_spec_decode.training.distill import Target, loss_fn


@pytest.fixture(scope="module")
def llama(tiny_model):
    return load(str(tiny_model("llama")))


@pytest.fixture(scope="module")
def gemma(tiny_model):
    return load(str(tiny_model("gemma3_text")))  # sliding window 8 on layers 0 and 2


def stock(model, prompt, n, **kw):
    out = []
    for t, _ in generate_step(prompt, model, max_tokens=n, **kw):
        out.append(int(t))
        if len(out) == n:
            break
    return out


def spec(model, drafter, prompt, n, k=3, **kw):
    return [
        t
        for t, _, _ in speculative_generate_step(
            prompt, model, drafter, num_draft_tokens=k, max_tokens=n, **kw
        )
    ]


def fresh_drafter(model, layers=1, seed=0, **kw):
    cfg = A.make_config(model, num_layers=layers)
    mx.random.seed(seed)
    return A.AssistantDrafter(model, A.Assistant(cfg), cfg, **kw)


def overfit_drafter(model, seq, steps=25, layers=1, lr=1e-2):
    """A drafter trained (with the real training loss) on one token sequence
    until it mostly agrees with the target there: drafts get accepted."""
    cfg = A.make_config(model, num_layers=layers)
    mx.random.seed(0)
    net = A.Assistant(cfg)
    target = Target(model, cfg)
    x = mx.array([seq], mx.uint32)
    inputs = target.run(x)
    mx.eval(inputs)
    opt = optim.Adam(learning_rate=lr)
    vg = nn.value_and_grad(net, lambda n: loss_fn(n, target, *inputs, 1, 0.1))
    first = None
    for _ in range(steps):
        (loss, ces, accs), g = vg(net)
        opt.update(net, g)
        mx.eval(net.parameters(), opt.state, loss, accs)
        first = first if first is not None else loss.item()
    model.unfreeze()
    return A.AssistantDrafter(model, net, cfg), first, loss.item(), accs.tolist()


def prompt_of(tok, text="one two three four five six seven eight nine ten"):
    return mx.array(tok.encode(text))


# ----------------------------------------------------------- shape, donors


def test_donor_layers_are_the_last_sliding_and_last_full(llama, gemma):
    cfg = A.make_config(llama[0], num_layers=2)
    assert cfg.donors == [1, 1] and cfg.windows == [None, None]  # no sliding layers: the last one
    cfg = A.make_config(gemma[0], num_layers=2)
    assert cfg.donors == [2, 3] and cfg.windows == [8, None]
    assert A.make_config(gemma[0], num_layers=1).donors == [3]
    # The drafter's heads are laid out as the donor's K/V.
    assert (cfg.num_kv_heads, cfg.head_dim) == (1, 16)


def test_no_copy_of_the_head_embedding_or_cache(llama):
    model, tok = llama
    d = fresh_drafter(model)
    params = tree_flatten(d.net.parameters())
    assert not any(k.startswith(("embed_tokens", "lm_head")) or 49152 in v.shape for k, v in params)
    n_params = sum(v.size for _, v in tree_flatten(d.net.parameters()))
    assert n_params < model.model.embed_tokens.weight.size / 10
    # The lm-head and embedding the drafter uses are the target's own modules.
    assert d.embed is model.model.embed_tokens
    x = mx.random.normal((1, 1, 64))
    assert mx.array_equal(d.head(x), model.model.embed_tokens.as_linear(x))
    # Nothing of the drafter rides in the prompt cache.
    assert d.make_cache() == [] and d.cache_ok([])


def test_drafter_reads_the_target_cache_in_place(llama):
    """The donor K/V are read through the target's own cache objects at
    draft time: changing the target's cache changes the drafts' inputs."""
    model, tok = llama
    d = fresh_drafter(model)
    split = target_mod.split(model)
    prompt = prompt_of(tok)
    cache = make_prompt_cache(model)
    h = split[0](prompt[None, :-1], cache)
    ctx = DraftContext(model, cache, [], hidden=h[0, -1:])
    d.prefill(ctx, prompt.tolist())
    donors = d.donors(ctx)
    assert all(c is cache[i] for c, i in zip(donors, d.cfg.donors, strict=False))
    keys, values, _ = A.donor_view(cache[d.cfg.donors[0]])
    assert keys.shape[2] == cache[0].offset == len(prompt) - 1
    assert mx.array_equal(keys, cache[d.cfg.donors[0]].keys[..., : keys.shape[2], :])

    def hidden_out():
        own = [[] for _ in d.net.layers]
        views = [A.donor_view(c) for c in d.donors(ctx)]
        return d.net.step(
            ctx.hidden[None], d.embed(prompt[-1:])[None], views, d.ropes, own, cache[0].offset
        )

    before = hidden_out()
    mx.eval(before)
    c = cache[d.cfg.donors[0]]
    saved = c.values
    c.values = mx.zeros_like(c.values)  # e.g. the target's cache rewritten in place
    after = hidden_out()
    assert not mx.allclose(before, after).item()
    c.values = saved
    assert mx.array_equal(before, hidden_out())


@pytest.mark.parametrize("arch,layers", [("llama", 1), ("llama", 2), ("gemma3_text", 2)])
def test_training_forward_equals_drafting(tiny_model, arch, layers):
    """``unrolled`` (training) and ``step`` (drafting) agree for chains from
    every base, including a sliding-window donor past its window."""
    model, tok = load(str(tiny_model(arch)))
    cfg = A.make_config(model, num_layers=layers)
    mx.random.seed(1)
    net = A.Assistant(cfg)
    split = target_mod.split(model)
    x = mx.array([tok.encode("one two three four five six seven eight nine ten " * 3)[:20]])
    T = x.shape[1]
    assert T == 20
    caches = [KVCache() for _ in make_prompt_cache(model)]
    h = split[0](x, caches)
    emb = model.model.embed_tokens(x)
    ropes = [A.rope_of(model, i) for i in cfg.donors]
    steps = 3
    outs = net.unrolled(
        h, emb, [A.donor_view(caches[i]) for i in cfg.donors], ropes, cfg.windows, steps
    )
    checked = 0
    for t in (0, 4, 9, 15):  # t = 9, 15: the rotating cache has wrapped
        c = make_prompt_cache(model)
        for i in range(t + 1):  # token by token, as decoding fills it
            hid = split[0](x[:, i : i + 1], c)
        own = [[] for _ in net.layers]
        views = [A.donor_view(c[i]) for i in cfg.donors]
        for s in range(steps):
            p = t + 1 + s
            hid = net.step(hid, emb[:, p : p + 1], views, ropes, own, c[cfg.donors[-1]].offset + s)
            assert mx.allclose(hid, outs[s][:, p : p + 1], atol=1e-4).item(), (t, s)
            checked += 1
    assert checked == 12


# ----------------------------------------------------------------- the loop


def assert_drafts_are_the_training_graph(model, drafter, prompt, n=30, k=3):
    """Every state the loop's drafter computed equals the training graph's
    (``Assistant.unrolled`` over the final sequence, as train-drafter runs
    it) at the same row and draft step, for every chain whose earlier
    drafts were accepted. Returns the number of checks per draft step."""
    rec = RecordingDrafter(drafter)
    out = spec(model, rec, prompt, n, k=k)
    assert out == stock(model, prompt, n)
    seq = prompt.tolist() + out
    cfg = drafter.cfg
    target = Target(model, cfg)
    h, emb, kv, _, _ = target.run(mx.array([seq], mx.uint32))
    graph = drafter.net.unrolled(
        h, emb, [(k_, v_, None) for k_, v_ in kv], target.ropes, cfg.windows, drafter.max_draft
    )
    model.unfreeze()
    # The first draft comes right after the prefill: its state is the
    # prefill's, at the last prompt position but one.
    assert rec.rounds and rec.rounds[0][0] == len(prompt) - 1
    checks = [0] * drafter.max_draft
    for base, last, outs, toks in rec.rounds:
        assert seq[base] == last  # the pending token is the one at the base row
        toks = toks.tolist()
        for s, o in enumerate(outs):
            if toks[:s] != seq[base + 1 : base + 1 + s]:
                break  # the chain left the sequence: nothing to compare with
            want = graph[s][:, base + s : base + s + 1]
            assert mx.allclose(o, want, atol=1e-4).item(), (base, s, mx.abs(o - want).max().item())
            checks[s] += 1
    assert checks[0] == len(rec.rounds)
    return checks


def test_loop_drafts_are_the_training_graph(llama, gemma, trained):
    """Regression test for train/inference agreement: what the decode loop
    drafts (positions, hidden state, pending token, donor rows, RoPE
    offsets, own keys after rollbacks) is what training computes."""
    model, tok = llama
    d, prompt, *_ = trained
    d = A.AssistantDrafter(
        model, d.net, d.cfg, auto_off=False
    )  # drafts every round, no timing probes
    checks = assert_drafts_are_the_training_graph(model, d, prompt, 40)
    assert checks[1] > 0 and checks[2] > 0  # accepted chains: later steps compared too
    other = prompt_of(tok, "the quick brown fox jumps over the lazy dog")
    assert_drafts_are_the_training_graph(model, d, other, 20)
    model, tok = gemma  # sliding-window and full donors, two layers, random weights
    fresh = fresh_drafter(model, layers=2, auto_off=False)
    assert_drafts_are_the_training_graph(model, fresh, prompt_of(tok, "one two three"), 6, k=2)


@pytest.mark.parametrize("layers", [1, 2])
def test_greedy_parity_random_drafter(llama, layers):
    model, tok = llama
    prompt = prompt_of(tok)
    ref = stock(model, prompt, 24)
    assert spec(model, fresh_drafter(model, layers, auto_off=False), prompt, 24) == ref
    s = last_stats()
    assert s.drafter == "assistant" and s.drafted > 0 and s.emitted == 24


@pytest.fixture(scope="module")
def trained(llama):
    """A drafter overfit on the target's own greedy continuation of a prompt."""
    model, tok = llama
    prompt = prompt_of(tok)
    seq = prompt.tolist() + stock(model, prompt, 40)
    d, first, last, accs = overfit_drafter(model, seq)
    return d, prompt, first, last, accs


def test_trained_drafter_agrees_and_output_is_stock(llama, trained):
    model, tok = llama
    d, prompt, first, last, accs = trained
    assert last < first and accs[0] > 0.7
    ref = stock(model, prompt, 40)
    for k in (1, 3, 5):
        assert spec(model, d, prompt, 40, k=k) == ref
        s = last_stats()
        assert s.accepted > 0 and s.forwards < 40, s
    # A different prompt: fewer acceptances, same output as stock.
    other = prompt_of(tok, "the quick brown fox jumps over the lazy dog")
    assert spec(model, d, other, 30) == stock(model, other, 30)


class Checked(A.AssistantDrafter):
    """Before every draft, recompute the drafter's inputs from scratch (a
    fresh prefill of the history) and check the drafts are identical: the
    target cache, the hidden state and the drafter's own state agree."""

    def __init__(self, base, split, history):
        self.__dict__.update(base.__dict__)
        self.split, self.history, self.checks = split, history, 0
        self.behind = 0  # rounds proposing drafts made behind the last verify

    def prefill(self, ctx, tokens):
        super().prefill(ctx, tokens)
        self.history[:] = list(tokens)

    def accept(self, ctx, tokens, n_drafted):
        super().accept(ctx, tokens, n_drafted)
        self.history.extend(tokens)
        assert ctx.state["own"] == 0  # the chain's own entries are gone

    def fresh(self, ctx):
        """A fresh prefill of the history but its pending token, checked
        against the loop's: the target cache holds exactly that, and
        ``ctx.hidden`` is the state that predicted the pending token."""
        seq = self.history
        assert ctx.target_cache[0].offset == len(seq) - 1
        cache = make_prompt_cache(self.model)
        h = self.split[0](mx.array([seq[:-1]]), cache)
        assert mx.allclose(ctx.hidden, h[0, -1:], atol=1e-4).item()
        self.checks += 1
        return DraftContext(self.model, cache, [], hidden=h[0, -1:])

    def draft(self, ctx, n):
        ahead = ctx.state.get("ahead")  # this drafter's scratch: (drafts, kept, held)
        got, _ = super().draft(ctx, n)
        if ctx.hidden is None:
            return got, None
        behind = ahead is not None and ahead[2] and "ahead" not in ctx.state
        self.behind += behind
        ref_ctx = self.fresh(ctx)
        A.AssistantDrafter.prefill(self, ref_ctx, self.history)
        want, _ = A.AssistantDrafter.draft(self, ref_ctx, n)
        # Drafts made behind a verify hold γ as it stood then: fewer where it grew.
        assert got.size == n or (behind and 0 < got.size < n)
        assert got.tolist() == want.tolist()[: got.size]
        return got, None


class TreeChecked(Checked):
    """``Checked``'s check before every token tree too (after a tree round,
    the hidden state is the accepted path's last node's)."""

    def draft_tree(self, ctx, n):
        if ctx.hidden is not None:
            self.fresh(ctx)
        return super().draft_tree(ctx, n)


def test_token_trees_are_stock_and_keep_the_drafters_inputs(llama, trained, monkeypatch):
    """Where a wider verify costs almost nothing (a GPU), the assistant grows
    token trees from its own top choices; the target verifies them in one
    forward, the output is stock greedy, and every round starts from the
    hidden state and cache of the accepted path."""
    from mlx_lm_spec_decode.controller import Controller

    monkeypatch.setattr(Controller, "verify_cost", lambda self: (0.95, 0.01))
    monkeypatch.setattr(Controller, "tree_surcharge", lambda self: 0.0)
    model, tok = llama
    d, prompt, *_ = trained
    history = []
    checked = TreeChecked(d, target_mod.split(model), history)
    checked.auto_off = False  # the tiny model's timings are not the point here
    checked.tree = True  # chains by default (trees measured slower on a GPU)
    # The prompt it was trained on (drafts kept), then one it was not.
    for text, n in ((None, 40), ("the quick brown fox jumps over the lazy dog", 30)):
        p = prompt if text is None else prompt_of(tok, text)
        assert spec(model, checked, p, n) == stock(model, p, n)
        s = last_stats()
        assert s.tree_rounds > 0 and (s.accepted > 5 or text), s
    assert checked.checks > 10
    # A short budget grows a chain; a wide one up to the budget's nodes,
    # its leaves' shares summing to one.
    ctx = DraftContext(model, make_prompt_cache(model), [])
    ctx.hidden = target_mod.split(model)[0](prompt[None, :-1], ctx.target_cache)[0, -1:]
    d.prefill(ctx, prompt.tolist())
    ((chain, w),) = d.draft_tree(ctx, 3)
    assert len(chain) == 3 and w == pytest.approx(1.0)
    paths = d.draft_tree(ctx, 12)
    tokens, parents, shares = tree_mod.trie(paths)
    assert len(tokens) == 13 and max(tree_mod.depths(parents)) == 12 // d.TREE_WIDTH
    assert sum(w for _, w in paths) == pytest.approx(1.0)


def test_a_pair_grows_one_tree_of_the_copy_and_the_assistants_guesses(llama, trained, monkeypatch):
    """``--draft-lookup`` over the assistant's trees, where a wider verify
    costs almost nothing: rounds verify trees holding the lookup's copies
    beside the assistant's branches, the output is stock greedy, the
    assistant's inputs are checked before each tree it grows, and the
    lookup's index holds the whole history."""
    from mlx_lm_spec_decode import LookupFirst, NGramDrafter
    from mlx_lm_spec_decode.controller import Controller

    monkeypatch.setattr(Controller, "verify_cost", lambda self: (0.95, 0.01))
    monkeypatch.setattr(Controller, "tree_surcharge", lambda self: 0.0)
    monkeypatch.setattr(Controller, "draft_cost", lambda self: 0.01)
    model, tok = llama
    d, prompt, *_ = trained
    checked = TreeChecked(d, target_mod.split(model), [])
    checked.tree = True

    class Both(LookupFirst):
        mixed = 0  # trees with nodes of each source

        def draft_tree(self, ctx, n):
            paths = super().draft_tree(ctx, n)
            Both.mixed += 0 < ctx.computed < len(tree_mod.trie(paths)[0]) - 1
            return paths

    pair = Both(checked, NGramDrafter(n_min=1, tree=True))
    text = "one two three four five six seven eight nine ten. " * 2
    for p in (prompt, prompt_of(tok, text)):
        cache = make_prompt_cache(model) + pair.make_cache()
        out = spec(model, pair, p, 30, prompt_cache=cache)
        assert out == stock(model, p, 30)
        assert last_stats().tree_rounds > 0
        assert cache[-1].tokens == p.tolist() + out
    assert Both.mixed > 0 and checked.checks > 0, (Both.mixed, checked.checks)


def test_rollback_keeps_drafter_and_target_consistent(llama, trained, monkeypatch):
    monkeypatch.setenv("MLX_LM_SPEC_BEHIND", "on")  # opt-in: its drafts are checked too
    model, tok = llama
    d, prompt, *_ = trained
    for text in ("one two three four five six seven eight nine ten", "the quick brown fox"):
        p = prompt_of(tok, text)
        c = Checked(d, target_mod.split(model), [])
        c.auto_off = False  # drafting every round (its drafts are not timed)
        out = spec(model, c, p, 30, k=4)
        s = last_stats()
        assert out == stock(model, p, 30)
        assert c.checks == s.draft_rounds > 0
        # Greedy chains: every round after a round is drafted behind its
        # verify (before the host reads it), and those drafts are checked
        # against a fresh prefill like any other.
        assert c.behind > 0


def test_drafts_behind_the_verify_are_opt_in(llama, trained, monkeypatch):
    """Off unless MLX_LM_SPEC_BEHIND=on (measured no faster on a GPU): the
    drafts are made after the host reads each verify; a bad value is an error."""
    model, tok = llama
    d, *_ = trained
    p = prompt_of(tok, "one two three four five six seven eight nine ten")
    for env in (None, "off", ""):
        if env is None:
            monkeypatch.delenv("MLX_LM_SPEC_BEHIND", raising=False)
        else:
            monkeypatch.setenv("MLX_LM_SPEC_BEHIND", env)
        c = Checked(d, target_mod.split(model), [])
        c.auto_off = False
        assert spec(model, c, p, 20, k=4) == stock(model, p, 20)
        assert c.checks > 0 and c.behind == 0
    monkeypatch.setenv("MLX_LM_SPEC_BEHIND", "auto")
    with pytest.raises(ValueError, match="MLX_LM_SPEC_BEHIND must be on or off"):
        target_mod.drafts_behind()


def test_stops_leave_exact_caches(llama, trained):
    model, tok = llama
    d, prompt, *_ = trained
    ref = stock(model, prompt, 30)
    for stop_after in (1, 2, 5, 11):
        cache = make_prompt_cache(model) + d.make_cache()
        gen = speculative_generate_step(
            prompt, model, d, num_draft_tokens=4, max_tokens=50, prompt_cache=cache
        )
        out = [next(gen)[0] for _ in range(stop_after)]
        gen.close()
        assert out == ref[:stop_after]
        seq = prompt.tolist() + out
        assert cache[0].offset == len(seq)
        probe = model(mx.array([[7]]), cache=cache)[0, -1]
        assert mx.allclose(probe, model(mx.array([seq + [7]]))[0, -1], atol=1e-4).item()


def test_sliding_window_target_parity(gemma):
    model, tok = gemma
    d = fresh_drafter(model, layers=2, auto_off=False)
    for text in ("one two", "one two three four five six"):  # the window (8) fills mid-request
        p = prompt_of(tok, text)
        assert spec(model, d, p, 16, k=2) == stock(model, p, 16)


def test_quantized_kv_cache(tiny_model):
    """With --kv-bits the donors are QuantizedKVCaches: read in place with
    quantized matmuls, close to the float read, and output is stock's."""
    model, tok = load(str(tiny_model("llama", head_dim=32)))  # MLX quantizes groups of >= 32
    d = fresh_drafter(model, auto_off=False)
    prompt = prompt_of(tok)
    split = target_mod.split(model)
    cache = make_prompt_cache(model)
    h = split[0](prompt[None, :-1], cache)
    quantized = [c.to_quantized(group_size=32, bits=8) for c in cache]
    outs = []
    for c in (cache, quantized):
        own = [[] for _ in d.net.layers]
        views = [A.donor_view(c[i]) for i in d.cfg.donors]
        outs.append(
            d.net.step(h[:, -1:], d.embed(prompt[-1:])[None], views, d.ropes, own, c[0].offset)
        )
    assert A.donor_view(quantized[d.cfg.donors[0]])[2] == (32, 8)
    assert mx.allclose(outs[0], outs[1], atol=0.05).item() and not mx.array_equal(outs[0], outs[1])
    kw = dict(kv_bits=8, kv_group_size=32, quantized_kv_start=4)
    assert spec(model, d, prompt, 24, **kw) == stock(model, prompt, 24, **kw)
    assert last_stats().drafted > 0


def test_sampling_drafts_carry_their_distribution(llama, trained):
    model, tok = llama
    d, prompt, *_ = trained
    from mlx_lm.sample_utils import make_sampler

    split = target_mod.split(model)
    cache = make_prompt_cache(model)
    h = split[0](prompt[None, :-1], cache)
    ctx = DraftContext(model, cache, [], temp=0.7, hidden=h[0, -1:])
    d.prefill(ctx, prompt.tolist())
    toks, q = d.draft(ctx, 4)
    assert toks.shape == (4,) and q.shape[0] == 4
    assert mx.allclose(q.sum(-1), mx.ones(4), atol=1e-4).item()
    mx.random.seed(0)
    out = [
        t
        for t, _, _ in speculative_generate_step(
            prompt,
            model,
            d,
            num_draft_tokens=3,
            max_tokens=20,
            sampler=make_sampler(temp=0.7, top_p=0.9),
        )
    ]
    assert len(out) == 20 and last_stats().drafted > 0


# ------------------------------------------------------------ save / load


def test_save_load_round_trip_and_fingerprint(tiny_model, llama, trained, tmp_path):
    model, tok = llama
    d, prompt, *_ = trained
    A.save(tmp_path / "a", d.net, d.cfg, dtype=mx.float32)
    loaded = A.load(tmp_path / "a", model)
    assert spec(model, loaded, prompt, 20) == spec(model, d, prompt, 20)
    cfg = json.loads((tmp_path / "a" / A.CONFIG_FILE).read_text())
    assert cfg["target"]["model_type"] == "llama" and len(cfg["target"]["probe"]) == 64

    # Same architecture, other weights: refused with a clear message.
    other, _ = load(str(tiny_model("llama", seed=5)))
    with pytest.raises(A.AssistantMismatch, match="same architecture but other weights"):
        A.load(tmp_path / "a", other)
    # Another architecture: refused.
    qwen, _ = load(str(tiny_model("qwen3")))
    with pytest.raises(A.AssistantMismatch, match="different model"):
        A.load(tmp_path / "a", qwen)
    # The same weights in another format (4-bit here would differ; float16 is close): accepted.
    half, _ = load(str(tiny_model("llama")))
    half.set_dtype(mx.float16)
    A.load(tmp_path / "a", half)


def test_bad_folders_fail_clearly(llama, trained, tmp_path):
    model, tok = llama
    d, *_ = trained
    with pytest.raises(A.AssistantError, match="does not exist"):
        A.load(tmp_path / "missing", model)
    (tmp_path / "empty").mkdir()
    with pytest.raises(A.AssistantError, match="not an assistant drafter folder"):
        A.load(tmp_path / "empty", model)
    A.save(tmp_path / "bad", d.net, d.cfg)
    (tmp_path / "bad" / A.CONFIG_FILE).write_text("{not json")
    with pytest.raises(A.AssistantError, match="not a valid assistant config"):
        A.load(tmp_path / "bad", model)
    A.save(tmp_path / "trunc", d.net, d.cfg)
    (tmp_path / "trunc" / A.WEIGHTS_FILE).write_bytes(b"\0" * 10)
    with pytest.raises(A.AssistantError, match="cannot be loaded"):
        A.load(tmp_path / "trunc", model)


def test_plugin_flags(llama, trained, tmp_path):
    from mlx_lm_ext import PluginError
    from mlx_lm_spec_decode import plugin

    model, tok = llama
    d, *_ = trained
    A.save(tmp_path / "a", d.net, d.cfg)
    args = Namespace(
        drafter="assistant",
        drafter_path=str(tmp_path / "a"),
        ngram_min=2,
        ngram_max=4,
        draft_max=None,
        fixed_draft=False,
        no_auto_off=False,
        num_draft_tokens=3,
    )
    plugin._check(args)
    got = plugin.make_drafter("generate", model, tok, None, args, options=None)
    assert isinstance(got, A.AssistantDrafter) and got.max_draft == 6 and not got.tree
    # Beside the lookup it grows trees (one tree of both a round), unless --draft-tree off.
    for tree, grows in (("auto", True), ("off", False)):
        pair_args = Namespace(**{**vars(args), "draft_lookup": True, "draft_tree": tree})
        pair = plugin.make_drafter("generate", model, tok, None, pair_args, options=None)
        assert pair.name == "ngram+assistant" and pair.tree == grows
        assert pair.model.tree == pair.lookup.tree == grows
    with pytest.raises(PluginError, match="--drafter-path"):
        plugin._check(Namespace(**{**vars(args), "drafter_path": None}))
    with pytest.raises(PluginError, match="does not exist"):
        plugin.make_drafter(
            "generate",
            model,
            tok,
            None,
            Namespace(**{**vars(args), "drafter_path": str(tmp_path / "x")}),
            None,
        )
    with pytest.raises(PluginError, match="does not exist"):
        plugin._check(Namespace(**{**vars(args), "drafter_path": str(tmp_path / "x")}))


def test_mlx_lm_generate_command(tiny_model, llama, trained, tmp_path):
    """mlx_lm.generate --plugin spec-decode --drafter assistant --drafter-path
    DIR: stock's text, the figures with --verbose; a drafter made for another
    model is refused with exit status 2 and the reason."""
    import subprocess
    import sys

    d, *_ = trained
    A.save(tmp_path / "a", d.net, d.cfg)

    def generate(model, *extra):
        cmd = [
            sys.executable,
            "-m",
            "mlx_lm",
            "generate",
            "--model",
            str(model),
            "--prompt",
            "one two three four five six seven eight nine ten",
            "--max-tokens",
            "24",
            "--verbose",
            "True",
            *extra,
        ]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=300)

    model = tiny_model("llama")
    stock_run = generate(model)
    ours = generate(
        model,
        "--plugin",
        "spec-decode",
        "--drafter",
        "assistant",
        "--drafter-path",
        str(tmp_path / "a"),
    )
    assert ours.returncode == 0, ours.stderr
    assert "Speculative decoding (assistant): drafted" in ours.stdout
    text = lambda out: out.split("==========")[1]  # noqa: E731
    assert text(ours.stdout) == text(stock_run.stdout)
    other = generate(
        tiny_model("qwen3"),
        "--plugin",
        "spec-decode",
        "--drafter",
        "assistant",
        "--drafter-path",
        str(tmp_path / "a"),
    )
    # Refused once the model is loaded (make_drafter), not before.
    assert other.returncode != 0 and "different model" in other.stderr
    missing = generate(model, "--plugin", "spec-decode", "--drafter", "assistant")
    assert missing.returncode == 2 and "--drafter-path" in missing.stderr
    wrong = generate(
        model, "--plugin", "spec-decode", "--drafter", "assistant", "--drafter-path", str(tmp_path)
    )
    assert wrong.returncode == 2 and "not an assistant drafter folder" in wrong.stderr


def test_training_starts_from_the_targets_own_prediction(llama):
    """init_from_target: before any training the drafter's first step
    returns the target's hidden state (so its prediction is the target's,
    one position back) instead of a random, saturated one."""
    model, tok = llama
    cfg = A.make_config(model, num_layers=2)
    net = A.Assistant(cfg)
    A.init_from_target(net, model)
    split = target_mod.split(model)
    prompt = prompt_of(tok)
    cache = make_prompt_cache(model)
    h = split[0](prompt[None, :-1], cache)[:, -1:]
    own = [[] for _ in net.layers]
    views = [A.donor_view(cache[i]) for i in cfg.donors]
    out = net.step(
        h,
        model.model.embed_tokens(prompt[-1:])[None],
        views,
        [A.rope_of(model, i) for i in cfg.donors],
        own,
        cache[0].offset,
    )
    cos = (out * h).sum() / (mx.linalg.norm(out) * mx.linalg.norm(h))
    assert cos.item() > 0.999
    assert mx.argmax(split[1](out), -1).item() == mx.argmax(split[1](h), -1).item()


@pytest.mark.parametrize("lookup", [[], ["--draft-lookup"]])
def test_mlx_lm_server_with_openai_client(tiny_model, llama, trained, tmp_path, lookup):
    """mlx_lm.server --plugin spec-decode --drafter assistant (and with
    --draft-lookup, the n-gram lookup first): greedy answers are the
    target's own, a repeated request is served from the prompt cache with
    the same text, usage carries the figures, and sampling works."""
    import socket
    import subprocess
    import sys
    import time
    import urllib.request

    from openai import OpenAI

    model_path = tiny_model("llama")
    model, tok = llama
    d, *_ = trained
    A.save(tmp_path / "a", d.net, d.cfg)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mlx_lm",
            "server",
            "--model",
            str(model_path),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--plugin",
            "spec-decode",
            "--drafter",
            "assistant",
            "--drafter-path",
            str(tmp_path / "a"),
            "--num-draft-tokens",
            "3",
            *lookup,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.time() + 120
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2)
                break
            except Exception:
                if proc.poll() is not None or time.time() > deadline:
                    raise RuntimeError(
                        proc.stdout.read() if proc.poll() is not None else "server did not start"
                    ) from None
                time.sleep(0.5)
        client = OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=120, max_retries=0
        )
        msgs = [{"role": "user", "content": "one two three four five six seven eight nine ten"}]
        r = client.chat.completions.create(
            model="default_model", messages=msgs, max_tokens=20, temperature=0
        )
        prompt = mx.array(tok.apply_chat_template(msgs, add_generation_prompt=True))
        want = tok.decode(stock(model, prompt, 20)).strip()  # the server drops the leading space
        assert r.choices[0].message.content.strip() == want
        spec_usage = r.usage.model_dump()["speculative_decoding"]
        drafter = "ngram+assistant" if lookup else "assistant"
        assert spec_usage["drafter"] == drafter and spec_usage["drafted"] > 0
        r2 = client.chat.completions.create(
            model="default_model", messages=msgs, max_tokens=20, temperature=0
        )
        assert r2.choices[0].message.content.strip() == want
        assert r2.usage.model_dump()["prompt_tokens_details"]["cached_tokens"] > 0
        r3 = client.chat.completions.create(
            model="default_model", messages=msgs, max_tokens=12, temperature=0.8, top_p=0.9
        )
        assert (
            r3.usage.model_dump()["speculative_decoding"]["emitted"] == r3.usage.completion_tokens
        )
    finally:
        proc.terminate()
        try:
            out, _ = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
    assert f"Speculative decoding ({drafter}): drafted" in out, out[-3000:]
