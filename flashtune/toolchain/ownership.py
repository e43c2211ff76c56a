"""Who may replace a directory flashtune loads native code from: its owner and ancestors.

The kernel cache (``runtime.cache``) and the shipped precompiled directories
(``runtime.precompile``) both load cubins and host libraries from disk. Whatever their own
permissions, a directory is only as safe as the directories above it: whoever can write a
parent can rename the directory away and put their own in its place (as ssh checks the
parents of ``~/.ssh``). ``unsafe_ancestor`` is that one check, shared by both.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Collection
from pathlib import Path


def describe_owner(st: os.stat_result) -> str:
    """'owned by alice (uid 1000), mode 0o755' for messages."""
    try:
        import pwd

        who = pwd.getpwuid(st.st_uid).pw_name
    except (ImportError, KeyError):
        who = "an unknown user"
    return f"owned by {who} (uid {st.st_uid}), mode {oct(stat.S_IMODE(st.st_mode))}"


def unsafe_ancestor(real: Path, owners: Collection[int]) -> tuple[Path, str] | None:
    """The first parent of the resolved path ``real`` that would let someone outside
    ``owners`` (uids) replace it, with why ('is writable by every user without the sticky
    bit' or 'belongs to another user (owned by ..., mode ...)'); None when every parent is
    safe. Parents that cannot be inspected are skipped (they cannot be written either)."""
    for parent in real.parents:
        try:
            st = os.stat(parent)
        except OSError:
            continue
        shared = st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX
        if st.st_uid not in owners or shared:
            why = ("is writable by every user without the sticky bit" if shared else
                   f"belongs to another user ({describe_owner(st)})")
            return parent, why
    return None
