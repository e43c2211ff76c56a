"""The command line starts light: importing flashtune.cli (what every `flashtune ...` call,
`--help` and tab completion pay before typer parses an argument) imports none of the heavy
libraries; each command imports them when it runs. Checked in a fresh interpreter, which
also records who imported a library that leaked in, so a failure names the import chain."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import flashtune

#: Libraries that cost from a tenth of a second (numpy) to seconds (torch) to import.
HEAVY = ("torch", "optuna", "sqlalchemy", "alembic", "scipy", "cupy", "numpy", "matplotlib")

REPO = Path(flashtune.__file__).resolve().parents[1]

#: Run in a fresh interpreter: a meta path hook records, for the first import of each heavy
#: library, the flashtune frames on the stack; then ``import flashtune.cli`` and the body.
PROBE = r"""
import json, sys, traceback
HEAVY = set(json.loads(sys.argv[1]))
ROOT = sys.argv[2]
chains = {}

class Witness:
    def find_spec(self, name, path=None, target=None):
        top = name.partition(".")[0]
        if top in HEAVY and top not in chains:
            chains[top] = [f"{f.filename[len(ROOT) + 1:]}:{f.lineno}"
                           for f in traceback.extract_stack()[:-1]
                           if f.filename.startswith(ROOT + "/flashtune/")]
        return None

sys.meta_path.insert(0, Witness())

def leaked():
    found = sorted({m.partition(".")[0] for m in sys.modules} & HEAVY)
    return {m: chains.get(m, ["(imported before the probe started)"]) for m in found}

import flashtune.cli
result = {"import": leaked()}
"""


def _probe(body: str) -> dict[str, object]:
    out = subprocess.run(
        [sys.executable, "-c", PROBE + body + "\nprint(json.dumps(result))\n",
         json.dumps(HEAVY), str(REPO)],
        capture_output=True, text=True, cwd=REPO, timeout=300,
        env={**os.environ, "COLUMNS": "100"})
    assert out.returncode == 0, out.stderr
    result: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def _describe(leaks: object) -> str:
    assert isinstance(leaks, dict)
    return "\n".join(f"{name} was imported via {' -> '.join(chain) or '(no flashtune frame)'}"
                     for name, chain in leaks.items())


def test_probe_names_a_heavy_import_and_its_chain() -> None:
    """The probe itself can fail: a heavy library imported after the CLI is reported, with
    the flashtune module that imported it."""
    result = _probe("import flashtune.api.forward\nresult['after'] = leaked()\n")
    after = result["after"]
    assert isinstance(after, dict) and "torch" in after, after
    assert any(step.startswith("flashtune/api/") for step in after["torch"]), after


def test_listing_and_rendering_kernels_imports_no_heavy_library() -> None:
    """`flashtune families`, `show` and `space` (listing families, rendering a kernel's
    source, walking a space) need no torch: the families import it when a function that
    makes or checks tensors first runs."""
    body = r"""
from typer.testing import CliRunner
from flashtune.cli import app
runs = {}
for args in (["families"], ["show", "--head-dim", "64"], ["show", "--op", "bwd"],
             ["show", "--op", "decode"], ["show", "--op", "fwd90aws", "--arch", "sm_90a"],
             ["space", "--op", "lse", "--head-dim", "64"]):
    run = CliRunner().invoke(app, args)
    runs[" ".join(args)] = [run.exit_code, len(run.output)]
result["runs"] = runs
result["rendered"] = leaked()
"""
    result = _probe(body)
    runs = result["runs"]
    assert isinstance(runs, dict) and all(code == 0 and size > 80
                                          for code, size in runs.values()), runs
    leaks = result["rendered"]
    assert not leaks, "rendering kernels imported heavy libraries:\n" + _describe(leaks)


def test_importing_the_cli_imports_no_heavy_library() -> None:
    result = _probe("")
    leaks = result["import"]
    assert not leaks, ("importing flashtune.cli imported heavy libraries; import them inside "
                       "the command that needs them:\n" + _describe(leaks))


def test_help_of_every_command_works_without_heavy_libraries() -> None:
    """`--help` of the app, every command and every subcommand exits 0 and shows the
    command's help, without importing a heavy library."""
    body = r"""
import typer
from typer.testing import CliRunner
from flashtune.cli import app

def walk(command, path):
    yield path, command
    for name, sub in sorted(getattr(command, "commands", {}).items()):
        yield from walk(sub, [*path, name])

helps = {}
for path, command in walk(typer.main.get_command(app), []):
    run = CliRunner().invoke(app, [*path, "--help"])
    summary = (command.help or "").split("\n")[0][:40]
    helps[" ".join(path) or "flashtune"] = [run.exit_code, "Usage:" in run.output,
                                            summary, " ".join(summary.split()) in
                                            " ".join(run.output.replace("│", " ").split())]
result["helps"] = helps
result["help"] = leaked()
"""
    result = _probe(body)
    helps = result["helps"]
    assert isinstance(helps, dict)
    # the walk reaches the commands and the db group's subcommands (it cannot pass empty)
    expected = {"flashtune", "settings", "families", "show", "compile", "space", "check",
                "profile", "explain", "precompile", "tune", "report", "correlate", "db",
                "db info", "db upgrade", "db list", "db show", "db export", "db import",
                "db merge", "db verify"}
    assert expected <= set(helps), sorted(expected - set(helps))
    broken = {name: h for name, h in helps.items() if h != [0, True, h[2], True]}
    assert not broken, f"--help failed or lacks the command's summary: {broken}"
    leaks = result["help"]
    assert not leaks, "--help imported heavy libraries:\n" + _describe(leaks)

