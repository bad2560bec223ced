"""Moved to kvserve.testing.fault_proxy (testing/fault_proxy.py), which bench/ and scripts/ import too; this name
stays only for branches that still import it from here."""

import sys

from kvserve.testing import fault_proxy as _moved

sys.modules[__name__] = _moved
