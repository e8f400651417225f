"""The Eagle3 baseline: training-time test computes what inference computes, decoding is lossless, and the
trainer learns and round-trips it."""

import pytest
import torch
from exactness import PROMPT, SAMPLES, assert_lossless, chi_square_pvalue, config, exact_distribution, peaked_target, prompts, sample_counts
from tiny_models import bigram_dataset, bigram_target, tiny_eagle3, tiny_target
from transformers import AutoModel
from transformers.cache_utils import DynamicCache

from modeling_dspark import DSparkTrainer, DSparkTrainingArguments, Eagle3DrafterModel
from modeling_dspark.training.eagle3_loss import compute_eagle3_loss
from modeling_dspark.training.loss import sample_anchor_positions


def features_of(target, drafter, ids):
    with torch.no_grad():
        out = target.model(input_ids=ids, output_hidden_states=True)
    return drafter.context_features(out.hidden_states), out.last_hidden_state


def test_training_time_test_equals_inference_chain():
    """Logits of every TTT step at an anchor equal those of the cached inference chain fed the same tokens."""
    target = tiny_target("qwen3")
    drafter = tiny_eagle3(target, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, target.config.vocab_size, (2, 24), generator=g)
    loss_mask = torch.ones_like(ids)
    loss_mask[:, :5] = 0
    features, last_hidden = features_of(target, drafter, ids)
    anchors, keep = sample_anchor_positions(loss_mask, 6, generator=g)
    out = compute_eagle3_loss(
        drafter, input_ids=ids, loss_mask=loss_mask, context_features=features, target_last_hidden=last_hidden,
        input_embeddings=target.get_input_embeddings(), lm_head=target.get_output_embeddings(), anchors=anchors,
        keep=keep, return_logits=True,
    )  # fmt: skip
    emb, head = target.get_input_embeddings(), target.get_output_embeddings()
    checked = 0
    for b in range(2):
        for n in range(anchors.shape[1]):
            p = int(anchors[b, n])
            if not keep[b, n] or p < 1:
                continue
            cache = DynamicCache()
            with torch.no_grad():
                hidden, normed = drafter(
                    input_embeds=emb(ids[b : b + 1, 1 : p + 1]), hidden=drafter.fc(features[b : b + 1, :p]),
                    position_ids=torch.arange(p)[None], cache=cache,
                )  # fmt: skip
                hidden, normed = hidden[:, -1:], normed[:, -1:]
                for i in range(drafter.config.ttt_length):
                    if not out.eval_mask[b, n, i]:
                        break
                    torch.testing.assert_close(head(normed[0, -1]), out.draft_logits[b, n, i], atol=1e-5, rtol=1e-5)
                    checked += 1
                    hidden, normed = drafter(input_embeds=emb(ids[b : b + 1, p + 1 + i][None]), hidden=hidden, position_ids=torch.tensor([[p + i]]), cache=cache)
    assert checked >= 20


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3", "llama, draft vocabulary"])
def test_eagle3_greedy_identical(family):
    target = tiny_target(family.split(",")[0])
    vocab = {"draft_vocab_ids": torch.arange(0, 96, 2)} if "draft" in family else {}
    drafter = tiny_eagle3(target, **vocab)
    for ids in prompts(target.config.vocab_size):
        assert_lossless(target, drafter, ids, max_new_tokens=40)
        stats = drafter.last_stats
        assert stats.num_rounds > 0 and max(r.drafted for r in stats.rounds) == drafter.config.ttt_length


def test_eagle3_sampling_matches_target():
    target = peaked_target()
    drafter = tiny_eagle3(target, seed=7)
    counts, drafted_rounds, accepted, _ = sample_counts(target, drafter, config())
    assert drafted_rounds >= SAMPLES // 2, "the tokens under test must come from drafted rounds"
    assert 0 < sum(accepted) < len(accepted) * 2, "both acceptance and rejection must occur"
    assert chi_square_pvalue(counts, exact_distribution(target), SAMPLES) > 1e-3
    assert PROMPT.shape[1] == 5


def test_eagle3_trainer_learns_and_round_trips(tmp_path):
    target = bigram_target(initializer_range=0.3)
    drafter = tiny_eagle3(target, dtype=torch.float32).train()
    args = DSparkTrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=60, learning_rate=1e-2, logging_steps=10,
        report_to=[], use_cpu=True, num_anchors=8, save_strategy="no", seed=0,
    )  # fmt: skip
    data = bigram_dataset(target)
    trainer = DSparkTrainer(model=drafter, args=args, target=target, train_dataset=data)
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    # soft CE has the target's entropy as its floor; the distance to the target (L1) shows the learning
    assert logs[-1]["loss"] < logs[0]["loss"] and logs[-1]["l1_loss"] < 0.9 * logs[0]["l1_loss"]
    assert logs[-1]["expected_tau"] > logs[0]["expected_tau"] + 0.1
    trainer.save_model(str(tmp_path / "eagle3"))
    loaded = AutoModel.from_pretrained(tmp_path / "eagle3")
    assert isinstance(loaded, Eagle3DrafterModel)
    for k, v in drafter.state_dict().items():
        assert torch.equal(v, loaded.state_dict()[k]), k
    assert not any("embed_tokens" in k or "lm_head" in k for k in loaded.state_dict())
    assert_lossless(target, loaded.eval(), prompts(target.config.vocab_size)[1], max_new_tokens=30)


def test_eagle3_incompatible_target_is_refused():
    drafter = tiny_eagle3(tiny_target())
    with pytest.raises(ValueError, match="Eagle3 drafter is incompatible.*vocabulary"):
        tiny_target(vocab_size=50).generate(torch.tensor([[1, 2, 3]]), assistant_model=drafter, max_new_tokens=4)
