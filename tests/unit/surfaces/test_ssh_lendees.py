"""Several lendees over SSH: `hold --lendee NAME` and its kind name one lendee, and a
name that is no lendee is refused before anything runs, naming the lendees there are
(a real asyncssh server, `test_ssh`'s stand-in verbs)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hostagent.host import journal
from hostagent.surfaces import ssh
from hostagent.surfaces.ssh import BadCommand, parse_command
from hostagent.surfaces.ssh_command import lendee_args
from tests.unit.ssh_scaffold import KEY_A, KEY_B, VERBS, Verbs, pub, run

pytestmark = pytest.mark.usefixtures("sink")  # journal records in memory (conftest)

LENDEES = ("gpu-node", "gpu-node-b")


@pytest.mark.parametrize(("line", "args"), [
    ("hold --lendee gpu-node-b", {"lendee": "gpu-node-b"}),
    ("resume --lendee gpu-node", {"lendee": "gpu-node"}),
    ("lend --lendee gpu-node-b", {"lendee": "gpu-node-b"}),
    ("reclaim --lendee gpu-node-b", {"lendee": "gpu-node-b"}),
    ("reclaim", {}),
])
def test_a_lendee_is_named_with_the_lendee_option(line: str, args: dict[str, str]) -> None:
    assert parse_command(line, VERBS, LENDEES) == (line.split(" ")[0], None)
    assert lendee_args(line) == args


@pytest.mark.parametrize(("line", "why"), [
    ("hold --lendee node-c", "'node-c' is not a lendee: the lendees are gpu-node, gpu-node-b; "
                             "name one, or leave --lendee out for every lendee"),
    ("hold --lendee", "--lendee takes one lendee name after the verb, e.g. "
                      "`hold --lendee gpu-node-b`"),
    ("hold gpu-node-b --lendee", "--lendee takes one lendee name after the verb, e.g. "
                                 "`hold --lendee gpu-node-b`"),
    ("hold --lendee a b", "--lendee takes one lendee name after the verb, e.g. "
                          "`hold --lendee gpu-node-b`"),
    ("hold --lendee $(reboot)", "a lendee name holds only letters, digits, '.', '_' and '-'"),
    ("play --lendee gpu-node", "play takes no --lendee: only hold, lend, reclaim, resume "
                               "name a lendee"),
    ("status --lendee gpu-node", "status takes no --lendee: only hold, lend, reclaim, resume "
                                 "name a lendee"),
    ("hold gpu-node-b", "hold takes no VM name (`hold --lendee NAME` names one lendee)"),
])
def test_a_bad_lendee_option_is_refused_saying_how_to_fix_it(line: str, why: str) -> None:
    with pytest.raises(BadCommand) as info:
        parse_command(line, VERBS, LENDEES)
    assert str(info.value) == why


async def test_over_ssh_the_named_lendee_reaches_the_verb_and_an_unknown_one_nothing(
        tmp_path: Path, sink: journal.ListSink) -> None:
    keys = tmp_path / "authorized_keys"
    keys.write_text(f'verbs="hold,status",vms="gaming1" {pub(KEY_A, "button")}\n'
                    f'verbs="*",vms="*" {pub(KEY_B, "admin")}\n')
    keys.chmod(0o600)
    verbs = Verbs()
    server = await ssh.serve(("127.0.0.1", 0), tmp_path / "host_key", keys, verbs.table(),
                             lendees=LENDEES)
    try:
        port = server.get_port()
        done = await run(port, KEY_A, tmp_path, "hold --lendee gpu-node-b")
        assert (done.exit_status, done.stdout) == (0, "hold done\n")
        done = await run(port, KEY_B, tmp_path, "lend --lendee node-c")
        assert (done.exit_status, done.stderr) == (64, (
            "hostagent: refused: 'node-c' is not a lendee: the lendees are gpu-node, "
            "gpu-node-b; name one, or leave --lendee out for every lendee\n"))
        done = await run(port, KEY_A, tmp_path, "reclaim --lendee gpu-node-b")
        assert done.exit_status == 77  # the key's verbs still decide
    finally:
        server.close()
        await server.wait_closed()
    assert verbs.calls == [("hold", {"lendee": "gpu-node-b"})]
