"""Moving a warm kernel cache between machines: ``mixgemm cache list / export / import``.

An archive is a gzip-compressed tar holding ``mixgemm-cache.json`` (the manifest: its format,
the exporting mixgemm and nvcc, the entries) and, per cache entry, ``kernels/<name>-<key>/``
(a kernel: ``meta.json``, ``kernel.cubin`` and, for a GEMM or decode kernel, ``helper.so``)
or ``host/<name>-<key>/`` (the compiled launcher: ``meta.json``, ``launcher.so``), as
:mod:`mixgemm.jit.build` lays them out.

Export takes the entries that are valid for **this** install (each artifact matches its
sha256 in meta.json, and the entry's key is the one this install computes for it), optionally
those whose name matches a regular expression.

Import checks every entry before anything is written, and refuses, with a message per entry:

* **foreign** members: anything but the manifest and ``kernels|host/<name>-<key>/<file>``
  (absolute paths, ``..``, links, devices, other directories), a name that is not a mixgemm
  kernel or host library, a directory name that does not match its meta.json, unexpected files;
* **corrupt** entries: a missing artifact or one whose sha256 differs from meta.json;
* **stale** entries: a key other than the one this install computes for that kernel -- built by
  another mixgemm version, from other headers, with another nvcc, other flags or nvcc
  environment (:func:`mixgemm.jit.build.cache_key`, :func:`mixgemm.jit.build.host_library_key`).

Trust: an archive's ``kernel.cubin`` is device code, loaded by the CUDA driver and run on the
GPU; its ``helper.so`` and ``launcher.so`` are host code, loaded with ``ctypes`` into every process
that uses the cache. The checks above compare an entry with the archive's own meta.json, so a
crafted archive with consistent metadata passes them; they cannot tell where the code came from.
So, by default, import never reads an archive's host libraries: it takes the cubins and compiles
each imported entry's host library here, with this install's nvcc and sources (the same flags as
a build; the entry's key, which covers the sources, flags and nvcc, is unchanged, and its
meta.json records ``"host_code": "built here"``). That costs the host half of each build (a
GEMM kernel's helper, the launcher: nvcc's host-only compiles) at import time, and nothing at the
first token. ``trust_host_code=True`` (``--trust-host-code``) takes the
archive's host libraries as they are, for an archive trusted like the code one runs.

An accepted entry is written like a build's (:func:`mixgemm.jit.build.install_entry`: a temporary
directory, checked again, then renamed into place under the entry's lock); a valid entry that
is already in the cache is kept, never replaced. The archive's members are read as data
only: no path from the archive is ever used to write a file, and its kernel sources are not
copied (the cache gets this install's rendering).
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import io
import json
import os
import re
import tarfile
import time
from pathlib import Path
from typing import Callable, Optional, Union

from .._version import __version__
from ..errors import BuildError, UserError
from ..utils.atomic import check_target, replacing
from . import build, launcher, torch_ops
from .render import render
from .specs import parse_name

__all__ = ["ARCHIVE_FORMAT", "CacheEntry", "ImportReport", "ExportReport", "list_entries", "export_cache",
           "import_cache"]

#: The manifest's ``format`` field, and its file name in the archive.
ARCHIVE_FORMAT = "mixgemm.kernel-cache"
ARCHIVE_VERSION = 1
MANIFEST = "mixgemm-cache.json"
KINDS = ("kernels", "host")
#: Larger members are refused (a cubin is a few MB; meta.json a few KB).
MAX_ARTIFACT_BYTES = 512 << 20
MAX_META_BYTES = 1 << 20

_STEM = re.compile(r"^(?P<name>[A-Za-z0-9_.]+(?:-[A-Za-z0-9_.]+)*)-(?P<key>[0-9a-f]{20})$")
_FILE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")
_KEY = re.compile(r"^[0-9a-f]{64}$")


def _host_sources() -> dict[str, Callable[[], tuple[str, tuple, Optional[dict]]]]:
    """mixgemm's host libraries (built by :func:`mixgemm.jit.build.load_host_library`): name ->
    (source, nvcc flags, what else enters the key). The torch operator library is one where this
    torch can take it (it builds against the installed torch)."""
    sources = {"launcher": lambda: (launcher.SOURCE.read_text(), build.HOST_LIBRARY_FLAGS, None)}
    if not torch_ops.available():
        sources[torch_ops.NAME] = lambda: (torch_ops.SOURCE.read_text(), torch_ops.build_flags(),
                                           torch_ops.key_extra())
    return sources


@dataclasses.dataclass(frozen=True)
class _Expected:
    """What this install expects of an entry of that kind and name."""

    key: str
    artifacts: tuple[str, ...]
    source_name: str
    source: str
    steps: dict                     # artifact -> the nvcc flags that build it

    @property
    def host_code(self) -> tuple[str, ...]:
        """The artifacts that run on the host, in the importing process (``.so`` libraries)."""
        return tuple(a for a in self.artifacts if a.endswith(".so"))


def _expected(kind: str, name: str, tc: build.Toolchain) -> _Expected:
    """This install's key, artifacts and source for the entry; ValueError if mixgemm has no
    kernel (or host library) of that name."""
    if kind == "kernels":
        spec = parse_name(name)          # ValueError for a name that is not a mixgemm kernel's
        if spec.name != name:
            raise ValueError(f"{name!r} is not the canonical name of a mixgemm kernel")
        source = render(spec)
        steps = build.artifact_steps(spec)
        return _Expected(build.cache_key(spec, source, tc), tuple(steps), f"{name}.cu", source, steps)
    sources = _host_sources()
    if name not in sources:
        raise ValueError(f"{name!r} is not one of mixgemm's host libraries ({', '.join(sources)})")
    source, flags, key_extra = sources[name]()
    return _Expected(build.host_library_key(name, source, tc, flags, key_extra), (f"{name}.so",), f"{name}.cpp",
                     source, {f"{name}.so": tuple(flags)})


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _stale_reason(meta: dict, tc: build.Toolchain) -> str:
    """Why an entry's key is not this install's, as far as its meta.json tells."""
    theirs = str(meta.get("mixgemm", "?"))
    if theirs != __version__:
        return f"built by mixgemm {theirs}, this is mixgemm {__version__}"
    nvcc = str(meta.get("nvcc_version", ""))
    mine = tc.version.splitlines()[-1] if tc.version else ""
    if nvcc and nvcc != mine:
        return f"built with nvcc '{nvcc}', this install has '{mine}'"
    return ("built from other mixgemm headers or sources, or with other nvcc flags or environment "
            f"({', '.join(build.KEY_ENV_VARS)})")


# ---------------------------------------------------------------------------------------------
# Listing
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class CacheEntry:
    """One entry of the local cache.

    ``state``: ``"current"`` (valid, and this install's key: it is used), ``"stale"`` (valid,
    another key: never used, e.g. left by an older mixgemm), ``"corrupt"`` (files do not match
    meta.json: rebuilt on use) or ``"foreign"`` (not a mixgemm entry)."""

    kind: str
    directory: Path
    name: str
    state: str
    detail: str = ""
    build_seconds: Optional[float] = None
    nbytes: int = 0


def _read_meta(directory: Path) -> dict:
    meta = json.loads((directory / "meta.json").read_text())
    if not isinstance(meta, dict) or not isinstance(meta.get("name"), str) or not isinstance(meta.get("key"), str) \
            or not isinstance(meta.get("sha256"), dict):
        raise ValueError("meta.json lacks name, key or sha256")
    return meta


def _classify(kind: str, directory: Path, tc: Optional[build.Toolchain]) -> CacheEntry:
    try:
        meta = _read_meta(directory)
    except (OSError, ValueError) as e:
        return CacheEntry(kind, directory, directory.name, "corrupt", f"no readable meta.json ({e})")
    name = meta["name"]
    size = sum(f.stat().st_size for f in directory.iterdir() if f.is_file())
    seconds = meta.get("build_seconds") if isinstance(meta.get("build_seconds"), (int, float)) else None

    def made(state: str, detail: str = "") -> CacheEntry:
        return CacheEntry(kind, directory, name, state, detail, seconds, size)

    if directory.name != build.entry_stem(name, meta["key"]):
        return made("foreign", f"its directory name does not match its meta.json ({name}, {meta['key'][:20]})")
    if tc is None:
        expected = None
    else:
        try:
            expected = _expected(kind, name, tc)
        except ValueError as e:
            return made("foreign", str(e))
    artifacts = expected.artifacts if expected else tuple(meta["sha256"])
    if not build.entry_valid(directory, name, meta["key"], artifacts):
        return made("corrupt", "its files do not match meta.json (rebuilt on first use)")
    if expected is None:
        return made("unchecked", "no nvcc: this install's key cannot be computed")
    if meta["key"] != expected.key:
        return made("stale", _stale_reason(meta, tc))
    return made("current")


def list_entries(pattern: "Optional[re.Pattern[str]]" = None) -> list[CacheEntry]:
    """The entries of the cache (:func:`mixgemm.jit.build.cache_dir`), kernels then host
    libraries, by name; with ``pattern``, those whose name it matches (``re.search``). Without
    nvcc their state is ``"unchecked"`` (the key needs nvcc's version)."""
    try:
        tc = build.toolchain()
    except BuildError:
        tc = None
    out = []
    for kind in KINDS:
        root = build.cache_dir() / kind
        if not root.is_dir():
            continue
        for directory in sorted(p for p in root.iterdir() if p.is_dir()):
            entry = _classify(kind, directory, tc)
            if pattern is None or pattern.search(entry.name):
                out.append(entry)
    return out


# ---------------------------------------------------------------------------------------------
# Export
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ExportReport:
    exported: list[CacheEntry]
    skipped: list[CacheEntry]      # stale, corrupt or foreign entries that matched
    path: Path
    nbytes: int


def _tarinfo(name: str, data: bytes, mode: int = 0o644) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = len(data), mode, int(time.time())
    info.uname = info.gname = ""
    return info


def export_cache(path: Union[str, os.PathLike], pattern: "Optional[re.Pattern[str]]" = None,
                 force: bool = False) -> ExportReport:
    """Write the current entries of the cache (those this install uses; with ``pattern``, those
    whose name matches) to a gzip-compressed tar at ``path``.

    The file is written under a temporary name in its directory and renamed when complete
    (:func:`mixgemm.utils.atomic.replacing`). Each entry's files are read under its lock and checked
    against meta.json as they are written.

    Raises
    ------
    mixgemm.errors.OutputPathError
        ``path`` is refused before any work (:func:`mixgemm.utils.atomic.check_target`): it exists
        (without ``force``), is a directory or anything but a regular file, or its directory does
        not exist.
    mixgemm.errors.UserError
        No entry is current (nothing to export).
    mixgemm.errors.BuildError
        No nvcc (the keys need its version).
    """
    path = Path(check_target(path, replace=force))
    build.toolchain()
    entries = list_entries(pattern)
    current = [e for e in entries if e.state == "current"]
    skipped = [e for e in entries if e.state != "current"]
    if not current:
        what = f" matching {pattern.pattern!r}" if pattern is not None else ""
        raise UserError(f"no current cache entry{what} in {build.cache_dir()} to export "
                        f"({len(skipped)} stale, corrupt or foreign)")
    exported = []
    with replacing(path) as tmp, open(tmp, "wb") as raw, \
            tarfile.open(fileobj=raw, mode="w:gz", format=tarfile.PAX_FORMAT) as tar:
        manifest = {"format": ARCHIVE_FORMAT, "version": ARCHIVE_VERSION, "mixgemm": __version__,
                    "nvcc_version": build.toolchain().version.splitlines()[-1],
                    "entries": [f"{e.kind}/{e.directory.name}" for e in current]}
        data = json.dumps(manifest, indent=1).encode()
        tar.addfile(_tarinfo(MANIFEST, data), io.BytesIO(data))
        for e in current:
            if _add_entry(tar, e):
                exported.append(e)
            else:
                skipped.append(dataclasses.replace(e, state="corrupt", detail="changed while exporting"))
    return ExportReport(exported, skipped, path, path.stat().st_size)


def _add_entry(tar: tarfile.TarFile, e: CacheEntry) -> bool:
    """Add the entry's meta.json and artifacts, read under its lock and checked; False if they no
    longer match meta.json."""
    with build.entry_lock(e.directory.name):
        try:
            meta_bytes = (e.directory / "meta.json").read_bytes()
            meta = json.loads(meta_bytes)
            files = {name: (e.directory / name).read_bytes() for name in meta["sha256"]}
        except (OSError, ValueError, KeyError, TypeError):
            return False
    if any(_sha256(data) != meta["sha256"][name] for name, data in files.items()):
        return False
    prefix = f"{e.kind}/{e.directory.name}"
    for name, data in sorted(files.items()):
        tar.addfile(_tarinfo(f"{prefix}/{name}", data, 0o755 if name.endswith(".so") else 0o644), io.BytesIO(data))
    tar.addfile(_tarinfo(f"{prefix}/meta.json", meta_bytes), io.BytesIO(meta_bytes))
    return True


# ---------------------------------------------------------------------------------------------
# Import
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass
class ImportReport:
    """What :func:`import_cache` did: entry names imported, already present, and refused
    (``(what, why)``: an entry, or an archive member that is not one); of those imported, the
    ones whose host code was built here."""

    imported: list[str] = dataclasses.field(default_factory=list)
    present: list[str] = dataclasses.field(default_factory=list)
    refused: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    #: Imported entries whose host code (helper.so, launcher.so) was compiled here, not taken
    #: from the archive (every imported entry with host code, unless trust_host_code).
    host_built: list[str] = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.refused


def _member_entry(member: tarfile.TarInfo) -> tuple[Optional[tuple[str, str, str]], str]:
    """``((kind, stem, file), "")`` for a member that belongs to a cache entry, ``(None, "")``
    for the manifest and plain directories, else ``(None, why it is refused)``."""
    name = member.name
    if name.startswith("/") or "\\" in name or "\0" in name:
        return None, "absolute or unsafe path"
    parts = name.split("/")
    while parts and parts[-1] == "" and member.isdir():
        parts.pop()
    if any(p in ("", ".", "..") for p in parts):
        return None, "unsafe path ('..', '.' or an empty component)"
    if member.issym() or member.islnk():
        return None, "a link"
    if not (member.isfile() or member.isdir()):
        return None, "not a regular file"
    if member.isdir():
        if len(parts) <= 2 and parts[0] in KINDS and (len(parts) == 1 or _STEM.match(parts[1])):
            return None, ""
        return None, "a directory that is not a cache entry's"
    if parts == [MANIFEST]:
        return None, ""
    if len(parts) != 3 or parts[0] not in KINDS or not _STEM.match(parts[1]) or not _FILE.match(parts[2]):
        return None, "not a mixgemm cache entry (kernels/<name>-<key>/<file> or host/<name>-<key>/<file>)"
    return (parts[0], parts[1], parts[2]), ""


def _read(tar: tarfile.TarFile, member: tarfile.TarInfo, limit: int) -> bytes:
    if member.size > limit:
        raise ValueError(f"{member.name} is {member.size} bytes (more than {limit})")
    f = tar.extractfile(member)
    if f is None:
        raise ValueError(f"{member.name} cannot be read")
    data = f.read(limit + 1)
    if len(data) != member.size:
        raise ValueError(f"{member.name} is truncated")
    return data


def import_cache(path: Union[str, os.PathLike],
                 progress: Optional[Callable[[str, str], None]] = None, *, trust_host_code: bool = False,
                 jobs: Optional[int] = None) -> ImportReport:
    """Import the entries of an archive written by :func:`export_cache` into the cache.

    Every entry is checked (see the module docstring) and either imported, found already
    present (valid: kept as is) or refused with a reason; the archive's other members are
    refused too. All entries are read and checked before the first is written, so an archive
    that cannot be read to its end imports nothing. ``progress(entry, outcome)`` is called per
    entry (``"imported"``, ``"present"`` or ``"refused"``).

    Parameters
    ----------
    path : str or os.PathLike
        The archive.
    progress : callable, optional
        ``progress(entry, outcome)``, called per entry.
    trust_host_code : bool, default False
        Take the archive's host libraries (each kernel's ``helper.so``, the compiled launcher's
        ``launcher.so``) as they are. They run in the process that uses the cache, and nothing
        in an archive can prove where they came from (the sha256 of meta.json is the archive's
        own), so by default they are never read: only the device code (``kernel.cubin``) is
        imported, and the host libraries are compiled here, by this install's nvcc, from this
        install's sources (see the module docstring).
    jobs : int, optional
        Host libraries compiled at a time (default: half the CPU cores).

    Raises
    ------
    mixgemm.errors.UserError
        ``path`` is missing, a directory or not a regular file, not a tar archive, or has no
        mixgemm manifest (nothing is imported then).
    mixgemm.errors.BuildError
        No nvcc (this install's keys need its version).
    """
    path = Path(path)
    if path.is_dir():
        raise UserError(f"{path} is a directory; give the archive file that `mixgemm cache export` wrote")
    if not path.exists():
        raise UserError(f"{path}: no such file")
    if not path.is_file():
        raise UserError(f"{path} is not a regular file; give the archive file that `mixgemm cache export` wrote")
    try:
        tar = tarfile.open(path, mode="r:*")
    except tarfile.ReadError:
        raise UserError(f"{path} is not a tar archive (plain, gzip, bzip2 or xz); give the archive file that "
                        f"`mixgemm cache export` wrote") from None
    except (tarfile.TarError, OSError, EOFError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise UserError(f"{path}: cannot read it as a tar archive ({first})") from None
    report = ImportReport()
    with tar:
        tc = build.toolchain()
        try:
            members = tar.getmembers()
        except (tarfile.TarError, OSError, EOFError) as e:
            raise UserError(f"{path}: a corrupt or truncated archive ({e})") from None
        manifest = [m for m in members if m.name == MANIFEST and m.isfile()]
        if not manifest:
            raise UserError(f"{path} is not a mixgemm cache archive (it has no {MANIFEST}; write one with "
                            f"`mixgemm cache export`)")
        try:
            info = json.loads(_read(tar, manifest[0], MAX_META_BYTES))
        except (ValueError, OSError, tarfile.TarError) as e:
            raise UserError(f"{path}: unreadable {MANIFEST} ({e})") from None
        if not isinstance(info, dict) or info.get("format") != ARCHIVE_FORMAT:
            raise UserError(f"{path}: {MANIFEST} is not a {ARCHIVE_FORMAT} manifest")
        if not isinstance(info.get("version"), int) or info["version"] > ARCHIVE_VERSION:
            raise UserError(f"{path}: archive version {info.get('version')!r}; this mixgemm reads version "
                            f"{ARCHIVE_VERSION} (upgrade mixgemm)")
        entries: dict[tuple[str, str], dict[str, tarfile.TarInfo]] = {}
        for m in members:
            where, why = _member_entry(m)
            if why:
                report.refused.append((m.name, f"foreign: {why}"))
            elif where is not None:
                kind, stem, fname = where
                files = entries.setdefault((kind, stem), {})
                if fname in files:
                    report.refused.append((m.name, "foreign: the archive holds this file twice"))
                files[fname] = m
        accepted, refused = [], []          # every entry is checked before any is written
        # in the archive's order, each entry's files read in theirs: a compressed archive is read
        # once, front to back (a member read after a later one decompresses the stream again from
        # its start)
        for (kind, stem), files in sorted(entries.items(), key=lambda item: min(m.offset for m in item[1].values())):
            label = f"{kind}/{stem}"
            checked = _check_entry(_prefetch(tar, files, trust_host_code), kind, stem, set(files), tc,
                                   trust_host_code)
            if isinstance(checked, str):
                refused.append((label, checked))
                if progress is not None:
                    progress(label, "refused")
            else:
                accepted.append((label, kind, checked))
        report.refused += sorted(refused)
        accepted.sort(key=lambda item: item[0])
    def install(item):
        label, kind, (name, key, files, artifacts, build_here, source_name) = item
        try:
            return label, bool(build_here), build.install_entry(kind, name, key, files, artifacts, build_here,
                                                                source_name)
        except (BuildError, OSError) as e:
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            return label, bool(build_here), f"not written: {first}"

    workers = max(1, jobs or (os.cpu_count() or 2) // 2) if any(item[2][4] for item in accepted) else 1
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        for label, built_here, placed in pool.map(install, accepted):
            if isinstance(placed, str):
                report.refused.append((label, placed))
                outcome = "refused"
            else:
                (report.imported if placed else report.present).append(label)
                if placed and built_here:
                    report.host_built.append(label)
                outcome = "imported" if placed else "present"
            if progress is not None:
                progress(label, outcome)
    return report


def _prefetch(tar: tarfile.TarFile, members: dict[str, tarfile.TarInfo],
              trust_host_code: bool) -> Callable[[str], bytes]:
    """``read(file)``: an entry's file as read from the archive (or the error reading it raised),
    all of them read at once in the archive's order. Host libraries (``*.so``) are not read
    unless ``trust_host_code``."""
    data: dict[str, Union[bytes, Exception]] = {}
    for fname, m in sorted(members.items(), key=lambda item: item[1].offset):
        if fname.endswith(".so") and not trust_host_code:
            continue
        try:
            data[fname] = _read(tar, m, MAX_META_BYTES if fname == "meta.json" else MAX_ARTIFACT_BYTES)
        except (ValueError, OSError, tarfile.TarError) as e:
            data[fname] = e

    def read(fname: str) -> bytes:
        got = data.get(fname)
        if got is None:
            raise ValueError(f"{fname} was not read")
        if isinstance(got, Exception):
            raise got
        return got
    return read


def _check_entry(read: Callable[[str], bytes], kind: str, stem: str, members: set[str],
                 tc: build.Toolchain, trust_host_code: bool = False) -> "Union[str, tuple]":
    """``(name, key, files, artifacts, build_here, source_name)`` for
    :func:`mixgemm.jit.build.install_entry`, or the reason the entry is refused. Unless
    ``trust_host_code``, the entry's host libraries are not read from the archive: ``build_here``
    names them, with their flags, to be compiled from this install's source."""
    if "meta.json" not in members:
        return "foreign: no meta.json"
    try:
        meta_bytes = read("meta.json")
        meta = json.loads(meta_bytes)
    except (ValueError, OSError, tarfile.TarError) as e:
        return f"corrupt: unreadable meta.json ({e})"
    if not isinstance(meta, dict) or not isinstance(meta.get("name"), str) or not isinstance(meta.get("key"), str) \
            or not _KEY.match(meta["key"]) or not isinstance(meta.get("sha256"), dict):
        return "foreign: meta.json lacks its name, key or sha256"
    name, key = meta["name"], meta["key"]
    if build.entry_stem(name, key) != stem:
        return f"foreign: the directory name does not match its meta.json ({build.entry_stem(name, key)})"
    try:
        expected = _expected(kind, name, tc)
    except ValueError as e:
        return f"foreign: {e}"
    allowed = set(expected.artifacts) | {"meta.json", expected.source_name}
    extra = sorted(set(members) - allowed)
    if extra:
        return f"foreign: unexpected files {extra}"
    if set(meta["sha256"]) != set(expected.artifacts):
        return f"foreign: meta.json lists {sorted(meta['sha256'])}, a {kind} entry holds {list(expected.artifacts)}"
    missing = [a for a in expected.artifacts if a not in members]
    if missing:
        return f"corrupt: missing {missing}"
    if key != expected.key:
        return f"stale: {_stale_reason(meta, tc)}"
    build_here = {} if trust_host_code else {a: expected.steps[a] for a in expected.host_code}
    taken = [a for a in expected.artifacts if a not in build_here]
    files = {"meta.json": meta_bytes}
    try:
        for a in taken:
            files[a] = read(a)
    except (ValueError, OSError, tarfile.TarError) as e:
        return f"corrupt: {e}"
    bad = [a for a in taken if _sha256(files[a]) != meta["sha256"][a]]
    if bad:
        return f"corrupt: {bad} do not match their sha256 in meta.json"
    files[expected.source_name] = expected.source.encode()
    return name, key, files, expected.artifacts, build_here, expected.source_name
