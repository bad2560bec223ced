"""Moved to kvserve.testing.e2e_harness (testing/e2e_harness.py), which bench/ and scripts/ import too; this name
stays only for branches that still import it from here."""

import sys

from kvserve.testing import e2e_harness as _moved

sys.modules[__name__] = _moved
