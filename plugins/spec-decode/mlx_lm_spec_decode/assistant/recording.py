"""``RecordingDrafter``: an assistant drafter that records what it drafts.

A check, not a drafter to serve with: the tests and
``benchmarks/bench_assistant.py --check`` compare what the loop drafted with
the training graph, so both import it from here.
"""

from .drafter import AssistantDrafter


class _StepRecorder:
    """Stands in for the drafter's net: the same ``step``, its outputs kept."""

    def __init__(self, net):
        self.net, self.layers, self.outs = net, net.layers, []

    def step(self, *args):
        out = self.net.step(*args)
        self.outs.append(out)
        return out


class RecordingDrafter(AssistantDrafter):
    """``base`` as the loop runs it, recording each round as ``(base position,
    pending token, per-step output states, drafts)``, left lazy as the loop
    leaves them. ``options``: ``max_draft``, ``adaptive``, ``auto_off``
    (default: ``base``'s)."""

    def __init__(self, base, **options):
        unknown = set(options) - {"max_draft", "adaptive", "auto_off"}
        if unknown:
            raise TypeError(f"unknown options {sorted(unknown)}")
        # A copy of ``base`` (not a new drafter): same net, head and ropes.
        self.__dict__.update(base.__dict__)
        self.__dict__.update(options)
        self.net = _StepRecorder(base.net)
        self.rounds = []

    def draft(self, ctx, n):
        base = ctx.target_cache[self.cfg.donors[-1]].offset
        last = list(ctx.state.get("last") or [None])
        self.net.outs = []
        toks, q = super().draft(ctx, n)
        if self.net.outs:
            self.rounds.append((base, last[0], list(self.net.outs), toks))
        return toks, q
