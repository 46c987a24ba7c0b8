"""Per-request figures of the verify loop, for --verbose, the server's usage
field and its log line."""

import threading
from dataclasses import asdict, dataclass
from typing import Optional

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
    auto_off: bool = False  # drafting switched off as slower than plain decoding
    fallback: Optional[str] = None  # why the request decoded plainly, if it did

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_forward(self) -> float:
        return self.emitted / self.forwards if self.forwards else 0.0

    def as_dict(self) -> dict:
        d = asdict(self)
        d["acceptance_rate"] = round(self.acceptance, 4)
        d["tokens_per_forward"] = round(self.tokens_per_forward, 4)
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
        if self.auto_off:
            s += ", drafting switched off (slower than plain decoding)"
        if self.fallback:
            s += f", plain decoding: {self.fallback}"
        return s


def start(stats: SpecStats) -> None:
    """Record ``stats`` as this thread's latest request, and as the current
    request's figures for the host (``usage``, ``--verbose``)."""
    from mlx_lm_ext import host

    _local.last = stats
    info = host.request_info()
    if info is not None:
        info["spec-decode"] = stats


def last() -> Optional[SpecStats]:
    """The stats of the latest speculative request on this thread, or None."""
    return getattr(_local, "last", None)
