"""Moved to kvserve.testing.router_harness (testing/router_harness.py), which bench/ and scripts/ import too; this name
stays only for branches that still import it from here."""

import sys

from kvserve.testing import router_harness as _moved

sys.modules[__name__] = _moved
