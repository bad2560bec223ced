"""Moved to kvserve.testing.server_side_apply (testing/server_side_apply.py), which bench/ and scripts/ import too; this name
stays only for branches that still import it from here."""

import sys

from kvserve.testing import server_side_apply as _moved

sys.modules[__name__] = _moved
