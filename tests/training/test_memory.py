import sys

import pytest

from modeling_dspark.training import memory


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_keep_freed_memory_takes_and_is_idempotent(monkeypatch):
    monkeypatch.setattr(memory, "_applied", False)
    assert memory.keep_freed_memory() is True
    assert memory.keep_freed_memory() is True


def test_keep_freed_memory_is_a_no_op_off_linux(monkeypatch):
    monkeypatch.setattr(memory, "_applied", False)
    monkeypatch.setattr(memory.sys, "platform", "darwin")
    assert memory.keep_freed_memory() is False


def test_cpu_trainer_keeps_freed_memory(monkeypatch, tmp_path):
    import torch
    from tiny_models import bigram_target, tiny_drafter

    from modeling_dspark.training import trainer as trainer_module
    from modeling_dspark.training.trainer import DSparkTrainer, DSparkTrainingArguments

    calls = []
    monkeypatch.setattr(trainer_module, "keep_freed_memory", lambda: calls.append(1) or True)
    target = bigram_target()
    args = DSparkTrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, save_strategy="no")
    DSparkTrainer(model=tiny_drafter(target, dtype=torch.float32), args=args, target=target)
    assert calls == [1]
