"""GPUs for real, in the lab: the in-guest check after a lend (the stand-in nvidia-smi
reports what each lab GPU's disk says), a dead boot's screenshot, the lint before a
start, and `hostagent lint` and `config init` reading domains through libvirt.

The SSH method is not lab-tested here: the lab guest has no sshd (busybox and qemu-ga
only); its host-key checking is tested against an in-process SSH server in
tests/unit/host/test_verify.py."""

from __future__ import annotations

import json
import re
import struct

import pytest

from hostagent.core.config import parse
from tests.lab.lab import GPUS, OWNERS, Lab, domain_xml
from tests.sysfs import FakeSysfs

pytestmark = pytest.mark.lab

UUID_A, NAME_A = GPUS["gpu-a"]
UUID_B, NAME_B = GPUS["gpu-b"]
UUID_C, NAME_C = GPUS["gpu-c"]


def config(lab: Lab, *, guest_agent: str = "60s", verify: str = "") -> None:
    text = lab.config_text().replace('guest_agent = "60s"', f'guest_agent = "{guest_agent}"')
    lab.write_config(text + (f"\n[verify]\n{verify}\n" if verify else ""))


def test_a_lend_checks_the_gpus_the_guest_driver_sees(lab: Lab) -> None:
    lab.start_agent()
    lab.wait_record(event="phase", to="lent")
    ok = lab.records(event="verify")
    assert len(ok) == 1 and ok[0]["HOSTAGENT_RESULT"] == "ok"
    assert ok[0]["HOSTAGENT_GPUS"].split(",") == [UUID_A, UUID_B, UUID_C]
    assert ok[0]["MESSAGE"] == (f"the driver in gpu-node sees {NAME_A} ({UUID_A}), {NAME_B} "
                                f"({UUID_B}), {NAME_C} ({UUID_C})")
    # Before the return to the cluster: the check comes between joining and lent.
    assert lab.phases() == ["off>booting", "booting>joining", "joining>lent"]
    status = lab.hostagent("status", "--json")
    assert json.loads(status.stdout)["verified"]["ok"] is True
    assert "GPUs checked in the guest" in lab.hostagent("status").stdout


@pytest.mark.parametrize("broken", [("gpu-b",), ("gpu-a", "gpu-b", "gpu-c")],
                         ids=["one-missing", "none"])
def test_a_gpu_the_guest_driver_does_not_see_fails_the_lend(lab: Lab, broken: tuple[str, ...]) -> None:
    for gpu in broken:
        lab.write_gpu(gpu, "no driver")
    config(lab, verify='timeout = "2s"')
    lab.start_agent()
    failed = lab.wait_record(event="phase", to="failed")
    assert lab.phases() == ["off>booting", "booting>joining", "joining>failed"]
    mismatch = lab.records(event="verify")
    assert len(mismatch) == 1
    rec = mismatch[0]
    assert (rec["HOSTAGENT_RESULT"], rec["PRIORITY"]) == ("mismatch", "3")
    assert rec["HOSTAGENT_MISSING"] == ",".join(broken)
    if broken == ("gpu-b",):
        assert rec["MESSAGE"].startswith(f"the driver in gpu-node does not see gpu-b ({NAME_B}, "
                                         f"{UUID_B}) (it sees: {UUID_A}, {UUID_C}); usual causes:")
    else:
        assert rec["MESSAGE"].startswith(
            "the driver in gpu-node sees no GPU (nvidia-smi exited with status 6: No devices "
            f"were found); missing: gpu-a ({NAME_A}, {UUID_A}), gpu-b ({NAME_B}, {UUID_B}), "
            f"gpu-c ({NAME_C}, {UUID_C})")
    assert "legacy 580 branch" in rec["MESSAGE"] and "<rom bar='off'/>" in rec["MESSAGE"]
    # The node is not lent; the VM keeps running; the reason says what is missing.
    assert "gpu-node did not come back whole: the driver in gpu-node" in failed["MESSAGE"]
    assert lab.state("gpu-node") == "running"
    assert json.loads(lab.hostagent("status", "--json").stdout)["verified"]["ok"] is False


def test_a_boot_whose_guest_agent_never_answers_leaves_a_screenshot(lab: Lab) -> None:
    config(lab, guest_agent="3s")
    lab.define("gpu-node", agent_delay=120)
    lab.start_agent()
    boot = lab.wait_record(30, event="boot", result="failed")
    lab.wait_record(event="phase", to="failed")
    inside = boot["HOSTAGENT_SCREENSHOT"]
    # QEMU gives PNG where it can, PPM otherwise; the README promises PNG either way.
    m = re.fullmatch(r"/var/lib/hostagent/screenshots/gpu-node-\d{8}T\d{6}\.\d{6}Z\.(png)",
                     inside)
    assert m is not None, inside
    assert f"its screen is saved in {inside}" in boot["MESSAGE"]
    kind, width, height = image_size(lab.path(inside).read_bytes())
    assert kind == m.group(1)
    assert width > 0 and height > 0


def image_size(data: bytes) -> tuple[str, int, int]:
    """The format and size of a PNG or binary PPM, checked whole enough to trust."""
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        length, chunk = struct.unpack(">I4s", data[8:16])
        assert (length, chunk) == (13, b"IHDR")
        width, height = struct.unpack(">II", data[16:24])
        assert data.endswith(b"IEND\xaeB`\x82")
        return "png", width, height
    # A binary PPM: "P6", width, height, maximum value, then width*height RGB pixels.
    m = re.match(rb"P6\s+(\d+)\s+(\d+)\s+(\d+)\s", data)
    assert m is not None, data[:20]
    width, height, top = (int(x) for x in m.groups())
    assert 0 < top < 256 and len(data) == m.end() + width * height * 3
    return "ppm", width, height


