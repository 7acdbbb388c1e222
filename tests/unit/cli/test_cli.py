"""`hostagent --help` and each command's page: what it does, an example, the exit
statuses; `--config` before or after the command."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from hostagent import cli

REPO = Path(__file__).resolve().parents[3]
GOOD = '[lendee]\ndomain = "gpu-node"\ngpus = ["0000:01:00.0"]\n'
COMMANDS = ["run", "status", "hold", "resume", "play", "release", "lend", "reclaim",
            "check-config", "history", "gpus", "lint", "unmark-node", "config", "config init"]


def help_of(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exit_:
        cli.main([*argv, "--help"])
    assert exit_.value.code == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_says_what_it_does_with_an_example(
        command: str, capsys: pytest.CaptureFixture[str]) -> None:
    page = help_of(command.split(), capsys)
    description = page.split("\n\n")[1]
    assert len(description.split()) >= 3 and description.endswith(".")
    example = page.split("example:\n", 1)[1].strip()
    assert example.startswith(f"hostagent {command}") or \
        re.match(rf"hostagent (--config \S+ )?{command}\b", example)


def test_the_exit_statuses_are_listed_in_help_and_readme(
        capsys: pytest.CaptureFixture[str]) -> None:
    page = help_of([], capsys)
    readme = " ".join((REPO / "README.md").read_text().split())
    for code, what in cli.EXIT_STATUSES:
        assert re.search(rf"^  {code}\s+{re.escape(what[:30])}", page, re.M), code
        assert f"| {code} | {what} |" in readme, code


def test_exit_statuses_of_a_good_a_bad_and_no_configuration(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good, bad = tmp_path / "good.toml", tmp_path / "bad.toml"
    good.write_text(f'control_socket = "{tmp_path}/nobody.sock"\n' + GOOD)
    bad.write_text(GOOD + "[lendee.oops\n")
    assert cli.main(["--config", str(good), "check-config"]) == 0
    assert cli.main(["--config", str(bad), "check-config"]) == 2
    assert cli.main(["--config", str(good), "status"]) == 1  # no agent listens there
    err = capsys.readouterr().err
    assert "nobody.sock" in err


def test_config_is_taken_before_or_after_the_command(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good, missing = tmp_path / "good.toml", tmp_path / "missing.toml"
    good.write_text(GOOD)
    assert cli.main(["check-config", "--config", str(good)]) == 0
    assert capsys.readouterr().out.startswith(f"{good}: OK")
    # The one after the command wins.
    assert cli.main(["--config", str(good), "check-config", "--config", str(missing)]) == 2
    assert str(missing) in capsys.readouterr().err
    assert cli.main(["--config", str(missing), "check-config"]) == 2


def test_reserve_takes_a_series_and_cancels_one_or_all(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """hostagent reserve VM --at HH:MM --every DAYS; --cancel (the next occurrence) and
    --cancel --all (the series): the verb's arguments, as the control socket carries them."""
    from hostagent import cli
    path = tmp_path / "config.toml"
    path.write_text('[lendee]\ndomain = "gpu-node"\ngpus = ["0000:01:00.0"]\n'
                    '[owners.gaming1]\ngpus = ["0000:01:00.0"]\n')
    sent: list[dict[str, object]] = []

    def request(socket: object, verb: str, args: dict[str, object]) -> list[dict[str, object]]:
        sent.append(args)
        return [{"ok": True, "data": {"message": "done"}}]
    monkeypatch.setattr(cli, "request", request)
    base = ["--config", str(path), "reserve", "gaming1"]
    assert cli.main([*base, "--at", "20:00", "--every", "weekdays"]) == 0
    assert cli.main([*base, "--cancel"]) == 0
    assert cli.main([*base, "--cancel", "--all"]) == 0
    assert sent == [{"vm": "gaming1", "at": "20:00", "every": "weekdays"},
                    {"vm": "gaming1", "cancel": True},
                    {"vm": "gaming1", "cancel": True, "every": True}]
    with pytest.raises(SystemExit):
        cli.main([*base, "--at", "20:00", "--all"])
