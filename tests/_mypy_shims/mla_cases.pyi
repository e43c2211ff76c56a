# mypy shim: tests import mla_cases as top-level (pytest puts tests/decode/ on sys.path).
from decode.mla_cases import *  # noqa: F403
