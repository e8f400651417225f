"""``python -m modeling_dspark.training.expected_tau``: the trainer's teacher-forced expected tau on response files."""

import json

import pytest
import torch
from tiny_models import bigram_dataset, bigram_target, oracle_drafter, tiny_drafter

from modeling_dspark.training.expected_tau import evaluate_expected_tau, main


def responses(target, n=8):
    return [{"id": str(i), "domain": "math", "prompt_ids": row["input_ids"][:4], "response_ids": row["input_ids"][4:]}
            for i, row in enumerate(bigram_dataset(target, n=n))]  # fmt: skip


def test_a_drafter_that_shares_the_targets_predictions_accepts_every_slot():
    target = bigram_target(initializer_range=0.5)  # peaked next-token distributions
    rows = responses(target)
    block = oracle_drafter(target).config.block_size
    oracle = evaluate_expected_tau(oracle_drafter(target), target, rows, num_anchors=8)
    assert oracle["expected_tau"] == pytest.approx(block + 1, abs=1e-3)
    assert oracle["acceptance_rate_per_position"] == pytest.approx([1.0] * block, abs=1e-3) and oracle["sequences"] == len(rows)
    untrained = evaluate_expected_tau(tiny_drafter(target), target, rows, num_anchors=8)
    assert 1.0 <= untrained["expected_tau"] < 1.5, untrained


def test_the_command_names_bad_input_before_loading_anything(tmp_path):
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    (drafter / "config.json").write_text(json.dumps({"model_type": "eagle3_drafter"}))
    data = tmp_path / "r.jsonl"
    data.write_text("")
    common = ["--label", "x", "--out", str(tmp_path / "out")]
    with pytest.raises(SystemExit, match="no such file"):
        main(["--drafter", str(drafter), "--data", str(tmp_path / "missing.jsonl"), *common])
    with pytest.raises(SystemExit, match="DSpark or DFlash drafter"):
        main(["--drafter", str(drafter), "--data", str(data), *common])
    (drafter / "config.json").write_text(json.dumps({"model_type": "dspark"}))
    with pytest.raises(SystemExit, match="no responses"):
        main(["--drafter", str(drafter), "--data", str(data), *common])
    with pytest.raises(SystemExit, match="not a drafter folder"):
        main(["--drafter", str(tmp_path), "--data", str(data), *common])


def test_the_command_evaluates_each_domain_on_the_prompts_asked(tmp_path, monkeypatch):
    import modeling_dspark
    from modeling_dspark.training import expected_tau
    from modeling_dspark.training.data import write_responses

    drafter = tmp_path / "drafter"
    drafter.mkdir()
    (drafter / "config.json").write_text(json.dumps({"model_type": "dspark"}))
    rows = [{"id": f"p{i}", "domain": ("math", "code")[i % 2], "prompt_ids": [1], "response_ids": [2] * 9} for i in range(12)]
    write_responses(tmp_path / "a.jsonl", rows)
    write_responses(tmp_path / "same.jsonl", [r for r in rows if int(r["id"][1:]) < 6])
    seen = {}
    monkeypatch.setattr(modeling_dspark, "load_target", lambda name, dtype=None: (None, None))
    monkeypatch.setattr(modeling_dspark.DSparkModel, "from_pretrained", classmethod(lambda cls, path, dtype=None: torch.nn.Linear(1, 1)))

    def fake(drafter, target, picked, **kwargs):
        seen[picked[0]["domain"]] = sorted(r["id"] for r in picked)
        return {"expected_tau": 2.0 if picked[0]["domain"] == "math" else 1.5, "acceptance_rate_per_position": [0.5], "sequences": len(picked)}

    monkeypatch.setattr(expected_tau, "evaluate_expected_tau", fake)
    out = tmp_path / "out"
    main(["--drafter", str(drafter), "--data", str(tmp_path / "a.jsonl"), "--same-prompts-as", str(tmp_path / "same.jsonl"), "--label", "x", "--out", str(out)])
    assert seen == {"math": ["p0", "p2", "p4"], "code": ["p1", "p3", "p5"]}
    result = json.loads((out / "expected_tau.json").read_text())["x"]
    assert result["domains"]["macro"]["expected_tau"] == pytest.approx(1.75) and result["domains"]["macro"]["sequences"] == 6
    assert "| x | drafter | 2.000 | 1.500 | - | 1.750 | 6 |" in (out / "expected_tau.md").read_text()
