"""Response files survive stopped runs: a gzip member cut mid-write, with a later run's members appended after it,
loses only the line being written, and the generator rewrites such a file before appending."""

import gzip
import json
import zlib

from modeling_dspark.training.data import _read_response_lines, read_responses, write_responses


def row(i: int) -> dict:
    return {"id": f"p{i}", "domain": "math", "prompt_ids": [1, 2], "response_ids": list(range(i, i + 40)), "finished": True}


def member(rows, cut: int | None = None) -> bytes:
    text = "".join(json.dumps(r) + "\n" for r in rows).encode()
    whole = gzip.compress(text)
    if cut is None:
        return whole
    # what a killed writer leaves: the header and the deflate stream flushed so far, without its end
    compressor = zlib.compressobj(9, zlib.DEFLATED, 31)
    flushed = compressor.compress(text[:cut]) + compressor.flush(zlib.Z_SYNC_FLUSH)
    return flushed


def test_a_member_cut_mid_write_with_members_after_it_keeps_every_whole_line(tmp_path):
    path = tmp_path / "responses.jsonl.gz"
    first, cut_rows, later = [row(0), row(1)], [row(2), row(3)], [row(4), row(5)]
    partial = len(json.dumps(cut_rows[0])) + 1 + 20  # row 2 whole, row 3 cut in the middle
    path.write_bytes(member(first) + member(cut_rows, cut=partial) + member(later))
    try:  # what a plain gzip reader makes of it
        gzip.decompress(path.read_bytes())
        plain_fails = False
    except (EOFError, zlib.error, gzip.BadGzipFile):
        plain_fails = True
    assert plain_fails
    rows, whole = _read_response_lines(path)
    assert [r["id"] for r in rows] == ["p0", "p1", "p2", "p4", "p5"] and not whole
    assert read_responses(path) == rows
    write_responses(path, rows)
    assert _read_response_lines(path) == (rows, True)
    assert len(gzip.decompress(path.read_bytes()).splitlines()) == 5  # one whole member now


def test_a_truncated_last_member_and_plain_jsonl(tmp_path):
    path = tmp_path / "responses.jsonl.gz"
    path.write_bytes(member([row(0), row(1)]) + member([row(2)], cut=10))
    assert [r["id"] for r in read_responses(path)] == ["p0", "p1"]
    plain = tmp_path / "responses.jsonl"
    plain.write_text(json.dumps(row(0)) + "\n" + json.dumps(row(1))[:30])
    assert _read_response_lines(plain) == ([row(0)], False)
    assert read_responses(tmp_path / "missing.jsonl.gz") == []


def test_the_data_command_samples_at_the_temperature_asked_and_refuses_a_bad_one(tmp_path, monkeypatch):
    import pytest

    import modeling_dspark
    from modeling_dspark.training import data

    out = str(tmp_path / "r.jsonl.gz")
    for flag, value in (("--temperature", "0"), ("--top-p", "1.5")):
        with pytest.raises(SystemExit, match=flag):
            data.main(["--out", out, flag, value])  # before the target is loaded
    used = {}
    monkeypatch.setattr(modeling_dspark, "load_target", lambda name: (None, None))
    monkeypatch.setattr(data, "load_prompts", lambda *a, **k: [])
    monkeypatch.setattr(data, "regenerate_responses", lambda *a, sampling, **k: used.update(sampling) or 0)
    data.main(["--out", out, "--temperature", "1.0", "--top-p", "1.0"])
    assert used == {**data.SAMPLING["smollm2-135m-instruct"], "temperature": 1.0, "top_p": 1.0}
    data.main(["--out", out])
    assert used == data.SAMPLING["smollm2-135m-instruct"]


def test_the_data_command_can_regenerate_the_held_out_prompts_only(tmp_path, monkeypatch):
    import pytest

    import modeling_dspark
    from modeling_dspark.training import data

    rows = [{"id": f"p{i}", "domain": "math", "prompt_ids": [1], "response_ids": [2, 3]} for i in range(400)]
    source = tmp_path / "train.jsonl.gz"
    write_responses(source, rows)
    held = {row["id"] for row in data.split_holdout(rows)[1]}
    assert 5 <= len(held) < 60
    out = str(tmp_path / "r.jsonl.gz")
    with pytest.raises(SystemExit, match="--held-out-of: no such file"):
        data.main(["--out", out, "--held-out-of", str(tmp_path / "missing.jsonl")])
    asked = []
    monkeypatch.setattr(modeling_dspark, "load_target", lambda name: (None, None))
    every = [{"id": f"p{i}", "prompt": "q", "domain": "math"} for i in range(500)]
    monkeypatch.setattr(data, "load_prompts", lambda *a, **k: every)
    monkeypatch.setattr(data, "regenerate_responses", lambda target, tok, prompts, *a, **k: asked.extend(p["id"] for p in prompts) or 0)
    data.main(["--out", out, "--held-out-of", str(source), "--domains", "math", "--num-prompts", "1000"])
    assert set(asked) == held and len(asked) == len(held)
    asked.clear()
    data.main(["--out", out, "--held-out-of", str(source), "--domains", "math", "--num-prompts", "3"])
    assert len(asked) == 3 and set(asked) <= held


def test_the_training_mixture_repeats_a_file_without_leaking_its_held_out_prompts(tmp_path, monkeypatch):
    import pytest

    import modeling_dspark
    from modeling_dspark.training import train
    from modeling_dspark.training.data import split_holdout

    big = [row(i) for i in range(300)]
    small = [{**row(i), "id": f"t1-{i}"} for i in range(200)]
    train_rows, held_out, prompts = train.training_mixture([big, small], [1, 3])
    joined_train, joined_held = split_holdout(big + small)
    assert held_out == joined_held and joined_held  # per-file splitting is the joined split
    assert prompts == len(joined_train)
    counts = {}
    for r in train_rows:
        counts[r["id"]] = counts.get(r["id"], 0) + 1
    assert {counts[r["id"]] for r in joined_train if r in big} == {1}
    assert {counts[r["id"]] for r in joined_train if r in small} == {3}
    assert not {r["id"] for r in held_out} & counts.keys()

    # a count per file, each at least 1, is checked before the target loads
    monkeypatch.setattr(modeling_dspark, "load_target", lambda *a, **k: pytest.fail("loaded the target"))
    for bad in (["1"], ["1", "0"], ["1", "2", "3"]):
        with pytest.raises(SystemExit):
            train.main(["--data", "a.jsonl", "b.jsonl", "--repeat", *bad, "--output-dir", str(tmp_path)])
