"""tools/pytest_shard.py (the shard, resume and record options) and tools/gpu_suite.py's
refusals and summary, on the CPU: a small generated suite run in subprocesses."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ROOT / "tools"
sys.path.insert(0, str(TOOLS))
import gpu_suite  # noqa: E402
import pytest_shard  # noqa: E402

SUITE = '''
import pytest

@pytest.mark.parametrize("i", range(23))
def test_many(i):
    assert i != 17

def test_skips():
    pytest.skip("not here")
'''


def _run(tmp_path, *args):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TOOLS), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-m", "pytest", "test_suite.py", "-p", "pytest_shard", "-p",
                           "no:cacheprovider", "-q", *args], cwd=tmp_path, env=env, capture_output=True, text=True)


@pytest.fixture
def suite(tmp_path):
    (tmp_path / "test_suite.py").write_text(SUITE)
    return tmp_path


def test_shards_are_disjoint_and_cover_the_suite(suite):
    seen = []
    for i in range(3):
        rec = suite / f"rec{i}.txt"
        _run(suite, "--shard", f"{i}/3", "--record", str(rec))
        seen += list(pytest_shard.read_record(rec)) if rec.exists() else []
    assert len(seen) == len(set(seen)) == 24
    out = pytest_shard.read_record(suite / "rec0.txt") | pytest_shard.read_record(suite / "rec1.txt") \
        | pytest_shard.read_record(suite / "rec2.txt")
    assert out["test_suite.py::test_many[17]"] == "failed"
    assert out["test_suite.py::test_skips"] == "skipped"
    assert sum(v == "passed" for v in out.values()) == 22


def test_a_resumed_run_runs_only_what_did_not_pass(suite):
    rec = suite / "rec.txt"
    first = _run(suite, "--record", str(rec))
    assert first.returncode == 1 and len(pytest_shard.read_record(rec)) == 24
    again = _run(suite, "--record", str(rec), "--skip-done", str(rec))
    assert "1 failed" in again.stdout and "23 deselected" in again.stdout, again.stdout
    assert rec.read_text().count("failed test_suite.py::test_many[17]") == 2


def test_a_bad_shard_is_a_usage_error(suite):
    for bad in ("3/3", "1", "a/b", "-1/2"):
        r = _run(suite, "--shard", bad)
        assert r.returncode == 4 and "--shard" in r.stderr, (bad, r.stderr)


def test_the_runner_refuses_bad_arguments(tmp_path, capsys):
    afile = tmp_path / "file"
    afile.write_text("")
    for argv, words in ((["--out", str(afile), "--gpus", "1"], "not a folder"),
                        (["--out", str(tmp_path / "o"), "--gpus", "0"], "no GPU"),
                        (["--out", str(tmp_path / "o"), "--workers", "0"], "--workers"),
                        (["--out", str(tmp_path / "o"), "--deadline", "0"], "--deadline")):
        with pytest.raises(SystemExit) as e:
            gpu_suite.main(argv)
        assert e.value.code == 2
        assert words in capsys.readouterr().err
    assert afile.read_text() == "" and not (tmp_path / "o").exists()


def test_the_summary_counts_each_collected_test_once(tmp_path):
    rec = tmp_path / "record.txt"
    rec.write_text("failed tests/a.py::t1\npassed tests/a.py::t1\npassed tests/a.py::t2\nerror tests/b.py::t3\n"
                   "skipped tests/b.py::t4\npassed tests/gone.py::t9\n")
    collected = gpu_suite.collected_ids("tests/a.py::t1\ntests/a.py::t2\ntests/b.py::t3\ntests/b.py::t4\n"
                                        "tests/b.py::t5\n\n5 tests collected in 1.0s\n")
    s = gpu_suite.summarize(rec, collected)
    assert (s["collected"], s["passed"], s["failed"], s["error"], s["skipped"], s["not_run"]) == (5, 2, 0, 1, 1, 1)
    assert s["failed_tests"] == ["tests/b.py::t3"] and s["not_run_tests"] == ["tests/b.py::t5"]
    json.dumps(s)


def test_the_shard_commands(tmp_path):
    rec = tmp_path / "record.txt"
    cmd = gpu_suite.pytest_command(gpu_suite.MARK, rec, ["-x"], "1/4", 3, resume=True)
    assert cmd[cmd.index("gpu and not multigpu") - 1] == "-m" and cmd[cmd.index("--shard") + 1] == "1/4"
    assert cmd[cmd.index("-n") + 1] == "3" and cmd[-1] == "-x"
    assert "--skip-done" not in cmd               # (nothing recorded yet)
    rec.write_text("")
    cmd = gpu_suite.pytest_command(gpu_suite.MULTI_MARK, rec, [], None, 1, resume=True)
    assert "--skip-done" in cmd and "--shard" not in cmd and "-n" not in cmd
    env = gpu_suite.child_env("2", 5)
    assert env["CUDA_VISIBLE_DEVICES"] == "2" and env["OMP_NUM_THREADS"] == "5"
    assert str(TOOLS) in env["PYTHONPATH"].split(os.pathsep)


def test_under_xdist_only_the_controller_records(suite):
    pytest.importorskip("xdist")
    rec = suite / "rec.txt"
    _run(suite, "-n", "2", "--record", str(rec), "--shard", "0/1")
    assert len(rec.read_text().splitlines()) == 24
