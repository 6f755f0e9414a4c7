"""Every verb answers bad input in one line: a bad argument, a bad number or an unusable path is one line on stderr
and exit status 2, never a traceback; ``--json`` prints exactly one JSON object on stdout; every option has help.

The walk over every option runs the real ``main`` in-process (fast); the unusable paths, ``--version`` and the
``--json`` outputs run the real ``kvlifecycle`` command as a subprocess."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from debug_scenarios import SCENARIOS

from kvlifecycle.cli import VERBS, build_parser, main
from kvlifecycle.cli.arguments import describe_user_error

OPTIONLESS = {"diagram"}  # verbs whose only option takes any text


def _parsers() -> Iterator[tuple[list[str], argparse.ArgumentParser]]:
    """Every (verb path, parser): the verbs, and each benchmark of ``bench``."""

    def walk(path: list[str], parser: argparse.ArgumentParser) -> Iterator[tuple[list[str], argparse.ArgumentParser]]:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs:
            yield path, parser
        for action in subs:
            for name, sub in action.choices.items():
                yield from walk([*path, name], sub)

    yield from walk([], build_parser())


def _numeric_options() -> list[tuple[list[str], str, bool]]:
    """(verb path, option, may be zero) of every option that takes a number."""
    out = []
    for path, parser in _parsers():
        for action in parser._actions:
            name = getattr(action.type, "__name__", "")
            if action.option_strings and name in ("int", "float", "non_negative_int", "port"):
                positive = isinstance(action.default, (int, float)) and action.default > 0
                zero_ok = name in ("non_negative_int", "port") or not positive
                out.append((path, action.option_strings[-1], zero_ok))
    return out


def _one_line_exit_2(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    err = capsys.readouterr().err
    assert exited.value.code == 2, (argv, err)
    assert err.count("\n") == 1 and "Traceback" not in err, (argv, err)
    return err


def test_the_walk_sees_every_verb_and_benchmark() -> None:
    paths = {" ".join(p) for p, _ in _parsers()}
    assert set(VERBS) - {"bench"} <= paths and {"bench lifecycle", "bench gpu"} <= paths


@pytest.mark.parametrize("path", [" ".join(p) for p, _ in _parsers()])
def test_an_unknown_option_is_one_line_and_exit_2(path: str, capsys: pytest.CaptureFixture[str]) -> None:
    err = _one_line_exit_2(capsys, [*path.split(), "--no-such-option"])
    assert ": error: " in err and "--help" in err


@pytest.mark.parametrize(("path", "option", "zero_ok"), _numeric_options(),
                         ids=lambda x: " ".join(x) if isinstance(x, list) else str(x))
def test_a_bad_number_is_refused_where_it_is_parsed(path: list[str], option: str, zero_ok: bool,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    required = {"drain": ["--etcd", "127.0.0.1:1", "--instance", "x"]}.get(path[0], [])
    positional = ["/nonexistent-log"] if path[0] in ("replay", "explain", "timeline") else []
    for bad in ("abc", "-1", "nan", *(() if zero_ok else ("0",))):
        err = _one_line_exit_2(capsys, [*path, *required, option, bad, *positional])
        assert option in err, err


def test_every_option_has_help() -> None:
    missing = [f"{' '.join(path)} {a.option_strings}" for path, parser in _parsers() for a in parser._actions
               if a.option_strings and not isinstance(a, (argparse._HelpAction, argparse._VersionAction))
               and not a.help]
    assert missing == []


def test_a_missing_extra_names_the_install_line() -> None:
    line = describe_user_error(ModuleNotFoundError("No module named 'torch'", name="torch"))
    assert line == "needs the 'torch' package, which is not installed: pip install 'kvlifecycle[torch]'"


def _cli(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvlifecycle", *argv], capture_output=True, text=True, timeout=300)


def test_version_and_a_missing_verb() -> None:
    from kvlifecycle import __version__

    done = _cli("--version")
    assert done.returncode == 0 and done.stdout.strip() == f"kvlifecycle {__version__}"
    bare = _cli()
    assert bare.returncode == 2 and bare.stderr.count("\n") == 1


def test_unusable_paths_are_one_line_and_exit_2(tmp_path: Path) -> None:
    SCENARIOS["clean"](tmp_path / "logs")
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    cases = [
        ("demo", "--out", str(a_file)),
        ("timeline", str(tmp_path / "logs"), "-o", str(tmp_path / "missing" / "t.json")),
        ("timeline", str(tmp_path / "logs"), "-o", str(tmp_path / "t.json"), "--png", str(a_file / "x.png")),
        ("replay", str(tmp_path / "missing")),
        ("explain", str(a_file)),
        ("diagram", "-o", str(tmp_path / "missing" / "d.md")),
        ("proxy",),
    ]
    for argv in cases:
        done = _cli(*argv)
        assert done.returncode == 2, (argv, done.stdout[-500:], done.stderr[-2000:])
        assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, (argv, done.stderr)
        assert done.stderr.startswith(f"kvlifecycle {argv[0]}"), done.stderr


def test_every_json_output_is_one_object(tmp_path: Path) -> None:
    SCENARIOS["clean"](tmp_path / "logs")
    logs = str(tmp_path / "logs")
    for argv in (("replay", logs, "--check", "--json"), ("explain", logs, "--json"),
                 ("explain", logs, "--until", "+4ms", "--json"), ("sim", "--seeds", "2", "--json", "--out",
                                                                  str(tmp_path / "sim")),
                 ("bench", "lifecycle", "--requests", "20", "--rounds", "1", "--blocks", "4", "--json")):
        done = _cli(*argv)
        assert done.returncode in (0, 1), (argv, done.stderr[-2000:])
        assert isinstance(json.loads(done.stdout), dict), argv


def test_doctor_lists_the_extras_present_and_what_a_missing_one_enables(tmp_path: Path) -> None:
    from hidden_modules import env_hiding

    rows = {r["extra"]: r for r in json.loads(_cli("doctor", "--extras", "--json").stdout)["extras"]}
    assert rows["transports"]["present"] is True and rows["testing"]["present"] is True
    hidden = subprocess.run([sys.executable, "-m", "kvlifecycle", "doctor", "--extras"], capture_output=True,
                            text=True, timeout=120, env=env_hiding(tmp_path, "nixl"))
    line = next(x for x in hidden.stdout.splitlines() if x.strip().startswith("transports"))
    assert "missing (nixl)" in line and "NIXL transport" in line
