"""The SSH endpoint: the command-line parser, the authorized-keys syntax, and a real
asyncssh server talked to by asyncssh's client on loopback, with stand-in verbs that
record what they were asked (the lab plays a real VM through it, with OpenSSH too)."""

from __future__ import annotations

import asyncio
import functools
import os
import stat
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import asyncssh
import pytest

from hostagent.core.ratelimit import Summarised
from hostagent.host import journal
from hostagent.surfaces import ssh
from hostagent.surfaces import ssh_keys
from hostagent.surfaces.ssh import BadCommand, KeysError, parse_authorized_keys, parse_command
from tests.unit.ssh_scaffold import KEY_A, KEY_B, KEY_C, VERBS, Verbs, connect, pub, run

pytestmark = pytest.mark.usefixtures("sink")  # journal records in memory (conftest)


def test_loading_ssh_prints_no_warning_to_the_journal() -> None:
    """cryptography 51 warns when asyncssh 2.24 reads its DSA classes; the agent's stderr
    is its journal, and the line would come at every start."""
    done = subprocess.run(
        [sys.executable, "-W", "default", "-c",
         "import hostagent.surfaces.ssh, hostagent.host.verify, asyncssh"],
        capture_output=True, text=True, timeout=60, check=False)
    assert (done.returncode, done.stderr) == (0, "")


def ssh_records(sink: journal.ListSink) -> list[tuple[str, str]]:
    return [(e.fields["HOSTAGENT_RESULT"], e.message) for e in sink.entries
            if e.fields.get("HOSTAGENT_EVENT") == "ssh"]


async def recorded(sink: journal.ListSink, result: str) -> None:
    """Wait for a record the server writes after the client is gone."""
    for _ in range(500):
        if any(r == result for r, _ in ssh_records(sink)):
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"no {result!r} record: {ssh_records(sink)}")


# --- the command line ----------------------------------------------------------------------


@pytest.mark.parametrize(("line", "parsed"), [
    ("status", ("status", None)),
    ("play gaming1", ("play", "gaming1")),
    ("release win-11.old_2", ("release", "win-11.old_2")),
    ("reclaim", ("reclaim", None)),
])
def test_command_lines_that_parse(line: str, parsed: tuple[str, str | None]) -> None:
    assert parse_command(line, VERBS) == parsed


@pytest.mark.parametrize(("line", "why"), [
    (None, "hostagent runs no shell: give a command, e.g. `status`"),
    ("", "the command is empty: give one, e.g. `status`"),
    ("play gaming1; rm -rf /", "a command is a verb and at most one VM name, e.g. `play gaming1`"),
    ("play gaming1;", "a VM name holds only letters, digits, '.', '_' and '-'"),
    ("play 'gaming1'", "a VM name holds only letters, digits, '.', '_' and '-'"),
    ('play "gaming1"', "a VM name holds only letters, digits, '.', '_' and '-'"),
    ("play $(reboot)", "a VM name holds only letters, digits, '.', '_' and '-'"),
    ("play `reboot`", "a VM name holds only letters, digits, '.', '_' and '-'"),
    ("play gaming1|sh", "a VM name holds only letters, digits, '.', '_' and '-'"),
    ("play gaming1\nrm -rf /", "the command may only hold printable ASCII characters"),
    ("play\tgaming1", "the command may only hold printable ASCII characters"),
    ("play gaming1\x00", "the command may only hold printable ASCII characters"),
    ("play gamíng1", "the command may only hold printable ASCII characters"),
    ("play  gaming1", "the words of a command are separated by exactly one space"),
    (" play gaming1", "the words of a command are separated by exactly one space"),
    ("play gaming1 ", "the words of a command are separated by exactly one space"),
    ("play", "play needs a VM name, e.g. `play gaming1`"),
    ("status gaming1", "status takes no VM name"),
    ("PLAY gaming1", "unknown verb 'PLAY'; known: hold, lend, play, reclaim, release, resume, status"),
    ("sh -c reboot", "unknown verb 'sh'; known: hold, lend, play, reclaim, release, resume, status"),
    ("scp -t /tmp", "unknown verb 'scp'; known: hold, lend, play, reclaim, release, resume, status"),
    ("play " + "g" * 300, "the command is longer than 256 characters"),
])
def test_command_lines_refused(line: str | None, why: str) -> None:
    with pytest.raises(BadCommand) as info:
        parse_command(line, VERBS)
    assert str(info.value) == why


