"""How DSpark decoding runs: the candidate generator behind ``generate(assistant_model=drafter)``, its hook,
and per-call statistics."""

from .candidate_generator import DSparkCandidateGenerator
from .drafting import DraftBlock, draft_block, draft_token
from .hooks import (
    TESTED_TRANSFORMERS,
    dspark_generate,
    install_generate_hook,
    is_dspark_drafter,
    is_hidden_state_drafter,
    uninstall_generate_hook,
)
from .eagle3_candidate_generator import Eagle3CandidateGenerator
from .engine import DSparkEngine, EngineRequest
from .profiler import plot_cost_table, profile_draft_cost, profile_sps, profile_verify_cost
from .scheduler import CostTable, DraftCost, PaddedCostTable
from .stats import DSparkGenerationStats, DSparkRound

__all__ = [
    "CostTable",
    "DraftCost",
    "PaddedCostTable",
    "DSparkCandidateGenerator",
    "DSparkEngine",
    "EngineRequest",
    "DSparkGenerationStats",
    "DSparkRound",
    "Eagle3CandidateGenerator",
    "DraftBlock",
    "draft_block",
    "draft_token",
    "TESTED_TRANSFORMERS",
    "dspark_generate",
    "install_generate_hook",
    "is_dspark_drafter",
    "is_hidden_state_drafter",
    "plot_cost_table",
    "profile_draft_cost",
    "profile_sps",
    "profile_verify_cost",
    "uninstall_generate_hook",
]
