"""Building kernels with nvcc into a content-addressed, atomic, locked disk cache.

A kernel spec (:mod:`mixgemm.jit.specs`; its source: :func:`mixgemm.jit.render.render`) builds into

* ``kernel.cubin``: the device code, ``-gencode=arch=compute_90a,code=sm_90a -DNDEBUG``;
* ``helper.so`` (GEMM kernels): the host helper compiled from the same source with
  ``-DMIXGEMM_HOST_HELPER``; it turns arguments into the kernel's ``Params`` bytes.

Cache layout: ``$MIXGEMM_CACHE_DIR`` (default ``~/.cache/mixgemm``) ``/kernels/<name>-<key>/``
holding the artifacts, the source and ``meta.json`` (key, sha256 of every artifact, the nvcc
command lines). The key is a sha256 over everything that can change the output: the mixgemm
version, the rendered source, the contents of mixgemm's headers (cutlass_ext/, converters/),
the CUTLASS version, the nvcc version, the flags, the arch and the environment variables
nvcc reads. An entry is built in a temporary directory and moved into place with
``os.replace``; one file lock per entry covers building and loading, so concurrent processes
never see half-written files. An entry whose files do not match ``meta.json`` is rebuilt.

Faults: the locks are ``flock`` locks, released by the kernel when their process dies, so a
lock file left behind is harmless. A build killed outright (SIGKILL, OOM) leaves its temporary
directory under ``tmp/`` (``<kernel name>-<random>``, holding an ``owner.json`` with the host
and process id); the next build removes every such directory whose process is gone
(:func:`stale_temporaries`), and nothing ever reads them.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import fcntl
import hashlib
import json
import logging
import re
import os
import shutil
import socket
import subprocess
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterable, Optional, Sequence, TypeVar

from .._version import __version__
from .render import render
from ..errors import BuildError
from ..utils.process import pid_alive
from .specs import HELPER_KINDS, GemmSpec, KernelSpec
from .toolchain import (ARCH, BASE_FLAGS, CUBIN_FLAGS, HELPER_FLAGS, KEY_ENV_VARS, Toolchain, cutlass_version,
                        extra_flags, headers_digest, include_flags, toolchain)

log = logging.getLogger("mixgemm")
T = TypeVar("T")

def cache_dir() -> Path:
    env = os.environ.get("MIXGEMM_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "mixgemm"


def artifact_steps(spec: KernelSpec) -> dict[str, tuple[str, ...]]:
    """Artifact file name -> the flags that produce it."""
    steps = {"kernel.cubin": BASE_FLAGS + CUBIN_FLAGS}
    if isinstance(spec, HELPER_KINDS):
        steps["helper.so"] = BASE_FLAGS + HELPER_FLAGS
    return steps


def artifact_names(spec: KernelSpec) -> tuple[str, ...]:
    """The files a kernel's cache entry holds besides its source and meta.json."""
    return tuple(artifact_steps(spec))


def cache_key(spec: KernelSpec, source: str, tc: Toolchain) -> str:
    """sha256 of everything that determines the artifacts."""
    env = {v: os.environ.get(v, "") for v in KEY_ENV_VARS}
    material = {
        "mixgemm": __version__,
        "name": spec.name,
        "source": source,
        "headers": headers_digest(source),
        "cutlass": cutlass_version(),
        "nvcc_version": tc.version,
        "arch": ARCH,
        "steps": {k: list(v) for k, v in artifact_steps(spec).items()},
        "extra_flags": extra_flags(),
        "env": env,
    }
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()


@dataclasses.dataclass(frozen=True)
class Artifacts:
    """A built kernel in the cache."""

    spec: KernelSpec
    key: str
    directory: Path

    @property
    def cubin_path(self) -> Path:
        return self.directory / "kernel.cubin"

    @property
    def helper_path(self) -> Optional[Path]:
        p = self.directory / "helper.so"
        return p if isinstance(self.spec, HELPER_KINDS) else None

    def read_cubin(self) -> bytes:
        return self.cubin_path.read_bytes()


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _entry_dir(spec: KernelSpec, key: str) -> Path:
    return cache_dir() / "kernels" / entry_stem(spec.name, key)


