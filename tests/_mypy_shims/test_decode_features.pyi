# mypy shim: tests import test_decode_features as top-level (pytest puts tests/decode/ on sys.path).
from decode.test_decode_features import *  # noqa: F403
