"""The batched engine: every request's greedy output equals its own plain greedy decoding, sampled outputs have
the target's distribution, under every scheduler, with requests of different lengths joining and leaving."""

import itertools

import pytest
import torch
from test_generate_sampling import NEW, PROMPT, VOCAB, chi_square_pvalue, exact_distribution, peaked_target

import generation.engine as engine_module
from generation import DSparkEngine
from generation.scheduler import CostTable
from generation.verification import process_logits
from tiny_models import bigram_target, oracle_drafter, tiny_drafter, tiny_target

COST = CostTable.from_dict({1: 100.0, 4: 95.0, 8: 90.0, 16: 80.0, 32: 60.0, 64: 40.0, 128: 20.0})
SETTINGS = {
    "none": {},
    "fixed": {"num_verify": 3},
    "threshold": {"threshold": 0.2},
    "algorithm1": {"cost_table": COST},
    "async": {"cost_table": COST},
}


def prompts(vocab, lengths=(3, 9, 17, 5, 12), seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in lengths]


def plain_greedy(target, ids, n):
    out = target.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=n)
    return out[0, len(ids) :].tolist()


@pytest.mark.parametrize("scheduler", sorted(SETTINGS))
@pytest.mark.parametrize("kind", ["random", "oracle"])
def test_batched_greedy_equals_plain_greedy_with_joins_and_leaves(scheduler, kind):
    if kind == "oracle":
        target = bigram_target()
        drafter = oracle_drafter(target)
    else:
        target = tiny_target("qwen3")
        drafter = tiny_drafter(target)
    engine = DSparkEngine(target, drafter, scheduler=scheduler, **SETTINGS[scheduler])
    ps = prompts(target.config.vocab_size)
    budgets = [23, 7, 30, 15, 11]
    streamed = {}

    def on_tokens(rid, tokens):
        streamed.setdefault(rid, []).extend(tokens)

    first = [engine.add_request(p, max_new_tokens=n, on_tokens=on_tokens) for p, n in zip(ps[:3], budgets[:3])]
    for _ in range(3):
        engine.step()
    later = [engine.add_request(p, max_new_tokens=n, on_tokens=on_tokens) for p, n in zip(ps[3:], budgets[3:])]  # join mid-run
    while engine.has_work():
        engine.step()
    for rid, ids, n in zip(first + later, ps, budgets):
        request = engine.finished[rid]
        assert request.output_ids == plain_greedy(target, ids, n), f"request {rid} ({scheduler}, {kind})"
        assert streamed[rid] == request.output_ids
    verified = sum(r.verified for rid in first + later for r in engine.finished[rid].stats.rounds)
    if scheduler != "none":
        assert verified > 0, "drafts must really have been verified"
    if kind == "oracle" and scheduler in ("fixed", "algorithm1"):
        assert max(r.accepted for r in engine.finished[first[2]].stats.rounds) >= 3
    assert max(step["active"] for step in engine.step_log) >= 4  # the joiners overlapped the first requests


