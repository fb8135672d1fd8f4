"""The launch timeline's process starts, read in fresh processes: each within a fraction of a second
of the first clock reading the process makes."""

from __future__ import annotations

import subprocess
import sys

from conftest import REPO


def test_a_process_start_is_within_a_fraction_of_a_second_of_the_process_reading_the_clock():
    """psutil's create_time read 1.0 s early here (boot time in whole seconds): every launch phase that
    starts at a process start was a second off."""
    code = "import time; t = time.time(); from rayjobs import timeline; print(t - timeline.process_start())"
    for _ in range(3):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
        assert out.returncode == 0, out.stderr
        assert -0.05 <= float(out.stdout) < 0.25, out.stdout  # the interpreter's own start, then the first line
