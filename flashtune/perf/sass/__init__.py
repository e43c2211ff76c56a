"""Reading compiled code: a kernel's SASS, its loops and its instruction classes.

``parse`` reads nvdisasm / cuobjdump text into functions, instructions and their static
instruction mix by category (sm_90a's HGMMA, mbarrier, TMA and named-barrier classes
included); ``cfg`` finds a function's loops (back edges whose target dominates the
branch); ``loops`` finds a kernel's main loops (the one definition of "main loop"): the
masked and unmasked loop of one K/V tile each, what a warp vote lets an iteration skip and
the local-memory accesses in a tensor-core chain; ``budget`` reads their instructions per
iteration by class against FlashAttention-2's same-tile figures; ``disasm`` disassembles a
cubin with the toolchain's nvdisasm (imported on demand).

Nothing here models time: the cost model (``flashtune.perf.model``) builds on these
readings, never the other way round.
"""
