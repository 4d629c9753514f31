"""The kernels behind the runtime Linears: C++ CPU ops (csrc/, built on first use by native.py), Triton kernels for
CUDA and their PyTorch references, and the int4 kernel layouts."""
