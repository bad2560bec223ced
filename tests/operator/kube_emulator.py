"""Moved to kvserve.testing.kube_emulator (testing/kube_emulator.py), which bench/ and scripts/ import too; this name
stays only for branches that still import it from here."""

import sys

from kvserve.testing import kube_emulator as _moved

sys.modules[__name__] = _moved
