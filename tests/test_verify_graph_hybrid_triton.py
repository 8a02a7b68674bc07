"""The chained-row checks of ``test_verify_graph_hybrid_ops.py`` on the Triton backends, interpreted.

``TRITON_INTERPRET=1`` must be set before ``triton`` is first imported (and
would make the Triton backends available to every other test of the process),
so the checks run in one child process: this file executed as a script. The
conv and the delta rule run our decode kernels in the interpreter; the scan
runs mamba-ssm's ``selective_state_update`` when mamba-ssm can be made
importable as ``test_triton_interpret.py`` does it, and is skipped otherwise.
By hand::

    TRITON_INTERPRET=1 python tests/test_verify_graph_hybrid_triton.py
"""

from __future__ import annotations

import sys

from interpreter_checks import interpreter_tests, main

CHECKS = ("conv", "scan", "delta")


if __name__ != "__main__":
    interpret_results, test_chained_rows_on_triton_in_interpreter = interpreter_tests(
        __file__, CHECKS, timeout=900
    )


def check_conv() -> tuple[str, str]:
    """Our conv decode kernel, chained through copied destination slots."""
    from test_verify_graph_hybrid_ops import check_conv as run

    from backplane.backends.triton.ssm import TritonSSMBackend

    assert TritonSSMBackend.chains_rows
    run(TritonSSMBackend())
    return "ok", ""


def check_scan() -> tuple[str, str]:
    """mamba-ssm's state update, chained through copied destination slots."""
    import importlib.util

    from test_triton_interpret import _extra_paths
    from test_verify_graph_hybrid_ops import check_scan as run

    reason = _extra_paths()
    if reason or importlib.util.find_spec("mamba_ssm") is None:
        return "skip", reason or "mamba-ssm is not importable"
    from backplane.backends.triton.ssm import TritonSSMBackend

    run(TritonSSMBackend())
    return "ok", ""


def check_delta() -> tuple[str, str]:
    """Our delta-rule decode kernel, chained through copied destination slots."""
    from test_verify_graph_hybrid_ops import check_delta as run

    from backplane.backends.triton.delta import TritonDeltaBackend

    assert TritonDeltaBackend.chains_rows
    run(TritonDeltaBackend())
    return "ok", ""


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], CHECKS, lambda name: globals()[f"check_{name}"]()))
