"""How DSpark drafts are decoded, served and measured.

- ``generation.decoding``: one request through ``target.generate(assistant_model=drafter)``: the one drafting
  path, the candidate generators, their hook into ``generate()``, per-call statistics.
- ``generation.scheduling``: what each round verifies and what it costs: the schedulers (Algorithm 1 and its
  asynchronous variant), the depth planner, the measured cost tables.
- ``generation.serving``: many requests at once: the batched engine, its ragged cache and per-row verification.
- ``generation.evaluation``: the paper's tables and figures, batch-1 speed, throughput under load.
"""

from generation.decoding.candidate_generator import DSparkCandidateGenerator
from generation.decoding.drafting import DraftBlock, draft_block, draft_token
from generation.decoding.eagle3_candidate_generator import Eagle3CandidateGenerator
from generation.decoding.hooks import (
    TESTED_TRANSFORMERS,
    dspark_generate,
    install_generate_hook,
    is_hidden_state_drafter,
    uninstall_generate_hook,
)
from generation.decoding.stats import DSparkGenerationStats, DSparkRound
from generation.scheduling.profiler import profile_draft_cost, profile_sps, profile_verify_cost
from generation.scheduling.scheduler import CostTable, DraftCost, PaddedCostTable
from generation.serving.engine import DSparkEngine, EngineRequest

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
    "is_hidden_state_drafter",
    "profile_draft_cost",
    "profile_sps",
    "profile_verify_cost",
    "uninstall_generate_hook",
]
