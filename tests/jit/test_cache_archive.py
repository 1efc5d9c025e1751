"""``mixgemm cache export / import / list`` (mixgemm.jit.cache), with the fake nvcc of
test_build: kernels built into one cache, exported, imported into another; stale, corrupt and
foreign entries refused one by one; nothing written outside the cache; a valid entry never
replaced."""
from __future__ import annotations

import io
import json
import os
import stat
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from mixgemm.jit import build, cache as cache_archive
from mixgemm.cli.main import main
from mixgemm.errors import UserError
from mixgemm.jit.specs import DequantSpec, GemmSpec, Scheduler
from mixgemm.dtypes import ActType, WeightType

from fake_nvcc import fake_env, nvcc_calls  # noqa: F401  (the fake nvcc and a private cache)

GEMM = GemmSpec(ActType.BF16, WeightType.U4, 128, 64, 64, scheduler=Scheduler.STREAMK)
DEQ = DequantSpec(ActType.FP16, WeightType.S2)
DEQ2 = DequantSpec(ActType.BF16, WeightType.U8)


def use_cache(monkeypatch, path: Path) -> Path:
    monkeypatch.setenv("MIXGEMM_CACHE_DIR", str(path))
    return path


@pytest.fixture
def warm(fake_env, monkeypatch):  # noqa: F811
    """Cache A with three kernels and the launcher, exported to archive.tgz; then cache B
    (empty) is the current one. Returns (archive, cache A, cache B)."""
    from mixgemm.jit import launcher

    a = use_cache(monkeypatch, fake_env / "cache-a")
    for spec in (GEMM, DEQ, DEQ2):
        build.build(spec)
    launcher.build_compiled()
    archive = fake_env / "archive.tgz"
    report = cache_archive.export_cache(archive)
    assert len(report.exported) == 4 and not report.skipped
    b = use_cache(monkeypatch, fake_env / "cache-b")
    return archive, a, b


def members(archive: Path) -> dict:
    with tarfile.open(archive) as tar:
        return {m.name: (m, tar.extractfile(m).read() if m.isfile() else b"") for m in tar.getmembers()}


def rewrite(archive: Path, out: Path, change=lambda name, data: data, add=()) -> Path:
    """Copy an archive, passing each file through ``change`` (None drops it), adding ``add``
    (TarInfo, bytes) members."""
    with tarfile.open(out, "w:gz") as tar:
        for name, (m, data) in members(archive).items():
            data = change(name, data)
            if data is not None:
                m.size = len(data)
                tar.addfile(m, io.BytesIO(data))
        for info, data in add:
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return out


def run(capsys, *argv):
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("trust", [False, True], ids=["default", "--trust-host-code"])
def test_export_then_import_into_an_empty_cache(warm, fake_env, capsys, trust):
    """By default the cubins come from the archive and the host libraries are compiled here (only
    they: no cubin is compiled); with --trust-host-code an import compiles nothing."""
    archive, a, b = warm
    names = list(members(archive))
    assert names[0] == cache_archive.MANIFEST
    manifest = json.loads(members(archive)[cache_archive.MANIFEST][1])
    assert manifest["format"] == cache_archive.ARCHIVE_FORMAT and len(manifest["entries"]) == 4
    assert sum(n.startswith("host/launcher-") and n.endswith("/launcher.so") for n in names) == 1
    assert not any(n.endswith((".cu", ".cpp")) for n in names), "sources are not exported"
    calls = nvcc_calls(fake_env)
    rc, out, err = run(capsys, "cache", "import", archive, *(["--trust-host-code"] if trust else []))
    assert rc == 0, err
    if trust:
        assert "imported 4 entries (host code taken from the archive: --trust-host-code), 0 already present, " \
               "0 refused" in out
        assert nvcc_calls(fake_env) == calls, "a trusting import compiles nothing"
    else:
        assert "imported 4 entries (the host code of 2 compiled here; --trust-host-code takes the archive's), " \
               "0 already present, 0 refused" in out
        assert sorted(nvcc_calls(fake_env)[len(calls):]) == ["helper.so", "launcher.so"], "only the host code"
    calls = nvcc_calls(fake_env)
    for spec in (GEMM, DEQ, DEQ2):
        assert build.is_cached(spec)
        art, cubin = build.load_artifacts(spec, build_if_missing=False)
        assert cubin == (a / "kernels" / art.directory.name / "kernel.cubin").read_bytes()
        assert (art.directory / f"{spec.name}.cu").is_file(), "this install's source is written"
        if spec is GEMM:
            meta = json.loads((art.directory / "meta.json").read_text())
            same = (art.directory / "helper.so").read_bytes() == (a / "kernels" / art.directory.name / "helper.so").read_bytes()
            assert same == trust and (meta.get("host_code") == "built here") != trust
    from mixgemm.jit import launcher
    assert launcher.build_compiled().parent.parent == b / "host"
    assert nvcc_calls(fake_env) == calls, "the imported launcher is used as is"
    assert not list((b / "tmp").iterdir()), "no temporary left"
    # again: everything is present
    rc, out, err = run(capsys, "cache", "import", archive)
    assert rc == 0 and "imported 0 entries, 4 already present" in out
    rc, out, err = run(capsys, "cache", "list")
    assert rc == 0 and out.count("current") == 4 and "4 entries" in err


