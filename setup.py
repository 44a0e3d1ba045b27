"""Build of HELM's compiled and generated parts: the Cython/C CPU kernels (executor/kernels) and
the daemon's gRPC code (executor/pb, generated from protos/).

Metadata lives in pyproject.toml; this file only declares the extension and the protoc step. One
build carries every kernel variant (AVX-512 + AVX512-BF16, AVX-512, AVX2+FMA+F16C, portable): the
compiler runs with portable base flags and each csrc/isa_*.c unit switches its own target on with
a pragma, so the binary runs on any x86-64 CPU and picks its variant at import (no -march=native).
"""
import os
import re
import tempfile

from Cython.Build import cythonize
from setuptools import Extension, setup
from setuptools.command.build_py import build_py

KERNELS = os.path.join("executor", "kernels")
CSRC = os.path.join(KERNELS, "csrc")

extension = Extension(
    "executor.kernels._kernels",
    sources=[os.path.join(KERNELS, "_kernels.pyx")]
    + [os.path.join(CSRC, name) for name in (
        "cpu_features.c", "decode_blocks.c", "isa_avx512bf16.c", "isa_avx512.c", "isa_avx2.c",
        "isa_portable.c")],
    include_dirs=[CSRC],
    depends=[os.path.join(CSRC, name) for name in sorted(os.listdir(CSRC)) if name.endswith(".h")],
    # -fno-math-errno lets sqrtf inline; -fno-trapping-math lets loops with branches on floats (the
    # clamps of our exp) vectorise, changing no value (only FP exception flags, which nothing reads);
    # -ffp-contract=off: FMAs only where the kernels ask for them, so results do not depend on how
    # the compiler scheduled a loop; no -ffast-math.
    extra_compile_args=["-O3", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=off",
                        "-Wno-unused-function"],
    # libgomp: torch's wheel bundles a libgomp.so.1 with the same soname; executor/kernels imports
    # torch first, so the loader binds this extension to torch's copy and both share one runtime.
    extra_link_args=["-fopenmp"],
)

PROTO = os.path.join("helm", "executor", "v1", "executor.proto")
PB = os.path.join("executor", "pb")


def generate_protos() -> None:
    """executor/pb/ from protos/ with grpc_tools.protoc (message, gRPC and .pyi modules). protoc
    writes the gRPC module's import of its message module as the absolute proto package path
    (`from helm.executor.v1 import executor_pb2`); it is made package-relative here. Without
    grpcio-tools (a machine with no package registry, tools/gpu_run.sh) a carried executor/pb/ is
    used as it is."""
    try:
        from grpc_tools import protoc
    except ImportError:
        if os.path.isfile(os.path.join(PB, "executor_pb2.py")):
            return
        raise

    with tempfile.TemporaryDirectory() as out:
        args = ["grpc_tools.protoc", "-Iprotos", f"--python_out={out}", f"--grpc_python_out={out}",
                f"--pyi_out={out}", os.path.join("protos", PROTO)]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on protos/{PROTO}")
        generated = os.path.join(out, os.path.dirname(PROTO))
        os.makedirs(PB, exist_ok=True)
        for name in sorted(os.listdir(generated)):
            with open(os.path.join(generated, name)) as f:
                text = re.sub(r"^from helm\.executor\.v1 import ", "from . import ", f.read(), flags=re.M)
            with open(os.path.join(PB, name), "w") as f:
                f.write(text)
    with open(os.path.join(PB, "__init__.py"), "w") as f:
        f.write(f'"""Generated from protos/{PROTO} by setup.py at install time; do not edit."""\n')


class BuildPyWithProtos(build_py):
    """build_py that generates executor/pb first (also runs for `pip install -e .`)."""

    def run(self):
        generate_protos()
        if self.packages is not None and "executor.pb" not in self.packages:
            self.packages.append("executor.pb")
        super().run()


setup(ext_modules=cythonize([extension], language_level=3,
                            compiler_directives={"boundscheck": False, "wraparound": False}),
      cmdclass={"build_py": BuildPyWithProtos})