@contextmanager
def entry_lock(stem: str):
    """The cache entry ``stem``'s file lock (held across processes while it is built or read)."""
    lock_dir = cache_dir() / "locks"
    lock_dir.mkdir(parents=True, exist_ok=True)
    with open(lock_dir / f"{stem}.lock", "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _locked(spec: KernelSpec, key: str):
    return entry_lock(entry_stem(spec.name, key))


def entry_valid(entry: Path, name: str, key: str, artifacts: Iterable[str]) -> bool:
    """True if the entry's meta.json matches the name and key, names exactly ``artifacts``, and
    every artifact matches its sha256."""
    try:
        meta = json.loads((entry / "meta.json").read_text())
        if meta.get("key") != key or meta.get("name") != name:
            return False
        for fname, digest in meta["sha256"].items():
            if _sha256(entry / fname) != digest:
                return False
        return set(meta["sha256"]) == set(artifacts)
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _valid(entry: Path, spec: KernelSpec, key: str) -> bool:
    return entry_valid(entry, spec.name, key, artifact_steps(spec))


# ptxas's notes that it serialized a kernel's wgmma pipeline (C7510 without NDEBUG; C7513/C7515
# when registers a wgmma in flight reads are redefined): each wgmma then waits for the previous
# one and the conversion no longer overlaps the tensor cores (measured 9-20% slower, docs/kernels.md).
_SERIALIZED_WGMMA = re.compile(r"^.*\(C75\d\d\).*wgmma\.mma_async instructions are serialized.*$", re.M)


def serialized_wgmma_notes(compiler_output: str) -> list[str]:
    """The lines of ptxas output that report a serialized wgmma pipeline."""
    return [m.group(0).strip() for m in _SERIALIZED_WGMMA.finditer(compiler_output)]


def _run_nvcc(tc: Toolchain, flags: Sequence[str], src: Path, out: Path) -> list[str]:
    cmd = [tc.nvcc, *flags, *include_flags(), *extra_flags(), str(src), "-o", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        tail = "\n".join(res.stderr.strip().splitlines()[-40:])
        raise BuildError(f"nvcc failed ({res.returncode}) building {out.name} for {src.parent.name}:\n"
                         f"{' '.join(cmd)}\n{tail}")
    notes = serialized_wgmma_notes(res.stdout + res.stderr)
    if notes:
        raise BuildError(f"ptxas serialized the wgmma pipeline of {src.parent.name} ({out.name}); the kernel "
                         f"would be correct but slow, so it is not cached:\n{' '.join(cmd)}\n" + "\n".join(notes))
    return cmd


#: A temporary build directory without a readable owner.json is stale after this long (its
#: owner writes owner.json right after creating it); one of any owner after STALE_ANY_S (no
#: build takes that long).
_STALE_UNOWNED_S = 3600
_STALE_ANY_S = 24 * 3600
_OWNER = "owner.json"


def _is_stale(tmp: Path, now: float) -> bool:
    try:
        owner = json.loads((tmp / _OWNER).read_text())
        host, pid, started = owner["host"], int(owner["pid"]), float(owner["started"])
    except (OSError, ValueError, KeyError, TypeError):
        try:
            return now - tmp.stat().st_mtime > _STALE_UNOWNED_S
        except OSError:
            return False
    if now - started > _STALE_ANY_S:
        return True
    # a process of another host (a cache on a shared file system) cannot be checked from here
    return host == socket.gethostname() and pid != os.getpid() and not pid_alive(pid)


def stale_temporaries() -> list[Path]:
    """Temporary build directories under the cache's ``tmp/`` whose build is gone: its process
    (on this host) no longer runs, or it is older than a day. A build killed outright leaves
    one; :func:`build` removes them."""
    tmp_root = cache_dir() / "tmp"
    now = time.time()
    try:
        candidates = [p for p in tmp_root.iterdir() if p.is_dir()]
    except OSError:
        return []
    return [p for p in candidates if _is_stale(p, now)]


def _remove_stale_temporaries() -> None:
    for tmp in stale_temporaries():
        shutil.rmtree(tmp, ignore_errors=True)


def _build_entry(spec: KernelSpec, key: str, source: str, tc: Toolchain, parallel_steps: bool) -> None:
    _build_into(_entry_dir(spec, key), spec.name, key, f"{spec.name}.cu", source, artifact_steps(spec), tc,
                parallel_steps, {"spec": repr(spec)})


def _build_into(final: Path, name: str, key: str, source_name: str, source: str, steps: dict[str, tuple[str, ...]],
                tc: Toolchain, parallel_steps: bool, meta_extra: dict) -> None:
    """Build ``steps`` (artifact -> nvcc flags) from ``source`` in a temporary directory, write
    meta.json last, and move the directory to ``final`` (the caller holds the entry's lock)."""
    with _temporary_entry(name) as tmp:
        src = tmp / source_name
        src.write_text(source)
        t0 = time.time()
        if parallel_steps and len(steps) > 1:
            with concurrent.futures.ThreadPoolExecutor(len(steps)) as pool:
                futs = {art: pool.submit(_run_nvcc, tc, flags, src, tmp / art) for art, flags in steps.items()}
                commands = {art: f.result() for art, f in futs.items()}
        else:
            commands = {art: _run_nvcc(tc, flags, src, tmp / art) for art, flags in steps.items()}
        meta = {
            "name": name,
            "key": key,
            **meta_extra,
            "mixgemm": __version__,
            "nvcc_version": tc.version.splitlines()[-1] if tc.version else "",
            "commands": commands,
            "build_seconds": round(time.time() - t0, 1),
            "sha256": {art: _sha256(tmp / art) for art in steps},
        }
        _write_meta(tmp, meta)
        _publish(tmp, final)


@contextmanager
def _temporary_entry(name: str):
    """A new temporary entry directory under the cache's ``tmp/`` with its ``owner.json`` (so
    that :func:`stale_temporaries` finds it if this process is killed); removed on the way out
    unless :func:`_publish` moved it into place."""
    tmp_root = cache_dir() / "tmp"
    tmp_root.mkdir(parents=True, exist_ok=True)
    _remove_stale_temporaries()
    tmp = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=tmp_root))
    try:
        (tmp / _OWNER).write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                                              "started": time.time(), "kernel": name}))
        yield tmp
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _write_meta(tmp: Path, meta: dict) -> None:
    meta_tmp = tmp / "meta.json.tmp"
    meta_tmp.write_text(json.dumps(meta, indent=1))
    os.replace(meta_tmp, tmp / "meta.json")          # meta last: its presence marks completeness


