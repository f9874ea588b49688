"""The compiled core's build (prefixcache/_core.c); everything else is in pyproject.toml.

python setup.py build_ext --inplace    # what scripts/setup.sh runs: the .so beside the sources
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "prefixcache._core",
            # _core_avx2.c / _core_avx512.c: the frame checksum per vector unit (_frame_simd.h)
            sources=["prefixcache/_core.c", "prefixcache/_core_avx2.c", "prefixcache/_core_avx512.c"],
            include_dirs=["third_party/xxhash"],  # vendored xxHash 0.8.4 (BSD-2-Clause, its LICENSE beside it)
            depends=["third_party/xxhash/xxhash.h", "prefixcache/_frame_simd.h"],
            extra_compile_args=["-O3", "-std=c11", "-Wall", "-Wextra", "-Wno-unused-parameter"],
        )
    ]
)
