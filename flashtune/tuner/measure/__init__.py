"""Measurement: what one candidate config goes through, and the backends that do it.

``base`` is the backend interface and its outcome types, ``evaluate`` one candidate from
compile outcome to result, ``workload`` what a bucket is measured on; the backends are
``cuda`` (a GPU), ``dry`` (NVRTC plus the CPU emulator, untimed) and what they share,
``common``.
"""
