"""Builds (or finds) libshadowkv and puts a copy into the package.

`pip install ./python` from a clean clone: when ../build/libshadowkv.so is missing,
this runs `make lib` in the repository root first (the Makefile installs its Debian
packages when needed). The library and, when it was built, the cuda plugin
(libshadowkv-cuda.so.0, opened at run time from the library's directory) are copied
into the package, so the installed package imports on a machine with no GPU and no
CUDA library. SHADOWKV_LIBDIR=/path names a directory holding an installed
libshadowkv.so.0 instead.
"""
import os
import shutil
import subprocess

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


class BuildWithLibrary(build_py):
    def run(self):
        libdir = os.environ.get("SHADOWKV_LIBDIR")
        if libdir:
            lib = os.path.join(libdir, "libshadowkv.so.0")
            plugin = os.path.join(libdir, "libshadowkv-cuda.so.0")
        else:
            lib = os.path.join(REPO, "build", "libshadowkv.so")
            plugin = os.path.join(REPO, "build", "libshadowkv-cuda.so.0")
            if not os.path.exists(lib):
                subprocess.check_call(["make", "-C", REPO, "lib"])
        if not os.path.exists(lib):
            raise RuntimeError(f"libshadowkv not found at {lib}")
        pkg = os.path.join(HERE, "shadowkv")
        shutil.copy2(lib, os.path.join(pkg, "libshadowkv.so.0"))
        if os.path.exists(plugin):
            shutil.copy2(plugin, os.path.join(pkg, "libshadowkv-cuda.so.0"))
        super().run()


setup(cmdclass={"build_py": BuildWithLibrary})