# --- authorized keys -----------------------------------------------------------------------

def test_authorized_keys_syntax() -> None:
    text = "\n".join([
        "# the kitchen button",
        f'verbs="play,release,status",vms="gaming1" {pub(KEY_A, "kitchen button")}',
        "",
        f'restrict,no-pty,verbs="*",vms="*" {pub(KEY_B)}',
    ])
    a, b = parse_authorized_keys(text, "keys", verbs=VERBS)
    assert (a.comment, a.verbs, a.vms, a.line) == (
        "kitchen button", frozenset({"play", "release", "status"}), frozenset({"gaming1"}), 2)
    assert a.fingerprint == KEY_A.get_fingerprint("sha256")
    assert (b.comment, b.verbs, b.vms) == (KEY_B.get_fingerprint("sha256"), None, None)
    assert a.may("play", "gaming1") is None
    assert a.may("play", "gaming2") == (
        "this key (kitchen button) may not touch gaming2; it may name: gaming1")
    assert a.may("reclaim", None) == (
        "this key (kitchen button) may not use 'reclaim'; it may use: play, release, status")
    assert b.may("reclaim", None) is None and b.may("play", "anything") is None
    [c] = parse_authorized_keys(f'verbs="status" {pub(KEY_C, "dash")}', "keys", verbs=VERBS)
    assert c.may("status", None) is None
    assert c.may("play", "gaming1") == "this key (dash) may not use 'play'; it may use: status"
    [d] = parse_authorized_keys(f'verbs="play" {pub(KEY_C, "d")}', "keys", verbs=VERBS)
    assert d.may("play", "gaming1") == "this key (d) may not touch gaming1; it may name: no VM"


MISTAKES = [
    (pub(KEY_A, "bare"), 'keys:1: this key has no verbs="...": say what it may do, e.g. '
                         'verbs="play,release,status",vms="gaming1"'),
    (f'command="/bin/sh",verbs="play" {pub(KEY_A)}',
     "keys:1: hostagent does not support the option 'command': a key says what it may do "
     'with verbs="..." and vms="..."'),
    (f'from="10.0.0.0/8",verbs="play" {pub(KEY_A)}',
     "keys:1: hostagent does not support the option 'from': a key says what it may do with "
     'verbs="..." and vms="..."'),
    (f'verbs="play,shell" {pub(KEY_A)}',
     "keys:1: verbs: unknown shell; known: hold, lend, play, reclaim, release, resume, status"),
    (f'verbs="play",vms="gaming1;x" {pub(KEY_A)}', "keys:1: vms: 'gaming1;x' is not a name"),
    (f'verbs=play {pub(KEY_A)}', "keys:1: the value of verbs must be in double quotes"),
    (f'verbs="play {pub(KEY_A)}', "keys:1: the value of verbs has no closing quote"),
    (f'verbs="play",verbs="status" {pub(KEY_A)}', "keys:1: verbs is given twice"),
    (f'verbs="play" {pub(KEY_A)}\nverbs="status" {pub(KEY_A)}',
     "keys:2: this key is already listed; one line per key"),
    ('verbs="play" ssh-ed25519 AAAAnotakey', "keys:1: not a public key"),
]


# Named by their errors: the keys are made afresh at each collection, and every process
# of a parallel run must collect the same names.
@pytest.mark.parametrize(("line", "error"), MISTAKES, ids=[e[:70] for _, e in MISTAKES])
def test_authorized_keys_mistakes_refuse_the_whole_file(line: str, error: str) -> None:
    with pytest.raises(KeysError) as info:
        parse_authorized_keys(line, "keys", verbs=VERBS)
    assert str(info.value).startswith(error)


