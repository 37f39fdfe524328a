"""Builds kvt._kvt (and the kvt-bootstrap tool) with kvt's CMake build for setuptools.

Environment:
  KVT_BUILD_DIR     a kvt build folder to build in (configured if it is not; reused if it is:
                    the fast path when kvt is already built). Default: a folder under
                    setuptools' build_temp, configured with -DKVT_BUILD_TESTS=OFF.
  KVT_CMAKE_ARGS    extra arguments for the configure step (e.g. -DCMAKE_CUDA_ARCHITECTURES=90).
  KVT_JOBS          parallel build jobs (default: the number of cores).
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent.parent  # kvt's source tree


class CMakeExtension(Extension):
    def __init__(self, name: str):
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext: Extension) -> None:
        if not (ROOT / "CMakeLists.txt").exists():
            raise RuntimeError(f"{ROOT} is not kvt's source tree: install from the python/ "
                               "folder of a kvt checkout")
        build_dir = Path(os.environ.get("KVT_BUILD_DIR") or Path(self.build_temp) / "kvt")
        build_dir = build_dir.resolve()
        # The interpreter the extension is built for: a venv's base interpreter has the same ABI
        # and the development headers.
        python = getattr(sys, "_base_executable", None) or sys.executable
        configure = ["cmake", "-S", str(ROOT), "-B", str(build_dir), "-DKVT_BUILD_PYTHON=ON",
                     f"-DPython_EXECUTABLE={python}"]
        if not (build_dir / "CMakeCache.txt").exists():
            configure += ["-G", "Ninja" if shutil.which("ninja") else "Unix Makefiles",
                          "-DCMAKE_BUILD_TYPE=Release", "-DKVT_BUILD_TESTS=OFF"]
            if shutil.which("ccache"):
                configure += ["-DCMAKE_CXX_COMPILER_LAUNCHER=ccache",
                              "-DCMAKE_CUDA_COMPILER_LAUNCHER=ccache"]
        configure += shlex.split(os.environ.get("KVT_CMAKE_ARGS", ""))
        subprocess.run(configure, check=True)
        jobs = os.environ.get("KVT_JOBS", str(os.cpu_count() or 1))
        subprocess.run(["cmake", "--build", str(build_dir), "-j", jobs, "--target", "kvt_python",
                        "kvt-bootstrap"], check=True)
        built = sorted((build_dir / "python" / "kvt").glob("_kvt*.so"))
        if not built:
            raise RuntimeError(f"the build left no _kvt*.so in {build_dir / 'python' / 'kvt'}")
        target = Path(self.get_ext_fullpath(ext.name))
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(built[-1], target)
        # kvt-bootstrap beside the package, where kvt.start_bootstrap looks for it.
        tool = build_dir / "tools" / "bootstrap" / "kvt-bootstrap"
        if tool.exists():
            bin_dir = target.parent / "bin"
            bin_dir.mkdir(exist_ok=True)
            shutil.copy2(tool, bin_dir / "kvt-bootstrap")


setup(ext_modules=[CMakeExtension("kvt._kvt")], cmdclass={"build_ext": CMakeBuild})
