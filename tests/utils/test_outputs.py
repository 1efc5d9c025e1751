"""Every writer (``mixgemm prepack``, ``generate --out``, ``cache export``, :func:`mixgemm.save`)
refuses, in one line and before any work, a target that exists and is not a regular file (a FIFO,
a character device, a directory, a symlink to one of them); ``--force`` replaces regular files
only; bad paths (``''``, ``newdir/``, ``file/x``) get one-line errors; the temporaries of a dead
process are removed by the next write (mixgemm.utils.atomic).

No test here can replace a real device node: the targets are FIFOs, directories and device nodes
made in the test's own directory, and symlinks to /dev/null whose replacement would replace the
symlink (in the test's directory), never /dev/null; the tests check that each is unchanged."""
from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch

import mixgemm
from mixgemm.utils.atomic import check_target, replacing, stale_temporaries
from mixgemm.cli.main import main
from mixgemm.errors import OutputPathError

ERR_PREPACK = "mixgemm prepack: error: "


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.fixture
def checkpoint(tmp_path):
    src = tmp_path / "in" / "model.safetensors"
    src.parent.mkdir()
    gen = torch.Generator().manual_seed(0)
    safetensors.torch.save_file({"layers.0.proj.weight": (torch.randn(64, 128, generator=gen) * 0.02).to(torch.bfloat16)},
                                str(src))
    return src


def run(capsys, *argv):
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def _fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


def _chardev(path: Path) -> Path:
    """A character device node (1, 3: like /dev/null) in the test's directory; skip where the
    container may not make one."""
    try:
        os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    except (PermissionError, OSError) as e:
        pytest.skip(f"cannot make a device node here: {e}")
    return path


def _dir(path: Path) -> Path:
    path.mkdir()
    (path / "keep").write_text("kept")
    return path


def _link_to_devnull(path: Path) -> Path:
    path.symlink_to("/dev/null")
    return path


def _link_to_fifo(path: Path) -> Path:
    fifo = _fifo(path.with_name(path.name + ".fifo"))
    path.symlink_to(fifo)
    return path


TARGETS = {
    "a FIFO": (_fifo, r"it is a FIFO \(named pipe\); mixgemm writes and replaces regular files only"),
    "a character device": (_chardev, r"it is a character device; mixgemm writes and replaces regular files only"),
    "a symlink to /dev/null": (_link_to_devnull, r"it is a character device; mixgemm writes and replaces "
                                                 r"regular files only"),
    "a symlink to a FIFO": (_link_to_fifo, r"it is a FIFO \(named pipe\)"),
    "a directory": (_dir, r"it is a directory"),
}


def _snapshot(directory: Path) -> dict:
    """Every entry of ``directory`` (not following links): its type, link target and contents."""
    out = {}
    for p in sorted(directory.rglob("*")):
        st = os.lstat(p)
        out[str(p)] = (stat.S_IFMT(st.st_mode), st.st_ino, os.readlink(p) if p.is_symlink() else None,
                       p.read_bytes() if stat.S_ISREG(st.st_mode) else None)
    return out


def _devnull_intact():
    st = os.stat("/dev/null")
    assert stat.S_ISCHR(st.st_mode) and os.major(st.st_rdev) == 1 and os.minor(st.st_rdev) == 3


@pytest.mark.parametrize("force", [False, True], ids=["", "--force"])
@pytest.mark.parametrize("what", list(TARGETS))
def test_prepack_refuses_a_target_that_is_not_a_regular_file(capsys, checkpoint, tmp_path, monkeypatch, what,
                                                             force, pin_case):
    make, message = TARGETS[what]
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    target = make(out_dir / "model.int4.safetensors")
    before = _snapshot(out_dir)
    q = sys.modules["mixgemm.weights.quantize"]
    monkeypatch.setattr(q, "quantize", lambda *a, **k: pytest.fail("quantized before refusing the output"))
    argv = ["prepack", checkpoint, "-o", target, "--bits", "4", "--group-size", "128"] + (["--force"] if force else [])
    rc, out, err = run(capsys, *argv)
    assert rc == 1 and out == "" and len(err.splitlines()) == 1, err
    import re
    assert re.fullmatch(ERR_PREPACK + rf"cannot write {re.escape(str(target))}: {message}.*\n", err), err
    assert _snapshot(out_dir) == before, "nothing replaced, nothing left"
    _devnull_intact()
    pin_case("Output path", f"{what}{' with --force' if force else ''}",
             f"mixgemm prepack IN -o TARGET --bits 4 --group-size 128{' --force' if force else ''}", "exit 1",
             err.splitlines()[0], "none (the target is unchanged)")


