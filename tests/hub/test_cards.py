"""Model cards validate (ModelCard round trip, metadata present) and the upload sends a complete folder."""

import json

import pytest
from huggingface_hub import ModelCard
from tiny_models import tiny_drafter, tiny_target

from hub_cards import drafter_card, push_drafter, remote_code_files, write_card


@pytest.fixture
def folder(tmp_path):
    path = tmp_path / "dspark-tiny"
    tiny_drafter(tiny_target()).save_pretrained(path)
    (path / "training_budget.json").write_text(json.dumps({"command": "python -m modeling_dspark.training.train ...", "steps": 10, "batch_size": 4,
                                                           "train_sequences": 8, "train_response_tokens": 100, "wall_time_s_this_run": 1.5}))  # fmt: skip
    metrics = {"ece": 0.02, "auroc": 0.7, "brier": 0.05}
    (path / "calibration.json").write_text(json.dumps({"before": metrics, "after": {**metrics, "ece": 0.01}}))
    (path / "card_notes.md").write_text("## Notes\n\nhand-written remark")
    return path


def eval_json(tmp_path):
    path = tmp_path / "eval.json"
    path.write_text(json.dumps({"benchmarks": {"gsm8k": {}, "mt-bench": {}},
                                "summary": {"tau": {"dspark": {"gsm8k": 1.51, "mt-bench": 1.36, "macro": 1.43}}}}))  # fmt: skip
    return path


def test_card_round_trips_with_metadata(folder, tmp_path):
    path = write_card(folder, eval_results=eval_json(tmp_path), repo_id="someone/dspark-tiny")
    card = ModelCard.load(path)
    data = card.data.to_dict()
    assert data["base_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert data["library_name"] == "transformers" and data["license"] == "apache-2.0"
    assert {"speculative-decoding", "dspark"} <= set(data["tags"])
    results = {r.dataset_type: r.metric_value for r in card.data.eval_results}
    assert results == {"gsm8k": 1.51, "mt-bench": 1.36}
    text = card.text
    assert "assistant_model=drafter" in text and "| 1.51 | 1.36 |" in text and "1.00 %" in text and "hand-written remark" in text
    assert ModelCard(str(card)).data.to_dict() == data  # text -> card -> same metadata


def test_card_kinds_and_errors(folder, tmp_path):
    dflash = tmp_path / "dflash"
    tiny_drafter(tiny_target(), markov_head_type=None, confidence_head=False).save_pretrained(dflash)
    assert "dflash" in drafter_card(dflash).data.tags
    with pytest.raises(ValueError, match="no drafter labelled"):
        drafter_card(folder, eval_results=eval_json(tmp_path), label="eagle3")
    with pytest.raises(FileNotFoundError, match="config.json"):
        drafter_card(tmp_path / "nothing")


def test_card_states_the_default_truncation(tmp_path):
    """The card says what a round verifies by default, read from the config, so a threshold set there is not a
    silent difference between two checkpoints of one architecture."""
    target = tiny_target()
    cases = {
        "threshold": ({"truncation": "threshold", "confidence_threshold": 0.1}, "is at least 0.1"),
        "full": ({"truncation": "threshold", "confidence_threshold": 0.0}, "the whole block of"),
        "cost": ({"truncation": "cost"}, "Algorithm 1"),
    }
    for name, (settings, phrase) in cases.items():
        drafter = tiny_drafter(target)
        for key, value in settings.items():
            setattr(drafter.config, key, value)
        drafter.save_pretrained(tmp_path / name)
        text = drafter_card(tmp_path / name).text
        section = text.split("## Drafting")[1].split("##")[0]
        assert phrase in section and f'truncation: "{settings["truncation"]}"' in section, (name, section)
    dflash = tiny_drafter(target, markov_head_type=None, confidence_head=False)  # no confidence head: whole blocks
    dflash.save_pretrained(tmp_path / "dflash")
    assert "the whole block of" in drafter_card(tmp_path / "dflash").text


class FakeApi:
    def __init__(self):
        self.calls = []

    def create_repo(self, repo_id, **kwargs):
        self.calls.append(("create_repo", repo_id, kwargs))

    def upload_folder(self, **kwargs):
        self.calls.append(("upload_folder", kwargs))
        return "commit"


def test_push_checks_the_folder_and_uploads_it(folder):
    with pytest.raises(FileNotFoundError, match="model card"):
        remote_code_files(folder)
    write_card(folder)
    files = remote_code_files(folder)
    assert {"config.json", "model.safetensors", "README.md", "configuration_dspark.py", "modeling_dspark.py"} <= set(files)
    (folder / "notes").mkdir()
    (folder / "notes" / "extra.md").write_text("sent too")
    (folder / "__pycache__").mkdir()
    (folder / "__pycache__" / "x.cpython-311.pyc").write_bytes(b"")
    listed, _ = push_drafter(folder, "someone/x", dry_run=True)
    assert set(files) < set(listed) and "notes/extra.md" in listed and not any("pycache" in f for f in listed)
    api = FakeApi()
    push_drafter(folder, "someone/x", private=True, api=api)
    assert api.calls[0] == ("create_repo", "someone/x", {"private": True, "exist_ok": True, "repo_type": "model"})
    assert api.calls[1][1]["folder_path"] == str(folder) and api.calls[1][1]["repo_id"] == "someone/x"
    assert api.calls[1][1]["allow_patterns"] == listed  # the dry run lists exactly what is sent
    config = json.loads((folder / "config.json").read_text())
    del config["auto_map"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="auto_map"):
        remote_code_files(folder)
