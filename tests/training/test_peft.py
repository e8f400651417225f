"""PEFT: LoRA-adapted drafters (adapter and merged) and PEFT-wrapped targets stay lossless."""

import torch
from exactness import assert_lossless, prompts
from peft import LoraConfig, PeftModel, get_peft_model
from tiny_models import bigram_dataset, bigram_target, tiny_drafter, tiny_target

from modeling_dspark import DSparkModel, DSparkTrainer, DSparkTrainingArguments
from modeling_dspark.training.adapt import add_lora, load_adapted_drafter


def test_lora_adapted_drafter_saves_loads_and_stays_lossless(tmp_path):
    target = bigram_target(initializer_range=0.3)
    base = tiny_drafter(target, dtype=torch.float32)
    base.save_pretrained(tmp_path / "base")
    model = add_lora(DSparkModel.from_pretrained(tmp_path / "base"), rank=4)
    frozen = {k: v.clone() for k, v in model.named_parameters() if not v.requires_grad}
    args = DSparkTrainingArguments(
        output_dir=str(tmp_path / "run"), per_device_train_batch_size=4, max_steps=20, learning_rate=1e-2,
        report_to=[], use_cpu=True, num_anchors=8, save_strategy="no", seed=0,
    )  # fmt: skip
    trainer = DSparkTrainer(model=model, args=args, target=target, train_dataset=bigram_dataset(target))
    trainer.train()
    assert all(torch.equal(frozen[k], v) for k, v in model.named_parameters() if k in frozen)
    trainer.save_model(str(tmp_path / "adapter"))
    files = {p.name for p in (tmp_path / "adapter").iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors"} <= files and "model.safetensors" not in files

    adapted = load_adapted_drafter(tmp_path / "adapter", tmp_path / "base", dtype=torch.float32)
    assert isinstance(adapted, PeftModel)
    ids = prompts(target.config.vocab_size)[2]
    embeds = adapted.embed_block(ids[:, -1], target.get_input_embeddings())
    with torch.no_grad():
        ref = model.eval()(block_embeds=embeds).last_hidden_state
        torch.testing.assert_close(adapted(block_embeds=embeds).last_hidden_state, ref)
        plain = DSparkModel.from_pretrained(tmp_path / "base")(block_embeds=embeds).last_hidden_state
    assert not torch.allclose(plain, ref), "the adapter must change the drafter"
    for ids in prompts(target.config.vocab_size):
        assert_lossless(target, adapted, ids, max_new_tokens=30)
    assert adapted.last_stats.num_rounds > 0

    merged = adapted.merge_and_unload()
    merged.save_pretrained(tmp_path / "merged")
    reloaded = DSparkModel.from_pretrained(tmp_path / "merged")
    with torch.no_grad():
        torch.testing.assert_close(reloaded(block_embeds=embeds).last_hidden_state, ref, atol=1e-5, rtol=1e-5)
    assert_lossless(target, reloaded, prompts(target.config.vocab_size)[0], max_new_tokens=30)


def lora_target():
    torch.manual_seed(5)
    config = LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False)
    return get_peft_model(tiny_target("qwen3"), config).eval()


def test_peft_target_greedy_identical_loaded_and_merged():
    target = lora_target()
    base_out = tiny_target("qwen3").generate(prompts(96)[1], do_sample=False, max_new_tokens=20)
    drafter = tiny_drafter(target.get_base_model())
    for ids in prompts(96):
        out = assert_lossless(target, drafter, ids, max_new_tokens=30)
    assert drafter.last_stats.num_rounds > 0
    assert not torch.equal(target.generate(prompts(96)[1], do_sample=False, max_new_tokens=20), base_out), "LoRA must matter"
    merged = target.merge_and_unload()
    for ids in prompts(96):
        assert_lossless(merged, drafter, ids, max_new_tokens=30)
    assert torch.equal(merged.generate(ids, do_sample=False, max_new_tokens=30), out)


def test_trainer_reads_a_peft_target_through_its_decoder(tmp_path):
    target = lora_target()
    drafter = tiny_drafter(target.get_base_model(), dtype=torch.float32)
    args = DSparkTrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, num_anchors=4)
    trainer = DSparkTrainer(model=drafter, args=args, target=target)
    ids = prompts(96)[2]
    features, last = trainer.target_features(ids, torch.ones_like(ids))
    with torch.no_grad():
        ref = target(input_ids=ids, output_hidden_states=True)
    torch.testing.assert_close(last, ref.hidden_states[-1])
    torch.testing.assert_close(features, drafter.context_features(ref.hidden_states))
