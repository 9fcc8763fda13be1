"""The native kernels are built when kvserve is installed, one library per instruction-set
level, and loaded with no compiler in sight; what cannot load says why."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvserve.model_service.kernels import cpu_gemm, levels, library, paged_decode
from kvserve.model_service.kernels.levels import LEVELS
from kvserve.model_service.kernels.library import KernelUnavailable, NotForThisCpu

linux_only = pytest.mark.skipif(platform.system() != "Linux", reason="the native kernels are built for Linux")


@linux_only
def test_the_install_built_every_level_of_every_kernel_this_machine_can_compile() -> None:
    """`pip install` (make install) compiles the kernels; a build that failed quietly (the
    extensions are optional) would leave the model service on its fallbacks, so CI fails here."""
    missing = library.missing_builds()
    assert not missing, f"not built at install: {', '.join(missing)}; `pip install -v .` shows the compiler's error"


def test_every_library_is_built_for_a_named_target() -> None:
    """No level leaves -march to the environment ($CFLAGS) on x86-64; elsewhere only the generic one is built."""
    assert all(march for _, _, march in levels.builds_for("x86_64"))
    assert levels.builds_for("aarch64") == [("paged_decode", "generic", ""), ("small_linear", "generic", ""),
                                               ("rms_norm", "generic", ""), ("rope", "generic", ""),
                                               ("decode_layer", "generic", ""), ("row_argmax", "generic", "")]


@linux_only
def test_the_best_level_this_cpu_runs_is_the_one_loaded(monkeypatch) -> None:
    """paged_decode has a generic level, so it loads everywhere; the avx512 level only where
    the CPU reports every flag -march=x86-64-v4 allows the compiler to use."""
    monkeypatch.setattr(library, "cpu_flags", lambda: LEVELS["avx2"].flags)
    if platform.machine() in ("x86_64", "AMD64"):
        assert paged_decode._load().level == "avx2"
    monkeypatch.setattr(library, "cpu_flags", lambda: frozenset())
    assert paged_decode._load().level == "generic"
    with pytest.raises(NotForThisCpu, match="the cpu_gemm kernel needs AVX-512"):
        cpu_gemm._load()


@linux_only
def test_a_level_not_built_at_install_is_reported(monkeypatch) -> None:
    monkeypatch.setattr(library, "library_path", lambda kernel, level: None)
    with pytest.raises(KernelUnavailable, match="no build of the paged_decode kernel for this CPU loads "
                                                 r"\(.*generic: not built when kvserve was installed\)"):
        paged_decode._load()


@linux_only
def test_a_library_that_will_not_load_gives_way_to_the_next_level(tmp_path, monkeypatch) -> None:
    broken = tmp_path / "broken.so"
    broken.write_text("not a shared library")
    real = library.library_path
    best = library.KERNELS["paged_decode"][0]
    monkeypatch.setattr(library, "cpu_flags", lambda: LEVELS[best].flags)
    monkeypatch.setattr(library, "library_path", lambda k, lv: broken if lv == best else real(k, lv))
    assert paged_decode._load().level != best


@linux_only
def test_a_library_built_from_another_version_of_its_source_is_refused(monkeypatch) -> None:
    monkeypatch.setattr(library, "source_sha256", lambda kernel: "0" * 64)
    with pytest.raises(KernelUnavailable, match=r"built from an older paged_decode.c\).*install kvserve again"):
        paged_decode._load()


@linux_only
def test_loading_needs_no_compiler(tmp_path: Path) -> None:
    """What serves needs no C compiler: the kernels load with none on the PATH."""
    code = ("from kvserve.model_service.kernels import paged_decode; paged_decode.load(); print('loaded')")
    env = {**os.environ, "PATH": str(tmp_path), "CC": str(tmp_path / "no-such-cc")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.stdout.strip() == "loaded", out.stderr


@linux_only
def test_loading_keeps_denormals_and_one_openmp_runtime() -> None:
    paged_decode.load()
    # A library linked with -ffast-math would switch on flush-to-zero process-wide.
    tiny = torch.tensor([1e-39], dtype=torch.float32)         # below float32's smallest normal
    assert (tiny * 1.0).item() != 0.0
    gomps = {line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines()
             if Path(line.split()[-1]).name.startswith("libgomp")}
    assert len(gomps) == 1, f"more than one OpenMP runtime loaded: {gomps}"


def test_the_source_digest_covers_the_shared_headers(tmp_path) -> None:
    """Kernels share code through headers: a changed header must mark every library stale."""
    from kvserve.model_service.kernels.levels import source_digest

    (tmp_path / "k.c").write_text('#include "shared.h"\n')
    (tmp_path / "shared.h").write_text("/* one */\n")
    before = source_digest(tmp_path, "k")
    (tmp_path / "shared.h").write_text("/* two */\n")
    assert source_digest(tmp_path, "k") != before
    assert source_digest(tmp_path, "missing") is None
