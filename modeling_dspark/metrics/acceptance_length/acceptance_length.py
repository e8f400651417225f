"""Acceptance length (the paper's tau) of a speculative decoder.

Config ``"rounds"`` (default): one example per verification round, ``accepted`` (drafted tokens the target
kept, bonus excluded) and ``verified`` (drafted tokens sent for verification). Returns tau = mean(accepted + 1),
the acceptance rate, tokens verified per round, per-position prefix acceptance (DeepSpec's accept_rate@k) and
conditional acceptance (the paper's Figure 2).

Config ``"analytic"``: one example per training block, ``acceptance_rates`` (per slot ``1 - 0.5 ||p_d - p_t||_1``)
and ``masks`` (1 = supervised slot). Returns the expected tau ``1 + sum_k prod_{i<=k} r_i`` with ``r_i`` the mean
rate of slot i, and the per-position rates.
"""

import datasets
import evaluate

from modeling_dspark.metrics import analytic_acceptance, round_acceptance

_FEATURES = {
    "rounds": datasets.Features({"accepted": datasets.Value("int64"), "verified": datasets.Value("int64")}),
    "analytic": datasets.Features(
        {"acceptance_rates": datasets.Sequence(datasets.Value("float64")), "masks": datasets.Sequence(datasets.Value("int64"))}
    ),
}


class AcceptanceLength(evaluate.Metric):
    def _info(self):
        name = self.config_name if self.config_name in _FEATURES else "rounds"
        return evaluate.MetricInfo(
            description=__doc__,
            citation="DSpark (arXiv 2607.05147), section 8",
            inputs_description=__doc__,
            features=_FEATURES[name],
        )

    def _compute(self, accepted=None, verified=None, acceptance_rates=None, masks=None, block_size=None):
        if self.config_name == "analytic":
            return analytic_acceptance(acceptance_rates, masks)
        return round_acceptance(accepted, verified, block_size)
