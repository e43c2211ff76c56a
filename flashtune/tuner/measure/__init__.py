"""Measurement: what one candidate config goes through, and the measurers that do it.

``base`` is the measurer interface and its outcome types, ``evaluate`` one candidate from
compile outcome to result, ``workload`` what a bucket is measured on; the measurers are
``cuda`` (a GPU), ``dry`` (NVRTC plus the CPU emulator, untimed) and what they share,
``common``; ``factory`` makes one by name (the only place a measurer is chosen).
``recorded`` answers a search from recorded measurements (a replayed landscape).

A measurer ("measurement backend") is the tuner's: not a runtime kernel backend
(``flashtune.runtime.backends``: CUDA or the emulator, what a measurer loads kernels with).
``measure`` imports nothing of ``search``.
"""