def _publish(tmp: Path, final: Path) -> None:
    """Move the complete temporary entry ``tmp`` to ``final`` (the caller holds its lock),
    replacing what is there (a corrupt or stale entry)."""
    (tmp / _OWNER).unlink()
    if final.exists():
        shutil.rmtree(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, final)


def entry_stem(name: str, key: str) -> str:
    """The directory name (and lock name) of a cache entry: ``<name>-<first 20 hex digits of key>``."""
    return f"{name}-{key[:20]}"


def install_entry(kind: str, name: str, key: str, files: "dict[str, bytes]", artifacts: Iterable[str],
                  build_here: "Optional[dict[str, tuple[str, ...]]]" = None, source_name: Optional[str] = None) -> bool:
    """Place an entry built elsewhere (``mixgemm cache import``) at ``<cache>/<kind>/<name>-<key>``,
    atomically, under the entry's lock. ``files`` holds ``meta.json`` (written last) and the
    other files by name; the entry must be valid (:func:`_entry_valid`: meta's name and key,
    every artifact's sha256) once written, else BuildError and nothing changes.

    ``build_here`` (artifact -> nvcc flags) names artifacts that are not taken from ``files`` but
    compiled here, by this install's nvcc, from ``files[source_name]`` (this install's source):
    the host code of an entry from an archive that is not trusted to carry any. Their sha256 and
    command lines replace those of meta.json, which records ``"host_code": "built here"``.

    Returns False, changing nothing, when a valid entry is already there (it is never replaced
    by another); True when this one was placed (replacing an invalid one)."""
    if kind not in ("kernels", "host"):
        raise ValueError(f"kind must be 'kernels' or 'host', got {kind!r}")
    build_here = dict(build_here or {})
    if build_here and source_name not in files:
        raise ValueError("building artifacts here needs source_name, a file of files")
    stem = entry_stem(name, key)
    final = cache_dir() / kind / stem
    artifacts = tuple(artifacts)
    with entry_lock(stem):
        if entry_valid(final, name, key, artifacts):
            return False
        with _temporary_entry(name) as tmp:
            for fname, data in files.items():
                if fname != "meta.json" and fname not in build_here:
                    (tmp / fname).write_bytes(data)
            meta_bytes = files["meta.json"]
            if build_here:
                tc = toolchain()
                t0 = time.time()
                commands = {art: _run_nvcc(tc, flags, tmp / source_name, tmp / art) for art, flags in build_here.items()}
                meta = json.loads(meta_bytes)
                meta["sha256"] = {**meta["sha256"], **{art: _sha256(tmp / art) for art in build_here}}
                if isinstance(meta.get("commands"), dict):
                    meta["commands"] = {**meta["commands"], **commands}
                meta["host_code"] = "built here"
                meta["host_build_seconds"] = round(time.time() - t0, 1)
                meta_bytes = json.dumps(meta, indent=1).encode()
            (tmp / "meta.json.tmp").write_bytes(meta_bytes)
            os.replace(tmp / "meta.json.tmp", tmp / "meta.json")
            if not entry_valid(tmp, name, key, artifacts):
                raise BuildError(f"{stem}: its files do not match its meta.json")
            _publish(tmp, final)
    return True


