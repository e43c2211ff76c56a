# mypy shim: tests import test_mla_decode as top-level (pytest puts tests/decode/ on sys.path).
from decode.test_mla_decode import *  # noqa: F403
