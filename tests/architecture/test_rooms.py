"""The rooms inside an area (docs/architecture.md): perf's ``sass`` (reading compiled code)
never imports its ``model`` (the cost model built on it), nor the profile above both; the
tuner's ``measure`` never imports its ``search``."""

from __future__ import annotations

import pytest
from test_layers import GRAPH

#: (room, rooms and modules it may not import)
ROOMS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("flashtune.perf.sass", ("flashtune.perf.model", "flashtune.perf.profile")),
    ("flashtune.tuner.measure", ("flashtune.tuner.search",)),
)


def _inside(module: str, room: str) -> bool:
    return module == room or module.startswith(room + ".")


@pytest.mark.parametrize(("room", "forbidden"), ROOMS)
def test_a_room_does_not_import_the_rooms_above_it(room: str,
                                                   forbidden: tuple[str, ...]) -> None:
    modules = [m for m in GRAPH if _inside(m, room)]
    assert modules, f"no module in {room}: the table of rooms is stale"
    wrong = sorted(f"{m} imports {t}" for m in modules for t in GRAPH[m]
                   if any(_inside(t, f) for f in forbidden))
    assert not wrong, "\n".join(wrong)