@pytest.mark.parametrize("trust", [False, True], ids=["default", "--trust-host-code"])
def test_an_import_reads_the_archive_once_front_to_back(warm, monkeypatch, trust):
    """Each member is read once, in the archive's order (export writes an entry's meta.json after
    its artifacts, and a compressed member read after a later one decompresses the stream again
    from its start: an import of n entries would cost n times the archive). Untrusted host
    libraries are not read at all."""
    archive, a, b = warm
    reads = []
    real = cache_archive._read
    monkeypatch.setattr(cache_archive, "_read", lambda tar, m, limit: reads.append(m) or real(tar, m, limit))
    report = cache_archive.import_cache(archive, trust_host_code=trust)
    assert len(report.imported) == 4 and not report.refused
    offsets = [m.offset for m in reads]
    assert offsets == sorted(offsets) and len(set(offsets)) == len(offsets), [m.name for m in reads]
    assert any(m.name.endswith("/meta.json") for m in reads[1:])
    assert any(m.name.endswith(".so") for m in reads) == trust


def test_export_selects_and_refuses_to_overwrite(warm, fake_env, monkeypatch, capsys):
    archive, a, b = warm
    use_cache(monkeypatch, a)
    rc, out, err = run(capsys, "cache", "export", archive)
    assert rc == 1 and "exists; pass --force" in err
    small = fake_env / "dequant.tgz"
    rc, out, err = run(capsys, "cache", "export", small, "--kernels", "dequant_fp16")
    assert rc == 0 and "exported 1 entries" in out
    assert [n for n in members(small) if n.endswith("meta.json")] == \
        [f"kernels/{next((a / 'kernels').glob(DEQ.name + '-*')).name}/meta.json"]
    rc, out, err = run(capsys, "cache", "export", fake_env / "x.tgz", "--kernels", "nothing")
    assert rc == 1 and "no current cache entry matching 'nothing'" in err
    rc, out, err = run(capsys, "cache", "export", fake_env / "nodir" / "x.tgz")
    assert rc == 1 and "does not exist" in err


