"""The tuner's option choices and defaults: plain values, importing nothing.

The command line shows them in its options (help texts and defaults), which typer builds
when the program starts; keeping them here lets ``flashtune --help`` print them without
importing Optuna, SQLAlchemy or torch. The tuner's modules use these same values.
"""

from __future__ import annotations

#: The search strategies of ``flashtune tune --sampler`` (guided: flashtune's own).
SAMPLERS = ("guided", "tpe", "gp", "random", "grid")

#: Spill stores per thread tolerated by default. A few bytes are usually spilled outside the
#: main loop and cost nothing; spills in attention's inner loop go to local memory on every
#: iteration and are never worth it: beyond 16 registers' worth a config is ruled out.
DEFAULT_MAX_SPILL_BYTES = 64

#: Re-measured finalists within this fraction of the best TFLOP/s tie; among them the
#: default config wins, else the simplest (``search/selection.py``).
DEFAULT_TOLERANCE = 0.02
