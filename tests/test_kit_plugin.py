"""The kit's pytest plugin: backend parametrisation and ``--backplane-backend``."""

from __future__ import annotations

import textwrap

import pytest

from backplane.core.backend_spec import BackendSpec
from backplane.testing import plugin
from backplane.testing.plugin import backend_params


def test_backend_params_cover_every_registered_backend() -> None:
    from backplane.core.registry import get_registry

    for family in ("attention", "ssm", "mla", "delta"):
        specs = get_registry().backends(family)
        params = backend_params(family)
        assert [p.id for p in params] == [s.name for s in specs]
        for param, spec in zip(params, specs, strict=True):
            assert param.values == (spec,)
            marks = {m.name: m for m in param.marks}
            assert marks["backplane_backend"].args == (family, spec.name)
            ok, reason = spec.availability()
            assert ("skip" in marks) == (not ok)
            if not ok:
                assert reason in marks["skip"].kwargs["reason"]


def test_selection_rules() -> None:
    anywhere, per_family = plugin._parse_selection(["torch", "mla=triton,attention=flashinfer"])
    assert anywhere == {"torch"}
    assert per_family == {"mla": {"triton"}, "attention": {"flashinfer"}}
    assert plugin._selected("ssm", "torch", anywhere, per_family)
    assert not plugin._selected("ssm", "triton", anywhere, per_family)
    assert plugin._selected("mla", "triton", anywhere, per_family)
    assert not plugin._selected("mla", "torch", anywhere, per_family)
    # Naming only one family's backend runs nothing of the other families.
    assert not plugin._selected("ssm", "torch", set(), {"mla": {"triton"}})


def test_load_backend_is_cached() -> None:
    from backplane.backends.torch.attention import TorchAttentionBackend

    # loaded as the engine loads it, so it must be a backend of its family
    spec = BackendSpec(family="attention", name="dummy", load=TorchAttentionBackend)
    assert plugin.load_backend(spec) is plugin.load_backend(spec)


_SUITE = textwrap.dedent(
    """
    import pytest
    from backplane.testing.plugin import backend_params

    @pytest.fixture(params=backend_params("attention"))
    def spec(request):
        return request.param

    def test_backend(spec):
        assert spec.family == "attention"
    """
)


def _pytest(tmp_path, capsys, *args: str) -> tuple[int, str]:
    """Run a nested pytest session in-process (a subprocess would re-import torch)."""
    (tmp_path / "test_suite.py").write_text(_SUITE)
    capsys.readouterr()
    code = pytest.main(
        [
            "-p",
            "backplane.testing.plugin",
            "-q",
            "-rA",
            "-p",
            "no:cacheprovider",
            *args,
            str(tmp_path / "test_suite.py"),
        ]
    )
    captured = capsys.readouterr()
    return int(code), captured.out + captured.err


def test_option_selects_one_backend(tmp_path, capsys) -> None:
    code, output = _pytest(tmp_path, capsys, "--backplane-backend", "torch")
    assert code == 0, output
    assert "test_suite.py::test_backend[torch]" in output and "1 passed" in output
    assert "deselected" in output
    assert "test_backend[triton]" not in output


def test_option_rejects_unknown_backend(tmp_path, capsys) -> None:
    code, output = _pytest(tmp_path, capsys, "--backplane-backend", "attention=nope")
    assert code != 0
    assert "no such attention backend" in output


def test_option_rejects_unknown_family(tmp_path, capsys) -> None:
    code, output = _pytest(tmp_path, capsys, "--backplane-backend", "notafamily=torch")
    assert code != 0
    assert "unknown family" in output
