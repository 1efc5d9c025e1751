"""The command line behaves like a Unix tool: exit status 0 / 1 / 2 (and 130 on SIGINT, 141 on a
closed stdout), errors on one line of stderr, tracebacks only with --debug; and the package
never imports its command line."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mixgemm.cli import main as cli
from mixgemm.cli.main import main
from mixgemm.errors import BuildError

ROOT = Path(__file__).resolve().parents[2]


def run(capsys, *argv):
    rc = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def env_with_checkout(**extra):
    env = dict(os.environ, PYTHONPATH=str(ROOT / "python") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.update(extra)
    return env


# ------------------------------------------------------------------------------ broken pipe

def test_list_into_a_closed_pipe(tmp_path, pin_case):
    """`mixgemm generate --list | head`: the reader is gone before the writer writes. Exit
    status 141 (128 + SIGPIPE, as the shell reports for a tool killed by SIGPIPE), nothing on
    stderr (no BrokenPipeError traceback, no 'Exception ignored' at exit)."""
    proc = subprocess.Popen([sys.executable, "-m", "mixgemm", "generate", "--list"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env_with_checkout(), cwd=tmp_path)
    proc.stdout.close()                     # like `head` exiting before the first line arrives
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 128 + signal.SIGPIPE == cli.EXIT_BROKEN_PIPE
    assert err == ""
    pin_case("Command line", "stdout closed early (a broken pipe)", "mixgemm generate --list | head",
             "exit 141", "(nothing on stderr)")


def test_list_piped_into_head(tmp_path):
    """The real pipeline: head gets the first name; no traceback either way."""
    script = (f"set -o pipefail; '{sys.executable}' -m mixgemm generate --list | head -n 1; "
              "echo \"status=${PIPESTATUS[0]}\"")
    res = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=env_with_checkout(),
                         cwd=tmp_path, timeout=120)
    first, status = res.stdout.splitlines()
    assert first.startswith("mixgemm_") and status in ("status=0", "status=141")
    assert "Traceback" not in res.stderr and "BrokenPipe" not in res.stderr and res.stderr == ""


# ------------------------------------------------------------------------------ exit statuses

@pytest.mark.parametrize("command", list(cli.SUBCOMMANDS))
def test_every_subcommand_has_one_line_usage_errors(capsys, command, pin_case):
    rc, out, err = run(capsys, command, "--no-such-option")
    assert rc == 2 and out == ""
    (line,) = err.splitlines()
    assert line.startswith(f"mixgemm {command}: error: ") and line.endswith(f"(see `mixgemm {command} --help`)")
    # (prepack first misses its required arguments)
    assert "unrecognized arguments: --no-such-option" in line or "required" in line
    pin_case("Command line", "an unknown option", f"mixgemm {command} --no-such-option", "exit 2", line)


@pytest.mark.parametrize("command", list(cli.SUBCOMMANDS))
def test_every_subcommand_has_help(capsys, command):
    rc, out, err = run(capsys, command, "--help")
    assert rc == 0 and out.startswith(f"usage: mixgemm {command}") and err == ""


def test_no_command(capsys):
    rc, out, err = run(capsys)
    assert rc == 2 and out == ""
    assert err.splitlines() == ["mixgemm: error: a command is required: prepack, demo, generate, bench, doctor, "
                                "cache (see `mixgemm --help`)"]


def test_reported_errors_of_each_subcommand(capsys, tmp_path, monkeypatch):
    """Exit status 1 and one line: one reported error per subcommand, on this CPU machine."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cases = {
        "prepack": ["prepack", tmp_path / "none.safetensors", "-o", tmp_path / "o.safetensors", "--bits", "4",
                    "--group-size", "64"],
        "demo": ["demo", "--group-size", "96"],                  # does not divide K = 4096
        "generate": ["generate", "--list", "--kernels", "no_such_kernel"],
        "bench": ["bench"],                                      # needs a GPU
        "doctor": ["doctor", "--no-kernel"],                     # no GPU: the GEMM path cannot work
        "cache": ["cache", "import", tmp_path / "none.tgz"],
    }
    assert set(cases) == set(cli.SUBCOMMANDS)
    for command, argv in cases.items():
        rc, out, err = run(capsys, *argv)
        assert rc == 1, (command, err)
        if command == "doctor":          # a report on stdout, not an error message
            assert err == "" and "FAIL" in out
            continue
        assert len(err.splitlines()) == 1 and err.startswith(f"mixgemm {command}: error: "), (command, err)


