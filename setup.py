"""Build of HELM's compiled parts: the Cython/C CPU kernels (executor/kernels).

Metadata lives in pyproject.toml; this file only declares the extension. One build carries every
kernel variant (AVX-512 + AVX512-BF16, AVX-512, AVX2+FMA+F16C, portable): the compiler runs with
portable base flags and each csrc/isa_*.c unit switches its own target on with a pragma, so the
binary runs on any x86-64 CPU and picks its variant at import (no -march=native).
"""
import os

from Cython.Build import cythonize
from setuptools import Extension, setup

KERNELS = os.path.join("executor", "kernels")
CSRC = os.path.join(KERNELS, "csrc")

extension = Extension(
    "executor.kernels._kernels",
    sources=[os.path.join(KERNELS, "_kernels.pyx")]
    + [os.path.join(CSRC, name) for name in (
        "cpu_features.c", "isa_avx512bf16.c", "isa_avx512.c", "isa_avx2.c", "isa_portable.c")],
    include_dirs=[CSRC],
    depends=[os.path.join(CSRC, name) for name in sorted(os.listdir(CSRC)) if name.endswith(".h")],
    # -fno-math-errno lets sqrtf inline; -ffp-contract=off: FMAs only where the kernels ask for
    # them, so results do not depend on how the compiler scheduled a loop; no -ffast-math.
    extra_compile_args=["-O3", "-fopenmp", "-fno-math-errno", "-ffp-contract=off", "-Wno-unused-function"],
    # libgomp: torch's wheel bundles a libgomp.so.1 with the same soname; executor/kernels imports
    # torch first, so the loader binds this extension to torch's copy and both share one runtime.
    extra_link_args=["-fopenmp"],
)

setup(ext_modules=cythonize([extension], language_level=3,
                            compiler_directives={"boundscheck": False, "wraparound": False}))