def test_the_agent_refuses_to_start_a_lendee_that_fails_lint(lab: Lab) -> None:
    # Without a guest-agent channel the lendee could never be shut down cleanly.
    assert lab.guest is not None
    xml = domain_xml("gpu-node", lab.guest, [lab.gpu_image(g) for g in sorted(GPUS)],
                     console=lab.root / "console" / "gpu-node.log")
    xml = re.sub(r"\s*<channel type='unix'>.*?</channel>", "", xml, flags=re.S)
    (lab.root / "gpu-node-nochannel.xml").write_text(xml)
    lab.virsh("define", str(lab.root / "gpu-node-nochannel.xml"))
    lab.start_agent()
    refused = lab.wait_record(event="lint", vm="gpu-node")
    assert (refused["HOSTAGENT_RESULT"], refused["HOSTAGENT_CHECK"]) == ("refused",
                                                                         "no-agent-channel")
    assert refused["MESSAGE"].startswith(
        "gpu-node: no guest-agent channel (org.qemu.guest_agent.0): hostagent shuts the lendee "
        "down through its guest agent only")
    assert lab.state("gpu-node") == "shut off"
    status = json.loads(lab.hostagent("status", "--json").stdout)
    assert status["lendee"]["phase"] == "off"
    assert "hostagent did not start gpu-node: no guest-agent channel" in status["lendee"]["reason"]


# What lint says of the lab's domains with nothing to fix: which road the lendee's GPUs
# take (the lab pins policy.hotplug = "none"), then the count.
CLEAN = ('gpu-node: GPUs change by restart; a regrow by restart waits until no GPU pod runs, '
         'however long (policy.hotplug = "none")\n'
         f"{1 + len(OWNERS)} domain(s) checked: 0 error(s), 0 warning(s)\n")


def test_hostagent_lint_reads_the_lab_domains_through_libvirt(lab: Lab) -> None:
    lab.write_config()
    # The lab's GPUs are disks whose user alias ties each to its GPU: lint takes them
    # for the GPUs the configuration gives each domain, and finds nothing to say.
    out = lab.hostagent("lint")
    assert (out.returncode, out.stdout) == (
        0, CLEAN), out.stderr
    # Autostart, which libvirt keeps outside the XML, is read too.
    lab.virsh("autostart", "gaming2")
    try:
        out = lab.hostagent("lint")
    finally:
        lab.virsh("autostart", "--disable", "gaming2")
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[0] == "gaming2: warning: libvirt autostarts it"
    assert "set start_at_boot = true under [owners.gaming2]" in out.stdout
    assert out.stdout.endswith("0 error(s), 1 warning(s)\n")


HOSTDEVS = {"gpu-a": ("0000:0a:00.0", "0000:0a:00.1"), "gpu-b": ("0000:0b:00.0",),
            "gpu-c": ("0000:0c:00.0",)}


def hostdev(address: str) -> str:
    domain, bus, rest = address.split(":")
    slot, function = rest.split(".")
    return (f"<hostdev mode='subsystem' type='pci' managed='yes'><source><address "
            f"domain='0x{domain}' bus='0x{bus}' slot='0x{slot}' function='0x{function}'/>"
            "</source><rom bar='off'/></hostdev>\n    ")


def test_config_init_and_lint_on_lab_domains_with_hostdevs(lab: Lab) -> None:
    # The lab domains, defined (never started) with the <hostdev>s the lab config's made-up
    # addresses stand for, and a host (sysfs) that has those cards on vfio-pci.
    assert lab.guest is not None
    for name in ("gpu-node", *OWNERS):
        gpus = OWNERS.get(name, tuple(sorted(GPUS)))
        xml = domain_xml(name, lab.guest, [lab.gpu_image(g) for g in gpus],
                         console=lab.root / "console" / f"{name}.log")
        devs = "".join(hostdev(a) for g in gpus for a in HOSTDEVS[g])
        (lab.root / f"{name}-pt.xml").write_text(xml.replace("<channel", devs + "<channel", 1))
        lab.virsh("define", str(lab.root / f"{name}-pt.xml"))
    host = FakeSysfs(lab.root / "sys")
    host.gpu("0a", group="10").gpu("0b", group="11", audio=False).gpu("0c", group="12",
                                                                      audio=False)

    out = lab.hostagent("config", "init", "--output", "-", "--sysfs", str(host.root))
    assert out.returncode == 0, out.stderr
    starter = parse(out.stdout, "starter")
    lab.write_config()
    wanted = parse(lab.config_text())
    assert starter.lendee.gpus == wanted.lendee.gpus
    assert {d: o.gpus for d, o in starter.owners.items()} == {
        d: o.gpus for d, o in wanted.owners.items()}
    assert {g.label: g.pci_functions for g in starter.gpus.values()} == {
        g.label: g.pci_functions for g in wanted.gpus.values()}
    assert "# 0000:0a:00.0: in gaming-win, gaming1, gpu-node; 10de:2584 on vfio-pci;" in \
        out.stdout
    assert "# gpu-a is owned by gaming-win and gaming1: they take turns" in out.stdout

    # And lint, reading the same domains through libvirt, finds them right.
    checked = lab.hostagent("lint", "--sysfs", str(host.root))
    assert (checked.returncode, checked.stdout) == (
        0, CLEAN), checked.stderr
    # Not written over the existing config without --force.
    refused = lab.hostagent("config", "init", "--sysfs", str(host.root))
    assert refused.returncode == 1 and "exists: left as it is" in refused.stderr
