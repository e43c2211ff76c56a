"""A source becomes a binary: the external tools flashtune drives, found by one search rule and
failing with typed errors, and what they build.

- ``cuda``: where NVRTC, the CUDA headers and nvdisasm are (the nvidia pip wheels on
  ``sys.path``, then ``FLASHTUNE_CUDA_HOME``, then ``/usr/local/cuda``);
- ``nvrtc``: the ctypes binding of NVRTC (compiles for any arch, no GPU or driver);
- ``disasm``: SASS of a cubin (nvdisasm, else cuobjdump);
- ``host``: the host C++ compiler, the CUDA headers it compiles against (found by the same
  rule as NVRTC's) and AddressSanitizer, for the CPU emulator.

Building on them:

- ``compiler``: compile keys over everything that changes a binary, NVRTC compiles (memoised,
  cached, in a process pool for many at once) and their resource check;
- ``compiled`` and ``resources``: a compiled kernel as an artifact (cubin, PTX, registers,
  spills, shared memory read back from ptxas);
- ``cache``: the private, digest-bound artifact cache with atomic writes, and ``ownership``,
  the check that no other user can replace a directory native code is loaded from.

Nothing here needs a GPU. Missing tools raise ToolchainNotFound saying what to install.
"""