@pytest.mark.parametrize("what", list(TARGETS))
def test_save_refuses_a_target_that_is_not_a_regular_file(tmp_path, what):
    make, message = TARGETS[what]
    target = make(tmp_path / "w.safetensors")
    before = _snapshot(tmp_path)
    with pytest.raises(OutputPathError, match=message):
        mixgemm.save(target, {"x": torch.zeros(2)})
    assert _snapshot(tmp_path) == before
    _devnull_intact()


def test_generate_refuses_a_source_that_is_not_a_regular_file(capsys, tmp_path):
    out = tmp_path / "src"
    out.mkdir()
    rc, _, err = run(capsys, "generate", "--out", out, "--kernels", "dequant_bf16_u[48]$")
    assert rc == 0, err
    names = sorted(os.listdir(out))
    assert len(names) == 2
    (out / names[0]).unlink()
    fifo = _fifo(out / names[0])
    (out / names[1]).write_text("old")
    rc, _, err = run(capsys, "generate", "--out", out, "--kernels", "dequant_bf16_u[48]$")
    assert rc == 1 and err == (f"mixgemm generate: error: cannot write {fifo}: it is a FIFO (named pipe); "
                               f"mixgemm writes and replaces regular files only\n")
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode) and (out / names[1]).read_text() == "old", \
        "every target is checked before the first is written"
    assert sorted(os.listdir(out)) == names


def test_generate_out_that_is_a_file(capsys, tmp_path, pin_case):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    rc, _, err = run(capsys, "generate", "--out", blocker, "--kernels", "dequant_bf16_u4$")
    assert rc == 1 and err == f"mixgemm generate: error: cannot write kernel sources to {blocker}: it exists and " \
                              f"is not a directory\n"
    pin_case("Output path", "generate --out FILE", "mixgemm generate --out FILE", "exit 1", err.splitlines()[0])
    rc, _, err = run(capsys, "generate", "--out", blocker / "src", "--kernels", "dequant_bf16_u4$")
    assert rc == 1 and err == (f"mixgemm generate: error: cannot make the directory {blocker / 'src'}: {blocker} "
                               f"is a file, not a directory\n")
    rc, _, err = run(capsys, "generate", "--out", "", "--kernels", "dequant_bf16_u4$")
    assert rc == 1 and err == "mixgemm generate: error: cannot write kernel sources to '': the --out directory is empty\n"
    assert blocker.read_text() == "x"


@pytest.mark.parametrize("case,make,expected", [
    ("''", lambda d: "", "cannot write '': the output path is empty"),
    ("newdir/", lambda d: f"{d}/newdir/",
     "cannot write {d}/newdir/: a path ending in '/' names a directory; give a file name"),
    ("file/x", lambda d: (Path(d, "file").write_text("x"), f"{d}/file/x")[1],
     "cannot write {d}/file/x: {d}/file is a file, not a directory"),
    ("missing/x", lambda d: f"{d}/missing/x", "cannot write {d}/missing/x: directory {d}/missing does not exist"),
])
def test_bad_output_paths(capsys, checkpoint, tmp_path, case, make, expected, pin_case):
    d = tmp_path / "out"
    d.mkdir()
    target = make(d)
    before = _snapshot(d)
    rc, out, err = run(capsys, "prepack", checkpoint, "-o", target, "--bits", "4", "--group-size", "128")
    assert rc == 1 and err == ERR_PREPACK + expected.format(d=d) + "\n"
    assert _snapshot(d) == before and not (d / "newdir").exists()
    pin_case("Output path", f"-o {case}", f"mixgemm prepack IN -o {case} --bits 4 --group-size 128", "exit 1",
             err.splitlines()[0])
    # the same refusal from the API, before any work
    with pytest.raises(OutputPathError) as excinfo:
        mixgemm.save(target, {"x": torch.zeros(2)})
    assert str(excinfo.value) == expected.format(d=d)
    assert _snapshot(d) == before


