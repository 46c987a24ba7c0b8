"""The assistant drafter on the real SmolLM2-135M (float32): greedy output is
stock greedy output on every prompt, with drafts accepted."""

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import pytest
from mlx_lm import load
from mlx_lm.generate import generate_step

from mlx_lm_spec_decode import assistant as A
from mlx_lm_spec_decode import last_stats, speculative_generate_step
from mlx_lm_spec_decode.training.distill import Target, loss_fn, schedule

PROMPTS = [
    "Write a haiku about the sea.",
    "What is the capital of France? Answer in one sentence.",
    "List three uses of a paperclip.",
]


def stock(model, prompt, n):
    out = []
    for t, _ in generate_step(prompt, model, max_tokens=n):
        out.append(int(t))
        if len(out) == n:
            break
    return out


@pytest.mark.slow
def test_real_model_greedy_parity(smollm2_f32_path):
    model, tok = load(str(smollm2_f32_path))
    chat = lambda text: mx.array(
        tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    )
    # A drafter fit (with the training loss) to the model's own answer to
    # the first prompt, so that drafts are accepted there.
    first = chat(PROMPTS[0])
    seq = first.tolist() + stock(model, first, 24)
    cfg = A.make_config(model, num_layers=1)
    mx.random.seed(0)
    net = A.Assistant(cfg)
    target = Target(model, cfg)
    A.init_from_target(net, model)
    inputs = target.run(mx.array([seq], mx.uint32))
    mx.eval(inputs)
    opt = optim.Adam(learning_rate=schedule(3e-3, 40, 8))
    vg = nn.value_and_grad(net, lambda n: loss_fn(n, target, *inputs, 1, 0.1))
    for _ in range(40):
        (loss, ces, accs), g = vg(net)
        g, _ = optim.clip_grad_norm(g, 1.0)
        opt.update(net, g)
        mx.eval(net.parameters(), opt.state, accs)
    model.unfreeze()
    assert accs[0].item() > 0.2
    drafter = A.AssistantDrafter(model, net, cfg, auto_off=False)
    for i, text in enumerate(PROMPTS):
        p = chat(text)
        assert [
            t
            for t, _, _ in speculative_generate_step(
                p, model, drafter, num_draft_tokens=3, max_tokens=32
            )
        ] == stock(model, p, 32), text
        s = last_stats()
        assert s.drafted > 0
        if i == 0:
            assert s.accepted > 0 and s.forwards < 32
