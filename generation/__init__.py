"""How DSpark decoding runs: the candidate generator behind ``generate(assistant_model=drafter)``, its hook,
and per-call statistics."""

from .candidate_generator import DraftProposal, DSparkCandidateGenerator, propose_block
from .hooks import (
    TESTED_TRANSFORMERS,
    dspark_generate,
    install_generate_hook,
    is_dspark_drafter,
    uninstall_generate_hook,
)
from .stats import DSparkGenerationStats, DSparkRound

__all__ = [
    "DSparkCandidateGenerator",
    "DSparkGenerationStats",
    "DSparkRound",
    "DraftProposal",
    "TESTED_TRANSFORMERS",
    "dspark_generate",
    "install_generate_hook",
    "is_dspark_drafter",
    "propose_block",
    "uninstall_generate_hook",
]
