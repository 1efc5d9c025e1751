"""Packaging hook: ship the C++ headers (cutlass_ext/, converters/) inside the wheel.

The headers live at the repository root (fixed by the design card); the JIT compiler needs them
at run time, so a regular (non-editable) install copies them to ``mixgemm/_include``.
An editable install or a source checkout finds them at the repository root instead
(see ``mixgemm.paths``).
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
            dst = os.path.join(dest_root, name)
            if os.path.isdir(dst):
                shutil.rmtree(dst)
            shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.o", "*.so", "build*"))


setup(cmdclass={"build_py": BuildPyWithHeaders})
