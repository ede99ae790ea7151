"""Builds (or finds) libshadowkv and puts a copy into the package.

`pip install ./python` from a clone: this runs `make lib` in the repository root (a no-op
when build/ is up to date; the Makefile installs its Debian packages when needed, and
builds the cuda plugin when nvcc is found: SKV_CUDA=0 in the environment skips it). The
library and, when it was built, the cuda plugin (libshadowkv-cuda.so.0, which the library
opens at run time from its own directory) are copied into the built package, not into the
source tree, so a source checkout keeps loading build/libshadowkv.so. The installed
package imports on a machine with no GPU and no CUDA library. SHADOWKV_LIBDIR=/path names
a directory holding an installed libshadowkv.so.0 instead (nothing is built then).
The wheel is tagged for this platform: it carries a shared library.
"""
import os
import shutil
import subprocess

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
LIBS = ("libshadowkv.so.0", "libshadowkv-cuda.so.0")


class BuildWithLibrary(build_py):
    def run(self):
        super().run()
        libdir = os.environ.get("SHADOWKV_LIBDIR")
        if libdir:
            lib = os.path.join(libdir, "libshadowkv.so.0")
            plugin = os.path.join(libdir, "libshadowkv-cuda.so.0")
        else:
            if not os.path.exists(os.path.join(REPO, "Makefile")):
                raise RuntimeError(f"no libshadowkv source tree at {REPO}; set SHADOWKV_LIBDIR to an installed library")
            subprocess.check_call(["make", "-C", REPO, "lib"])
            lib = os.path.join(REPO, "build", "libshadowkv.so")
            plugin = os.path.join(REPO, "build", "libshadowkv-cuda.so.0")
        if not os.path.exists(lib):
            raise RuntimeError(f"libshadowkv not found at {lib}")
        pkg = os.path.join(self.build_lib, "shadowkv")
        os.makedirs(pkg, exist_ok=True)
        for name in LIBS:  # nothing stale from an earlier build
            if os.path.exists(os.path.join(pkg, name)):
                os.remove(os.path.join(pkg, name))
        shutil.copy2(lib, os.path.join(pkg, "libshadowkv.so.0"))
        if os.path.exists(plugin):
            shutil.copy2(plugin, os.path.join(pkg, "libshadowkv-cuda.so.0"))


class BinaryDistribution(Distribution):
    def has_ext_modules(self):  # a platform wheel: the package holds a shared library
        return True


setup(cmdclass={"build_py": BuildWithLibrary}, distclass=BinaryDistribution)
