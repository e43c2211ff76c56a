# mypy shim: tests import test_mla_configs as top-level (pytest puts tests/decode/ on sys.path).
from decode.test_mla_configs import *  # noqa: F403
