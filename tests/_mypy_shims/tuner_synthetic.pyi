# mypy shim: tests import tuner_synthetic as top-level (pytest puts tests/tuner/ on sys.path).
from tuner.tuner_synthetic import *  # noqa: F403
