"""Small guards the commands share so that bad paths and sizes end in a message, not a
traceback: output directories are created (or refused) before any work starts."""

from __future__ import annotations

from pathlib import Path

import typer


def output_dir(path: Path, option: str) -> Path:
    """Create ``path`` (and its parents) as a directory for the command's output files, or
    raise typer.BadParameter saying why it cannot be one."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise typer.BadParameter(
            f"cannot create the directory {path}: {exc.strerror or exc}; choose a directory "
            "you can write", param_hint=option) from None
    if not path.is_dir():
        raise typer.BadParameter(f"{path} is not a directory", param_hint=option)
    return path
