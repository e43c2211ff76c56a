"""The default-table type of the families whose defaults are a checked-in table per (arch
class, compiled head dim, causal): the forward (families/fwd/defaults.py) and the backward
(families/bwd/defaults.py). Each entry names its config and why it was chosen.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from flashtune.codegen.arch import ARCHS, ArchClass
from flashtune.codegen.spec import COMPILED_HEAD_DIMS, KernelConfig
from flashtune.errors import InvalidConfig


def archs_of(cls: ArchClass) -> list[str]:
    """Every arch flashtune knows in class ``cls``."""
    return [name for name, spec in ARCHS.items() if spec.default_class is cls]


@dataclass(frozen=True)
class DefaultEntry:
    """The default config of one (arch class, compiled head dim, causal) and why."""

    arch_class: ArchClass
    head_dim: int
    causal: bool
    config: KernelConfig
    reason: str

    def __post_init__(self) -> None:
        if self.head_dim not in COMPILED_HEAD_DIMS:
            raise InvalidConfig(f"default entry head_dim={self.head_dim} is not a compiled "
                                f"head dim; expected one of {COMPILED_HEAD_DIMS}")
        if not self.reason.strip():
            raise InvalidConfig(f"default entry {self.key} needs a reason")

    @property
    def key(self) -> tuple[ArchClass, int, bool]:
        return (self.arch_class, self.head_dim, self.causal)

    def to_dict(self) -> dict[str, Any]:
        """A flat row for docs and ``flashtune`` listings."""
        return {
            "arch_class": self.arch_class.value,
            "archs": archs_of(self.arch_class),
            "head_dim": self.head_dim,
            "causal": self.causal,
            "config": self.config.key(),
            "reason": self.reason,
        }
