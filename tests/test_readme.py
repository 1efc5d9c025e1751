"""The README's two set-up commands, and .ci/run running exactly the test one."""
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")

INSTALL = "pip install torch==2.13.0 && pip install . && mixgemm demo"
TEST = "pip install torch==2.13.0 && pip install -e '.[test]' && python -m pytest -q"


def block(marker):
    m = re.search(rf"<!-- {marker} -->\n```bash\n(.*?)\n```\n<!-- /{marker} -->", README, re.S)
    assert m, f"no fenced bash block between the {marker} markers"
    return m.group(1)


def test_readme_has_exactly_the_two_setup_commands():
    assert block("install-command") == INSTALL
    assert block("test-command") == TEST
    # and no other shell blocks that a reader could take for set-up steps
    assert len(re.findall(r"^```(?:bash|sh|shell|console)$", README, re.M)) == 2
    assert "sm_90a" in README and "nvcc >= 12.4" in README


def test_ci_runs_the_readme_test_command():
    ci = ROOT / ".ci" / "run"
    assert os.access(ci, os.X_OK), ".ci/run must be executable"
    text = ci.read_text()
    assert "set -euo pipefail" in text and "-eq 5" in text
    out = subprocess.run(["bash", str(ci), "--print-command"], capture_output=True, text=True,
                         check=True, timeout=60).stdout
    assert out.strip() == TEST


@pytest.mark.parametrize("command,rc", [("true", 0), ("exit 3", 3), ("exit 5", 1),
                                        ("false && echo not reached", 1)])
def test_ci_exit_status(tmp_path, command, rc):
    """.ci/run passes the command's status through, except 5 (no tests collected) fails."""
    (tmp_path / ".ci").mkdir()
    shutil.copy(ROOT / ".ci" / "run", tmp_path / ".ci" / "run")
    (tmp_path / "README.md").write_text(
        f"x\n<!-- test-command -->\n```bash\n{command}\n```\n<!-- /test-command -->\n")
    result = subprocess.run(["bash", str(tmp_path / ".ci" / "run")], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == rc, result.stderr
    if command == "exit 5":
        assert "no tests" in result.stderr


def test_readme_says_what_the_first_gpu_run_costs():
    """Near the install command: the first use of each kernel compiles it (65-100 s, once per
    machine), how to build ahead of time, and the doctor."""
    after_install = README.split("<!-- /install-command -->", 1)[1].split("\n## ", 1)[0]
    assert "first use of each kernel compiles it" in after_install
    assert "65-100 s" in after_install and "once per machine" in after_install
    assert "`mixgemm generate --build`" in after_install and "`mixgemm doctor`" in after_install
