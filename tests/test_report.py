"""`python -m harness.report` on input it cannot use (the plots themselves are
checked on real sweeps in test_sweep.py)."""

from __future__ import annotations

import subprocess
import sys

from support import REPO


def test_a_dir_without_runs_is_refused_with_the_fix(tmp_path):
    (tmp_path / "empty").mkdir()
    for target in (tmp_path / "empty", tmp_path / "missing"):
        proc = subprocess.run(
            [sys.executable, "-m", "harness.report", str(target)], cwd=REPO, capture_output=True, text=True, timeout=60
        )
        assert proc.returncode == 2
        assert str(target) in proc.stderr and "Fix: pass outputs/" in proc.stderr
        assert "Traceback" not in proc.stderr
    assert not (tmp_path / "empty" / "report").exists()
