"""Builds the one compiled module, shmloader._ring, from csrc/.

Env switches: SHMLOADER_DEBUG=1 builds with assertions and -O0; SHMLOADER_ANNOTATE=1 writes
Cython's HTML annotation next to the .pyx.
"""

import os

import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup

debug = os.environ.get("SHMLOADER_DEBUG") == "1"
ring = Extension(
    "shmloader._ring",
    sources=["csrc/_ring.pyx"],
    depends=["csrc/ring.h", "csrc/ring.pxd", "csrc/arena.h", "csrc/copy.h"],
    include_dirs=["csrc", numpy.get_include()],
    extra_compile_args=["-O0", "-g"] if debug else ["-O3"],
    define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")]
    + ([("SHMLOADER_DEBUG", "1")] if debug else [("CYTHON_WITHOUT_ASSERTIONS", "1")]),
)
setup(
    ext_modules=cythonize(
        [ring],
        language_level=3,
        annotate=os.environ.get("SHMLOADER_ANNOTATE") == "1",
        compiler_directives={"boundscheck": False, "wraparound": False},
    )
)
