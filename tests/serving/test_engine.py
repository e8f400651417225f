"""The batched engine: every request's greedy output equals its own plain greedy decoding, sampled outputs have
the target's distribution, under every scheduler, with requests of different lengths joining and leaving."""

import math
import time
from pathlib import Path

import pytest
import torch
from exactness import NEW, PROMPT, chi_square_pvalue, exact_distribution, peaked_target
from tiny_models import bigram_target, oracle_drafter, tiny_drafter, tiny_target
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

import generation.scheduling.depth_planner as depth_planner_module
import generation.serving.engine as engine_module
from generation import DSparkEngine
from generation.scheduling.scheduler import CostTable, DraftCost, PaddedCostTable

COST = CostTable.from_dict({1: 100.0, 4: 95.0, 8: 90.0, 16: 80.0, 32: 60.0, 64: 40.0, 128: 20.0})
# the engine's own cost model: a padded verify forward and a drafter whose cost grows with the slots drafted
PADDED = PaddedCostTable.from_dict({r: {w: 0.010 * (1 + 0.005 * r * w) for w in range(1, 9)} for r in (1, 4, 16)})
DRAFT = DraftCost.from_dict({r: [0.001 * d * (1 + 0.1 * r) for d in range(1, 8)] for r in (1, 4, 16)})
SETTINGS = {  # label -> DSparkEngine keyword arguments
    "none": {"scheduler": "none"},
    "fixed": {"scheduler": "fixed", "num_verify": 3},
    "threshold": {"scheduler": "threshold", "threshold": 0.2},
    "algorithm1": {"scheduler": "algorithm1", "cost_table": COST},
    "async": {"scheduler": "async", "cost_table": COST},
    "algorithm1+draft cost": {"scheduler": "algorithm1", "cost_table": PADDED, "draft_cost": DRAFT, "probe_interval": 3},  # fmt: skip
    "async+draft cost": {"scheduler": "async", "cost_table": PADDED, "draft_cost": DRAFT, "probe_interval": 3},
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
    engine = DSparkEngine(target, drafter, **SETTINGS[scheduler])
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
    if kind == "oracle" and scheduler in ("fixed", "algorithm1", "algorithm1+draft cost"):
        assert max(r.accepted for r in engine.finished[first[2]].stats.rounds) >= 3
    assert max(step["active"] for step in engine.step_log) >= 4  # the joiners overlapped the first requests


def test_prefill_time_is_kept_apart_from_the_decode_steps():
    """``prefill_seconds`` adds up the prefill forwards alone, those of requests joining mid-run included: the load
    benchmark's decode throughput subtracts it from the steps' time."""
    target = tiny_target()
    engine = DSparkEngine(target, tiny_drafter(target), **SETTINGS["fixed"])
    prefill, pause = engine._prefill, 0.15

    def slow_prefill():
        time.sleep(pause)
        return prefill()

    engine._prefill = slow_prefill
    ps = prompts(target.config.vocab_size)
    engine.add_request(ps[0], max_new_tokens=6)
    assert engine.prefill_seconds == 0.0
    start = time.perf_counter()
    engine.step()  # the prefill, then a decode round
    step_seconds = time.perf_counter() - start
    assert pause <= engine.prefill_seconds < step_seconds
    decode_start = engine.prefill_seconds
    engine.step()  # a decode round alone
    assert engine.prefill_seconds == decode_start
    engine.add_request(ps[1], max_new_tokens=6)  # joins mid-run
    while engine.has_work():
        engine.step()
    assert 2 * pause <= engine.prefill_seconds < 2 * pause + 2 * (step_seconds - pause) + 1.0


def sample_engine_counts(samples=2000, per_batch=10, seed=0, draft_vocab_ids=None, **settings):
    target = peaked_target()
    drafter = tiny_drafter(target, seed=7, **({} if draft_vocab_ids is None else {"draft_vocab_ids": draft_vocab_ids}))
    torch.manual_seed(seed)
    counts, verified, accepted = {}, 0, 0
    for _ in range(samples // per_batch):
        engine = DSparkEngine(target, drafter, **settings)
        outs = engine.generate([PROMPT[0].tolist()] * per_batch, max_new_tokens=NEW, temperature=1.0)
        for out in outs:
            counts[tuple(out)] = counts.get(tuple(out), 0) + 1
        for r in engine.finished.values():
            verified += sum(x.verified for x in r.stats.rounds)
            accepted += sum(x.accepted for x in r.stats.rounds)
    return counts, verified, accepted


@pytest.mark.parametrize("scheduler", sorted(SETTINGS))
def test_batched_sampling_matches_target(scheduler):
    counts, verified, accepted = sample_engine_counts(**SETTINGS[scheduler])
    if scheduler != "none":
        assert verified > 1000 and 0 < accepted < verified, "tokens under test must come from verified drafts"
    assert chi_square_pvalue(counts, exact_distribution(peaked_target()), sum(counts.values())) > 1e-3


def test_reduced_draft_vocabulary_in_the_engine():
    """Greedy rows equal plain greedy decoding and sampled rows follow the target with a draft vocabulary that
    misses tokens the target writes (token 2 of 4 here, odd ids of 96 for greedy)."""
    counts, verified, accepted = sample_engine_counts(draft_vocab_ids=torch.tensor([0, 1, 3]), **SETTINGS["fixed"])
    assert verified > 1000 and 0 < accepted < verified
    assert sum(c for k, c in counts.items() if 2 in k) > 0
    assert chi_square_pvalue(counts, exact_distribution(peaked_target()), sum(counts.values())) > 1e-3
    target = tiny_target("qwen3")
    drafter = tiny_drafter(target, draft_vocab_ids=torch.arange(0, 96, 2))
    engine = DSparkEngine(target, drafter, scheduler="fixed", num_verify=3)
    ps = prompts(96)
    outs = engine.generate(ps, max_new_tokens=12)
    assert outs == [plain_greedy(target, p, 12) for p in ps]
    assert sum(r.verified for req in engine.finished.values() for r in req.stats.rounds) > 0


def test_broken_acceptance_is_detected(monkeypatch):
    real = engine_module.verify_drafts

    def accept_all(target_logits, draft_logits, drafts, lengths, greedy):
        _, next_token = real(target_logits, draft_logits, drafts, lengths, torch.ones_like(greedy))
        return lengths.clone(), next_token

    monkeypatch.setattr(engine_module, "verify_drafts", accept_all)
    counts, *_ = sample_engine_counts(scheduler="fixed", num_verify=3)
    assert chi_square_pvalue(counts, exact_distribution(peaked_target()), sum(counts.values())) < 1e-3


def exact_processed_distribution(target, temperature, top_p, top_k=0):
    """``exact_distribution`` under Transformers' own warpers for these settings (the oracle is not our code)."""
    warpers = [TemperatureLogitsWarper(temperature)] if temperature != 1.0 else []
    warpers += [TopKLogitsWarper(top_k)] if top_k else []
    warpers += [TopPLogitsWarper(top_p)] if top_p < 1.0 else []
    return exact_distribution(target, processors=LogitsProcessorList(warpers))


def test_rows_with_different_temperature_top_k_and_top_p_follow_their_own_distribution():
    """Rows with different settings in one batch: each follows its own processed target distribution."""
    target = peaked_target()
    drafter = tiny_drafter(target, seed=7)
    torch.manual_seed(1)
    settings = [(0.5, 1.0, 0), (1.0, 1.0, 0), (1.0, 0.8, 0), (1.0, 1.0, 2)]
    counts = {s: {} for s in settings}
    for _ in range(150):
        engine = DSparkEngine(target, drafter, scheduler="fixed", num_verify=3)
        ids = {
            s: [engine.add_request(PROMPT[0].tolist(), max_new_tokens=NEW, temperature=s[0], top_p=s[1], top_k=s[2]) for _ in range(6)]
            for s in settings
        }
        while engine.has_work():
            engine.step()
        for s, rids in ids.items():
            for rid in rids:
                key = tuple(engine.finished[rid].output_ids)
                counts[s][key] = counts[s].get(key, 0) + 1
    for s, c in counts.items():
        assert chi_square_pvalue(c, exact_processed_distribution(target, *s), sum(c.values())) > 1e-3, f"T, top_p, top_k = {s}"
    # the settings really differ: top-p 0.8 and top-k 2 remove sequences that T=1 produces
    assert any(v == 0.0 for v in exact_processed_distribution(target, 1.0, 0.8).values())
    assert any(v == 0.0 for v in exact_processed_distribution(target, 1.0, 1.0, 2).values())


def test_requests_stop_where_plain_generate_stops():
    """Stop strings, custom criteria and stop token ids per request, firing inside accepted blocks."""
    from tiny_models import StopAfterTokens, StopAtLength, char_tokenizer
    from transformers import StoppingCriteriaList

    target = bigram_target()
    drafter = oracle_drafter(target)  # blocks of 4 accepted whole: new tokens 1-4 and 6-9 are drafts
    tok = char_tokenizer()
    ps = prompts(96)
    free = [plain_greedy(target, p, 40) for p in ps]
    assert free[1][:4] == [20, 69, 60, 30] and free[3][:4] == [46, 88, 20, 69] and len(set(free[4][:8])) == 8
    requests = [  # (prompt, add_request / generate() keywords); each stop first fires on a drafted token
        (ps[0], dict(stopping_criteria=[StopAtLength(len(ps[0]) + 10)])),
        (ps[1], dict(stopping_criteria=[StopAfterTokens(60, 30)])),
        (ps[4], dict(stop_strings=[tok.decode(free[4][5:7])], tokenizer=tok)),
        (ps[3], dict(eos_token_id=[69, 95])),
        (ps[2], {}),
    ]
    engine = DSparkEngine(target, drafter, scheduler="fixed")
    rids = [engine.add_request(p, max_new_tokens=40, **kw) for p, kw in requests]
    while engine.has_work():
        engine.step()
    for rid, (p, kw) in zip(rids, requests):
        gen_kw = {**kw, "stopping_criteria": StoppingCriteriaList(kw["stopping_criteria"])} if "stopping_criteria" in kw else kw
        ref = target.generate(torch.tensor([p]), do_sample=False, max_new_tokens=40, **gen_kw)[0, len(p) :].tolist()
        assert engine.finished[rid].output_ids == ref, kw
    cut_inside = 0
    for rid in rids[:4]:
        request = engine.finished[rid]
        assert len(request.output_ids) < 40, "the stop must fire before the token limit"
        *earlier, last = request.stats.rounds
        committed_last = len(request.output_ids) - 1 - sum(r.accepted + 1 for r in earlier)  # 1: the prefill's token
        cut_inside += committed_last < last.accepted + 1
    assert cut_inside >= 3, "the stops must fall inside accepted blocks"


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
    with pytest.raises(ValueError, match="top_k"):
        engine.add_request([1, 2], top_k=-1)
    with pytest.raises(ValueError, match="repetition_penalty=1.3 is not supported by DSparkEngine"):
        engine.add_request([1, 2], repetition_penalty=1.3)
    with pytest.raises(ValueError, match="tokenizer"):
        engine.add_request([1, 2], stop_strings=["x"])
    assert not engine.waiting


def test_a_draft_cost_table_is_keyed_by_the_drafting_code_and_mkl_path(monkeypatch):
    import inspect

    import generation.decoding.drafting as drafting
    from generation.scheduling.profiler import code_key, cost_table_path

    target = tiny_target()
    drafter = tiny_drafter(target)
    before = cost_table_path(target, 32, kind="draft", drafter=drafter)
    assert cost_table_path(target, 32, kind="draft", drafter=drafter) == before, "the same code: the same table"
    source = inspect.getsource

    def edited(obj):  # the drafting loop as if its source had changed
        return source(obj) + "\n# edited" if obj is drafting else source(obj)

    monkeypatch.setattr(inspect, "getsource", edited)
    assert cost_table_path(target, 32, kind="draft", drafter=drafter) != before
    monkeypatch.undo()
    monkeypatch.setenv("MKL_CBWR", "COMPATIBLE")  # another MKL path for the few-row products: another price
    assert cost_table_path(target, 32, kind="draft", drafter=drafter) != before
    assert code_key() == code_key(None) and len(code_key(drafter).split("|")) > 3, "versions and the profiler, then the drafter's modules"


def test_cost_tables_live_where_the_environment_says_and_the_suite_keeps_its_own(tmp_path, monkeypatch):
    import os

    from generation.scheduling.profiler import cost_table_path

    target = tiny_target()
    # tables timed beside other workers' tests must never price a user's later runs
    assert Path(os.environ["DSPARK_COST_CACHE"]) in cost_table_path(target, 32).parents
    assert Path.home() / ".cache" not in cost_table_path(target, 32).parents
    monkeypatch.delenv("DSPARK_COST_CACHE")
    monkeypatch.setenv("DSPARK_CACHE", str(tmp_path / "all"))
    assert cost_table_path(target, 32).parent == tmp_path / "all" / "sps"
    monkeypatch.setenv("DSPARK_COST_CACHE", str(tmp_path / "tables"))
    assert cost_table_path(target, 32).parent == tmp_path / "tables"


def test_profiler_measures_caches_and_the_load_benchmark_runs(tmp_path, monkeypatch):
    import json as _json

    from tiny_models import ByteChat

    from generation.evaluation.load_benchmark import run_load, write_load_report
    from generation.scheduling.profiler import cost_table_path, profile_draft_cost, profile_sps, profile_verify_cost

    monkeypatch.setenv("DSPARK_COST_CACHE", str(tmp_path / "cost_tables"))  # empty: the first calls profile
    target = tiny_target()
    cost = profile_sps(target, max_tokens=16, context_length=32, repeats=2, progress=False)
    assert cost.tokens == (1, 2, 3, 4, 6, 8, 12, 16) and all(s > 0 for s in cost.steps_per_second)
    drafter = tiny_drafter(target)
    verify = profile_verify_cost(target, rows=(1, 3), max_width=4, context_length=32, repeats=1, progress=False)
    assert verify.rows == (1, 3) and verify.widths == (1, 2, 3, 4) and verify.forward_seconds(2, 3) > 0
    draft = profile_draft_cost(target, drafter, rows=(1, 3), context_length=32, repeats=1, progress=False)
    assert draft.rows == (1, 3) and draft.max_depth == drafter.config.block_size and draft.draft_seconds(3, 1) > 0
    assert len(draft.context_seconds) == 2 and draft.draft_seconds(3, 1, context=66) >= draft.draft_seconds(3, 1)
    cached = profile_draft_cost(target, drafter, rows=(3,), context_length=32, progress=False)
    assert cached.seconds == draft.seconds[1:] and cached.context_seconds == draft.context_seconds[1:]  # from disk
    for kind, kw in (("verify-4d", {}), ("draft", {"drafter": drafter})):  # a CPU sdpa target: the 4-D mask
        assert cost_table_path(target, 32, kind=kind, **kw).is_file()
    assert profile_verify_cost(target, rows=(1,), max_width=2, context_length=32, progress=False).to_dict() == {
        1: {w: verify.to_dict()[1][w] for w in (1, 2)}
    }  # a subset of a cached table comes from disk
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
    methods = {
        "no speculation": {"scheduler": "none"},
        "fixed 3": {"scheduler": "fixed", "num_verify": 3},
        "algorithm 1, paper cost": {"scheduler": "algorithm1", "costs": "paper"},
        "algorithm 1": {"scheduler": "algorithm1", "costs": "engine"},
        "algorithm 1, cold": {"scheduler": "algorithm1", "costs": "engine", "warm": False},
    }
    results = run_load(target, drafter, ByteChat(96), concurrency=(1, 3), methods=methods, max_new_tokens=6,
                       cost_table=COST, verify_cost=verify, draft_cost=draft, eval_dir=eval_dir, progress=False,
                       warmup_tokens=3, repeats=2)  # fmt: skip
    assert results["warmup_tokens"] == 3 and set(results["methods"]["algorithm 1, cold"]) == {1, 3}
    assert all(len(row["tokens_per_s_runs"]) == 2 for rows in results["methods"].values() for row in rows.values())
    assert all(len(row["decode_tokens_per_s_runs"]) == 2 and min(row["decode_tokens_per_s_runs"]) > 0
               for rows in results["methods"].values() for row in rows.values())  # fmt: skip
    assert results["methods"]["no speculation"][3]["mean_budget_per_request"] == 0
    assert results["methods"]["fixed 3"][1]["mean_budget_per_request"] > 0
    fixed_depth = results["methods"]["fixed 3"][1]["mean_draft_depth"]
    assert 0 < fixed_depth <= 3  # fixed k drafts k slots, not the block (fewer when the token limit is close)
    assert results["methods"]["algorithm 1, paper cost"][1]["mean_draft_depth"] >= fixed_depth  # full blocks
    results["verify_cost_seconds"], results["draft_cost_seconds"] = verify.to_dict(), draft.to_dict()
    write_load_report(results, tmp_path / "out", COST, "test")
    report = (tmp_path / "out" / "load.md").read_text()
    assert "Mean slots drafted" in report
    plain_decode = [line for line in report.split("## Decode tokens / s")[1].splitlines() if line.startswith("| no speculation")]
    assert plain_decode and plain_decode[0].count("(1.000)") == 2  # each R's ratio to itself
    for name in ("load.md", "load.json", "load.png", "sps.png", "engine_costs.png"):
        assert (tmp_path / "out" / name).stat().st_size > 0


def test_depth_planned_from_earlier_steps_keeps_sampling_exact(monkeypatch):
    """The drafting depth (0 = skip the drafter) may depend on anything drafted in earlier steps, rejected drafts
    included, without biasing the output: an adversarial plan that hashes the previous survival into a depth."""
    depths = []

    def adversarial(estimates, cost, draft_cost, max_depth, **kwargs):
        depths.append(int(1000 * estimates[0][0]) % 3)
        return depths[-1]

    monkeypatch.setattr(depth_planner_module, "plan_draft_depth", adversarial)
    counts, verified, accepted = sample_engine_counts(**SETTINGS["algorithm1+draft cost"], adapt_costs=False)
    assert {0, 1, 2} <= set(depths), "the plan must really have varied, skips included"
    assert verified > 500 and 0 < accepted < verified
    assert chi_square_pvalue(counts, exact_distribution(peaked_target()), sum(counts.values())) > 1e-3


def run_engine(target, drafter, n=24, rows=4, **settings):
    engine = DSparkEngine(target, drafter, **settings)
    outs = engine.generate(prompts(target.config.vocab_size, lengths=(5, 8, 3, 11)[:rows]), max_new_tokens=n)
    return engine, outs


def test_draft_cost_decides_whether_and_how_deep_to_draft():
    target = bigram_target()
    drafter = oracle_drafter(target)  # every draft is the target's own choice
    with torch.no_grad():  # a constant confidence 0.8: survival 0.8, 0.64, 0.51, 0.41
        drafter.confidence_head.proj.weight.zero_()
        drafter.confidence_head.proj.bias.fill_(math.log(0.8 / 0.2))
    gamma = drafter.config.block_size
    plain = [plain_greedy(target, p, 24) for p in prompts(target.config.vocab_size, lengths=(5, 8, 3, 11))]

    def drafted(draft_cost, **kw):
        engine, outs = run_engine(
            target, drafter, scheduler="algorithm1", cost_table=PADDED, draft_cost=draft_cost, adapt_costs=False, **kw
        )
        assert outs == plain
        return [step["drafted"] for step in engine.step_log]

    # drafting is free and a wider verify forward costs little more: full blocks
    free = drafted(DraftCost.from_dict({4: [0.0] * gamma}))
    assert sum(d == gamma for d in free) >= len(free) - 2, free
    # a drafter call costs 100 target forwards: only the first step (nothing known yet) and the probes draft, one
    # slot each
    costly = drafted(DraftCost.from_dict({4: [1.0 * d for d in range(1, gamma + 1)]}), probe_interval=4)
    assert costly[0] == 1 and set(costly) == {0, 1} and sum(d > 0 for d in costly) <= 1 + len(costly) // 4, costly
    # a cost growing as D^2: the best depth is 2 (Theta 632 / 668 / 596 / 498 for D = 1..4 against 392 for D = 0)
    medium = drafted(DraftCost.from_dict({4: [0.001 * d * d for d in range(1, gamma + 1)]}))
    assert medium[0] == 1 and all(d <= 2 for d in medium[1:]) and sum(d == 2 for d in medium) >= len(medium) - 3, medium


def test_probes_wait_longer_when_the_drafter_has_more_to_read(monkeypatch):
    """A probe first reads every position the drafter missed, so its price, and its wait under the probe budget,
    grow with the longest row's unread context; the engine passes that on (the longest prompt after prefill, one
    position more per plain step), and the output is still the target's."""
    per_position = 0.001  # a tenth of a plain round per unread position
    catch_up = DraftCost.from_dict({4: [0.0] * 4}, {4: per_position})
    planner = depth_planner_module.DepthPlanner(PADDED, catch_up, 4, probe_interval=1, adapt_costs=False)
    plain = planner.modelled_seconds(4, 0, [0] * 4)
    base = planner.probe_price(4)
    assert base == pytest.approx(planner.modelled_seconds(4, 1, [1] * 4) / plain - 1)
    assert planner.probe_price(4, 52) == pytest.approx(base + 50 * per_position / plain)
    planner.mean_survival = [0.01, 0.001, 0.0, 0.0]  # the plan skips the drafter; only probes draft
    planner.rounds_since_draft = math.ceil(base / planner.PROBE_BUDGET)
    assert planner.plan([None] * 4) == 1  # due with two unread positions per row
    planner._probed = False
    assert planner.plan([None] * 4, context=52) == 0  # not yet with fifty more
    # a plan to draft pays the catch-up once, spread over the tokens the rows have left
    planner = depth_planner_module.DepthPlanner(PADDED, catch_up, 4, probe_interval=1000, adapt_costs=False)
    sure = [[0.9, 0.8, 0.7, 0.6]] * 4
    assert planner.plan(sure, context=52) == 4  # tokens left unbounded: the steady state decides
    assert planner.plan(sure, context=52, tokens_left=1000) == 4  # 50 ms over 4000 tokens
    assert planner.plan(sure, context=52, tokens_left=3) == 0  # 50 ms over 12 tokens: more than drafting saves
    assert planner.plan(sure, context=2, tokens_left=3) == 4  # nothing missed: nothing to pay

    target = bigram_target()
    drafter = oracle_drafter(target)
    contexts, left = [], []
    plan = depth_planner_module.DepthPlanner.plan

    def recording(self, estimates, context=DraftCost.BASE_CONTEXT, tokens_left=None):
        contexts.append(context)
        left.append(tokens_left)
        return plan(self, estimates, context, tokens_left)

    monkeypatch.setattr(depth_planner_module.DepthPlanner, "plan", recording)
    lengths = (5, 8, 3, 11)
    costly = DraftCost.from_dict({4: [1.0 * d for d in range(1, 5)]}, {4: per_position})
    engine, outs = run_engine(target, drafter, scheduler="algorithm1", cost_table=PADDED, draft_cost=costly, adapt_costs=False)
    assert outs == [plain_greedy(target, p, 24) for p in prompts(target.config.vocab_size, lengths=lengths)]
    drafted = [step["drafted"] for step in engine.step_log]
    assert contexts[0] == max(lengths) and drafted[0] == 1  # the first look reads the whole prompts
    assert left[0] == 23 and left[1] == pytest.approx(23 - engine.step_log[0]["committed"] / 4)  # mean tokens left
    plain_stretch = drafted[1:].index(1) if 1 in drafted[1:] else len(drafted) - 1
    assert plain_stretch >= 8 and all(b - a == 1 for a, b in zip(contexts[1:plain_stretch], contexts[2 : plain_stretch + 1]))


def test_engine_continues_from_another_engines_depth_planner():
    """A new engine given ``depth_planner=`` starts from what the earlier one measured: with a costly drafter it
    skips drafting from its first step instead of looking again, and its output is still the target's."""
    target = bigram_target()
    drafter = oracle_drafter(target)
    gamma = drafter.config.block_size
    costly = DraftCost.from_dict({4: [1.0 * d for d in range(1, gamma + 1)]})
    plain = [plain_greedy(target, p, 24) for p in prompts(target.config.vocab_size, lengths=(5, 8, 3, 11))]
    first, outs = run_engine(target, drafter, scheduler="algorithm1", cost_table=PADDED, draft_cost=costly, adapt_costs=False)
    assert outs == plain and first.step_log[0]["drafted"] == 1  # nothing known yet: a one-slot look
    second = DSparkEngine(target, drafter, scheduler="async", depth_planner=first.depth_planner)
    assert second.depth_planner is first.depth_planner and second.cost_table is PADDED and second.draft_cost is costly
    outs = second.generate(prompts(target.config.vocab_size, lengths=(5, 8, 3, 11)), max_new_tokens=24)
    assert outs == plain and second.step_log[0]["drafted"] == 0
    with pytest.raises(ValueError, match="must be a DepthPlanner"):
        DSparkEngine(target, drafter, scheduler="algorithm1", depth_planner=object())
    with pytest.raises(ValueError, match="not 'fixed'"):
        DSparkEngine(target, drafter, scheduler="fixed", depth_planner=first.depth_planner)
    with pytest.raises(ValueError, match="not both"):
        DSparkEngine(target, drafter, scheduler="algorithm1", cost_table=COST, depth_planner=first.depth_planner)
    other = tiny_target("qwen3")
    with pytest.raises(ValueError, match="measured on other models"):
        DSparkEngine(other, tiny_drafter(other), scheduler="algorithm1", depth_planner=first.depth_planner)
    with pytest.raises(ValueError, match="2-slot blocks"):
        planner = depth_planner_module.DepthPlanner(PADDED, DraftCost.from_dict({4: [0.0] * 2}), 2)
        DSparkEngine(target, drafter, scheduler="algorithm1", depth_planner=planner)


def test_engine_refuses_bad_cost_settings():
    target = tiny_target()
    drafter = tiny_drafter(target)
    with pytest.raises(ValueError, match="DraftCost"):
        DSparkEngine(target, drafter, scheduler="algorithm1", cost_table=COST, draft_cost={1: [0.1]})
    with pytest.raises(ValueError, match="covers 2 slots, the drafter drafts 4"):
        DSparkEngine(target, drafter, scheduler="algorithm1", cost_table=COST, draft_cost=DraftCost.from_dict({1: [0.1, 0.2]}))
    with pytest.raises(ValueError, match="probe_interval"):
        DSparkEngine(target, drafter, scheduler="algorithm1", cost_table=COST, draft_cost=DRAFT, probe_interval=0)


def test_measured_step_times_correct_the_cost_model():
    """The plan scales each depth's modelled step time by the measured ratio: a depth that turns out slower than
    its tables say is given up, whichever the tables preferred."""
    target = bigram_target()
    drafter = oracle_drafter(target)
    engine = DSparkEngine(target, drafter, scheduler="algorithm1", cost_table=PADDED, draft_cost=DraftCost.from_dict({4: [0.0] * 4}))
    planner = engine.depth_planner
    planner.record_round_time(4, 0, [0] * 4, 0.0102)  # plain steps: as modelled
    assert planner.cost_ratio[4, 0] == pytest.approx(1.0)
    planner.record_round_time(4, 1, [1] * 4, 1.0)  # the first drafted round pays one-off costs: not a price
    assert (4, 1) not in planner.cost_ratio and (4, True) not in planner.throughput_sums
    planner.record_round_time(3, 4, [4] * 3, 0.110)  # a full block took 10x its model (load level 4 covers R = 3)
    assert planner.cost_ratio[4, 4] == pytest.approx(10.0)
    planner.record_round_time(4, 4, [4] * 4, 0.011)
    assert planner.cost_ratio[4, 4] == pytest.approx(0.7 * 10 + 0.3 * 1.0)
    assert planner.scale(4, 2) == pytest.approx((1.0 + 7.3) / 2)  # an unseen depth: the level's mean ratio
    assert planner.scale(8, 1) == 1.0
    from generation.scheduling.scheduler import plan_draft_depth

    sure = [[0.9, 0.8, 0.7, 0.6]] * 4
    free = DraftCost.from_dict({4: [0.0] * 4})
    assert plan_draft_depth(sure, PADDED, free, 4) == 4
    assert plan_draft_depth(sure, PADDED, free, 4, cost_scale=lambda d: 1.0 if d == 0 else 5.0) == 0


def past_first_draft(planner):
    """The planner after its first drafted round, which it leaves untimed (one-off costs of the drafter's first call)."""
    planner.record_round_time(1, 1, [1], 1.0, committed=1)
    return planner


def test_a_plan_that_loses_in_fact_is_dropped():
    """Where the rounds that drafted have committed fewer tokens per second than the plain ones at the same load
    level, over enough rounds of each to tell, the planner skips the drafter there, whatever the tables favour, and
    drafts again once drafting measures ahead; other levels keep their own record, and ``adapt_costs=False`` keeps
    the tables' plan."""
    free = DraftCost.from_dict({4: [0.0] * 4})
    sure = [[0.9, 0.8, 0.7, 0.6]] * 4
    planner = past_first_draft(depth_planner_module.DepthPlanner(PADDED, free, 4, probe_interval=1000))
    plain_s, block_s = planner.modelled_seconds(4, 0, [0] * 4), planner.modelled_seconds(4, 4, [4] * 4)  # times as modelled
    need_drafted, need_plain = planner.EVIDENCE_ROUNDS[True], planner.EVIDENCE_ROUNDS[False]
    assert need_drafted > need_plain >= 1
    assert planner.plan(sure) == 0  # the first plan at a level measures a plain round
    for _ in range(need_plain):
        planner.record_round_time(4, 0, [0] * 4, plain_s, committed=4)
    assert planner.throughput(4, False) == pytest.approx(4 / plain_s)
    assert planner.plan(sure) == 4  # free drafting of sure blocks: the tables favour full blocks
    for _ in range(need_drafted - 1):  # ... which commit no more than a plain round, in more time
        planner.record_round_time(4, 4, [4] * 4, block_s, committed=4)
    assert planner.throughput(4, True) is None and planner.plan(sure) == 4  # too few rounds to tell yet
    planner.record_round_time(4, 4, [4] * 4, block_s, committed=4)
    assert planner.throughput(4, True) == pytest.approx(4 / block_s)
    assert planner.drafting_trails(4) and planner.plan(sure) == 0
    assert not planner.drafting_trails(8)
    assert planner.probe_wait == planner.probe_interval  # dropped on measured throughput: probes keep their pace
    planner.record_round_time(4, 4, [4] * 4, block_s, committed=120)  # a probe that paid, many times over
    decay = planner.THROUGHPUT_DECAY
    tokens = sum(4 * decay**k for k in range(1, need_drafted + 1)) + 120
    seconds = sum(block_s * decay**k for k in range(need_drafted + 1))
    assert planner.throughput(4, True) == pytest.approx(tokens / seconds)  # a ratio of decayed sums
    assert not planner.drafting_trails(4) and planner.plan(sure) == 4
    planner.record_round_time(4, 4, [4] * 4, block_s, committed=None)  # an n-gram round: not drafting's to count
    assert planner.throughput(4, True) == pytest.approx(tokens / seconds)
    fixed = depth_planner_module.DepthPlanner(PADDED, free, 4, probe_interval=1000, adapt_costs=False)
    for _ in range(need_drafted):
        fixed.record_round_time(4, 0, [0] * 4, plain_s, committed=4)
        fixed.record_round_time(4, 4, [4] * 4, block_s, committed=1)
    assert not fixed.drafting_trails(4) and fixed.plan(sure) == 4


def test_noisy_drafted_rounds_do_not_drop_a_plan_that_pays():
    """Drafted rounds at R = 1 commit 1 or 2 tokens; a run of unlucky rounds must not outweigh a measured gain
    (drafting 18 % ahead on average, as one-slot drafting measured at R = 1 on the shipped drafter)."""
    free = DraftCost.from_dict({4: [0.0] * 4})
    planner = past_first_draft(depth_planner_module.DepthPlanner(PADDED, free, 4, probe_interval=1000))
    plain_s = 0.040
    drafted_s = 0.040 * 1.44 / 1.18  # survival 0.44: 1.44 tokens per round, 18 % ahead of plain
    for _ in range(4):
        planner.record_round_time(1, 0, [0], plain_s, committed=1)
    rounds = [2 if k % 25 < 11 else 1 for k in range(100)]  # 44 % accepted, the accepted ones bunched
    dropped = 0
    for committed in rounds:
        planner.record_round_time(1, 1, [1], drafted_s, committed=committed)
        dropped += planner.drafting_trails(1)
    assert planner.throughput(1, True) > planner.throughput(1, False)
    assert dropped < len(rounds) // 4


def test_survival_is_scaled_slot_by_slot_by_what_the_verified_drafts_reached():
    """The planner scales each slot's calibrated survival by how often earlier verified rounds reached it over how
    often their survival promised it would, shrunk towards the slot before: no correction before anything is
    verified, decayed sums after, within bounds, the curve non-increasing; a slot never verified takes the factor
    of the slots before it; a drafter that promises more than it delivers loses the plan the tables gave its
    promise; ``correct_survival=False`` (or ``adapt_costs=False``) keeps the survival as calibrated."""
    free = DraftCost.from_dict({4: [0.0] * 4})
    steep = PaddedCostTable.from_dict({4: {w: 0.010 * (1 + 0.6 * (w - 1)) for w in range(1, 9)}})  # a verified draft costs 60 %
    sure = [[0.9, 0.8, 0.7, 0.6]] * 4
    planner = depth_planner_module.DepthPlanner(steep, free, 4, probe_interval=1000)
    assert planner.plan(sure) == 0  # the first plan at a level measures a plain round
    planner.record_round_time(4, 0, [0] * 4, planner.modelled_seconds(4, 0, [0] * 4), committed=4)
    assert planner.plan(sure) > 0 and planner.survival_scales == [1.0] * 4 and planner.corrected(sure) == sure
    planner.record_acceptance(sure, [0] * 4, [0] * 4)  # nothing verified: nothing learnt, nothing decayed
    assert planner.slot_sums == [[0.0, 0.0]] * 4
    for _ in range(5):  # 4 rows verify 2 drafts: the first always accepted, the second half the time
        planner.record_acceptance(sure, [2] * 4, [2, 1, 2, 1])
    decay, prior = planner.ACCEPTANCE_DECAY, planner.ACCEPTANCE_PRIOR
    weight = sum(decay**k for k in range(5))
    assert planner.slot_sums[0] == pytest.approx([4 * weight, 3.6 * weight])
    assert planner.slot_sums[1] == pytest.approx([2 * weight, 3.2 * weight]) and planner.slot_sums[2] == [0.0, 0.0]
    first = (4 * weight + prior) / (3.6 * weight + prior)
    second = (2 * weight + prior * first) / (3.2 * weight + prior)
    assert planner.survival_scales == pytest.approx([first, second, second, second])  # slots 3-4: never verified
    assert first > 1 > second
    assert planner.corrected(sure)[0] == pytest.approx([min(1.0, 0.9 * first), 0.8 * second, 0.7 * second, 0.6 * second])
    for _ in range(200):  # slot 2 stops being reached: at half its promise, a second draft slot no longer pays
        planner.record_acceptance(sure, [2] * 4, [1] * 4)
    assert planner.survival_scales[1] == planner.SURVIVAL_SCALE_BOUNDS[0]
    assert planner.plan(sure) == 1
    for _ in range(200):  # nothing accepted, for long: every factor stops at its lower bound
        planner.record_acceptance(sure, [4] * 4, [0] * 4)
    assert planner.survival_scales == [planner.SURVIVAL_SCALE_BOUNDS[0]] * 4
    assert planner.plan(sure) == 0
    timid = [[0.4, 0.2, 0.1, 0.05]] * 4
    for _ in range(200):  # everything accepted of drafts that promised little: capped survival, still non-increasing
        planner.record_acceptance(timid, [4] * 4, [4] * 4)
    high = planner.SURVIVAL_SCALE_BOUNDS[1]
    assert planner.survival_scales == [high] * 4
    assert planner.corrected(sure) == [[1.0, 1.0, 1.0, 1.0]] * 4
    assert planner.corrected([[0.9, 0.2, 0.3, 0.1]]) == [[1.0, 0.4, 0.4, 0.2]]  # never rising along the block
    for kw in ({"adapt_costs": False}, {"correct_survival": False}):
        fixed = depth_planner_module.DepthPlanner(steep, free, 4, probe_interval=1000, **kw)
        for _ in range(5):
            fixed.record_acceptance(sure, [4] * 4, [0] * 4)
        assert fixed.survival_scales == [1.0] * 4 and fixed.corrected(sure) == sure, kw


def test_unobserved_slots_continue_the_observed_acceptance():
    """Slots beyond those drafted continue at the last per-slot acceptance seen (geometric), not at the last
    slot's survival, so a one-slot probe at 0.5 does not promise 0.5 for slot 7; estimates blend that continuation into slots not
    seen this round."""
    assert depth_planner_module.extend_survival([0.5], 4) == [0.5, 0.25, 0.125, 0.0625]
    assert depth_planner_module.extend_survival([0.8, 0.4], 4) == [0.8, 0.4, 0.2, 0.1]
    assert depth_planner_module.extend_survival([0.8, 0.0], 3) == [0.8, 0.0, 0.0]
    assert depth_planner_module.extend_survival([0.9, 0.6, 0.3], 3) == [0.9, 0.6, 0.3]
    assert depth_planner_module.blend_survival(None, [0.5], 3) == [0.5, 0.25, 0.125]
    # an old tail moves towards the continuation of what is seen now, so it cannot stay low unseen
    assert depth_planner_module.blend_survival([0.6, 0.5, 0.4], [0.4], 3) == pytest.approx([0.5, 0.33, 0.232])
    assert depth_planner_module.blend_survival([0.8, 0.01, 0.0], [0.8], 3)[1] > 0.3


def test_small_steps_are_planned_over_the_recent_blocks_where_their_mean_would_not_draft(monkeypatch):
    """Half the blocks survive to the end, half die at slot 1. Priced as their mean (0.48, 0.45, ...), every depth
    loses to plain decoding, since the mean block pays the full width for half its tokens; Algorithm 1 cuts each
    block where it falls, so over the blocks themselves drafting (nearly) the full block pays. The plan reads the
    blocks once they hold 4 steps' worth; steps of several rows only where MAX_BLOCK_ROWS allows."""
    planner_type = depth_planner_module.DepthPlanner
    verify = PaddedCostTable.from_dict({1: {w: 1.0 + 0.5 * (w - 1) for w in range(1, 9)}})
    draft = DraftCost.from_dict({1: [0.1 + 0.01 * d for d in range(1, 8)]})
    planner = planner_type(verify, draft, 7, adapt_costs=False)
    good, bad = [0.95 ** (k + 1) for k in range(7)], [0.05 ** (k + 1) for k in range(7)]
    estimate = None
    for i in range(planner_type.MIN_BLOCKS - 1):
        estimate = planner.update_estimates([estimate], [good if i % 2 else bad])[0]
    mean = planner.mean_survival
    assert planner.plan([mean]) == 0, "too few blocks: the plan is the mean's"
    estimate = planner.update_estimates([estimate], [good])[0]
    depth = planner.plan([mean])
    assert depth >= 5 and depth == planner.plan_over_blocks(1, 1)
    assert planner.plan([mean, mean]) == 0, "two rows: planned on their estimates (MAX_BLOCK_ROWS)"
    monkeypatch.setattr(planner_type, "MAX_BLOCK_ROWS", 4)
    assert not planner.plans_over_blocks(2), "two rows need 8 blocks"
    from generation.scheduling.scheduler import plan_draft_depth

    assert plan_draft_depth([[0.5 * (g + b) for g, b in zip(good, bad)]], verify, draft, 7) == 0
    assert len(planner.recent_blocks) == 4 and all(len(b) == 7 for b in planner.recent_blocks)
    for i in range(4):  # two rows: a step is a run of two blocks, its cut Algorithm 1's on their sums per slot
        planner.update_estimates([estimate, estimate], [good, bad] if i % 2 else [bad, good])
    assert planner.plans_over_blocks(2) and planner.plan([mean, mean]) == planner.plan_over_blocks(2, 2) > 0
    flattened = planner_type(CostTable.from_dict({b: 1.0 for b in range(1, 17)}), draft, 7, adapt_costs=False)
    flattened.recent_blocks.extend([good] * planner_type.BLOCK_MEMORY)
    assert flattened.plans_over_blocks(1) and not flattened.plans_over_blocks(2), "several rows need a padded table"
    for _ in range(planner_type.BLOCK_MEMORY):  # the memory moves on: all bad now
        planner.update_estimates([estimate], [bad[:2]])
    assert planner.plan_over_blocks(1, 1) == 0


def test_engine_feeds_the_planner_the_drafts_it_verified(monkeypatch):
    """The engine reports every verified block's calibrated survival and accepted drafts to its planner: with
    undecayed sums each slot's sums are exactly the rounds that reached it and the survival they promised it,
    recomputed from the requests' own rounds. The oracle drafter's drafts are all accepted while its confidence
    promises 0.8 a slot, so the first slot's factor rises above 1, and the output is still the target's."""
    monkeypatch.setattr(depth_planner_module.DepthPlanner, "ACCEPTANCE_DECAY", 1.0)
    target = bigram_target()
    drafter = oracle_drafter(target)
    with torch.no_grad():
        drafter.confidence_head.proj.weight.zero_()
        drafter.confidence_head.proj.bias.fill_(math.log(0.8 / 0.2))
    free = DraftCost.from_dict({4: [0.0] * drafter.config.block_size})
    engine, outs = run_engine(target, drafter, scheduler="algorithm1", cost_table=PADDED, draft_cost=free)
    assert outs == [plain_greedy(target, p, 24) for p in prompts(target.config.vocab_size, lengths=(5, 8, 3, 11))]
    rounds = [x for r in engine.finished.values() for x in r.stats.rounds if x.verified]
    assert len(rounds) >= 8
    with torch.no_grad():
        expected = sum(drafter.survival(torch.tensor([x.confidence_logits])).sum().item() for x in rounds)
    accepted = sum(x.accepted for x in rounds)
    assert accepted == sum(x.verified for x in rounds)  # the oracle's drafts
    with torch.no_grad():
        per_slot = [drafter.survival(torch.tensor([x.confidence_logits]))[0].tolist() for x in rounds]
    sums = engine.depth_planner.slot_sums
    for k in range(drafter.config.block_size):
        reached = sum(x.accepted > k for x in rounds if x.verified > k)
        promised = sum(s[k] for s, x in zip(per_slot, rounds) if x.verified > k)
        assert sums[k] == pytest.approx([reached, promised])
    assert sum(s[0] for s in sums) == accepted and sum(s[1] for s in sums) == pytest.approx(expected)
    assert accepted > expected and engine.depth_planner.survival_scales[0] > 1


@pytest.mark.parametrize("scheduler", ["fixed", "threshold", "algorithm1+draft cost"])
def test_hybrid_rows_greedy_equal_plain_and_batched_equals_singleton(scheduler):
    target = tiny_target("qwen3")
    drafter = tiny_drafter(target)
    ps = [p * 3 for p in prompts(96, lengths=(3, 5, 4))] + prompts(96, lengths=(9, 12))  # repeated text: n-gram matches
    budgets = [20, 14, 25, 9, 17]
    engine = DSparkEngine(target, drafter, prompt_lookup_num_tokens=6, **SETTINGS[scheduler])
    ids = [engine.add_request(p, max_new_tokens=n) for p, n in zip(ps, budgets)]
    while engine.has_work():
        engine.step()
    kinds = {}
    for rid, p, n in zip(ids, ps, budgets):
        request = engine.finished[rid]
        assert request.output_ids == plain_greedy(target, p, n), f"request {rid} ({scheduler})"
        for r in request.stats.rounds:
            kinds[r.proposal] = kinds.get(r.proposal, 0) + (r.verified > 0)
            assert r.accepted <= r.verified
    assert kinds.get("ngram", 0) > 0 and kinds.get("dspark", 0) > 0, kinds
    single = DSparkEngine(target, drafter, prompt_lookup_num_tokens=6, **SETTINGS[scheduler])
    assert [single.generate([p], max_new_tokens=n)[0] for p, n in zip(ps, budgets)] == [engine.finished[i].output_ids for i in ids]


def test_hybrid_rows_sampling_matches_target():
    target = peaked_target()
    drafter = tiny_drafter(target, seed=7)
    torch.manual_seed(0)
    counts, verified, accepted = {}, {"ngram": 0, "dspark": 0}, {"ngram": 0, "dspark": 0}
    for _ in range(200):
        engine = DSparkEngine(target, drafter, prompt_lookup_num_tokens=3, **SETTINGS["fixed"])
        for out in engine.generate([PROMPT[0].tolist()] * 10, max_new_tokens=NEW, temperature=1.0):
            counts[tuple(out)] = counts.get(tuple(out), 0) + 1
        for request in engine.finished.values():
            for r in request.stats.rounds:
                if r.proposal in verified:
                    verified[r.proposal] += r.verified
                    accepted[r.proposal] += r.accepted
    for kind in verified:  # both proposals verified, accepted and rejected
        assert verified[kind] > 300 and 0 < accepted[kind] < verified[kind], (verified, accepted)
    assert chi_square_pvalue(counts, exact_distribution(target), sum(counts.values())) > 1e-3


def test_hybrid_rows_price_the_block_on_the_corrected_survival():
    """The engine's n-gram-or-block choice reads the block's survival scaled as the scheduler scales it: a block of
    2 slots at survival 1 beats a prompt-lookup continuation worth about one token, the same block at a quarter of
    its promised survival does not."""
    target = tiny_target("qwen3")
    drafter = tiny_drafter(target)
    engine = DSparkEngine(target, drafter, prompt_lookup_num_tokens=6, **SETTINGS["algorithm1+draft cost"])
    engine.add_request(prompts(96, lengths=(4,))[0] * 3, max_new_tokens=20)
    engine.step()
    request = engine.active[0]
    request.output_ids = request.output_ids + request.prompt_ids[:2]  # the choice reads only the text: now it repeats
    request.survival_estimate = [1.0] * drafter.config.block_size
    sure = torch.full((1, 2), 20.0)  # c_1 = 1 after any calibration
    assert engine._ngram_rows([request], [10], [2], sure) == {}
    # a quarter of what the survival promised was reached, at every slot
    engine.depth_planner.slot_sums = [[1000.0, 4000.0] for _ in range(drafter.config.block_size)]
    assert engine.depth_planner.survival_scales == pytest.approx([0.25] * drafter.config.block_size, rel=1e-2)
    assert list(engine._ngram_rows([request], [10], [2], sure)) == [0]


def test_hybrid_engine_settings_are_checked():
    target = tiny_target()
    with pytest.raises(ValueError, match="needs a drafter"):
        DSparkEngine(target, None, scheduler="none", prompt_lookup_num_tokens=4)
    with pytest.raises(ValueError, match="positive integers"):
        DSparkEngine(target, tiny_drafter(target), scheduler="fixed", prompt_lookup_num_tokens=0)
