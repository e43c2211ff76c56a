# mypy shim: tests import test_mla_bytes as top-level (pytest puts tests/decode/ on sys.path).
from decode.test_mla_bytes import *  # noqa: F403