def test_stale_entries_are_refused(fake_env, monkeypatch, capsys):  # noqa: F811
    """Entries built with other nvcc flags (NVCC_APPEND_FLAGS is in the key), or by another
    mixgemm version, are refused; the current ones beside them are imported."""
    a = use_cache(monkeypatch, fake_env / "a")
    build.build(DEQ)
    monkeypatch.setenv("NVCC_APPEND_FLAGS", "-lineinfo")
    build.build(DEQ2)
    archive = fake_env / "flags.tgz"
    assert len(cache_archive.export_cache(archive).exported) == 1, "DEQ is stale under these flags"
    monkeypatch.delenv("NVCC_APPEND_FLAGS")
    use_cache(monkeypatch, fake_env / "b")
    rc, out, err = run(capsys, "cache", "import", archive)
    assert rc == 1
    assert f"refused kernels/{DEQ2.name}-" in err and "nvcc flags or environment" in err
    assert not (fake_env / "b" / "kernels").exists() or not list((fake_env / "b" / "kernels").iterdir())
    # another mixgemm version
    use_cache(monkeypatch, a)
    monkeypatch.setattr(build, "__version__", "0.0.1")
    monkeypatch.setattr(cache_archive, "__version__", "0.0.1")
    build.build(DEQ)
    old = fake_env / "old.tgz"
    cache_archive.export_cache(old)
    monkeypatch.undo()
    use_cache(monkeypatch, fake_env / "c")
    report = cache_archive.import_cache(old)
    assert not report.imported and len(report.refused) == 1
    assert "stale: built by mixgemm 0.0.1" in report.refused[0][1]


def test_corrupt_and_foreign_members_are_refused(warm, fake_env, capsys):
    archive, a, b = warm
    gemm_dir = next(n for n in members(archive) if n.startswith(f"kernels/{GEMM.name}-")).split("/")[1]

    def tamper(name, data):
        return data + b"x" if name == f"kernels/{gemm_dir}/kernel.cubin" else data

    def info(name, kind=tarfile.REGTYPE, size=0, link=""):
        t = tarfile.TarInfo(name)
        t.type, t.size, t.linkname = kind, size, link
        return t

    evil = b"evil"
    foreign_meta = json.dumps({"name": "evil", "key": "0" * 64, "sha256": {}}).encode()
    bad = rewrite(archive, fake_env / "bad.tgz", tamper, add=[
        (info("../evil.txt", size=4), evil),
        (info("/tmp/evil-abs.txt", size=4), evil),
        (info(f"kernels/{gemm_dir}/../../../evil2.txt", size=4), evil),
        (info("kernels/link-01234567890123456789/meta.json", tarfile.SYMTYPE, link="/etc/passwd"), None),
        (info("kernels/evil-00000000000000000000/meta.json", size=len(foreign_meta)), foreign_meta),
        (info("somewhere/else.txt", size=4), evil),
        (info("kernels/dev-01234567890123456789/fifo", tarfile.FIFOTYPE), None),
    ])
    rc, out, err = run(capsys, "cache", "import", bad)
    assert rc == 1
    lines = err.strip().splitlines()
    refused = {line.split("refused ")[1].split(": ")[0]: line for line in lines}
    assert f"kernels/{gemm_dir}" in refused and "corrupt" in refused[f"kernels/{gemm_dir}"]
    for name, why in (("../evil.txt", "unsafe path"), ("/tmp/evil-abs.txt", "absolute"),
                      (f"kernels/{gemm_dir}/../../../evil2.txt", "unsafe path"),
                      ("kernels/link-01234567890123456789/meta.json", "a link"),
                      ("kernels/evil-00000000000000000000", "not a mixgemm kernel name"),
                      ("somewhere/else.txt", "not a mixgemm cache entry"),
                      ("kernels/dev-01234567890123456789/fifo", "not a regular file")):
        assert name in refused and why in refused[name], (name, err)
    assert "imported 3 entries (the host code of 1 compiled here; --trust-host-code takes the archive's), 0 already present, 8 refused" in out
    assert not build.is_cached(GEMM) and build.is_cached(DEQ)
    for p in (fake_env / "evil.txt", fake_env.parent / "evil.txt", Path("/tmp/evil-abs.txt"), fake_env / "evil2.txt"):
        assert not p.exists()
    assert {p.name for p in b.iterdir()} <= {"kernels", "host", "locks", "tmp"}


