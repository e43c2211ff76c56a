"""The external tools flashtune drives, found by one search rule and failing with typed errors.

- ``cuda``: where NVRTC, the CUDA headers and nvdisasm are (the nvidia pip wheels on
  ``sys.path``, then ``FLASHTUNE_CUDA_HOME``, then ``/usr/local/cuda``);
- ``nvrtc``: the ctypes binding of NVRTC (compiles for any arch, no GPU or driver);
- ``disasm``: SASS of a cubin (nvdisasm, else cuobjdump);
- ``host``: the host C++ compiler, the CUDA headers it compiles against (found by the same
  rule as NVRTC's) and AddressSanitizer, for the CPU emulator.

Nothing here needs a GPU. Missing tools raise ToolchainNotFound saying what to install.
"""
