"""A journal of a benchmark's finished runs, one JSON line each, so that a long run that
is stopped (or killed) resumes where it stopped: ``search_efficiency.py --journal PATH``
reads the runs already there, skips their tasks and appends each run as it finishes.

A run is keyed by its task (a frozen dataclass of plain fields: landscape path, strategy,
seed, prior, budget, charging); its result is a frozen dataclass whose fields are the
task, floats and tuples of floats. The runs are seeded, so a resumed benchmark reports what
an uninterrupted one would (except the recorded CPU times)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")
R = TypeVar("R")


def load(path: Path, task_type: Callable[..., T], result_type: Callable[..., R]
         ) -> dict[T, R]:
    """The runs recorded in ``path`` by task (empty when it does not exist). A line cut
    short by a kill (the last one) is ignored; any other unreadable line is an error
    naming the file and line."""
    if not path.exists():
        return {}
    found: dict[T, R] = {}
    lines = path.read_text().splitlines()
    for number, line in enumerate(lines, 1):
        try:
            raw: dict[str, Any] = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):
                break
            raise ValueError(f"{path}:{number}: not a JSON line; expected one run per line "
                             "(delete the file to start over)") from None
        task = task_type(**raw.pop("task"))
        fields = {k: tuple(v) if isinstance(v, list) else v for k, v in raw.items()}
        found[task] = result_type(task=task, **fields)
    return found


def append(path: Path, result: object) -> None:
    """``result`` (a dataclass with a ``task`` field) as one more line of ``path``, flushed
    at once. A line cut short by a kill is dropped first, so that the new line does not
    join it."""
    assert dataclasses.is_dataclass(result) and not isinstance(result, type)
    record = dataclasses.asdict(result)
    with path.open("a+b") as f:
        f.seek(0)
        text = f.read()
        if text and not text.endswith(b"\n"):
            f.truncate(text.rfind(b"\n") + 1)
        f.write(json.dumps(record).encode() + b"\n")
        f.flush()