def test_success_is_zero(capsys, tmp_path):
    rc, out, err = run(capsys, "generate", "--out", tmp_path / "src", "--kernels", "dequant_bf16_u4$")
    assert rc == 0 and out == f"wrote 1 kernel sources to {tmp_path / 'src'}/\n" and err == ""
    assert os.listdir(tmp_path / "src") == ["mixgemm_dequant_bf16_u4.cu"]


# ------------------------------------------------------------------------------ --debug

def test_debug_prints_the_traceback(capsys, tmp_path):
    argv = ["prepack", tmp_path / "none.safetensors", "-o", tmp_path / "o.safetensors", "--bits", "4",
            "--group-size", "64"]
    rc, _, err = run(capsys, *argv)
    assert rc == 1 and len(err.splitlines()) == 1 and "Traceback" not in err
    rc, _, err = run(capsys, "--debug", *argv)
    assert rc == 1 and err.startswith("Traceback (most recent call last):")
    assert err.splitlines()[-1] == f"mixgemm prepack: error: {tmp_path / 'none.safetensors'}: no such file"


def test_a_long_message_is_one_line_unless_debug(capsys, monkeypatch):
    """A build failure carries the compiler's output: the first line only, and a pointer to
    --debug, which prints all of it."""
    from mixgemm.jit import build

    def fail(specs, **kw):
        raise BuildError("1 of 1 kernels failed to build:\n\nnvcc failed (2) building kernel.cubin\nerror: x")
    monkeypatch.setattr(build, "build_many", fail)
    rc, _, err = run(capsys, "generate", "--build", "--kernels", "dequant_bf16_u4$")
    assert rc == 1
    assert err.splitlines() == ["mixgemm generate: error: 1 of 1 kernels failed to build: "
                                "(`mixgemm --debug generate ...` prints the whole message)"]
    rc, _, err = run(capsys, "--debug", "generate", "--build", "--kernels", "dequant_bf16_u4$")
    assert rc == 1 and "Traceback" in err and "error: x" in err


def test_a_bug_is_one_line_unless_debug(capsys, monkeypatch, pin_case):
    from mixgemm.cli import demo

    def boom(*a, **k):
        return 1 / 0
    monkeypatch.setattr(demo, "run", boom)
    rc, _, err = run(capsys, "demo")
    assert rc == 1
    assert err.splitlines() == ["mixgemm demo: internal error: ZeroDivisionError: division by zero (a bug in "
                                "mixgemm: `mixgemm --debug demo ...` prints the traceback; please report it)"]
    pin_case("Command line", "an unexpected exception (a bug)", "mixgemm demo (with a bug)", "exit 1",
             err.splitlines()[0])
    rc, _, err = run(capsys, "--debug", "demo")
    assert rc == 1 and "Traceback" in err and "1 / 0" in err


def test_an_os_error_is_a_reported_error(capsys, tmp_path, monkeypatch):
    import errno

    def denied(src, dst):
        raise PermissionError(errno.EACCES, "Permission denied", str(dst))
    monkeypatch.setattr(os, "replace", denied)
    out = tmp_path / "src"
    rc, _, err = run(capsys, "generate", "--out", out, "--kernels", "dequant_bf16_u4$")
    assert rc == 1 and len(err.splitlines()) == 1
    assert re.fullmatch(rf"mixgemm generate: error: {re.escape(str(out))}/\S+\.cu: Permission denied\n", err)
    assert os.listdir(out) == [], "no temporary left"


