"""The plan cache: a relaunch with the same graph, cluster, mesh, batch and options reuses the plan
(and says so); any of them changed plans again; a damaged file is planned over."""

import json

import pytest

from autopar.cli import main


@pytest.fixture
def cache(tmp_path, monkeypatch):
    where = tmp_path / "plans"
    monkeypatch.setenv("AUTOPAR_PLAN_CACHE", str(where))
    return where


def _plan(capsys, *argv):
    assert main(["plan", "gpt-tiny", "--cluster", "a100-dgx", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_a_relaunch_reuses_the_plan_and_says_so(capsys, cache):
    first = _plan(capsys, "--mesh", "1x4")
    assert "cached" not in first["search"] and len(list(cache.iterdir())) == 1
    again = _plan(capsys, "--mesh", "1x4")
    kept = next(cache.iterdir())
    assert again["search"].pop("cached") == str(kept)
    strip = {"planning_time_s"}
    assert {k: v for k, v in again.items() if k not in strip} == {k: v for k, v in first.items() if k not in strip}
    assert main(["plan", "gpt-tiny", "--cluster", "a100-dgx", "--mesh", "1x4"]) == 0
    said = capsys.readouterr().out
    assert "reusing the plan cached at" in said and "AUTOPAR_PLAN_CACHE=off" in said and "planned in" not in said


@pytest.mark.parametrize("other", [("--mesh", "1x2"), ("--mesh", "1x4", "--batch", "16"),
                                   ("--mesh", "1x4", "--memory-limit", "0.5"), ("--mesh", "1x4", "--manual", "1,4,1"),
                                   ("--mesh", "1x4", "--manual", "1,2,2"), ("--mesh", "1x4", "--stages", "2"),
                                   ("--mesh", "1x4", "--mixed-precision", "bf16")])
def test_a_changed_request_plans_again(capsys, cache, other):
    _plan(capsys, "--mesh", "1x4")
    changed = _plan(capsys, *other)
    assert "cached" not in changed["search"] and len(list(cache.iterdir())) == 2
    assert "cached" in _plan(capsys, *other)["search"]  # and is kept in turn


def test_another_cluster_plans_again(capsys, cache):
    _plan(capsys, "--mesh", "1x4")
    assert main(["plan", "gpt-tiny", "--cluster", "v100-p3", "--mesh", "1x4", "--json"]) == 0
    assert "cached" not in json.loads(capsys.readouterr().out)["search"]


def test_a_damaged_plan_file_is_planned_over(capsys, cache, caplog):
    first = _plan(capsys, "--mesh", "1x4")
    kept = next(cache.iterdir())
    kept.write_text("{ not json")
    again = _plan(capsys, "--mesh", "1x4")
    assert "cached" not in again["search"] and again["estimate"] == first["estimate"]
    assert "cannot be read" in caplog.text
    assert json.loads(kept.read_text())["estimate"] == first["estimate"]


def test_off_plans_every_time(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("AUTOPAR_PLAN_CACHE", "off")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    for _ in range(2):
        assert "cached" not in _plan(capsys, "--mesh", "1x4")["search"]
    assert not any(tmp_path.iterdir())


def test_writers_of_one_file_at_once_each_leave_a_whole_one(tmp_path):
    """Two launches filling the cache at once write the same file: each through its own temporary
    file, so every rename succeeds, the file is one writer's whole, and nothing is left beside it."""
    import multiprocessing

    from autopar.contract.jsonio import read_json

    target = tmp_path / "plan.json"
    procs = [multiprocessing.get_context("fork").Process(target=_write_many, args=(target, i)) for i in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    assert [p.exitcode for p in procs] == [0] * 4
    assert read_json(target, "plan file")["writer"] in range(4)
    assert [f.name for f in tmp_path.iterdir()] == ["plan.json"]


def _write_many(target, writer):
    from autopar.contract.jsonio import write_json

    for i in range(200):
        write_json(target, {"writer": writer, "i": i, "pad": "x" * 4096})
