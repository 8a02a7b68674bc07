"""What a serving process imports: ``import backplane.api`` and an engine built from
keywords leave the optional heavy packages unimported (each check in a fresh process)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

#: packages only some features need (server, configuration files, GGUF, grammars, HF
#: conversion, compilation); a plain ``LLM`` or ``AsyncLLM`` must not pay for them
OPTIONAL = (
    "yaml",
    "fastapi",
    "uvicorn",
    "jinja2",
    "transformers",
    "gguf",
    "xgrammar",
    "triton",
    "torch._dynamo",
)


def _imported_after(code: str) -> dict[str, bool]:
    """Run ``code`` in a fresh interpreter and say which of :data:`OPTIONAL` it imported."""
    script = textwrap.dedent(code) + textwrap.dedent(
        f"""
        import json, sys
        print(json.dumps({{name: name in sys.modules for name in {list(OPTIONAL)!r}}}))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=300
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_importing_the_api_imports_no_optional_package() -> None:
    imported = _imported_after("import backplane.api\n")
    assert [name for name, loaded in imported.items() if loaded] == []


def test_an_engine_built_from_keywords_does_not_read_yaml() -> None:
    imported = _imported_after(
        """
        from backplane.api import LLM
        LLM("tiny-llama", device="cpu", num_kv_pages=16, max_num_seqs=2).shutdown()
        """
    )
    assert imported["yaml"] is False


def test_a_configuration_file_still_imports_yaml(tmp_path: Path) -> None:
    config = tmp_path / "engine.yaml"
    config.write_text("page_size: 32\n")
    imported = _imported_after(
        f"""
        from backplane.engine.config import EngineConfig
        assert EngineConfig.from_yaml({str(config)!r}).page_size == 32
        """
    )
    assert imported["yaml"] is True
