"""A backend that cannot run a kit case's layer is reported as skipped, with the reason."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

#: The tree under test: the child pytest imports it from here, wherever an
#: installed copy points.
ROOT = Path(__file__).resolve().parents[1]


def test_unsupported_layer_error_becomes_a_skip(tmp_path):
    (tmp_path / "test_case.py").write_text(
        textwrap.dedent(
            """
            from backplane.core.errors import UnsupportedLayerError

            def test_small_head_dim():
                raise UnsupportedLayerError(
                    "head_dim 8 is too small", family="attention", backend="example"
                )

            def test_other_errors_still_fail():
                raise ValueError("a real bug")
            """
        )
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-rs",
            "-p",
            "backplane.testing.plugin",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=dict(
            os.environ,
            PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
        ),
    )
    out = proc.stdout
    assert "1 failed, 1 skipped" in out, out
    assert "head_dim 8 is too small" in out
