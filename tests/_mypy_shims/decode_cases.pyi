# mypy shim: tests import decode_cases as top-level (pytest puts tests/decode/ on sys.path).
from decode.decode_cases import *  # noqa: F403
