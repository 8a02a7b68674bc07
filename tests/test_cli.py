"""The ``backplane`` command line: help, listings, JSON, failure reporting, exit codes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

import backplane.cli as cli
from backplane.core.errors import ConfigError
from backplane.core.hookspecs import FAMILIES

JSON_KEYS = {"family", "name", "plugin", "available", "reason", "priority", "speed"}


def _run(*args: str, pythonpath: str | None = None, env: dict[str, str] | None = None):
    """Run the CLI in a fresh interpreter (plugin discovery sees the given PYTHONPATH)."""
    full_env = dict(os.environ)
    full_env.pop("BACKPLANE_DISABLE_PLUGINS", None)
    if pythonpath:
        full_env["PYTHONPATH"] = os.pathsep.join(
            p for p in (pythonpath, full_env.get("PYTHONPATH")) if p
        )
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "backplane.cli", *args],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=300,
    )


@pytest.fixture
def quiet_logging(monkeypatch):
    """Keep main() from reconfiguring the root logger of the test process; record the level."""
    levels: list[str] = []
    monkeypatch.setattr(cli, "_configure_logging", levels.append)
    return levels


def _commands() -> list[str]:
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    return list(sub.choices)


# -- parser -----------------------------------------------------------------------------------


def test_help_lists_the_commands(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "backends" in out and "plugins" in out and "--log-level" in out


def test_every_command_has_help(capsys):
    commands = _commands()
    assert {"backends", "plugins"} <= set(commands)
    assert set(commands) <= set(cli.COMMANDS)
    for name in commands:
        with pytest.raises(SystemExit) as exc:
            cli.main([name, "--help"])
        assert exc.value.code == 0, name
        assert f"usage: backplane {name}" in capsys.readouterr().out


def test_no_command_prints_help_and_fails(capsys, quiet_logging):
    assert cli.main([]) == 2
    assert "usage: backplane" in capsys.readouterr().err


def test_missing_command_modules_are_skipped(monkeypatch):
    monkeypatch.setattr(cli, "COMMANDS", ("backends", "no_such_command"))
    assert _commands() == ["backends"]


def test_broken_command_module_is_listed_and_fails_cleanly_when_run(
    monkeypatch, capsys, quiet_logging
):
    real_import = cli.importlib.import_module

    def fake_import(name, *args):
        if name == "backplane.cli.plugins":
            raise ImportError("cannot import name 'thing' from 'somewhere'")
        return real_import(name, *args)

    monkeypatch.setattr(cli.importlib, "import_module", fake_import)
    assert set(_commands()) >= {"backends", "plugins"}
    assert cli.main(["plugins"]) == 2
    assert capsys.readouterr().err == (
        "backplane: error: the 'plugins' command cannot run: ImportError: cannot import name "
        "'thing' from 'somewhere'\n"
    )


def test_backplane_error_is_one_line_exit_2(monkeypatch, capsys, quiet_logging):
    import backplane.cli.backends as backends_cmd

    def fail(args):
        raise ConfigError("config file 'x.yaml', key 'page_size': expected an integer >= 1, got 0")

    monkeypatch.setattr(backends_cmd, "run", fail)
    assert cli.main(["backends"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (
        "backplane: error: config file 'x.yaml', key 'page_size': expected an integer >= 1, got 0\n"
    )


def test_log_level_option(capsys, quiet_logging):
    assert cli.main(["--log-level", "DEBUG", "plugins", "--json"]) == 0
    assert quiet_logging == ["debug"]
    assert cli.main(["plugins", "--json", "--log-level", "info"]) == 0
    assert quiet_logging == ["debug", "info"]
    assert cli.main(["plugins", "--json"]) == 0
    assert quiet_logging[-1] == "warning"
    with pytest.raises(SystemExit) as exc:
        cli.main(["--log-level", "loud", "plugins"])
    assert exc.value.code == 2


# -- backends ---------------------------------------------------------------------------------


def test_backends_json_has_the_documented_keys(capsys, quiet_logging):
    assert cli.main(["backends", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows and all(JSON_KEYS <= set(row) for row in rows)
    torch_rows = {r["family"]: r for r in rows if r["name"] == "torch"}
    assert set(torch_rows) == set(FAMILIES)
    assert all(r["plugin"] == "torch" for r in torch_rows.values())
    assert [r["family"] for r in rows] == sorted((r["family"] for r in rows), key=FAMILIES.index)


def test_backends_family_filter(capsys, quiet_logging):
    assert cli.main(["backends", "--family", "ssm", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows and {r["family"] for r in rows} == {"ssm"}
    with pytest.raises(SystemExit) as exc:
        cli.main(["backends", "--family", "conv"])
    assert exc.value.code == 2


def test_backends_table(capsys, quiet_logging):
    assert cli.main(["backends"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == [
        "FAMILY",
        "NAME",
        "PLUGIN",
        "AVAILABLE",
        "PRIORITY",
        "TOK/S",
        "ON",
        lines[0].split()[7],
        "DESCRIPTION",
        "/",
        "REASON",
    ]
    torch_attention = [
        line.split()[:6] for line in lines[1:] if line.split()[:2] == ["attention", "torch"]
    ]
    assert torch_attention == [["attention", "torch", "torch", "yes", "0", "-"]]


def test_backends_table_shows_the_figures_of_a_device_class(capsys, quiet_logging):
    """The in-tree attention figures for sm90 appear in the table (sm90: Triton decodes faster)."""
    assert cli.main(["backends", "--family", "attention", "--device-class", "sm90"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[5:8] == ["TOK/S", "ON", "sm90"]
    cells = {line.split()[1]: line.split()[5:9] for line in lines[1:]}
    assert cells["triton"] == ["decode", "953,", "prefill", "16537"]
    assert cells["flashinfer"] == ["decode", "713,", "prefill", "14075"]
    assert cells["torch"][0] == "-"
    assert cli.main(["backends", "--family", "attention", "--device-class", "sm61"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert all(line.split()[5] == "-" for line in lines[1:])


# -- plugins ----------------------------------------------------------------------------------


def test_plugins_json(capsys, quiet_logging):
    assert cli.main(["plugins", "--json"]) == 0
    infos = {i["name"]: i for i in json.loads(capsys.readouterr().out)}
    torch_info = infos["torch"]
    assert torch_info["distribution"] == "backplane"
    assert torch_info["version"] == __import__("backplane").__version__
    assert torch_info["hooks"] == sorted(f"backplane_{f}_backends" for f in FAMILIES)
    assert torch_info["error"] is None


def test_plugins_table(capsys, quiet_logging):
    assert cli.main(["plugins"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["NAME", "DISTRIBUTION", "VERSION", "HOOKS", "STATUS"]
    torch_line = next(line.split() for line in lines if line.startswith("torch "))
    assert torch_line[1:] == ["backplane", "0.1.0", "attention,delta,mla,ssm", "ok"]


# -- third-party plugins, end to end in a fresh interpreter -----------------------------------

_GOOD = textwrap.dedent(
    """
    from backplane import BackendSpec, hookimpl

    @hookimpl
    def backplane_mla_backends():
        return [BackendSpec(family="mla", name="latentx", load="nowhere:X", priority=-1)]
    """
)


def test_plugin_raising_at_import_is_reported_while_listing_works(make_plugin_dist):
    root = make_plugin_dist(
        "cli-plugins",
        {"crashy": "bp_cli_crashy", "fine": "bp_cli_fine"},
        {"bp_cli_crashy": "raise ImportError('needs libfoo.so')\n", "bp_cli_fine": _GOOD},
        version="0.3",
    )
    plugins = _run("plugins", "--json", pythonpath=str(root))
    assert plugins.returncode == 0, plugins.stderr
    infos = {i["name"]: i for i in json.loads(plugins.stdout)}
    assert infos["crashy"]["error"] == "ImportError: needs libfoo.so"
    assert (infos["crashy"]["distribution"], infos["crashy"]["version"]) == ("cli-plugins", "0.3")
    assert infos["fine"]["error"] is None and infos["torch"]["error"] is None

    table = _run("plugins", pythonpath=str(root))
    crashy_line = next(line for line in table.stdout.splitlines() if line.startswith("crashy "))
    assert crashy_line.split()[1:4] == ["cli-plugins", "0.3", "-"]
    assert crashy_line.endswith("ERROR ImportError: needs libfoo.so")

    backends = _run("backends", "--json", pythonpath=str(root))
    assert backends.returncode == 0, backends.stderr
    rows = json.loads(backends.stdout)
    assert {(r["family"], r["name"], r["plugin"]) for r in rows} >= {
        ("mla", "latentx", "fine"),
        ("attention", "torch", "torch"),
    }
    assert "plugin(s) failed to load: crashy" in backends.stderr
    assert "(see `backplane plugins`)" in backends.stderr


def test_duplicate_backend_is_a_clean_error(make_plugin_dist):
    source = textwrap.dedent(
        """
        from backplane import BackendSpec, hookimpl

        @hookimpl
        def backplane_attention_backends():
            return [BackendSpec(family="attention", name="torch", load="nowhere:X")]
        """
    )
    root = make_plugin_dist("dupe-dist", {"dupe": "bp_cli_dupe"}, {"bp_cli_dupe": source})
    result = _run("backends", pythonpath=str(root))
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.splitlines()[-1] == (
        "backplane: error: backend attention/torch is provided by two plugins: 'dupe' and "
        "'torch'; uninstall one, or disable one with BACKPLANE_DISABLE_PLUGINS=torch"
    )
    assert "Traceback" not in result.stderr
    fixed = _run(
        "backends", "--json", pythonpath=str(root), env={"BACKPLANE_DISABLE_PLUGINS": "dupe"}
    )
    assert fixed.returncode == 0, fixed.stderr


def test_disabled_plugin_is_shown_as_disabled():
    result = _run("plugins", env={"BACKPLANE_DISABLE_PLUGINS": "torch"})
    torch_line = next(line for line in result.stdout.splitlines() if line.startswith("torch "))
    assert torch_line.split()[-1] == "disabled"
    rows = json.loads(_run("backends", "--json", env={"BACKPLANE_DISABLE_PLUGINS": "torch"}).stdout)
    assert all(r["plugin"] != "torch" for r in rows)


def test_console_script_entry_point_is_declared():
    import importlib.metadata

    scripts = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="console_scripts")}
    assert scripts.get("backplane") == "backplane.cli:main"