def test_a_valid_entry_is_never_replaced_and_an_invalid_one_is(warm, fake_env):
    archive, a, b = warm
    build.build(DEQ)                                     # B's own build of DEQ ...
    entry = next((b / "kernels").glob(DEQ.name + "-*"))
    cubin = entry / "kernel.cubin"
    cubin.write_bytes(b"built here")                      # ... made different, and still valid
    meta = json.loads((entry / "meta.json").read_text())
    meta["sha256"]["kernel.cubin"] = build._sha256(cubin)
    (entry / "meta.json").write_text(json.dumps(meta))
    build.build(DEQ2)
    entry2 = next((b / "kernels").glob(DEQ2.name + "-*"))
    (entry2 / "kernel.cubin").write_bytes(b"truncat")     # invalid: replaced by the import
    report = cache_archive.import_cache(archive)
    assert report.ok
    assert sorted(report.present) == [f"kernels/{entry.name}"]
    assert f"kernels/{entry2.name}" in report.imported
    assert cubin.read_bytes() == b"built here"
    assert (entry2 / "kernel.cubin").read_bytes() == (a / "kernels" / entry2.name / "kernel.cubin").read_bytes()


def test_archives_that_are_not_mixgemm_caches(warm, fake_env, capsys):
    archive, a, b = warm
    junk = fake_env / "junk.tgz"
    junk.write_bytes(b"not a tar at all")
    rc, out, err = run(capsys, "cache", "import", junk)
    assert rc == 1 and "not a tar archive" in err
    no_manifest = rewrite(archive, fake_env / "nomanifest.tgz",
                          lambda name, data: None if name == cache_archive.MANIFEST else data)
    rc, out, err = run(capsys, "cache", "import", no_manifest)
    assert rc == 1 and "not a mixgemm cache archive" in err
    assert not (b / "kernels").exists(), "nothing imported from an archive without a manifest"
    future = rewrite(archive, fake_env / "future.tgz", lambda name, data: json.dumps(
        {**json.loads(data), "version": 99}).encode() if name == cache_archive.MANIFEST else data)
    rc, out, err = run(capsys, "cache", "import", future)
    assert rc == 1 and "upgrade mixgemm" in err
    truncated = fake_env / "truncated.tgz"
    truncated.write_bytes(archive.read_bytes()[: archive.stat().st_size * 2 // 3])
    rc, out, err = run(capsys, "cache", "import", truncated)
    assert rc == 1 and "truncated" in err and len(err.strip().splitlines()) == 1, err
    assert not (b / "kernels").exists() and not (b / "host").exists(), "nothing imported from a truncated archive"
    rc, out, err = run(capsys, "cache", "import", fake_env / "missing.tgz")
    assert rc == 1 and "no such file" in err
    rc, out, err = run(capsys, "cache", "import")
    assert rc == 2
    rc, out, err = run(capsys, "cache", "frobnicate")
    assert rc == 2


def test_list_states(fake_env, monkeypatch, capsys):  # noqa: F811
    build.build(DEQ)
    build.build(DEQ2)
    monkeypatch.setenv("NVCC_APPEND_FLAGS", "-G")
    build.build(DEQ2)                                   # an entry of other flags: stale without them
    monkeypatch.delenv("NVCC_APPEND_FLAGS")
    entry = next(p for p in (Path(os.environ["MIXGEMM_CACHE_DIR"]) / "kernels").glob(DEQ.name + "-*"))
    (entry / "kernel.cubin").write_bytes(b"")
    states = sorted(e.state for e in cache_archive.list_entries())
    assert states == ["corrupt", "current", "stale"]
    rc, out, err = run(capsys, "cache", "list", "--kernels", "u8")
    assert rc == 0 and len(out.strip().splitlines()) == 2 and "1 current, 1 stale" in err


def test_install_entry_refuses_files_that_do_not_match(fake_env):  # noqa: F811
    with pytest.raises(build.BuildError, match="do not match"):
        build.install_entry("kernels", DEQ.name, "a" * 64, {
            "meta.json": json.dumps({"name": DEQ.name, "key": "a" * 64, "sha256": {"kernel.cubin": "0" * 64}}).encode(),
            "kernel.cubin": b"x"}, ("kernel.cubin",))
    cache = Path(os.environ["MIXGEMM_CACHE_DIR"])
    assert not (cache / "kernels").exists() and not list((cache / "tmp").iterdir())
    with pytest.raises(UserError, match="no such file"):
        cache_archive.import_cache(cache / "nothing.tgz")


def test_a_failed_export_leaves_nothing(warm, fake_env, monkeypatch):
    """An export that fails half way (here: an OSError reading the second entry) leaves neither
    the archive nor its temporary."""
    archive, a, b = warm
    use_cache(monkeypatch, a)
    calls = []

    def failing(tar, e):
        calls.append(e)
        if len(calls) == 2:
            raise OSError("disk gone")
        return real(tar, e)

    real = cache_archive._add_entry
    monkeypatch.setattr(cache_archive, "_add_entry", failing)
    out = fake_env / "out" / "x.tgz"
    out.parent.mkdir()
    with pytest.raises(OSError, match="disk gone"):
        cache_archive.export_cache(out)
    assert list(out.parent.iterdir()) == []


@pytest.mark.parametrize("force", [False, True])
def test_export_refuses_a_target_that_is_not_a_regular_file(warm, fake_env, monkeypatch, capsys, force):
    archive, a, b = warm
    use_cache(monkeypatch, a)
    fifo = fake_env / "out.tgz"
    os.mkfifo(fifo)
    listed = []
    monkeypatch.setattr(cache_archive, "list_entries", lambda *x: listed.append(x) or [])
    rc, out, err = run(capsys, "cache", "export", fifo, *(["--force"] if force else []))
    assert rc == 1 and err == (f"mixgemm cache: error: cannot write {fifo}: it is a FIFO (named pipe); "
                               f"mixgemm writes and replaces regular files only\n")
    assert not listed, "refused before any work"
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    rc, out, err = run(capsys, "cache", "export", fake_env)
    assert rc == 1 and err == f"mixgemm cache: error: cannot write {fake_env}: it is a directory\n"


def test_export_removes_the_temporaries_of_a_dead_process(warm, fake_env, monkeypatch, capsys):
    archive, a, b = warm
    use_cache(monkeypatch, a)
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    target = fake_env / "new.tgz"
    left = fake_env / f".new.tgz.{proc.pid}.abc.tmp"
    left.write_bytes(b"partial")
    rc, out, err = run(capsys, "cache", "export", target)
    assert rc == 0, err
    assert not left.exists() and not [n for n in os.listdir(fake_env) if n.startswith(".new.tgz")]


def test_import_of_what_is_not_an_archive_file(fake_env, capsys, pin_case):  # noqa: F811
    """One whole line for each, before nvcc is asked anything."""
    text = fake_env / "notes.txt"
    text.write_text("hello\n")
    gz = fake_env / "notes.txt.gz"
    import gzip
    gz.write_bytes(gzip.compress(b"hello\n"))
    fifo = fake_env / "pipe"
    os.mkfifo(fifo)
    hint = "give the archive file that `mixgemm cache export` wrote"
    for path, message, case in (
            (text, f"{text} is not a tar archive (plain, gzip, bzip2 or xz); {hint}", "a text file"),
            (gz, f"{gz} is not a tar archive (plain, gzip, bzip2 or xz); {hint}", "a gzip file that is not a tar"),
            (fake_env, f"{fake_env} is a directory; {hint}", "a directory"),
            (fifo, f"{fifo} is not a regular file; {hint}", "a FIFO")):
        rc, out, err = run(capsys, "cache", "import", path)
        assert rc == 1 and err == f"mixgemm cache: error: {message}\n", err
        pin_case("Cache", f"cache import of {case}", "mixgemm cache import FILE", "exit 1", err.splitlines()[0])
    assert not (Path(os.environ["MIXGEMM_CACHE_DIR"]) / "kernels").exists()


def _craft(archive: Path, out: Path, payload: bytes) -> tuple[Path, str]:
    """``archive`` with the GEMM kernel's helper.so and the launcher's launcher.so replaced by
    ``payload``, and each entry's meta.json updated to match it (consistent metadata: every
    check that compares an entry with itself passes)."""
    import hashlib
    digest = hashlib.sha256(payload).hexdigest()
    gemm_dir = next(n for n in members(archive) if n.startswith(f"kernels/{GEMM.name}-")).split("/")[1]

    def change(name, data):
        if name.endswith(("/helper.so", "/launcher.so")):
            return payload
        if name.endswith("/meta.json") and (name.startswith(f"kernels/{gemm_dir}/") or name.startswith("host/")):
            meta = json.loads(data)
            meta["sha256"] = {a: (digest if a.endswith(".so") else d) for a, d in meta["sha256"].items()}
            return json.dumps(meta).encode()
        return data
    return rewrite(archive, out, change), gemm_dir


def _files_holding(root: Path, payload: bytes) -> list:
    return [p for p in root.rglob("*") if p.is_file() and payload in p.read_bytes()]


def test_a_crafted_helper_is_never_imported_by_default(warm, fake_env, capsys, monkeypatch, pin_case):
    """An archive whose helper.so and launcher.so are someone else's code, with meta.json made to
    match: a default import passes every check and takes the cubins, but the host libraries in the
    cache are the ones compiled here; the crafted bytes are nowhere in the cache, so nothing can
    load them. Only --trust-host-code takes them (and then the archive is trusted as code)."""
    archive, a, b = warm
    payload = b"\x7fELF crafted host code " * 8
    crafted, gemm_dir = _craft(archive, fake_env / "crafted.tgz", payload)
    rc, out, err = run(capsys, "cache", "import", crafted)
    assert rc == 0 and err == "", err
    assert "imported 4 entries (the host code of 2 compiled here" in out
    assert _files_holding(b, payload) == [], "the archive's host code is nowhere in the cache"
    helper = b / "kernels" / gemm_dir / "helper.so"
    assert helper.is_file() and json.loads((helper.parent / "meta.json").read_text())["host_code"] == "built here"
    assert build.is_cached(GEMM)
    from mixgemm.jit import launcher
    assert payload not in launcher.build_compiled().read_bytes()
    pin_case("Cache", "cache import of an archive with crafted host code (consistent meta.json)",
             "mixgemm cache import crafted.tgz", "exit 0", out.splitlines()[0],
             "the cubins imported; helper.so and launcher.so compiled here (the crafted ones never read)")
    # with the flag, into another cache: the archive's host code is taken as it is
    use_cache_dir = use_cache(monkeypatch, fake_env / "cache-c")
    rc, out, err = run(capsys, "cache", "import", crafted, "--trust-host-code")
    assert rc == 0, err
    assert len(_files_holding(use_cache_dir, payload)) == 2


def test_trusted_host_code_is_still_checked(warm, fake_env, capsys):
    """--trust-host-code takes the archive's host libraries, but a helper.so that does not match
    its meta.json is refused as corrupt; without the flag it is not read at all."""
    archive, a, b = warm
    gemm_dir = next(n for n in members(archive) if n.startswith(f"kernels/{GEMM.name}-")).split("/")[1]
    bad = rewrite(archive, fake_env / "bad.tgz",
                  lambda name, data: data + b"x" if name == f"kernels/{gemm_dir}/helper.so" else data)
    rc, out, err = run(capsys, "cache", "import", bad, "--trust-host-code")
    assert rc == 1 and f"refused kernels/{gemm_dir}: corrupt: ['helper.so'] do not match their sha256" in err
    rc, out, err = run(capsys, "cache", "import", bad)
    assert rc == 0 and build.is_cached(GEMM)


def test_a_failing_host_build_refuses_the_entry(warm, fake_env, capsys, monkeypatch):
    archive, a, b = warm
    monkeypatch.setenv("FAKE_NVCC_FAIL", "1")
    rc, out, err = run(capsys, "cache", "import", archive)
    assert rc == 1
    lines = err.splitlines()
    assert len(lines) == 2 and all("not written: nvcc failed" in line for line in lines), err
    assert "imported 2 entries, 0 already present, 2 refused" in out
    assert not build.is_cached(GEMM) and build.is_cached(DEQ)
    assert not list((b / "tmp").iterdir())