def build(spec: KernelSpec, *, force: bool = False, parallel_steps: bool = True,
          announce: bool = False) -> Artifacts:
    """Build ``spec`` into the cache unless a valid entry exists; return its artifacts.

    With ``announce`` a log line says that a kernel is being built (the JIT path)."""
    tc = toolchain()
    source = render(spec)
    key = cache_key(spec, source, tc)
    entry = _entry_dir(spec, key)
    with _locked(spec, key):
        if force or not _valid(entry, spec, key):
            if announce:
                log.warning("mixgemm: building kernel %s (%s); %s", spec.name, _why_build(entry),
                            build_time_hint(spec))
            _build_entry(spec, key, source, tc, parallel_steps)
    return Artifacts(spec, key, entry)


def build_time_hint(spec: KernelSpec) -> str:
    """How long a build of ``spec`` takes, for the log line of a first use: an sm90 GEMM kernel
    15-100 s (CUTLASS's collective; a free core and the two nvcc steps in parallel at the low end),
    a decode or dequant kernel a few seconds (README, "No compile stall on first use")."""
    if isinstance(spec, GemmSpec):
        return "this takes about a minute"
    return "this takes a few seconds"


def _why_build(entry: Path) -> str:
    if entry.exists():
        return f"its cache entry {entry} is incomplete or corrupt: its files do not match meta.json"
    return f"first use, not in the cache {cache_dir()}"


def load_artifacts(spec: KernelSpec, *, build_if_missing: bool = True) -> tuple[Artifacts, bytes]:
    """The cubin bytes of ``spec`` (validated against meta.json), building it first if it is not
    in the cache (or its entry is corrupt). Build and read happen under the entry's lock."""
    tc = toolchain()
    source = render(spec)
    key = cache_key(spec, source, tc)
    entry = _entry_dir(spec, key)
    with _locked(spec, key):
        if not _valid(entry, spec, key):
            if not build_if_missing:
                raise BuildError(f"kernel {spec.name} is not in the cache {cache_dir()}")
            log.warning("mixgemm: building kernel %s (%s); %s", spec.name, _why_build(entry),
                        build_time_hint(spec))
            _build_entry(spec, key, source, tc, parallel_steps=True)
        art = Artifacts(spec, key, entry)
        return art, art.read_cubin()


