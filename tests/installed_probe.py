"""Run by tests/test_wheel.py with the Python of a fresh virtual environment into which only the
mixgemm wheel was installed (a copy of this file is run from a temporary directory, so that no
checkout directory lands on sys.path). Prints one JSON object on stdout.

    python installed_probe.py where              where mixgemm and its headers were found
    python installed_probe.py closure NAME...    the include closure of each named kernel
    python installed_probe.py build NAME         build one kernel into $MIXGEMM_CACHE_DIR
    python installed_probe.py launcher           build the compiled launcher into $MIXGEMM_CACHE_DIR
"""
import json
import os
import re
import sys

#: Every #include line: the delimiter ('"' or '<') and the name.
_INCLUDE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]', re.M)


def where() -> dict:
    import mixgemm
    from mixgemm.jit import env as paths

    return {"mixgemm": mixgemm.__file__, "version": mixgemm.__version__, "sys_path": sys.path,
            "source_root": str(paths.source_root()), "cutlass": str(paths.cutlass_include_dir()),
            "env": {k: os.environ.get(k) for k in ("MIXGEMM_SOURCE_DIR", "PYTHONPATH")}}


def closure(names: list) -> dict:
    """Render each kernel and follow its #includes, as the preprocessor does with mixgemm's
    flags (-I cutlass_ext -I converters -I <CUTLASS>): a quoted include is looked up next to the
    including file first, then in the -I directories; an angle include in the -I directories,
    else it is a system or CUDA header. mixgemm's own headers are followed transitively; a
    CUTLASS header must exist but is not followed (it belongs to the nvidia-cutlass package).
    Also runs the build's own resolver (mixgemm.jit.build.headers_digest) on every source."""
    from mixgemm.jit import build, render as codegen, env as paths, specs

    roots = [paths.cutlass_ext_dir(), paths.converters_dir()]
    search = roots + [paths.cutlass_include_dir()]
    ours, cutlass, missing, digest_errors = set(), set(), {}, {}
    memo: dict = {}

    def includes_of(text: str, here):
        found = []
        for delim, name in _INCLUDE.findall(text):
            dirs = ([here] if delim == '"' and here is not None else []) + search
            path = next((d / name for d in dirs if (d / name).is_file()), None)
            found.append((delim, name, path))
        return found

    for kname in names:
        spec = specs.parse_name(kname)
        source = codegen.render(spec)
        try:
            build.headers_digest(source)
        except build.BuildError as e:
            digest_errors[kname] = str(e)
        todo, seen = [(source, None, kname)], set()
        while todo:
            text, here, who = todo.pop()
            for delim, name, path in includes_of(text, here):
                if path is None:
                    if delim == '"':
                        missing.setdefault(f"{who}: {name}", kname)
                    continue
                path = path.resolve()
                if any(path.is_relative_to(r.resolve()) for r in roots):
                    ours.add(str(path))
                    if path not in seen:
                        seen.add(path)
                        if path not in memo:
                            memo[path] = path.read_text()
                        todo.append((memo[path], path.parent, str(path)))
                else:
                    cutlass.add(name)
    return {"kernels": len(names), "mixgemm_headers": sorted(ours), "cutlass_headers": sorted(cutlass),
            "missing": missing, "digest_errors": digest_errors}


def build_one(name: str) -> dict:
    from mixgemm.jit import build, specs

    art = build.build(specs.parse_name(name))
    meta = json.loads((art.directory / "meta.json").read_text())
    return {"cubin": str(art.cubin_path), "cubin_head": art.read_cubin()[:4].hex(),
            "helper": None if art.helper_path is None else str(art.helper_path),
            "commands": meta["commands"]}


def launcher() -> dict:
    """The compiled launcher (package data mixgemm/jit/csrc/launcher.cpp, with the installed headers)."""
    from mixgemm.jit import launcher as lau

    path = lau.build_compiled()
    return {"source": str(lau.SOURCE), "library": str(path), "head": path.read_bytes()[:4].hex()}


if __name__ == "__main__":
    what, args = sys.argv[1], sys.argv[2:]
    result = {"where": lambda: where(), "closure": lambda: closure(args),
              "build": lambda: build_one(args[0]), "launcher": launcher}[what]()
    print(json.dumps(result))