def sample_engine_counts(scheduler, samples=2000, per_batch=10, seed=0, **settings):
    target = peaked_target()
    drafter = tiny_drafter(target, seed=7)
    torch.manual_seed(seed)
    counts, verified, accepted = {}, 0, 0
    for _ in range(samples // per_batch):
        engine = DSparkEngine(target, drafter, scheduler=scheduler, **settings)
        outs = engine.generate([PROMPT[0].tolist()] * per_batch, max_new_tokens=NEW, temperature=1.0)
        for out in outs:
            counts[tuple(out)] = counts.get(tuple(out), 0) + 1
        for r in engine.finished.values():
            verified += sum(x.verified for x in r.stats.rounds)
            accepted += sum(x.accepted for x in r.stats.rounds)
    return counts, verified, accepted


@pytest.mark.parametrize("scheduler", sorted(SETTINGS))
def test_batched_sampling_matches_target(scheduler):
    counts, verified, accepted = sample_engine_counts(scheduler, **SETTINGS[scheduler])
    if scheduler != "none":
        assert verified > 1000 and 0 < accepted < verified, "tokens under test must come from verified drafts"
    assert chi_square_pvalue(counts, exact_distribution(peaked_target()), sum(counts.values())) > 1e-3


def test_broken_acceptance_is_detected(monkeypatch):
    real = engine_module.verify_drafts

    def accept_all(target_logits, draft_logits, drafts, lengths, greedy):
        _, next_token = real(target_logits, draft_logits, drafts, lengths, torch.ones_like(greedy))
        return lengths.clone(), next_token

    monkeypatch.setattr(engine_module, "verify_drafts", accept_all)
    counts, *_ = sample_engine_counts("fixed", num_verify=3)
    assert chi_square_pvalue(counts, exact_distribution(peaked_target()), sum(counts.values())) < 1e-3


def exact_processed_distribution(target, temperature, top_p):
    """Like ``exact_distribution``, with temperature and top-p applied at every position."""
    seqs = torch.tensor(list(itertools.product(range(VOCAB), repeat=NEW)))
    full = torch.cat([PROMPT.expand(len(seqs), -1), seqs], dim=1)
    start = PROMPT.shape[1] - 1
    with torch.no_grad():
        logits = target(full).logits.float()[:, start : start + NEW]
    n = len(seqs)
    processed = process_logits(logits, torch.full((n,), temperature), torch.full((n,), top_p))
    logp = torch.log_softmax(processed, dim=-1).gather(-1, seqs[..., None]).squeeze(-1).sum(-1)
    return {tuple(s.tolist()): float(p) for s, p in zip(seqs, logp.exp())}


def test_rows_with_different_temperature_and_top_p_follow_their_own_distribution():
    """Rows with different settings in one batch: each follows its own processed target distribution."""
    target = peaked_target()
    drafter = tiny_drafter(target, seed=7)
    torch.manual_seed(1)
    settings = [(0.5, 1.0), (1.0, 1.0), (1.0, 0.8)]
    counts = {s: {} for s in settings}
    for _ in range(150):
        engine = DSparkEngine(target, drafter, scheduler="fixed", num_verify=3)
        ids = {s: [engine.add_request(PROMPT[0].tolist(), max_new_tokens=NEW, temperature=s[0], top_p=s[1]) for _ in range(6)] for s in settings}
        while engine.has_work():
            engine.step()
        for s, rids in ids.items():
            for rid in rids:
                key = tuple(engine.finished[rid].output_ids)
                counts[s][key] = counts[s].get(key, 0) + 1
    for (t, p), c in counts.items():
        expected = exact_processed_distribution(target, t, p)
        assert chi_square_pvalue(c, expected, sum(c.values())) > 1e-3, f"T={t}, top_p={p}"
    # the settings really differ: top-p 0.8 removes sequences that T=1 produces
    assert any(v == 0.0 for v in exact_processed_distribution(target, 1.0, 0.8).values())


def test_engine_refuses_bad_settings():
    target = tiny_target()
    drafter = tiny_drafter(target)
    with pytest.raises(ValueError, match="scheduler must be"):
        DSparkEngine(target, drafter, scheduler="magic")
    with pytest.raises(ValueError, match="confidence head"):
        DSparkEngine(target, tiny_drafter(target, confidence_head=False), scheduler="threshold")
    with pytest.raises(ValueError, match="sliding-window"):
        DSparkEngine(tiny_target("gemma3"), None, scheduler="none")
    engine = DSparkEngine(target, drafter, scheduler="fixed")
    with pytest.raises(ValueError, match="one prompt"):
        engine.add_request(torch.ones(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.add_request([1, 2], max_new_tokens=0)


def test_profiler_measures_caches_and_the_load_benchmark_runs(tmp_path, monkeypatch):
    import json as _json

    from test_harness import ByteChat

    from generation.load_benchmark import run_load, write_load_report
    from generation.profiler import cost_table_path, profile_sps

    monkeypatch.setenv("DSPARK_CACHE", str(tmp_path / "cache"))
    target = tiny_target()
    cost = profile_sps(target, max_tokens=16, context_length=32, repeats=2, progress=False)
    assert cost.tokens == (1, 2, 3, 4, 6, 8, 12, 16) and all(s > 0 for s in cost.steps_per_second)
    path = cost_table_path(target, 32)
    assert path.is_file()
    stored = _json.loads(path.read_text())
    stored["steps_per_second"] = {b: 1.0 for b in stored["steps_per_second"]}  # a cached table is reused as is
    path.write_text(_json.dumps(stored))
    assert profile_sps(target, max_tokens=16, context_length=32, progress=False).steps_per_second == (1.0,) * 8

    eval_dir = tmp_path / "eval"
    eval_dir.mkdir()
    for name in ("gsm8k", "humaneval", "mt-bench"):
        (eval_dir / f"{name}.jsonl").write_text("".join(_json.dumps({"id": i, "prompt": f"{name} {i}", "domain": "x"}) + "\n" for i in range(2)))
    methods = {"no speculation": {"scheduler": "none"}, "fixed 3": {"scheduler": "fixed", "num_verify": 3}, "algorithm 1": {"scheduler": "algorithm1"}}
    results = run_load(target, tiny_drafter(target), ByteChat(96), concurrency=(1, 3), methods=methods, max_new_tokens=6,
                       cost_table=COST, eval_dir=eval_dir, progress=False)  # fmt: skip
    assert results["methods"]["no speculation"][3]["mean_budget_per_request"] == 0
    assert results["methods"]["fixed 3"][1]["mean_budget_per_request"] > 0
    write_load_report(results, tmp_path / "out", COST, "test")
    for name in ("load.md", "load.json", "load.png", "sps.png"):
        assert (tmp_path / "out" / name).stat().st_size > 0