def test_keyboard_interrupt(capsys, monkeypatch, pin_case):
    from mixgemm.cli import demo

    def interrupted(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(demo, "run", interrupted)
    rc, _, err = run(capsys, "demo")
    assert rc == 130 == cli.EXIT_INTERRUPTED and err == "mixgemm demo: interrupted\n"
    pin_case("Command line", "KeyboardInterrupt in any command", "mixgemm demo (Ctrl-C)", "exit 130",
             err.splitlines()[0])


# ------------------------------------------------------------------------------ dependencies

def test_the_package_never_imports_its_command_line(tmp_path):
    """Importing any module of the package (all but the command line, mixgemm.cli.*, and the
    ``__main__`` modules, which run their command when imported) leaves mixgemm.cli.main out of sys.modules: dependencies
    point from the command line to the package."""
    code = """if True:
        import importlib, json, pkgutil, sys
        import mixgemm
        bad = {}
        names = sorted(m.name for m in pkgutil.walk_packages(mixgemm.__path__, "mixgemm."))
        for name in names:
            if name.startswith("mixgemm.cli.") or name.rsplit(".", 1)[-1] == "__main__":
                continue
            importlib.import_module(name)
            if "mixgemm.cli.main" in sys.modules:
                bad[name] = True
                del sys.modules["mixgemm.cli.main"]
        print(json.dumps({"modules": names, "import_the_cli": sorted(bad)}))
    """
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env_with_checkout(),
                         cwd=tmp_path, timeout=300)
    assert res.returncode == 0, res.stderr
    import json
    report = json.loads(res.stdout.splitlines()[-1])
    assert {"mixgemm.cli.doctor", "mixgemm.cli.demo", "mixgemm.jit.build", "mixgemm.ops.dense", "mixgemm.weights.io",
            "mixgemm.bench.model", "mixgemm.dispatch.plans"} <= set(report["modules"])
    assert report["import_the_cli"] == []


def test_public_subpackages_load_on_first_attribute_access(tmp_path):
    """``import mixgemm`` alone does not load mixgemm.nn / moe / formats / hf, and the first
    ``mixgemm.<name>`` loads it (PEP 562), as users write ``mixgemm.nn.QuantLinear`` without
    importing the subpackage; a misspelt name is an AttributeError, and the CLI stays unloaded."""
    code = """if True:
        import json, sys
        import mixgemm
        lazy = sorted(mixgemm._LAZY_SUBMODULES)
        before = {n: f"mixgemm.{n}" in sys.modules for n in ("nn", "moe", "formats", "hf")}
        found = {n: getattr(mixgemm, n).__name__ for n in lazy}
        names = [mixgemm.nn.QuantLinear.__name__, mixgemm.moe.fused_moe.__name__,
                 mixgemm.formats.from_awq.__name__, mixgemm.nn.QuantMoE.__name__,
                 mixgemm.nn.QuantMoE is sys.modules["mixgemm.nn.moe"].QuantMoE]
        try:
            mixgemm.no_such_module
            missing = None
        except AttributeError as e:
            missing = str(e)
        print(json.dumps({"before": before, "found": found, "names": names, "missing": missing,
                          "cli": "mixgemm.cli.main" in sys.modules, "in_dir": sorted(set(lazy) & set(dir(mixgemm)))}))
    """
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env_with_checkout(),
                         cwd=tmp_path, timeout=300)
    assert res.returncode == 0, res.stderr
    import json
    report = json.loads(res.stdout.splitlines()[-1])
    assert not any(report["before"].values()), report["before"]
    assert report["found"] == {n: f"mixgemm.{n}" for n in report["found"]}
    assert {"nn", "moe", "formats", "hf"} <= set(report["found"]) and report["in_dir"] == sorted(report["found"])
    assert report["names"] == ["QuantLinear", "fused_moe", "from_awq", "QuantMoE", True]
    assert report["missing"] == "module 'mixgemm' has no attribute 'no_such_module'"
    assert report["cli"] is False
