"""The compiled core's build (prefixcache/_core.c); everything else is in pyproject.toml.

python setup.py build_ext --inplace    # what scripts/setup.sh runs: the .so beside the sources
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "prefixcache._core",
            sources=["prefixcache/_core.c", "prefixcache/_resp.c"],
            include_dirs=["third_party/xxhash"],  # vendored xxHash 0.8.4 (BSD-2-Clause, its LICENSE beside it)
            depends=["third_party/xxhash/xxhash.h", "prefixcache/_resp.h"],
            extra_compile_args=["-O3", "-std=c11", "-Wall", "-Wextra", "-Wno-unused-parameter"],
        )
    ]
)
