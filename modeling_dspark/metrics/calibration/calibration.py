"""Calibration of a drafter's confidence head: per-position ECE (equal-width bins), AUROC and Brier score of the
cumulative survival ``a_k = prod_{i<=k} sigmoid(z_i / T_i)`` against observed prefix acceptance.

One example per verification round: ``confidence_logits`` (raw logits of the verified slots, in order) and
``accepted`` (how many of them the target accepted). Arguments of ``compute``: ``temperatures`` (STS
temperatures, default all 1) and ``num_bins`` (default 20). Returns count-weighted means ``ece`` / ``auroc`` /
``brier`` and ``per_position`` entries.
"""

import datasets
import evaluate

from modeling_dspark.training.calibration import CalibrationRounds, calibration_metrics


class Calibration(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=__doc__,
            citation="DSpark (arXiv 2607.05147), section 5",
            inputs_description=__doc__,
            features=datasets.Features(
                {"confidence_logits": datasets.Sequence(datasets.Value("float64")), "accepted": datasets.Value("int64")}
            ),
        )

    def _compute(self, confidence_logits, accepted, temperatures=None, num_bins=20):
        rounds = CalibrationRounds.from_lists(confidence_logits, accepted)
        temps = temperatures if temperatures is not None else [1.0] * rounds.logits.shape[1]
        return calibration_metrics(rounds, temps, num_bins=num_bins)
