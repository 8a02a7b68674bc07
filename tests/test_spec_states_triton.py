"""The verification-state checks of ``test_spec_states.py`` on the Triton backends, in the interpreter.

``TRITON_INTERPRET=1`` must be set before ``triton`` is first imported (and
would make the Triton backends available to every other test of the process),
so the checks run in one child process: this file executed as a script. The
conv (ours), the SSM scan (mamba-ssm's kernels and ours) and the delta rule
(our decode kernel; fla's chunked kernel, which the interpreter cannot run,
replaced by the torch backend's chunked form) each run a verification step,
keep one position per sequence and decode on, against the float64 references.
The scan check runs when mamba-ssm can be made importable as
``test_triton_interpret.py`` does it, and is skipped otherwise. By hand::

    TRITON_INTERPRET=1 python tests/test_spec_states_triton.py
"""

from __future__ import annotations

import sys
from pathlib import Path

from interpreter_checks import interpreter_tests, main

ROOT = Path(__file__).resolve().parents[1]
#: the accepted positions each check keeps (none, all, mixed)
KEEPS = ((0, 0, 0), (3, 3, 2), (1, 3, 0))
CHECKS = ("mamba2", "delta")


if __name__ != "__main__":
    interpret_results, test_verification_states_on_triton_in_interpreter = interpreter_tests(
        __file__, CHECKS, timeout=900
    )


def check_mamba2() -> tuple[str, str]:
    """Triton conv and scan: verify, keep, decode against the float64 references."""
    import importlib.util

    from test_spec_states import check_mamba2 as run
    from test_triton_interpret import _extra_paths

    reason = _extra_paths()
    if reason or importlib.util.find_spec("mamba_ssm") is None:
        return "skip", reason or "mamba-ssm is not importable"
    from backplane.backends.triton.ssm import TritonSSMBackend

    for keep in KEEPS:
        run(TritonSSMBackend(), keep)
    return "ok", ""


def _chunk_in_torch(q, k, v, g, beta, *, scale, initial_state, use_qk_l2norm_in_kernel,
                    cu_seqlens_cpu, **_):  # fmt: skip
    """fla's ``chunk_gated_delta_rule`` over packed sequences, as the torch backend computes it.

    The interpreter cannot run fla's autotuned chunked kernels (their autotuner
    needs a device driver), so the prefill part of the Triton op runs this.
    """
    import torch

    from backplane.backends.torch.delta import _chunked_delta, _prepare_qk

    cu = cu_seqlens_cpu.tolist()
    o = torch.empty(v.shape, dtype=torch.float32)
    finals = []
    for i in range(len(cu) - 1):
        rows = slice(cu[i], cu[i + 1])
        qs, ks = _prepare_qk(q[0, rows], k[0, rows], v.shape[2], scale, use_qk_l2norm_in_kernel)
        o[0, rows], final = _chunked_delta(
            qs, ks, v[0, rows].float(), g[0, rows].float(), beta[0, rows].float(), initial_state[i]
        )
        finals.append(final)
    return o, torch.stack(finals)


def check_delta() -> tuple[str, str]:
    """Triton gated delta rule: verify, keep, decode against the float64 reference.

    Our decode kernel runs in the interpreter; the prefill part's fla kernel is
    replaced by :func:`_chunk_in_torch`.
    """
    import types

    from test_spec_states import check_delta as run

    from backplane.backends.triton import delta

    delta._fla = lambda: types.SimpleNamespace(chunk=_chunk_in_torch)
    for keep in KEEPS:
        run(delta.TritonDeltaBackend(), keep)
    return "ok", ""


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], CHECKS, lambda name: globals()[f"check_{name}"]()))
