# mypy shim: tests import test_decode_wide as top-level (pytest puts tests/decode/ on sys.path).
from decode.test_decode_wide import *  # noqa: F403
