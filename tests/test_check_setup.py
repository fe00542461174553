"""`make check` (scripts/check_setup.py): each check fails with one readable line, and the
verdict counts the failures. (The full run, server included, is `make check` itself.)"""

import importlib.util
import socket
import sys
from pathlib import Path

import pytest

from helpers.server.background import port_is_free

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "check_setup.py"


@pytest.fixture
def check_setup():
    spec = importlib.util.spec_from_file_location("check_setup", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_an_old_python_is_named_with_what_to_do(check_setup, monkeypatch):
    monkeypatch.setattr(sys, "version_info", (3, 9, 6, "final", 0))
    with pytest.raises(check_setup.Failed, match=r"Python 3\.9\.6 is too old.*3\.10"):
        check_setup.check_python()


def test_a_missing_package_is_named(check_setup, monkeypatch):
    monkeypatch.setattr(check_setup, "PACKAGES", ("json", "no_such_package_for_the_course"))
    with pytest.raises(check_setup.Failed, match="cannot import no_such_package_for_the_course"):
        check_setup.check_imports()


def test_a_taken_port_is_reported(check_setup):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        assert not port_is_free("127.0.0.1", port)
        with pytest.raises(check_setup.Failed, match=f"port {port} is still taken"):
            check_setup.check_port(port)
    assert port_is_free("127.0.0.1", port)


def _stub_checks(check_setup, monkeypatch, failing=()):
    def make(name, value):
        def check(*args):
            if name in failing:
                raise check_setup.Failed(f"{name} broke")
            return value
        return check
    for name in ("python", "imports", "model", "widget", "kernel", "port"):
        monkeypatch.setattr(check_setup, f"check_{name}", make(name, f"{name} fine"))
    monkeypatch.setattr(check_setup, "check_server", make("server", ("server fine", 1234)))


def test_the_verdict_says_ready_only_when_every_check_passed(check_setup, monkeypatch, capsys):
    _stub_checks(check_setup, monkeypatch)
    assert check_setup.main() == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 8 and all(line.startswith("✓ ") for line in out[:7])
    assert out[-1].startswith("READY: all 7 checks passed")

    _stub_checks(check_setup, monkeypatch, failing=("model",))
    assert check_setup.main() == 1
    out = capsys.readouterr().out.splitlines()
    assert "✗ model: model broke" in out
    assert out[-1].startswith("NOT READY: 1 of 7 checks failed")


def test_a_server_that_does_not_run_fails_the_port_check_too(check_setup, monkeypatch, capsys):
    _stub_checks(check_setup, monkeypatch, failing=("server",))
    assert check_setup.main() == 1
    out = capsys.readouterr().out
    assert "✗ port: not checked, the server did not run" in out
    assert "NOT READY: 2 of 7 checks failed" in out


def test_an_unexpected_error_is_one_line_too(check_setup, monkeypatch, capsys):
    _stub_checks(check_setup, monkeypatch)
    monkeypatch.setattr(check_setup, "check_widget", lambda: {}["missing"])
    assert check_setup.main() == 1
    line = next(l for l in capsys.readouterr().out.splitlines() if l.startswith("✗"))
    assert line.startswith("✗ widgets: KeyError: 'missing' (")
