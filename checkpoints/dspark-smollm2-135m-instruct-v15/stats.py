"""Per-call speculative-decoding statistics (the paper's tau: accepted tokens per round, bonus included)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

__all__ = ["DSparkRound", "DSparkGenerationStats", "acceptance_length", "expected_acceptance_length"]


def acceptance_length(accepted: Iterable[int]) -> float:
    """tau (SPEC section 8): mean tokens produced per verification round, ``accepted + 1`` each (the bonus token
    or the correction included), pooled over rounds; nan without rounds."""
    accepted = list(accepted)
    return sum(a + 1 for a in accepted) / len(accepted) if accepted else float("nan")


def expected_acceptance_length(survival: Iterable[float]) -> float:
    """Expected tau of a round verifying the slots whose prefix survival (probability that every slot up to it
    is accepted) is ``survival``: ``1 + sum_k a_k``."""
    return 1.0 + sum(survival)


@dataclass
class DSparkRound:
    drafted: int  # tokens the drafter sampled this round
    verified: int  # drafted tokens sent to the target for verification
    accepted: int = 0  # verified tokens the target accepted (the bonus token is not counted here)
    confidence_logits: list[float] = field(default_factory=list)  # raw c_k logits of the verified slots
    draft_seconds: float = 0.0  # wall time of the drafter's work this round
    proposal: str = "dspark"  # what was verified: "dspark" (a drafted block), "ngram" (prompt lookup), "plain"
    match_length: int = 0  # n-gram rounds: length of the matched suffix n-gram


@dataclass
class DSparkGenerationStats:
    rounds: list[DSparkRound] = field(default_factory=list)
    # the round being verified right now (drafted, not yet counted): what a streamer sees while tokens arrive
    pending: DSparkRound | None = None

    @property
    def num_rounds(self) -> int:
        return len(self.rounds)

    @property
    def tau(self) -> float:
        """Mean tokens produced per verification round, bonus token included (SPEC section 8)."""
        return acceptance_length(r.accepted for r in self.rounds)

    @property
    def acceptance_rate(self) -> float:
        """Accepted / verified draft tokens over the whole call."""
        verified = sum(r.verified for r in self.rounds)
        return sum(r.accepted for r in self.rounds) / verified if verified else float("nan")

    @property
    def mean_verified(self) -> float:
        return sum(r.verified for r in self.rounds) / len(self.rounds) if self.rounds else float("nan")

    def proposal_share(self) -> dict[str, float]:
        """Share of rounds that verified each kind of proposal (hybrid drafting)."""
        kinds = [r.proposal for r in self.rounds]
        return {kind: kinds.count(kind) / len(kinds) for kind in sorted(set(kinds))}

    def as_dict(self) -> dict:
        return {
            "num_rounds": self.num_rounds,
            "tau": self.tau,
            "acceptance_rate": self.acceptance_rate,
            "mean_verified": self.mean_verified,
            "drafted": [r.drafted for r in self.rounds],
            "verified": [r.verified for r in self.rounds],
            "accepted": [r.accepted for r in self.rounds],
            "proposal": [r.proposal for r in self.rounds],
        }

    def __repr__(self) -> str:
        return (
            f"DSparkGenerationStats(rounds={self.num_rounds}, tau={self.tau:.3f}, "
            f"acceptance_rate={self.acceptance_rate:.3f}, mean_verified={self.mean_verified:.2f})"
        )
