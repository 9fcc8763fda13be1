"""What pyproject.toml cannot say declaratively: the package layout and the native kernels.

Installing kvserve adds exactly one top-level import package, `kvserve`. Its root is
protos/kvserve (the generated stubs live beside their .proto files), and each service folder of
the repository is one subpackage of it:

    protos/kvserve/    -> kvserve             (kvserve.kvcache.v1, kvserve.inference.v1)
    services/          -> kvserve.services
    kvcache_service/   -> kvserve.kvcache_service
    model_service/     -> kvserve.model_service
    clients/           -> kvserve.clients

The native CPU kernels (model_service/kernels/*.c) are compiled here, by the same
`pip install` that installs the package: once per instruction-set level they list in
model_service/kernels/levels.py, which also gives the flags and why. They are plain shared
libraries loaded through ctypes (kernels/library.py), not Python modules. Each build is
optional: where it fails (no C compiler, an old one) the package installs without it (`pip -v`
shows the compiler's error), the model service warns at start, and it runs on oneDNN and
torch's own ops instead.
"""

import os
import platform
import runpy
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

FOLDERS = {
    "kvserve": "protos/kvserve",
    "kvserve.services": "services",
    "kvserve.kvcache_service": "kvcache_service",
    "kvserve.model_service": "model_service",
    "kvserve.clients": "clients",
}
KERNELS_DIR = Path("model_service/kernels")
LEVEL_SOURCES = Path("build/kernel_levels")


def packages() -> list[str]:
    found = []
    for root, folder in FOLDERS.items():
        found.append(root)
        found += [f"{root}.{sub}" for sub in find_packages(folder)]
    return sorted(set(found))


def kernel_extensions() -> list[Extension]:
    levels = runpy.run_path(str(KERNELS_DIR / "levels.py"))
    out = []
    for kernel, name, march in levels["builds_for"](platform.machine()):
        source = KERNELS_DIR / f"{kernel}.c"
        digest = levels["source_digest"](KERNELS_DIR, kernel)   # library.py checks it on load
        # Each level compiles a one-line file of its own that includes the kernel: an object is
        # named after its source, and the levels of one kernel, built at once
        # (BuildKernelsInParallel), would otherwise write and link the same object.
        wrapper = LEVEL_SOURCES / name / f"{kernel}.c"
        wrapper.parent.mkdir(parents=True, exist_ok=True)
        text = f'#include "{source.resolve()}"\n'
        if not wrapper.is_file() or wrapper.read_text() != text:   # rewritten, it would rebuild
            wrapper.write_text(text)
        out.append(Extension(
            f"kvserve.model_service.kernels._{kernel}_{name}",
            sources=[str(wrapper)],
            depends=[str(source), *(str(header) for header in sorted(KERNELS_DIR.glob("*.h")))],
            extra_compile_args=[*levels["COMPILE_FLAGS"], *([f"-march={march}"] if march else [])],
            define_macros=[("KVSERVE_SOURCE_SHA256", f'"{digest}"')],
            libraries=["m"],   # expf; glibc's libm.so brings libmvec, the vectorised one
            optional=True,
        ))
    return out


class BuildKernelsInParallel(build_ext):
    """The kernels' libraries (one per kernel and level, about twenty) compiled one per core:
    one at a time they were the longest part of an install after torch's."""

    def finalize_options(self) -> None:
        super().finalize_options()
        if not self.parallel:
            self.parallel = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


setup(
    cmdclass={"build_ext": BuildKernelsInParallel},
    package_dir=FOLDERS,
    packages=packages(),
    package_data={"": ["*.proto", "*.pyi"]},
    ext_modules=kernel_extensions(),
)