def test_host_key_is_created_once(tmp_path: Path, sink: journal.ListSink) -> None:
    path = tmp_path / "state" / "ssh_host_ed25519_key"
    key = ssh.load_host_key(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    public = (tmp_path / "state" / "ssh_host_ed25519_key.pub").read_text()
    assert public.startswith("ssh-ed25519 ")
    assert asyncssh.import_public_key(public).public_data == key.public_data
    again = ssh.load_host_key(path)
    assert again.public_data == key.public_data  # never replaced
    assert [r for r, _ in ssh_records(sink)] == ["created"]
    path.write_text("garbage")
    with pytest.raises(ssh.EndpointError, match="cannot use it as the SSH host key"):
        ssh.load_host_key(path)


# --- a real server, asyncssh's client ------------------------------------------------------


@pytest.fixture
async def endpoint(tmp_path: Path) -> AsyncIterator[tuple[int, Verbs, Path]]:
    keys = tmp_path / "authorized_keys"
    keys.write_text(f'verbs="play,release,status",vms="gaming1" {pub(KEY_A, "button")}\n'
                    f'verbs="*",vms="*" {pub(KEY_B, "admin")}\n')
    keys.chmod(0o600)
    verbs = Verbs()
    server = await ssh.serve(("127.0.0.1", 0), tmp_path / "host_key", keys, verbs.table())
    try:
        yield server.get_port(), verbs, keys
    finally:
        server.close()
        await server.wait_closed()


async def test_an_allowed_key_plays_and_gets_the_progress_and_exit_0(
        endpoint: tuple[int, Verbs, Path], tmp_path: Path, sink: journal.ListSink) -> None:
    port, verbs, _ = endpoint
    async with connect(port, KEY_A, tmp_path) as conn:
        done = await conn.run("play gaming1")
    assert done.exit_status == 0
    assert done.stdout.splitlines() == [
        "[   0.0s] draining gpu-node (waiting for gpu-node's node to drain)",
        "[   0.1s] gpu-node is off",
        "gaming1 is running",
    ]
    assert done.stderr == ""
    assert verbs.calls == [("play", {"vm": "gaming1"})]
    await recorded(sink, "closed")
    records = ssh_records(sink)
    assert [r for r, _ in records] == [
        "created", "listening", "connected", "known", "authenticated", "allowed", "ok", "closed"]
    allowed = next(e for e in sink.entries if e.fields.get("HOSTAGENT_RESULT") == "allowed")
    assert allowed.fields["HOSTAGENT_KEY"] == "button"
    assert allowed.fields["HOSTAGENT_FINGERPRINT"] == KEY_A.get_fingerprint("sha256")
    assert allowed.fields["HOSTAGENT_COMMAND"] == "'play gaming1'"
    assert allowed.fields["HOSTAGENT_PEER"].startswith("127.0.0.1:")


async def test_refusals_happen_before_anything_runs(
        endpoint: tuple[int, Verbs, Path], tmp_path: Path, sink: journal.ListSink,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ssh, "PEER_BURST", 1000)  # every record of this burst is read
    port, verbs, _ = endpoint
    with pytest.raises(asyncssh.PermissionDenied):
        async with connect(port, KEY_C, tmp_path):
            pass
    assert ("refused", f"refused an unknown key {KEY_C.get_fingerprint('sha256')} from "
            f"{next(m for r, m in ssh_records(sink) if r == 'connected').split()[-1]} "
            "(user 'hostagent')") in ssh_records(sink)
    done = await run(port, KEY_A, tmp_path, "play gaming2")
    assert (done.exit_status, done.stderr) == (77, (
        "hostagent: denied: this key (button) may not touch gaming2; it may name: "
        "gaming1\n"))
    done = await run(port, KEY_A, tmp_path, "reclaim")
    assert done.exit_status == 77
    for line in ("play gaming1; rm -rf /", "play 'gaming1'", "play gaming1 && reboot",
                 "play  gaming1", "play gaming1\nreboot", "x" * 5000, "status; id"):
        done = await run(port, KEY_A, tmp_path, line)
        assert done.exit_status == 64, line
        assert done.stderr.startswith("hostagent: refused: "), line
        assert done.stdout == ""
    # A shell, a terminal, SFTP, forwarding: refused by the protocol.
    async with connect(port, KEY_A, tmp_path) as conn:
        with pytest.raises(asyncssh.ChannelOpenError, match="PTY request failed"):
            await conn.create_process("status", term_type="xterm")
    async with connect(port, KEY_A, tmp_path) as conn:
        with pytest.raises(asyncssh.ChannelOpenError, match="Session request failed"):
            await conn.create_process()  # a shell
    async with connect(port, KEY_A, tmp_path) as conn:
        with pytest.raises(asyncssh.ChannelOpenError, match="Session request failed"):
            await conn.start_sftp_client()  # the sftp subsystem
    async with connect(port, KEY_A, tmp_path) as conn:
        with pytest.raises(asyncssh.ChannelOpenError):
            await conn.open_connection("127.0.0.1", port)
        with pytest.raises(asyncssh.ChannelListenError):
            await conn.forward_remote_port("127.0.0.1", 0, "127.0.0.1", 22)
    assert verbs.calls == []
    refused = [m for r, m in ssh_records(sink) if r == "refused"]
    for what in ("a terminal (pty)", "a shell", "the subsystem 'sftp'",
                 f"a port forwarding to 127.0.0.1:{port}",
                 "a remote port forwarding from 127.0.0.1:0"):
        assert any(m.startswith(f"refused {what} to button at ") for m in refused), what
    assert any("refused command 'play gaming1; rm -rf /' from button" in m for m in refused)
    assert [r for r, _ in ssh_records(sink)].count("denied") == 2


async def test_a_failed_verb_exits_1_and_a_hangup_stops_the_waiting(
        endpoint: tuple[int, Verbs, Path], tmp_path: Path) -> None:
    port, verbs, _ = endpoint
    done = await run(port, KEY_B, tmp_path, "reclaim")
    assert (done.exit_status, done.stderr) == (1, "hostagent: the lendee is stuck\n")
    done = await run(port, KEY_B, tmp_path, "status")
    assert (done.exit_status, done.stdout) == (0, "status done\n")
    async with connect(port, KEY_B, tmp_path) as conn:
        await conn.create_process("release gaming2")
        await asyncio.wait_for(verbs.release_started.wait(), 5)
    await asyncio.wait_for(verbs.release_closed.wait(), 5)  # the client went away


async def test_the_keys_file_is_read_again_and_a_broken_one_refuses_everyone(
        endpoint: tuple[int, Verbs, Path], tmp_path: Path, sink: journal.ListSink) -> None:
    port, verbs, keys = endpoint
    keys.write_text(f'verbs="status" {pub(KEY_C, "new")}\n')
    os.utime(keys, ns=(1, 1))
    async with connect(port, KEY_C, tmp_path) as conn:
        assert (await conn.run("status")).exit_status == 0
    with pytest.raises(asyncssh.PermissionDenied):
        async with connect(port, KEY_A, tmp_path):
            pass
    keys.write_text(f'command="sh" {pub(KEY_C, "new")}\n')
    os.utime(keys, ns=(2, 2))
    with pytest.raises(asyncssh.PermissionDenied):
        async with connect(port, KEY_C, tmp_path):
            pass
    assert any(r == "error" and "every key is refused until it is fixed" in m
               for r, m in ssh_records(sink))


async def test_an_unsafe_or_missing_keys_file_refuses_every_key_until_fixed(
        tmp_path: Path, sink: journal.ListSink) -> None:
    # Broken at start used to stop the agent (exit 2, never restarted): a file being
    # rewritten at that moment took the hook socket down with it. Now the endpoint
    # starts, refuses every key with the reason in the journal, and takes the file as
    # soon as it is fixed.
    keys = tmp_path / "authorized_keys"
    keys.write_text(f'verbs="status" {pub(KEY_A)}\n')
    keys.chmod(0o664)
    server = await ssh.serve(("127.0.0.1", 0), tmp_path / "host_key", keys, Verbs().table())
    try:
        port = server.get_port()
        with pytest.raises(asyncssh.PermissionDenied):
            async with connect(port, KEY_A, tmp_path):
                pass
        keys.chmod(0o644)
        async with connect(port, KEY_A, tmp_path) as conn:
            assert (await conn.run("status")).exit_status == 0
    finally:
        server.close()
        await server.wait_closed()
    errors = [m for r, m in ssh_records(sink) if r == "error"]
    assert len(errors) == 1 and "writable by group or others" in errors[0]
    assert any(r == "fixed" for r, _ in ssh_records(sink))
    server = await ssh.serve(("127.0.0.1", 0), tmp_path / "host_key", tmp_path / "none",
                             Verbs().table())
    server.close()
    assert "cannot read the SSH authorized keys" in [m for r, m in ssh_records(sink)
                                                     if r == "error"][-1]


@pytest.mark.skipif(os.geteuid() != 0, reason="chown needs root")
async def test_a_keys_file_not_owned_by_root_is_refused(tmp_path: Path) -> None:
    keys = tmp_path / "authorized_keys"
    keys.write_text(f'verbs="status" {pub(KEY_A)}\n')
    keys.chmod(0o644)
    os.chown(keys, 65534, 65534)
    server = await ssh.serve(("127.0.0.1", 0), tmp_path / "host_key", keys, Verbs().table())
    try:
        with pytest.raises(asyncssh.PermissionDenied):
            async with connect(server.get_port(), KEY_A, tmp_path):
                pass
    finally:
        server.close()
        await server.wait_closed()
    with pytest.raises(KeysError, match=rf"owned by uid 65534, not root.*chown root {keys}"):
        ssh_keys._KeyFile(keys, VERBS)._read()


async def test_a_port_that_cannot_be_bound_is_transient(tmp_path: Path) -> None:
    keys = tmp_path / "authorized_keys"
    keys.write_text(f'verbs="status" {pub(KEY_A)}\n')
    keys.chmod(0o600)
    first = await ssh.serve(("127.0.0.1", 0), tmp_path / "host_key", keys, Verbs().table())
    try:
        with pytest.raises(ssh.Transient, match="cannot listen for SSH on 127.0.0.1:.*retrying"):
            await ssh.serve(("127.0.0.1", first.get_port()), tmp_path / "host_key", keys,
                            Verbs().table())
    finally:
        first.close()
        await first.wait_closed()


def test_the_host_key_is_written_whole_and_an_empty_one_is_replaced(
        tmp_path: Path, sink: journal.ListSink) -> None:
    path = tmp_path / "ssh_host_ed25519_key"
    path.write_bytes(b"")  # what a crash left behind the old, unsynced write
    key = ssh.load_host_key(path)
    assert asyncssh.read_private_key(path).public_data == key.public_data
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name, path.name + ".pub"]
    cut = path.read_bytes()[:100]
    path.write_bytes(cut)
    with pytest.raises(ssh.EndpointError, match=rf"cut short.*mv {path} {path}.broken"):
        ssh.load_host_key(path)
    assert path.read_bytes() == cut  # never replaced behind the clients' back


