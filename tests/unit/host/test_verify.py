"""The in-guest GPU check: parsing nvidia-smi, comparing by UUID or by count, asking over
SSH with the host key checked; and keeping a dead boot's screenshots."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import asyncssh
import pytest

from hostagent.host import screenshots, verify
from hostagent.service.agent import Agent
from hostagent.core.config import parse
from hostagent.host.libvirt import ExecResult
from hostagent.host.verify import Expected, SeenGpu
from tests.unit.agents import CONFIG, FakeLibvirt, lent

A = Expected(label="gpu-a", uuid="GPU-aaaa", name="RTX 3050")
B = Expected(label="gpu-b", uuid="GPU-bbbb", name="GTX 960")
ANSWER = ("GPU-aaaa, 00000000:01:00.0, NVIDIA GeForce RTX 3050\n"
          "GPU-bbbb, 00000000:02:00.0, NVIDIA GeForce GTX 960\n")


def test_parse_query_reads_nvidia_smi_csv() -> None:
    assert verify.parse_query(ANSWER + "\n") == [
        SeenGpu(uuid="GPU-aaaa", pci="00000000:01:00.0", name="NVIDIA GeForce RTX 3050"),
        SeenGpu(uuid="GPU-bbbb", pci="00000000:02:00.0", name="NVIDIA GeForce GTX 960"),
    ]
    # A name with a comma stays whole.
    assert verify.parse_query("GPU-c, 00000000:03:00.0, Card, Rev 2")[0].name == "Card, Rev 2"
    with pytest.raises(ValueError, match="not a uuid, pci.bus_id, name line"):
        verify.parse_query("NVIDIA-SMI has failed because it couldn't communicate")


def test_every_gpu_seen_by_uuid() -> None:
    out = verify.outcome_of_run([A, B], 0, ANSWER, "")
    assert out.ok and out.missing == () and out.extra == ()
    assert out.summary("gpu-node") == ("the driver in gpu-node sees NVIDIA GeForce RTX 3050 "
                                       "(GPU-aaaa), NVIDIA GeForce GTX 960 (GPU-bbbb)")


def test_one_missing_by_uuid() -> None:
    out = verify.outcome_of_run([A, B], 0, ANSWER.splitlines()[0], "")
    assert not out.ok and out.missing == (B,)
    assert out.summary("gpu-node") == ("the driver in gpu-node does not see gpu-b (GTX 960, "
                                       "GPU-bbbb) (it sees: GPU-aaaa)")


def test_no_device_at_all() -> None:
    out = verify.outcome_of_run([A, B], 6, "No devices were found\n", "")
    assert not out.ok and out.missing == (A, B)
    assert out.summary("gpu-node") == (
        "the driver in gpu-node sees no GPU (nvidia-smi exited with status 6: No devices were "
        "found); missing: gpu-a (RTX 3050, GPU-aaaa), gpu-b (GTX 960, GPU-bbbb)")


def test_garbage_output_is_a_failure_not_a_crash() -> None:
    out = verify.outcome_of_run([A], 0, "Segmentation fault\n", "")
    assert not out.ok and out.problem is not None and "unexpected output" in out.problem


def test_without_uuids_gpus_are_counted() -> None:
    a, b = Expected(label="gpu-a"), Expected(label="gpu-b")
    assert verify.outcome_of_run([a, b], 0, ANSWER, "").ok
    short = verify.outcome_of_run([a, b], 0, ANSWER.splitlines()[1], "")
    assert short.missing == (b,)
    # Mixed: known UUIDs by UUID, the rest by what is left over.
    assert verify.compare([A, b], verify.parse_query(ANSWER)).ok
    assert verify.compare([B, a], verify.parse_query(ANSWER.splitlines()[1])).missing == (a,)


def test_a_wrong_card_is_not_a_lent_one() -> None:
    # The guest sees as many GPUs as lent, but not the ones lent: by UUID, that is missing.
    other = "GPU-zzzz, 00000000:01:00.0, NVIDIA GeForce RTX 3050\n" + ANSWER.splitlines()[1]
    out = verify.outcome_of_run([A, B], 0, other, "")
    assert out.missing == (A,) and [g.uuid for g in out.extra] == ["GPU-zzzz"]


def test_the_usual_causes_name_driver_branch_option_rom_and_passthrough() -> None:
    assert "legacy 580 branch" in verify.CAUSES
    assert "<rom bar='off'/>" in verify.CAUSES
    assert "hostagent lint" in verify.CAUSES


# --- over SSH, against a real (in-process) SSH server ---------------------------------------


class _Server(asyncssh.SSHServer):
    def begin_auth(self, username: str) -> bool:
        return True


async def _answer(process: asyncssh.SSHServerProcess[str]) -> None:
    if process.command == "nvidia-smi --query-gpu=uuid,pci.bus_id,name --format=csv,noheader":
        process.stdout.write(ANSWER)
        process.exit(0)
    else:
        process.stderr.write(f"unexpected command {process.command!r}\n")
        process.exit(127)


@pytest.fixture
async def ssh_server(tmp_path: Path) -> AsyncIterator[dict[str, Any]]:
    host_key = asyncssh.generate_private_key("ssh-ed25519")
    client_key = asyncssh.generate_private_key("ssh-ed25519")
    (tmp_path / "id").write_bytes(client_key.export_private_key())
    (tmp_path / "id").chmod(0o600)
    (tmp_path / "authorized").write_bytes(client_key.export_public_key())
    server = await asyncssh.create_server(
        _Server, "127.0.0.1", 0, server_host_keys=[host_key],
        authorized_client_keys=str(tmp_path / "authorized"), process_factory=_answer)
    port = server.sockets[0].getsockname()[1]
    known = tmp_path / "known_hosts"
    known.write_text(f"[127.0.0.1]:{port} {host_key.export_public_key().decode()}")
    stranger = tmp_path / "known_hosts.other"
    other = asyncssh.generate_private_key("ssh-ed25519").export_public_key().decode()
    stranger.write_text(f"[127.0.0.1]:{port} {other}")
    try:
        yield {"host": "127.0.0.1", "port": port, "user": "hostagent",
               "key": str(tmp_path / "id"), "known": str(known), "stranger": str(stranger)}
    finally:
        server.close()
        await server.wait_closed()


class DriverLoadingLate(FakeLibvirt):
    """The lendee's guest agent answers before its NVIDIA driver has loaded: the first
    query fails as nvidia-smi does then, every later one lists both GPUs."""

    def __init__(self, agent: Agent) -> None:
        super().__init__(agent)
        self.queries = 0

    async def guest_exec(self, name: str, path: str, args: list[str], *,
                         timeout: float = 30) -> ExecResult:
        self.queries += 1
        if self.queries == 1:
            return ExecResult(9, "", "NVIDIA-SMI has failed because it couldn't communicate "
                                     "with the NVIDIA driver.")
        return ExecResult(0, "GPU-aaaa, 00000000:0a:00.0, RTX A\n"
                             "GPU-bbbb, 00000000:0b:00.0, GTX 960\n", "")


async def test_a_driver_loading_after_the_guest_agent_is_asked_again_within_the_timeout(
        tmp_path: Path) -> None:
    """The query is repeated soon after a failed one, within verify.timeout: the lend
    goes on once the driver lists its GPUs. The queries were 3 s apart, so that a
    verify.timeout of 3 s or less asked once and failed the lend, and each lend waited
    up to 3 s after the driver had loaded to be uncordoned."""
    text = CONFIG.format(root=tmp_path, relend="0.2s").replace(
        'method = "none"', 'method = "guest-agent"\ntimeout = "2s"')
    agent = Agent(parse(text, "test.toml"))
    fake = DriverLoadingLate(agent)
    agent.libvirt = fake
    agent.start()
    try:
        await lent(agent, fake)
    finally:  # the agent's steps end with the test
        me = asyncio.current_task()
        left = [t for t in asyncio.all_tasks() if t is not me]
        for task in left:
            task.cancel()
        await asyncio.gather(*left, return_exceptions=True)
    assert fake.queries == 2
    assert agent.executor.facts.verified is not None
    assert agent.executor.facts.verified["ok"] is True


async def test_ssh_runs_the_query_on_a_known_host(ssh_server: dict[str, Any]) -> None:
    s = ssh_server
    code, out, err = await verify.run_ssh(host=s["host"], port=s["port"], user=s["user"],
                                          key=s["key"], known_hosts=s["known"],
                                          argv=["nvidia-smi", *verify.QUERY], timeout=10)
    assert (code, err) == (0, "")
    assert verify.outcome_of_run([A, B], code, out, err).ok


async def test_ssh_refuses_a_host_whose_key_is_not_the_known_one(
        ssh_server: dict[str, Any]) -> None:
    s = ssh_server
    with pytest.raises(verify.VerifyError, match=r"SSH to hostagent@127\.0\.0\.1:\d+: .*"
                       r"[Hh]ost key"):
        await verify.run_ssh(host=s["host"], port=s["port"], user=s["user"], key=s["key"],
                             known_hosts=s["stranger"], argv=["nvidia-smi", *verify.QUERY],
                             timeout=10)


async def test_ssh_that_cannot_connect_says_where(tmp_path: Path) -> None:
    listener = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    listener.close()
    await listener.wait_closed()
    (tmp_path / "k").write_bytes(asyncssh.generate_private_key("ssh-ed25519")
                                 .export_private_key())
    (tmp_path / "k").chmod(0o600)
    (tmp_path / "known").write_text("")
    with pytest.raises(verify.VerifyError, match=rf"SSH to u@127\.0\.0\.1:{port}: .*"
                       r"[Cc]onnect"):
        await verify.run_ssh(host="127.0.0.1", port=port, user="u", key=str(tmp_path / "k"),
                             known_hosts=str(tmp_path / "known"), argv=["true"], timeout=5)
    (tmp_path / "known").chmod(0o600)
    with pytest.raises(verify.VerifyError, match="Invalid private key"):
        await verify.run_ssh(host="127.0.0.1", port=port, user="u",
                             key=str(tmp_path / "known"), known_hosts=str(tmp_path / "known"),
                             argv=["true"], timeout=5)


async def test_ssh_refuses_a_key_others_may_read(ssh_server: dict[str, Any]) -> None:
    s = ssh_server
    Path(s["key"]).chmod(0o640)
    with pytest.raises(verify.VerifyError) as info:
        await verify.run_ssh(host=s["host"], port=s["port"], user=s["user"], key=s["key"],
                             known_hosts=s["known"], argv=["nvidia-smi", *verify.QUERY],
                             timeout=10)
    assert str(info.value) == (
        f"verify.ssh.key: {s['key']}: a private key readable by group or others (mode "
        f"0640), so anyone who can read it can use it: chmod 600 {s['key']}, and replace the "
        "key if others may have copied it")


# --- screenshots ------------------------------------------------------------------------------


def test_screenshot_names_sort_by_time_and_name_the_format() -> None:
    when = datetime(2026, 9, 12, 23, 5, 7, 123456, tzinfo=UTC)
    assert screenshots.file_name("gpu-node", "image/png", when) == \
        "gpu-node-20260912T230507.123456Z.png"
    assert screenshots.extension("image/x-portable-pixmap") == "ppm"
    assert screenshots.extension("application/x-thing") == "bin"


def test_only_the_last_five_per_vm_are_kept(tmp_path: Path) -> None:
    start = datetime(2026, 9, 12, tzinfo=UTC)
    for i in range(7):
        screenshots.save(tmp_path, "gpu-node", "image/png", b"x", when=start + timedelta(hours=i))
    other = screenshots.save(tmp_path, "gpu-node-2", "image/png", b"y", when=start)
    kept = sorted(p.name for p in tmp_path.iterdir())
    assert [n for n in kept if n.startswith("gpu-node-2026")] == [
        f"gpu-node-20260912T{h:02d}0000.000000Z.png" for h in range(2, 7)]
    assert other.name in kept  # another VM's (even with a name that starts alike) stay


def _read_png(data: bytes) -> tuple[int, int, bytes]:
    """(width, height, RGB bytes) of an 8-bit RGB PNG with no filters: what we write."""
    import struct
    import zlib
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    at, idat, header = 8, b"", b""
    while at < len(data):
        (length,) = struct.unpack(">I", data[at:at + 4])
        kind, body = data[at + 4:at + 8], data[at + 8:at + 8 + length]
        crc = struct.unpack(">I", data[at + 8 + length:at + 12 + length])[0]
        assert crc == zlib.crc32(kind + body)
        if kind == b"IHDR":
            header = body
        elif kind == b"IDAT":
            idat += body
        at += 12 + length
    width, height, depth, color = struct.unpack(">IIBB", header[:10])
    assert (depth, color) == (8, 2)
    raw = zlib.decompress(idat)
    row = 1 + 3 * width
    assert all(raw[y * row] == 0 for y in range(height))
    return width, height, b"".join(raw[y * row + 1:(y + 1) * row] for y in range(height))


def test_a_ppm_screenshot_is_kept_as_png(tmp_path: Path) -> None:
    # The README promises .png; QEMU's PPM opens in few viewers and in no browser.
    pixels = bytes(range(2 * 3 * 3)) * 1
    ppm = b"P6\n# made by QEMU\n3 2\n255\n" + pixels
    path = screenshots.save(tmp_path, "gpu-node", "image/x-portable-pixmap", ppm)
    assert path.suffix == ".png"
    assert _read_png(path.read_bytes()) == (3, 2, pixels)


def test_ppm_conversion_scales_other_depths() -> None:
    assert _read_png(screenshots.ppm_to_png(b"P6 1 1 15\n\x0f\x00\x07"))[2] == b"\xff\x00\x77"
    assert _read_png(screenshots.ppm_to_png(b"P6 1 1 65535\n\xff\xff\x00\x00\x80\x00")
                     )[2] == b"\xff\x00\x80"


@pytest.mark.parametrize("junk", [b"", b"P3 1 1 255\n1 2 3", b"P6 2 2 255\n\x00\x00\x00",
                                  b"P6 0 1 255\n", b"P6 99999999 1 255\n"])
def test_a_ppm_that_cannot_be_read_is_kept_as_it_came(tmp_path: Path, junk: bytes) -> None:
    with pytest.raises(ValueError):
        screenshots.ppm_to_png(junk)
    path = screenshots.save(tmp_path, "gpu-node", "image/x-portable-pixmap", junk)
    assert path.suffix == ".ppm" and path.read_bytes() == junk


# --- this boot's id -----------------------------------------------------------------------

BOOT = "5d41402a-bc4b-4a76-b971-9d911017c592"


def test_the_boot_id_is_one_uuid_from_the_guest() -> None:
    assert verify.parse_boot_id(BOOT.upper() + "\n") == BOOT
    for junk in ("", "not-a-uuid", BOOT + " " + BOOT, BOOT + "\x1b[2J", "x" * 10_000):
        with pytest.raises(verify.VerifyError) as e:
            verify.parse_boot_id(junk)
        assert len(str(e.value)) < 200 and "\x1b" not in str(e.value)


async def test_the_boot_id_is_read_with_cat_and_failures_are_verify_errors() -> None:
    asked: list[tuple[str, list[str]]] = []

    async def run(path: str, args: list[str]) -> tuple[int, str, str]:
        asked.append((path, args))
        return 0, BOOT + "\n", ""

    assert await verify.boot_id(run) == BOOT
    assert asked == [("cat", ["/proc/sys/kernel/random/boot_id"])]

    async def refused(path: str, args: list[str]) -> tuple[int, str, str]:
        raise OSError("guest-exec is disabled")

    async def failed(path: str, args: list[str]) -> tuple[int, str, str]:
        return 1, "", "cat: can't open"

    for runner in (refused, failed):
        with pytest.raises(verify.VerifyError, match="boot_id"):
            await verify.boot_id(runner)
