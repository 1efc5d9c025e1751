"""Packaging hook: ship the C++ headers (cutlass_ext/, converters/) inside the wheel.

The headers live at the repository root (fixed by the design card); the JIT compiler needs them
at run time, so a regular (non-editable) install copies them to ``mixgemm/_include``.
An editable install or a source checkout finds them at the repository root instead
(see ``mixgemm.jit.env``).

The two trees are copied whole: no file is left out by its name. (A name filter once dropped
``collective/builder.hpp`` with the build outputs it meant to skip, and no installed mixgemm
could build a GEMM kernel: issue #15.) Nothing is ever built inside these trees, so there is
nothing to filter; tests/test_wheel.py checks that the wheel holds exactly their files and that
every kernel's include closure resolves against the installed package. MANIFEST.in puts the
same trees into the sdist.
"""
import os
import shutil

from setuptools import setup
from setuptools.command.build_py import build_py

_HEADER_DIRS = ("cutlass_ext", "converters")


class BuildPyWithHeaders(build_py):
    def run(self):
        super().run()
        here = os.path.dirname(os.path.abspath(__file__))
        dest_root = os.path.join(self.build_lib, "mixgemm", "_include")
        for name in _HEADER_DIRS:
            src = os.path.join(here, name)
            if not os.path.isdir(src):
                raise FileNotFoundError(f"{src} is missing: mixgemm's headers must be built from a "
                                        f"full source tree (a checkout or the sdist)")
            dst = os.path.join(dest_root, name)
            if os.path.isdir(dst):
                shutil.rmtree(dst)      # a stale copy from an earlier build
            shutil.copytree(src, dst)


setup(cmdclass={"build_py": BuildPyWithHeaders})