def test_a_host_key_others_may_read_is_refused_with_the_fix(tmp_path: Path) -> None:
    path = tmp_path / "ssh_host_ed25519_key"
    ssh.load_host_key(path)
    path.chmod(0o644)
    with pytest.raises(ssh.EndpointError) as info:
        ssh.load_host_key(path)
    assert str(info.value) == (
        f"the SSH host key: {path}: a private key readable by group or others (mode 0644), "
        f"so anyone who can read it can use it: chmod 600 {path}, and replace the key if "
        "others may have copied it")
    path.chmod(0o600)
    assert ssh.load_host_key(path).public_data == asyncssh.read_private_key(path).public_data


# --- the keys file is read as sshd's StrictModes would --------------------------------------


def grants_of(keys: Path) -> tuple[list[str], str | None]:
    found = ssh_keys._KeyFile(keys, VERBS)
    return [g.comment for g in found.grants], found.problem


def test_a_keys_file_linked_into_a_directory_others_may_write_is_refused(
        tmp_path: Path) -> None:
    # The link is root's, the file it names is root's and 0644: stat() said fine. But
    # anyone may replace that file between the check and the read (a link flipped in
    # its directory), and so grant a key of theirs every verb.
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    (shared / "keys").write_text(f'verbs="*",vms="*" {pub(KEY_C, "intruder")}\n')
    (shared / "keys").chmod(0o644)
    keys = tmp_path / "authorized_keys"
    keys.symlink_to(shared / "keys")
    granted, problem = grants_of(keys)
    assert granted == []
    assert problem is not None and problem.startswith(
        f"{shared}: writable by group or others, so anyone who can write there can replace "
        f"{keys}: chmod go-w {shared}")


