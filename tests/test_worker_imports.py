"""NOTE [ What a worker imports ] in shmloader/worker.py: a worker's first batches import
nothing that the main process has not imported (numpy.random, numpy.ma), in either mode: such an
import is paid again by every worker, on the cores that fetch the first batch."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(120)


def test_a_workers_first_batches_import_nothing_the_main_process_lacks():
    script = os.path.join(os.path.dirname(__file__), "_imports_script.py")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.path.dirname(os.path.dirname(__file__)),
                                                                    os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=100, env=env)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found == {"default": [], "sample_parallel": []}, found
