"""Kernels from spec to launch: specs, the kernel catalog, the C++ renderer, the toolchain and
paths, the build and its cache, the CUDA driver bindings, the loader and the launcher."""