def test_every_directory_above_the_keys_file_is_checked(tmp_path: Path) -> None:
    above = tmp_path / "etc" / "hostagent"
    above.mkdir(parents=True)
    keys = above / "authorized_keys"
    keys.write_text(f'verbs="status" {pub(KEY_A, "button")}\n')
    keys.chmod(0o644)
    assert grants_of(keys) == (["button"], None)
    (tmp_path / "etc").chmod(0o775)
    granted, problem = grants_of(keys)
    assert granted == [] and problem is not None
    assert f"{tmp_path / 'etc'}: writable by group or others" in problem
    # Sticky, as /tmp: nobody else may rename or remove what root owns there.
    (tmp_path / "etc").chmod(0o1777)
    assert grants_of(keys) == (["button"], None)


def test_a_link_flipped_after_it_was_resolved_is_not_followed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = tmp_path / "keys"
    real.write_text(f'verbs="status" {pub(KEY_A, "button")}\n')
    real.chmod(0o644)
    keys = tmp_path / "authorized_keys"
    keys.symlink_to(real)
    assert grants_of(keys) == (["button"], None)
    # As if the link had been put there after the path was resolved: the open itself
    # refuses it (O_NOFOLLOW) instead of reading whatever it names.
    monkeypatch.setattr(os.path, "realpath", lambda p: str(p))
    granted, problem = grants_of(keys)
    assert granted == [] and problem is not None
    assert "cannot read the SSH authorized keys (Too many levels of symbolic links)" in problem


