"""Render a family's template into a KernelSource through the one Jinja environment.

Templates only bind parameters (constexpr values, feature switches, the entry point); the
kernel logic lives in the ``*.cuh`` headers beside them. Only ints, bools and enum-derived
names from validated Problem/KernelConfig values reach a template.
"""

from __future__ import annotations

import functools
import hashlib
import re
from collections.abc import Mapping
from importlib import resources
from pathlib import Path

import jinja2

from flashtune._version import __version__
from flashtune.codegen.spec import KernelConfig, KernelSource, Problem

#: Options that change the binary and are not arch-specific; the compiler adds the arch,
#: include paths and verbosity flags.
COMPILE_OPTIONS: tuple[str, ...] = ("-std=c++17", "-DNDEBUG")

_INCLUDE_RE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.MULTILINE)
_PRAGMA_ONCE_RE = re.compile(r"^\s*#\s*pragma\s+once\b")


def templates_dir() -> Path:
    """Directory holding the templates and device headers (an include path for compilers)."""
    return Path(str(resources.files("flashtune") / "templates"))


@functools.lru_cache(maxsize=1)
def environment() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.PackageLoader("flashtune", "templates"),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,
    )


def included_headers(code: str) -> dict[str, str]:
    """Contents of every flashtune header ``code`` includes, transitively, by name."""
    root = templates_dir()
    found: dict[str, str] = {}
    pending = _INCLUDE_RE.findall(code)
    while pending:
        name = pending.pop()
        if name in found:
            continue
        path = root / name
        if not path.is_file():
            continue  # a system or CUDA header: covered by the compiler version in the key
        text = path.read_text()
        found[name] = text
        pending.extend(_INCLUDE_RE.findall(text))
    return dict(sorted(found.items()))


def translation_unit(source: KernelSource) -> str:
    """The whole CUDA source NVRTC compiles for ``source``: its code with every flashtune
    header it includes inlined where the preprocessor first reads it (each once, as their
    ``#pragma once`` says; a later include of it becomes a comment). System and CUDA
    headers (``<cuda_fp16.h>``) and the emulator's own header, which only the CPU build's
    ``FLASHTUNE_EMULATOR`` branch includes, stay includes."""
    done: set[str] = set()

    def expand(text: str) -> str:
        out: list[str] = []
        for line in text.splitlines(keepends=True):
            match = _INCLUDE_RE.match(line)
            name = match.group(1) if match else None
            if name is None or name not in source.headers:
                out.append("// (pragma once: inlined once)\n" if _PRAGMA_ONCE_RE.match(line)
                           else line)
            elif name in done:
                out.append(f"// #include \"{name}\": already inlined above\n")
            else:
                done.add(name)
                body = expand(source.headers[name])
                end = "" if body.endswith("\n") else "\n"
                out.append(f"// ===== begin {name} (flashtune/templates/{name}) =====\n"
                           f"{body}{end}// ===== end {name} =====\n")
        return "".join(out)

    return expand(source.code)


def entry_name(problem: Problem, config: KernelConfig) -> str:
    """The kernel's C identifier: the problem's and the config's keys, '-' (per-operand
    element types, negative knob values) spelled '_'."""
    return f"flashtune_{problem.key()}_{config.key()}".replace("-", "_")


def _digest(body: str, headers: dict[str, str], options: tuple[str, ...]) -> str:
    h = hashlib.sha256()
    for part in (f"flashtune {__version__}", body, *options):
        h.update(part.encode())
        h.update(b"\0")
    for name, text in headers.items():
        h.update(name.encode() + b"\0" + text.encode() + b"\0")
    return h.hexdigest()


#: What a template may receive: ints, bools and words chosen by validated value types.
TemplateValue = int | bool | str


def render_template(template: str, problem: Problem, config: KernelConfig,
                    params: Mapping[str, TemplateValue], *, smem_bytes: int,
                    threads: int, target: str | None = None) -> KernelSource:
    """Render ``template`` with ``params`` (plus ``entry``, ``smem_bytes`` and ``threads``)
    into the KernelSource of ``problem`` x ``config``; ``target``: the arch-specific target
    the code needs (``KernelSource.target``).

    Families call this with parameters derived from validated Problem and KernelConfig
    values only; no string from a user, a file or a database reaches a template.
    """
    entry = entry_name(problem, config)
    body = environment().get_template(template).render(
        entry=entry, smem_bytes=smem_bytes, threads=threads, **params)
    headers = included_headers(body)
    digest = _digest(body if target is None else f"target {target}\n{body}", headers,
                     COMPILE_OPTIONS)
    banner = (
        f"// flashtune {__version__} generated kernel\n"
        f"// problem: {problem.key()}  config: {config.key()}\n"
        f"// entry: {entry}  dynamic smem: {smem_bytes} B  threads: {threads}\n"
        f"// digest: {digest}\n"
        + ("" if target is None else f"// target: {target} only\n")
    )
    return KernelSource(problem=problem, config=config, code=banner + body, entry=entry,
                        headers=headers, options=COMPILE_OPTIONS, digest=digest,
                        smem_bytes=smem_bytes, threads=threads, target=target)
