"""Parsed SASS of a cubin for the instruction statistics (``toolchain.disasm`` disassembles)."""

from __future__ import annotations

from flashtune.codegen.arch import get_arch
from flashtune.perf.sass.parse import SassListing, parse_sass
from flashtune.toolchain.disasm import disassemble


def sass_listing(cubin: bytes, arch: str) -> SassListing:
    """Disassemble and parse ``cubin``, checking that it was built for ``arch``.

    Raises ValueError when the listing names a different target arch.
    """
    want = get_arch(arch).name
    listing = parse_sass(disassemble(cubin))
    # nvdisasm names sm_90a's cubins sm_90a and may drop the suffix; compare the numbers
    if listing.arch is not None and listing.arch.rstrip("af") != want.rstrip("af"):
        raise ValueError(f"the cubin targets {listing.arch}, not {want}; compile it for {want}")
    return listing
