# mypy shim: tests import test_decode_sinks as top-level (pytest puts tests/decode/ on sys.path).
from decode.test_decode_sinks import *  # noqa: F403