async def test_a_key_holder_in_a_loop_cannot_flood_the_journal(
        endpoint: tuple[int, Verbs, Path], tmp_path: Path, sink: journal.ListSink,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Each command over SSH is several records (the key, the authentication, the
    command, its end, the connection's end): a key holder in a loop wrote hundreds a
    second, past journald's rate limit, which then drops the agent's transitions too.
    One address's records are let through `PEER_BURST` per interval; the rest are
    counted in one "suppressed" record, written with the first record after it."""
    monkeypatch.setattr(ssh, "PEER_INTERVAL", 5.0)
    monkeypatch.setattr(ssh, "PEER_BURST", 20)  # a short loop is past it
    # The rate's clock (Summarised's `clock`) stands still through the loop, busy machine
    # or not, and is moved past the interval after it, rather than waited for.
    now = [time.monotonic()]
    monkeypatch.setattr(ssh, "Summarised", functools.partial(Summarised,
                                                             clock=lambda: now[0]))
    port, verbs, _ = endpoint
    runs = ssh.PEER_BURST // 5 + 15  # five records each: past the allowance
    for _ in range(runs):
        assert (await run(port, KEY_A, tmp_path, "status")).exit_status == 0
    records = [e for e in sink.entries if e.fields.get("HOSTAGENT_EVENT") == "ssh"]
    per_connection = [e for e in records if e.fields.get("HOSTAGENT_RESULT") in (
        "known", "authenticated", "allowed", "ok", "closed")]
    assert len(per_connection) == ssh.PEER_BURST
    now[0] += ssh.PEER_INTERVAL + 0.1
    assert (await run(port, KEY_A, tmp_path, "status")).exit_status == 0
    suppressed = [e for e in sink.entries if e.fields.get("HOSTAGENT_RESULT") == "suppressed"]
    assert len(suppressed) == 1
    assert suppressed[0].message.startswith("127.0.0.0/24: ")
    assert runs * 5 - ssh.PEER_BURST - 5 <= int(suppressed[0].fields["HOSTAGENT_COUNT"]) \
        <= runs * 5 - ssh.PEER_BURST


async def test_a_key_offerer_from_many_addresses_of_one_network_cannot_flood_the_journal(
        endpoint: tuple[int, Verbs, Path], tmp_path: Path, sink: journal.ListSink,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Offering a listed public key (which is no secret) and signing with another key
    writes a record before any signature; counted per address, one host with many
    addresses (a whole /64 in IPv6) had a rate for each. One network's records are
    counted together."""
    monkeypatch.setattr(ssh, "PEER_BURST", 20)
    port, _, _ = endpoint
    pair = asyncssh.load_keypairs([KEY_B])[0]
    pair.public_data = KEY_A.public_data  # the button's key offered, signed with another
    host_key = asyncssh.read_private_key(tmp_path / "host_key")
    known = asyncssh.import_known_hosts(
        f"[127.0.0.1]:{port} {host_key.export_public_key().decode()}")
    for i in range(ssh.PEER_BURST + 40):
        with pytest.raises(asyncssh.PermissionDenied):
            async with asyncssh.connect("127.0.0.1", port, username="hostagent",
                                        client_keys=[pair], known_hosts=known, agent_path=None,
                                        config=None, password_auth=False, kbdint_auth=False,
                                        local_addr=(f"127.0.0.{10 + i % 10}", 0)):
                pass
    offered = [e for e in sink.entries if e.fields.get("HOSTAGENT_RESULT") == "known"]
    assert len(offered) == ssh.PEER_BURST