def is_cached(spec: KernelSpec) -> bool:
    tc = toolchain()
    source = render(spec)
    key = cache_key(spec, source, tc)
    with _locked(spec, key):
        return _valid(_entry_dir(spec, key), spec, key)


#: Flags of mixgemm's own host libraries (the compiled launcher): host C++ only, no device code.
HOST_LIBRARY_FLAGS = ("-std=c++17", "-O2", "-shared", "-Xcompiler=-fPIC", "-Xlinker=--strip-all")


def host_library_key(name: str, source: str, tc: Toolchain, flags: Sequence[str] = HOST_LIBRARY_FLAGS,
                     key_extra: Optional[dict] = None) -> str:
    """sha256 of everything that determines a host library built by :func:`load_host_library`."""
    material = {
        "kind": "host-library",
        "mixgemm": __version__,
        "name": name,
        "source": source,
        "headers": headers_digest(source),
        "nvcc_version": tc.version,
        "flags": list(flags),
        "extra_flags": extra_flags(),
        "env": {v: os.environ.get(v, "") for v in KEY_ENV_VARS},
    }
    if key_extra:
        material["extra"] = key_extra
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()


def load_host_library(name: str, source: str, load: Callable[[Path], T], flags: Sequence[str] = HOST_LIBRARY_FLAGS,
                      key_extra: Optional[dict] = None) -> T:
    """Build the C++ ``source`` (host code; it may include mixgemm's headers) into
    ``<cache>/host/<name>-<key>/<name>.so`` unless a valid entry exists, and return
    ``load(path)``, called under the entry's lock (so no other process replaces the file while it
    is opened). The cache rules are the kernels': content-addressed key, one file lock per entry,
    atomic publication, an entry whose sha256 does not match meta.json is rebuilt. ``flags``
    (nvcc's) and ``key_extra`` (what else the build depends on, e.g. the torch it compiles
    against) enter the key."""
    tc = toolchain()
    key = host_library_key(name, source, tc, flags, key_extra)
    stem = entry_stem(name, key)
    entry = cache_dir() / "host" / stem
    artifact = f"{name}.so"
    with entry_lock(stem):
        if not entry_valid(entry, name, key, (artifact,)):
            log.info("mixgemm: building %s (host library) in %s", name, cache_dir())
            _build_into(entry, name, key, f"{name}.cpp", source, {artifact: tuple(flags)}, tc, False, {})
        return load(entry / artifact)


def build_many(specs: Iterable[KernelSpec], jobs: Optional[int] = None, *, force: bool = False,
               progress: bool = True) -> list[Artifacts]:
    """Build several kernels in parallel (``jobs`` nvcc builds at a time), with a progress bar.
    Raises BuildError listing every failure after the others have finished."""
    specs = list(specs)
    jobs = jobs or max(1, (os.cpu_count() or 2) // 2)
    results: dict[str, Artifacts] = {}
    errors: list[str] = []
    bar = None
    if progress:
        from tqdm import tqdm   # deferred: loaded only when a progress bar is shown
        bar = tqdm(total=len(specs), desc="mixgemm build", unit="kernel")
    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        futs = {pool.submit(build, s, force=force, parallel_steps=False): s for s in specs}
        for fut in concurrent.futures.as_completed(futs):
            spec = futs[fut]
            try:
                results[spec.name] = fut.result()
            except BuildError as e:
                errors.append(str(e))
            if bar is not None:
                bar.update(1)
                bar.set_postfix_str(spec.name[-40:])
    if bar is not None:
        bar.close()
    if errors:
        raise BuildError(f"{len(errors)} of {len(specs)} kernels failed to build:\n\n" + "\n\n".join(errors))
    return [results[s.name] for s in specs]
