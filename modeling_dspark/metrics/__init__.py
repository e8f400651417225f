"""`evaluate` metric modules shipped with the package, and the acceptance statistics they compute.

    import evaluate
    from modeling_dspark.metrics import metric_path
    tau = evaluate.load(metric_path("acceptance_length"), "rounds").compute(accepted=[0, 3, 1], verified=[7, 7, 7])

Modules (loadable offline, each a folder with one script): ``acceptance_length`` (configs ``"rounds"``: tau and
per-position acceptance from verification rounds; ``"analytic"``: the expected tau implied by per-slot
acceptance rates ``1 - 0.5 L1`` of a training batch) and ``calibration`` (per-position ECE / AUROC / Brier of
the cumulative survival against observed prefix acceptance). The maths lives here and in
:mod:`modeling_dspark.training.calibration`; the modules, the trainer, the calibration script and the evaluation
harness all call the same functions.
"""

from __future__ import annotations

import itertools
import math
import operator
from functools import lru_cache
from pathlib import Path

from generation.decoding.stats import acceptance_length, expected_acceptance_length

__all__ = [
    "METRICS_DIR",
    "analytic_acceptance",
    "conditional_acceptance",
    "load_metric",
    "metric_path",
    "prefix_acceptance",
    "round_acceptance",
]

METRICS_DIR = Path(__file__).resolve().parent


def metric_path(name: str) -> str:
    """Folder of a shipped metric module, for ``evaluate.load``."""
    path = METRICS_DIR / name
    if not (path / f"{name}.py").is_file():
        known = sorted(p.name for p in METRICS_DIR.iterdir() if (p / f"{p.name}.py").is_file())
        raise ValueError(f"no metric module {name!r}; shipped: {known}")
    return str(path)


@lru_cache(maxsize=None)
def load_metric(name: str, config_name: str | None = None):
    """``evaluate.load`` of a shipped module (cached: loading imports and copies the script)."""
    import evaluate

    return evaluate.load(metric_path(name), config_name)


def prefix_acceptance(accepted, verified, block: int) -> list[float]:
    """DeepSpec's accept_rate@k: rounds with more than k accepted / rounds that verified more than k."""
    out = []
    for k in range(block):
        offered = [a for a, v in zip(accepted, verified) if v > k]
        out.append(sum(a > k for a in offered) / len(offered) if offered else math.nan)
    return out


def conditional_acceptance(accepted, verified, block: int) -> list[float]:
    """The paper's Figure 2 quantity: P(slot k accepted | slots before it accepted) = acc@k / acc@(k-1)."""
    out = []
    for k in range(block):
        reached = [a for a, v in zip(accepted, verified) if v > k and a >= k]
        out.append(sum(a > k for a in reached) / len(reached) if reached else math.nan)
    return out


def round_acceptance(accepted, verified, block: int | None = None) -> dict:
    """Tau (tokens per round, bonus included, pooled over rounds) and per-position acceptance of real rounds."""
    accepted, verified = [int(a) for a in accepted], [int(v) for v in verified]
    if any(a > v or a < 0 for a, v in zip(accepted, verified)):
        raise ValueError("every round needs 0 <= accepted <= verified")
    block = block or max(verified, default=0)
    n = len(accepted)
    return {
        "tau": acceptance_length(accepted),
        "rounds": n,
        "acceptance_rate": sum(accepted) / sum(verified) if sum(verified) else math.nan,
        "mean_verified": sum(verified) / n if n else math.nan,
        "prefix_acceptance": prefix_acceptance(accepted, verified, block),
        "conditional_acceptance": conditional_acceptance(accepted, verified, block),
    }


def analytic_acceptance(acceptance_rates, masks) -> dict:
    """Expected tau ``1 + sum_k prod_{i<=k} r_i`` from per-slot acceptance rates ``r = 1 - 0.5 L1`` averaged over
    supervised slots (rows are blocks; ``masks`` marks the supervised slots)."""
    width = max((len(r) for r in acceptance_rates), default=0)
    num, den = [0.0] * width, [0] * width
    for rates, mask in zip(acceptance_rates, masks):
        if len(rates) != len(mask):
            raise ValueError("acceptance_rates and masks rows must have the same length")
        for k, (r, m) in enumerate(zip(rates, mask)):
            if m:
                num[k] += float(r)
                den[k] += 1
    return expected_tau_from_sums(num, den)


def expected_tau_from_sums(num, den) -> dict:
    """Same as :func:`analytic_acceptance` from per-slot sums (what the trainer accumulates)."""
    rates = [n / d if d else 0.0 for n, d in zip(num, den)]
    survival = itertools.accumulate(rates, operator.mul)  # slot k is reached only if slots 0..k-1 were accepted
    return {"expected_tau": expected_acceptance_length(survival), "acceptance_rate_per_position": rates, "supervised_per_position": [int(d) for d in den]}