def test_save_into_a_new_directory_name(tmp_path):
    """mixgemm.save('newdir/') was a raw SafetensorError; a missing directory stays a
    FileNotFoundError, a directory an IsADirectoryError."""
    with pytest.raises(OutputPathError, match="names a directory; give a file name"):
        mixgemm.save(f"{tmp_path}/newdir/", {"x": torch.zeros(2)})
    with pytest.raises(FileNotFoundError, match="does not exist"):
        mixgemm.save(tmp_path / "no" / "x.safetensors", {"x": torch.zeros(2)})
    with pytest.raises(IsADirectoryError, match="it is a directory"):
        mixgemm.save(tmp_path, {"x": torch.zeros(2)})
    assert os.listdir(tmp_path) == []


def test_force_replaces_a_regular_file_and_a_symlink_only_as_a_link(capsys, checkpoint, tmp_path):
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    real = out_dir / "real.safetensors"
    real.write_bytes(b"old")
    link = out_dir / "link.safetensors"
    link.symlink_to(real)
    rc, _, err = run(capsys, "prepack", checkpoint, "-o", link, "--bits", "4", "--group-size", "128")
    assert rc == 1 and err == ERR_PREPACK + f"{link} exists; pass --force to replace it\n"
    rc, _, err = run(capsys, "prepack", checkpoint, "-o", link, "--bits", "4", "--group-size", "128", "--force")
    assert rc == 0, err
    assert real.read_bytes() == b"old" and not link.is_symlink() and link.is_file()
    assert isinstance(mixgemm.load(link)["layers.0.proj.weight"], mixgemm.PackedWeight)


def test_check_target_api(tmp_path):
    fifo = _fifo(tmp_path / "f")
    with pytest.raises(OutputPathError, match="FIFO"):
        check_target(fifo)
    regular = tmp_path / "r"
    regular.write_text("x")
    assert check_target(regular) == str(regular)
    with pytest.raises(FileExistsError, match="pass --force"):
        check_target(regular, replace=False)
    assert check_target(tmp_path / "new", replace=False) == str(tmp_path / "new")


def test_the_target_changing_during_the_write_is_refused(tmp_path):
    target = tmp_path / "t"
    with pytest.raises(OutputPathError, match="FIFO"):
        with replacing(target) as tmp:
            Path(tmp).write_text("new")
            os.mkfifo(target)
    assert stat.S_ISFIFO(os.lstat(target).st_mode) and os.listdir(tmp_path) == ["t"]


def test_generate_removes_the_temporaries_of_a_dead_process(capsys, tmp_path):
    import re

    from mixgemm.jit import catalog
    dead = _dead_pid()
    out = tmp_path / "src"
    out.mkdir()
    spec = [s for s in catalog.default_specs() if re.search("dequant_bf16_u4$", s.name)][0]
    left = out / f".{spec.name}.cu.{dead}.abc.tmp"
    live = out / f".{spec.name}.cu.{os.getppid()}.def.tmp"
    left.write_text("partial")
    live.write_text("partial")
    assert stale_temporaries(out / f"{spec.name}.cu") == [str(left)]
    rc, _, err = run(capsys, "generate", "--out", out, "--kernels", f"^{spec.name}$")
    assert rc == 0, err
    assert sorted(os.listdir(out)) == sorted([f"{spec.name}.cu", live.name])
