"""Find or fetch Prometheus 2.42 and promtool (Debian's package, unpacked, no root needed).

`python scripts/prometheus_bin.py` prints the bin directory, fetching the package into
build/prometheus/ when neither $KVSERVE_PROMETHEUS_DIR nor the PATH has both binaries.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / "build" / "prometheus"


def _has_both(d: Path) -> bool:
    return (d / "promtool").is_file() and (d / "prometheus").is_file()


def find() -> Path | None:
    """The directory holding `prometheus` and `promtool`, or None."""
    env = os.environ.get("KVSERVE_PROMETHEUS_DIR")
    candidates = [Path(env)] if env else []
    if shutil.which("promtool"):
        candidates.append(Path(shutil.which("promtool")).parent)
    candidates.append(CACHE / "usr" / "bin")
    return next((d for d in candidates if _has_both(d)), None)


def ensure() -> Path:
    """Find the binaries, or download and unpack the Debian package (apt-get download)."""
    found = find()
    if found:
        return found
    if not shutil.which("apt-get") or not shutil.which("dpkg-deb"):
        raise RuntimeError("no promtool/prometheus here and no apt-get/dpkg-deb to fetch them; "
                           "set KVSERVE_PROMETHEUS_DIR to a directory holding both")
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(["apt-get", "download", "prometheus"], cwd=tmp, check=True,
                       capture_output=True)
        (deb,) = Path(tmp).glob("prometheus_*.deb")
        CACHE.mkdir(parents=True, exist_ok=True)
        subprocess.run(["dpkg-deb", "-x", str(deb), str(CACHE)], check=True)
    found = find()
    if not found:
        raise RuntimeError(f"unpacked the prometheus package into {CACHE} but found no binaries")
    return found


if __name__ == "__main__":
    try:
        print(ensure())
    except (RuntimeError, subprocess.CalledProcessError) as e:
        print(f"prometheus: {e}", file=sys.stderr)
        sys.exit(1)
