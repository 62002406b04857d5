"""varbench.app.cli: the top-level parser and main's exit codes (0, 1, 2 for a UsageError as
one line, 130 when interrupted)."""

from __future__ import annotations

import sys
import types

import pytest

from varbench._util.checks import UsageError
from varbench._util.version import VERSION
from varbench.app import cli
from varbench.app.cli import main


def test_help_lists_the_subcommands(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for cmd in ("tasks", "sample", "warmstart"):
        assert cmd in out


def test_every_command_module_registers(capsys):
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    names = set(sub.choices)
    assert {"run", "merge", "compare", "check", "train", "validate", "tasks", "sample",
            "warmstart", "proxy", "variance", "cancellation"} <= names
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"varbench {VERSION}"


def test_no_command_prints_help_and_exits_2(capsys):
    assert main([]) == 2
    assert "usage: varbench" in capsys.readouterr().out


@pytest.fixture
def fake(monkeypatch):
    """A command module registering `varbench fake WHAT`, whose handler does WHAT."""

    def handler(args):
        if args.what == "usage":
            raise UsageError("k=0 is not valid; expected an integer >= 1")
        if args.what == "interrupt":
            raise KeyboardInterrupt
        if args.what == "bug":
            raise RuntimeError("a bug")
        if args.what in ("typeerror", "valueerror", "keyerror"):
            # internal bugs of the builtin types the CLI used to print as user errors
            raise {"typeerror": TypeError, "valueerror": ValueError,
                   "keyerror": KeyError}[args.what]("internal")
        return {"ok": 0, "fail": 1, "none": None}[args.what]

    def register(sub):
        p = sub.add_parser("fake")
        p.add_argument("what")
        p.set_defaults(func=handler)

    mod = types.ModuleType("vb_fake_commands")
    mod.register = register
    monkeypatch.setitem(sys.modules, "vb_fake_commands", mod)
    monkeypatch.setattr(cli, "_COMMAND_MODULES", [*cli._COMMAND_MODULES, "vb_fake_commands"])


def test_exit_codes(fake, capsys):
    assert main(["fake", "ok"]) == 0 and main(["fake", "none"]) == 0
    assert main(["fake", "fail"]) == 1
    capsys.readouterr()
    assert main(["fake", "usage"]) == 2
    err = capsys.readouterr().err
    assert err == "varbench fake: error: k=0 is not valid; expected an integer >= 1\n"
    assert main(["fake", "interrupt"]) == 130
    assert capsys.readouterr().err == "varbench fake: interrupted\n"
    with pytest.raises(RuntimeError, match="a bug"):  # a bug keeps its traceback
        main(["fake", "bug"])
    for what, exc in (("typeerror", TypeError), ("valueerror", ValueError),
                      ("keyerror", KeyError)):
        with pytest.raises(exc, match="internal"):
            main(["fake", what])


def test_an_internal_error_reaches_the_user_as_a_traceback_with_exit_1(tmp_path):
    """Run as a user would: a bug inside a command is a traceback and exit 1, not exit 2."""
    import subprocess

    plugin = tmp_path / "vb_bug_site"
    plugin.mkdir()
    (plugin / "sitecustomize.py").write_text(
        "import varbench.estimators.registry as r\n"
        "def broken(*a, **k):\n"
        "    raise TypeError('internal bug for the test')\n"
        "r.advantages = broken\n"
    )
    env = {**__import__("os").environ, "PYTHONPATH": str(plugin)}
    out = subprocess.run([sys.executable, "-m", "varbench", "check", "rloo", "--steps", "10"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 1, out.stderr
    assert "Traceback" in out.stderr and "internal bug for the test" in out.stderr


def test_os_errors_are_user_errors_with_path_and_reason(tmp_path, capsys):
    """Regression: OS errors (output path is a file, permission denied) reached users as
    tracebacks in run, merge, train, compare."""
    blocker = tmp_path / "file"
    blocker.write_text("x")
    suite = tmp_path / "s.toml"
    suite.write_text('[suite]\nname = "s"\n[[cases]]\nname = "c"\nkind = "check"\n'
                     'estimator = "centered"\nnum_steps = 10\nbaselines = []\n')
    assert main(["run", str(suite), "--out", str(tmp_path / "shard")]) == 0
    for argv in (["run", str(suite), "--out", str(blocker)],
                 ["run", str(suite), "--out", str(blocker / "sub")],
                 ["merge", str(tmp_path / "shard"), "--out", str(blocker / "sub")],
                 ["compare", str(blocker), str(blocker)],
                 ["train", "--out", str(blocker), "--policy", "micro", "--no-warm-start",
                  "--steps", "1"]):
        capsys.readouterr()
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert str(blocker) in err and "Traceback" not in err and len(err.splitlines()) == 1


def test_os_error_text_names_both_paths():
    err = OSError(13, "Permission denied", "/a", None, "/b")
    assert cli.os_error_text(err) == "'/a' -> '/b': Permission denied"


def test_internal_error_says_so_before_its_traceback(fake, capsys):
    with pytest.raises(RuntimeError, match="a bug"):
        main(["fake", "bug"])
    assert "internal error (a bug in varbench, not in your input)" in capsys.readouterr().err
