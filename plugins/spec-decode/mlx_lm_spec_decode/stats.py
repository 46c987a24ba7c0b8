"""Per-request figures of the verify loop, for --verbose, the server's usage
field and its log line.

The summary line says what happened, from these figures only: how much was
drafted and kept, tokens per target forward, the measured speed of the
drafting rounds against the request's own plain steps (both timed in the
same run), and each time drafting switched itself off: at which token, why,
and whether and when it came back on.
"""

import threading
from dataclasses import asdict, dataclass, field
from typing import List, Optional

_local = threading.local()


@dataclass
class SpecStats:
    drafter: str
    gamma_start: int
    gamma: int = 0
    drafted: int = 0  # drafted tokens the target verified
    accepted: int = 0  # of those, the ones it kept
    emitted: int = 0  # tokens yielded
    forwards: int = 0  # target forwards that produced tokens (verify or plain)
    draft_rounds: int = 0  # forwards that verified at least one draft
    tree_rounds: int = 0  # of those, the ones that verified a branching token tree
    auto_off: bool = False  # drafting switched itself off at least once
    fallback: Optional[str] = None  # why the request decoded plainly, if it did
    # Each switch-off: tokens emitted by then, and why; tokens emitted when
    # drafting came back on (one entry per switch-off it ended).
    off_at: List[int] = field(default_factory=list)
    off_why: List[str] = field(default_factory=list)
    on_again_at: List[int] = field(default_factory=list)
    off_for_good: bool = False  # the last switch-off was for the rest of the request
    # Measured in this request: drafting rounds (draft + verify) and plain steps.
    draft_seconds: float = 0.0
    draft_tokens: int = 0  # tokens the drafting rounds emitted
    plain_seconds: float = 0.0
    plain_tokens: int = 0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_forward(self) -> float:
        return self.emitted / self.forwards if self.forwards else 0.0

    @property
    def drafting_tps(self) -> Optional[float]:
        """Tokens per second of the drafting rounds (None if none was timed)."""
        return self.draft_tokens / self.draft_seconds if self.draft_seconds > 0 else None

    @property
    def plain_tps(self) -> Optional[float]:
        """Tokens per second of this request's plain steps (None if none was timed)."""
        return self.plain_tokens / self.plain_seconds if self.plain_seconds > 0 else None

    @property
    def speedup(self) -> Optional[float]:
        """Drafting rounds' tokens/s over the plain steps' (None without both)."""
        d, p = self.drafting_tps, self.plain_tps
        return d / p if d is not None and p is not None else None

    @property
    def off_at_end(self) -> bool:
        """Drafting was off when the request ended."""
        return len(self.off_at) > len(self.on_again_at)

    # -------------------------------------------------- what the loop reports

    def drafting_round(self, tokens: int, seconds: float) -> None:
        """A drafting round emitted ``tokens`` in ``seconds`` (draft and verify)."""
        if self.off_at_end:
            self.on_again_at.append(self.emitted)
        self.draft_tokens += tokens
        self.draft_seconds += seconds

    def plain_run(self, tokens: int, seconds: float) -> None:
        """``tokens`` plain steps took ``seconds``."""
        self.plain_tokens += tokens
        self.plain_seconds += seconds

    def switched_off(self, why: str, for_good: bool) -> None:
        """Drafting switches itself off now (``for_good``: for the rest of the request)."""
        self.auto_off = True
        self.off_at.append(self.emitted)
        self.off_why.append(why or "measured slower")
        self.off_for_good = for_good

    # ------------------------------------------------------------- reporting

    def as_dict(self) -> dict:
        d = asdict(self)
        d["acceptance_rate"] = round(self.acceptance, 4)
        d["tokens_per_forward"] = round(self.tokens_per_forward, 4)
        for key in ("drafting_tps", "plain_tps", "speedup"):
            v = getattr(self, key)
            d[key] = None if v is None else round(v, 4)
        d["draft_seconds"] = round(self.draft_seconds, 6)
        d["plain_seconds"] = round(self.plain_seconds, 6)
        return d

    def line(self) -> str:
        s = (
            f"Speculative decoding ({self.drafter}): drafted {self.drafted}, "
            f"accepted {self.accepted} ({100 * self.acceptance:.1f}%), "
            f"{self.tokens_per_forward:.2f} tokens per target forward "
            f"({self.emitted} tokens, {self.forwards} forwards), "
            f"draft length {self.gamma_start}->{self.gamma}"
        )
        if self.tree_rounds:
            s += f", {self.tree_rounds} token trees"
        speed = self.speed_text()
        if speed:
            s += f"; {speed}"
        switches = self.switches_text()
        if switches:
            s += f"; {switches}"
        if self.fallback:
            s += f"; plain decoding: {self.fallback}"
        return s

    def speed_text(self) -> str:
        """The drafting rounds' measured speed against this request's plain steps."""
        d, p = self.drafting_tps, self.plain_tps
        if d is None and p is None:
            return ""
        if d is None:
            return f"no drafting rounds, plain steps {p:.1f} tokens/s"
        if p is None:
            return f"drafting rounds {d:.1f} tokens/s (no plain steps timed)"
        return f"drafting rounds {d:.1f} tokens/s, {d / p:.2f}x this request's plain steps ({p:.1f} tokens/s)"

    def switches_text(self) -> str:
        """Whether and when drafting switched itself off, why, and if it came back."""
        if not self.off_at:
            return "drafting stayed on" if self.draft_seconds > 0 else ""
        parts = []
        for i, (at, why) in enumerate(zip(self.off_at, self.off_why, strict=False)):
            if i < len(self.on_again_at):
                parts.append(f"off at token {at} ({why}), on again at token {self.on_again_at[i]}")
            elif self.off_for_good:
                parts.append(f"off for the rest of the request from token {at} ({why})")
            else:
                parts.append(f"off from token {at} to the end ({why})")
        n = len(self.off_at)
        head = (
            "drafting switched itself off once: "
            if n == 1
            else f"drafting switched itself off {n} times: "
        )
        return head + "; ".join(parts)


def start(stats: SpecStats) -> None:
    """Record ``stats`` as this thread's latest request, and as the current
    request's figures for the host (``usage``, ``--verbose``)."""
    from mlx_lm_ext import api as host

    _local.last = stats
    info = host.request_info()
    if info is not None:
        info["spec-decode"] = stats


def last() -> Optional[SpecStats]:
    """The stats of the latest speculative request on this thread, or None."""
    return getattr(_local, "last", None)
