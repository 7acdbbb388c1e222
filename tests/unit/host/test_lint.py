"""Domain lint: one XML per finding, a clean set, against a fake sysfs tree."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from hostagent.host import lint
from hostagent.core.config import Config, parse
from hostagent.core.model import Hotplug, Policy
from hostagent.host.lint import Check, Severity
from tests.configs import three_gpus_two_owners
from tests.unit.domain_scaffold import (
    domain,
    gpu,
    hostdev,
)

REPO = Path(__file__).resolve().parents[3]

CONFIG = three_gpus_two_owners(uuids=False, functions=True)


def clean_set() -> dict[str, str]:
    return {
        "gpu-node": domain("gpu-node", gpu("01") + gpu("02") + gpu("03")),
        # Gaming VMs keep their option ROM: one GPU each, and they need its display.
        "gaming1": domain("gaming1", gpu("01", rom_off=False)),
        "gaming2": domain("gaming2", gpu("02", rom_off=False)),
    }


@pytest.fixture
def host(sysfs: Any) -> Any:
    sysfs.gpu("01").gpu("02").gpu("03", device="1401")
    sysfs.add("0000:00:01.0", cls=0x060400, device="1901", driver="pcieport", group="1")
    return sysfs


@pytest.fixture
def cfg() -> Config:
    return parse(textwrap.dedent(CONFIG))


def run(xmls: dict[str, str], host: Any, cfg: Config | None = None) -> list[lint.Finding]:
    return lint.lint([lint.parse_domain(x) for x in xmls.values()], sysfs=host.root,
                     config=cfg)


def only(findings: list[lint.Finding]) -> lint.Finding:
    assert len(findings) == 1, lint.format_findings(findings)
    return findings[0]


def test_clean_domains_have_no_finding(host: Any, cfg: Config) -> None:
    assert run(clean_set(), host, cfg) == []


def test_parse_domain_reads_what_lint_needs() -> None:
    dom = lint.parse_domain(clean_set()["gpu-node"])
    assert dom.name == "gpu-node" and dom.q35 and dom.ovmf and dom.agent_channel
    assert [h.address for h in dom.hostdevs][:2] == ["0000:01:00.0", "0000:01:00.1"]
    assert all(h.managed and h.rom_bar_off for h in dom.hostdevs)
    assert [(b.kind, b.media) for b in dom.boot] == [("disk", True), ("cdrom", False)]
    with pytest.raises(ValueError, match="not a libvirt domain"):
        lint.parse_domain("<network/>")


def test_hostdev_whose_card_is_gone(host: Any) -> None:
    f = only(run({"gaming1": domain("gaming1", [hostdev("0000:09:00.0")])}, host))
    assert (f.check, f.severity, f.domain) == (Check.HOSTDEV_MISSING, Severity.ERROR, "gaming1")
    assert f.what == "<hostdev> 0000:09:00.0 is not on this host"
    assert f.why == ("libvirt refuses to start a domain whose hostdev points at an empty slot, "
                     "so the VM does not start at all.")
    assert "virsh edit gaming1" in f.fix


def test_unmanaged_device_on_a_host_driver(sysfs: Any) -> None:
    sysfs.gpu("01", driver="nvidia")
    f = run({"gaming1": domain("gaming1", gpu("01", managed="no"))}, sysfs)
    assert {(x.check, x.severity) for x in f} == {(Check.NOT_VFIO, Severity.ERROR)}
    assert f[0].what == "0000:01:00.0 (10de:2584) is bound to nvidia and managed='no'"
    assert "vfio-pci.ids=10de:2584" in f[0].fix


def test_managed_device_on_a_host_driver_is_a_warning(sysfs: Any) -> None:
    sysfs.gpu("01", driver="nvidia", audio=False)
    f = only(run({"gaming1": domain("gaming1", [hostdev("0000:01:00.0")])}, sysfs))
    assert (f.check, f.severity) == (Check.NOT_VFIO, Severity.WARNING)


def test_iommu_group_member_left_on_the_host(sysfs: Any) -> None:
    sysfs.gpu("01", group="12", audio=False)
    sysfs.add("0000:01:00.1", cls=0x040300, device="228e", driver="snd_hda_intel", group="12")
    sysfs.add("0000:00:01.0", cls=0x060400, driver="pcieport", group="12")  # a bridge: fine
    f = only(run({"gaming1": domain("gaming1", [hostdev("0000:01:00.0")])}, sysfs))
    assert (f.check, f.severity) == (Check.GROUP_NOT_VIABLE, Severity.ERROR)
    assert f.what == ("0000:01:00.1 (10de:228e, snd_hda_intel) shares IOMMU group 12 with "
                      "0000:01:00.0 but stays on the host")


def test_functions_of_one_gpu_split_between_vms(host: Any) -> None:
    xmls = {"gaming1": domain("gaming1", [hostdev("0000:01:00.0", rom_off=False)]),
            "gpu-node": domain("gpu-node", [hostdev("0000:01:00.1")])}
    found = run(xmls, host)
    assert {(f.check, f.severity, f.domain) for f in found} == {
        (Check.SPLIT_GPU, Severity.ERROR, "gaming1"), (Check.SPLIT_GPU, Severity.ERROR, "gpu-node")}
    assert found[0].what == ("the functions of IOMMU group 1 are split between VMs: gaming1 has "
                             "0000:01:00.0; gpu-node has 0000:01:00.1")
    # One VM with part of what another has: it works while the rest is on vfio-pci.
    xmls["gpu-node"] = domain("gpu-node", gpu("01"))
    assert {(f.check, f.severity) for f in run(xmls, host)} == {
        (Check.SPLIT_GPU, Severity.WARNING)}


def test_several_gpus_under_ovmf_without_rom_bar_off(host: Any) -> None:
    f = only(run({"gpu-node": domain("gpu-node", gpu("01") + gpu("02", rom_off=False))}, host))
    assert (f.check, f.severity) == (Check.ROM_BAR, Severity.WARNING)
    assert f.what == ("2 GPUs under OVMF, and 0000:02:00.0, 0000:02:00.1 without "
                      "<rom bar='off'/>")
    assert "<rom bar='off'/>" in f.fix
    # One GPU, or SeaBIOS: nothing to say.
    assert run({"g": domain("g", gpu("01", rom_off=False))}, host) == []
    assert run({"g": domain("g", gpu("01", rom_off=False) + gpu("02", rom_off=False),
                            firmware="")}, host) == []


def test_ovmf_is_recognised_by_its_loader_too() -> None:
    xml = domain("g", [], firmware="").replace(
        "</os>", "<loader readonly='yes' type='pflash'>/usr/share/OVMF/OVMF_CODE.fd</loader></os>")
    assert lint.parse_domain(xml).ovmf


def test_passthrough_on_i440fx(host: Any) -> None:
    f = only(run({"g": domain("g", gpu("01"), machine="pc-i440fx-7.2")}, host))
    assert (f.check, f.severity) == (Check.NOT_Q35, Severity.WARNING)
    assert f.what == "machine type pc-i440fx-7.2 with PCI passthrough"
    assert run({"g": domain("g", [], machine="pc-i440fx-7.2")}, host) == []


def test_cdrom_with_media_ahead_of_the_disk(host: Any) -> None:
    f = only(run({"g": domain("g", [], disk=2, cdrom=1, media=True)}, host))
    assert (f.check, f.severity) == (Check.CDROM_FIRST, Severity.WARNING)
    assert f.what == "a CD-ROM with media boots ahead of the disk"
    # An empty drive first, or media after the disk: fine.
    assert run({"g": domain("g", [], disk=2, cdrom=1, media=False)}, host) == []
    assert run({"g": domain("g", [], disk=1, cdrom=2, media=True)}, host) == []


def test_cdrom_first_in_the_os_boot_list(host: Any) -> None:
    xml = domain("g", [], media=True).replace("<boot order='1'/>", "").replace(
        "<boot order='2'/>", "").replace("</os>", "<boot dev='cdrom'/><boot dev='hd'/></os>")
    assert only(run({"g": xml}, host)).check is Check.CDROM_FIRST


def test_lendee_without_a_guest_agent_channel(host: Any, cfg: Config) -> None:
    xmls = clean_set()
    xmls["gpu-node"] = domain("gpu-node", gpu("01") + gpu("02") + gpu("03"), channel=False)
    f = only(run(xmls, host, cfg))
    assert (f.check, f.severity, f.domain) == (Check.NO_AGENT_CHANNEL, Severity.ERROR, "gpu-node")
    assert f.why == ("hostagent shuts the lendee down through its guest agent only, so without "
                     "the channel it can never give the GPUs back.")
    # An owner needs none; without a configuration nobody knows, so it warns.
    xmls = clean_set()
    xmls["gaming1"] = domain("gaming1", gpu("01", rom_off=False), channel=False)
    assert run(xmls, host, cfg) == []
    assert only(run({"g": domain("g", [], channel=False)}, host)).severity is Severity.WARNING


def test_config_says_an_owner_has_a_gpu_its_xml_lacks(host: Any, cfg: Config) -> None:
    xmls = clean_set()
    xmls["gaming1"] = domain("gaming1", [])
    found = run(xmls, host, cfg)
    assert {(f.check, f.severity, f.domain) for f in found} == {
        (Check.CONFIG_XML, Severity.ERROR, "gaming1")}
    assert [f.what for f in found] == [
        "the config says gaming1 owns gpu-a but its XML has no <hostdev> for 0000:01:00.0",
        "the config says gaming1 owns gpu-a but its XML has no <hostdev> for 0000:01:00.1"]


def test_lendee_lacks_a_lent_gpu_and_an_owner_has_anothers(host: Any, cfg: Config) -> None:
    xmls = clean_set()
    xmls["gpu-node"] = domain("gpu-node", gpu("01") + gpu("02"))
    xmls["gaming1"] = domain("gaming1", gpu("01", rom_off=False) + gpu("02", rom_off=False))
    found = [f for f in run(xmls, host, cfg) if f.check is Check.CONFIG_XML]
    assert [f.what for f in found] == [
        "the config says gpu-node borrows gpu-c but its persistent definition has no <hostdev> for 0000:03:00.0",
        "the config says gpu-node borrows gpu-c but its persistent definition has no <hostdev> for 0000:03:00.1",
        "gaming1's XML has 0000:02:00.0 of GPU gpu-b, but the config gives it to gaming2",
        "gaming1's XML has 0000:02:00.1 of GPU gpu-b, but the config gives it to gaming2",
    ]
    assert found[0].why.startswith("the agent starts the lendee from its persistent definition")


SHARED = CONFIG + """
[owners.gaming-win]
gpus = ["gpu-a"]
"""


def test_every_owner_of_a_shared_gpu_is_checked(host: Any) -> None:
    cfg = parse(textwrap.dedent(SHARED))
    xmls = clean_set()
    xmls["gaming-win"] = domain("gaming-win", gpu("01", rom_off=False))
    assert run(xmls, host, cfg) == []
    xmls["gaming-win"] = domain("gaming-win", [hostdev("0000:01:00.0", rom_off=False)])
    found = [f for f in run(xmls, host, cfg) if f.check is Check.CONFIG_XML]
    assert [(f.domain, f.what) for f in found] == [
        ("gaming-win", "the config says gaming-win owns gpu-a but its XML has no <hostdev> for "
                       "0000:01:00.1")]
    # A VM the config does not give gpu-a to hears of both owners.
    xmls["gaming-win"] = domain("gaming-win", gpu("01", rom_off=False))
    xmls["gaming2"] = domain("gaming2", gpu("02", rom_off=False) + gpu("01", rom_off=False))
    found = [f for f in run(xmls, host, cfg) if f.check is Check.CONFIG_XML]
    assert [f.what for f in found] == [
        "gaming2's XML has 0000:01:00.0 of GPU gpu-a, but the config gives it to gaming1 and "
        "gaming-win",
        "gaming2's XML has 0000:01:00.1 of GPU gpu-a, but the config gives it to gaming1 and "
        "gaming-win"]


def test_a_device_tied_to_a_gpu_by_its_user_alias_stands_for_it(host: Any, cfg: Config) -> None:
    # The lab's GPUs are disks with <alias name='ua-hostagent-gpu-X'/>.
    def stand_in(label: str) -> str:
        return f"""<disk type='file' device='disk'>
      <source file='/lab/{label}.img'/>
      <target dev='vdx' bus='virtio'/>
      <alias name='ua-hostagent-{label}'/>
    </disk>"""
    xmls = {"gpu-node": domain("gpu-node", [stand_in(g) for g in ("gpu-a", "gpu-b", "gpu-c")]),
            "gaming1": domain("gaming1", [stand_in("gpu-a")]),
            "gaming2": domain("gaming2", [stand_in("gpu-b")])}
    assert lint.parse_domain(xmls["gpu-node"]).aliases == (
        "ua-hostagent-gpu-a", "ua-hostagent-gpu-b", "ua-hostagent-gpu-c")
    assert run(xmls, host, cfg) == []
    xmls["gpu-node"] = domain("gpu-node", [stand_in("gpu-a"), stand_in("gpu-b")])
    assert [f.what for f in run(xmls, host, cfg)] == [
        "the config says gpu-node borrows gpu-c but its persistent definition has no <hostdev> for 0000:03:00.0",
        "the config says gpu-node borrows gpu-c but its persistent definition has no <hostdev> for 0000:03:00.1"]


def test_autostart_on_the_lendee_or_an_owner_races_the_agent(host: Any, cfg: Config) -> None:
    doms = [lint.parse_domain(xml, autostart=name != "gaming2")
            for name, xml in {**clean_set(), "other": domain("other", [])}.items()]
    found = [f for f in lint.lint(doms, sysfs=host.root, config=cfg)
             if f.check is Check.AUTOSTART]
    assert [(f.domain, f.severity) for f in found] == [
        ("gpu-node", Severity.WARNING), ("gaming1", Severity.WARNING)]
    lendee, owner = found
    assert lendee.what == "libvirt autostarts it"
    assert "before hostagent answers its hook, which can then only spool" in lendee.why
    assert lendee.fix == ("virsh autostart --disable gpu-node; hostagent lends the free GPUs at "
                          "boot by itself")
    assert owner.fix == ("virsh autostart --disable gaming1; to start it at boot, set "
                         "start_at_boot = true under [owners.gaming1]: hostagent then starts it "
                         "once its GPUs are free")
    # Unknown (read from a file) or without a config: nothing to say.
    assert not any(f.check is Check.AUTOSTART for f in run(clean_set(), host, cfg))
    assert not any(f.check is Check.AUTOSTART
                   for f in lint.lint(doms, sysfs=host.root, config=None))


def test_the_agent_check_fires_nothing_on_a_domain_without_hostdevs(sysfs: Any) -> None:
    # The lab's guests: GPUs are disks, there is no PCI device to look up on the host.
    xml = domain("gpu-node", [])
    assert lint.check_domain(lint.parse_domain(xml), sysfs=sysfs.root, lendee=True) == []


def test_cli_lint_exit_status_and_output(host: Any, tmp_path: Path) -> None:
    files = []
    for name, xml in clean_set().items():
        (tmp_path / f"{name}.xml").write_text(xml)
        files += ["--xml", str(tmp_path / f"{name}.xml")]
    config = tmp_path / "config.toml"
    config.write_text(textwrap.dedent(CONFIG))

    def hostagent(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "hostagent.cli", "--config", str(config),
                               "lint", "--sysfs", str(host.root), *args],
                              capture_output=True, text=True, cwd=REPO, check=False)

    ok = hostagent(*files)
    assert (ok.returncode, ok.stdout) == (0, (
        "gpu-node: GPUs change by restart; a regrow by restart waits until no GPU pod runs, "
        "however long (gpu-node cannot hot-plug its GPUs: <hostdev> 0000:01:00.0 of gpu-a is "
        "not in a pcie-root-port of its own)\n"
        "3 domain(s) checked: 0 error(s), 0 warning(s)\n"))
    (tmp_path / "gaming1.xml").write_text(domain("gaming1", [hostdev("0000:09:00.0")]))
    bad = hostagent(*files, "gaming1")
    assert bad.returncode == 1
    assert bad.stdout.splitlines()[:3] == [
        "gaming1: error: <hostdev> 0000:09:00.0 is not on this host",
        "  why: libvirt refuses to start a domain whose hostdev points at an empty slot, so "
        "the VM does not start at all.",
        "  fix: remove the hostdev (virsh edit gaming1) or point it at the card's new address "
        "(lspci -D; put a replacement card in the freed slot to keep it)"]
    assert bad.stdout.endswith("1 domain(s) checked: 3 error(s), 0 warning(s)\n")


# --- each lent GPU can be reset between VMs -------------------------------------------------


def resets(sysfs: Any, cfg: Config) -> list[lint.Finding]:
    return [f for f in run(clean_set(), sysfs, cfg) if f.check is Check.RESET]


def lent_gpus(sysfs: Any, **gpu_a: Any) -> None:
    """gpu-a as given, gpu-b and gpu-c with FLR, each on the root bus unless `behind`."""
    sysfs.gpu("01", **gpu_a).gpu("02").gpu("03", device="1401")


def test_a_lent_gpu_that_cannot_be_reset_is_an_error(sysfs: Any, cfg: Config) -> None:
    # No function reset (a kernel since 5.15 shows no reset_method then) and no bridge
    # above it for a bus reset: the next VM gets the GPU as the last one left it.
    lent_gpus(sysfs, reset_method=None)
    [function, audio] = resets(sysfs, cfg)
    assert (function.domain, function.severity) == ("gpu-node", Severity.ERROR)
    assert function.what == (
        "0000:01:00.0 of GPU gpu-a cannot be reset between VMs: it has no reset method "
        "and no bridge above it whose bus could be reset")
    assert "its memory" in function.why and "/reset_method" in function.fix
    assert audio.what.startswith("0000:01:00.1 of GPU gpu-a cannot be reset")


def test_a_function_missing_from_the_host_does_not_end_the_check_of_the_others(
        sysfs: Any, cfg: Config) -> None:
    # gpu-a's main function is gone (hostdev-missing says so); its audio function, still
    # there and without a reset, is an error of its own.
    sysfs.add("0000:01:00.1", cls=0x040300, device="228e", group="1", reset_method=None)
    sysfs.gpu("02").gpu("03", device="1401")
    [audio] = resets(sysfs, cfg)
    assert audio.what.startswith("0000:01:00.1 of GPU gpu-a cannot be reset between VMs")


def test_every_reset_method_turned_off_is_an_error(sysfs: Any, cfg: Config) -> None:
    sysfs.add("0000:00:01.0", cls=0x060400, device="1901", driver="pcieport", group="1")
    lent_gpus(sysfs, reset_method="", behind="0000:00:01.0")
    found = resets(sysfs, cfg)
    assert [(f.severity, f.what) for f in found] == [
        (Severity.ERROR, f"0000:01:00.{n} of GPU gpu-a cannot be reset between VMs: every "
                         "reset method is turned off (its reset_method is empty)")
        for n in (0, 1)]
    assert found[0].fix.startswith("echo default > /sys/bus/pci/devices/0000:01:00.0/reset_method")


def test_a_bus_reset_alone_behind_its_bridge_is_enough(sysfs: Any, cfg: Config) -> None:
    # A GPU without FLR, its audio function beside it: the kernel lists no method (its
    # bus reset needs the bus to itself), and vfio-pci resets the bus on release.
    sysfs.add("0000:00:01.0", cls=0x060400, device="1901", driver="pcieport", group="1")
    lent_gpus(sysfs, reset_method=None, behind="0000:00:01.0")
    assert resets(sysfs, cfg) == []
    # A kernel before 5.15 has no reset_method but a reset file where one works.
    sysfs.add("0000:00:02.0", cls=0x060400, device="1901", driver="pcieport", group="2")
    (next((sysfs.root / "devices").rglob("0000:02:00.0")) / "reset_method").unlink()
    assert resets(sysfs, cfg) == []


def test_a_bus_only_reset_with_other_devices_behind_the_bridge_warns(
        sysfs: Any, cfg: Config) -> None:
    sysfs.add("0000:00:01.0", cls=0x060400, device="1901", driver="pcieport", group="1")
    lent_gpus(sysfs, reset_method="bus", behind="0000:00:01.0", audio=False)
    sysfs.add("0000:01:00.1", cls=0x040300, device="228e", group="1", reset_method="bus",
              behind="0000:00:01.0")
    sysfs.add("0000:01:01.0", cls=0x0c0330, vendor="1912", device="0014", driver="xhci_hcd",
              group="1", reset_method="bus", behind="0000:00:01.0")
    [function, audio] = resets(sysfs, cfg)
    assert (function.severity, function.what) == (Severity.WARNING, (
        "0000:01:00.0 of GPU gpu-a is reset only by a reset of its bus, which 0000:01:01.0 "
        "(1912:0014) shares"))
    assert "resets 0000:01:01.0 too" in function.why
    assert "only while none of them is in use" in function.why
    assert audio.what.startswith("0000:01:00.1 of GPU gpu-a is reset only by a reset")


def test_reset_is_checked_for_the_lendee_only(sysfs: Any, cfg: Config) -> None:
    lent_gpus(sysfs, reset_method=None)
    owner = {"gaming1": clean_set()["gaming1"]}
    assert not [f for f in run(owner, sysfs, cfg) if f.check is Check.RESET]
    # Nor before a VM starts (check_domain): a finding there would stop the start.
    dom = lint.parse_domain(clean_set()["gpu-node"])
    assert not [f for f in lint.check_domain(dom, sysfs=sysfs.root, lendee=True)
                if f.check is Check.RESET]


# --- policy.hotplug = "auto": what the definition allows, and what the lendee shows ---------


def test_auto_is_hot_add_at_most_and_needs_a_64_bit_window() -> None:
    from tests.unit.hotplug_scaffold import LINT_CONFIG, hot_add_findings, lendee_xml
    auto = LINT_CONFIG.replace('hotplug = "add"', "")
    how, why = lint.hotplug_capability(lint.parse_domain(lendee_xml()), parse(auto))
    assert how is Hotplug.ADD and why.endswith(
        "hot-add; hot-unplug only once the running lendee shows its GPU plugins honour "
        "nvidia.com/gpu.deploy.device-plugin and its nvidia-smi supports drain")
    # Without the window, no hot-add under auto: a GPU attached live gets no address.
    bare = lint.parse_domain(lendee_xml(pref64=False))
    assert lint.hotplug_capability(bare, parse(auto)) == (Hotplug.NONE, (
        "gpu-node cannot hot-add its GPUs: no 64-bit prefetchable window is reserved on the "
        "root ports (pcie-root-port.pref64-reserve)"))
    # And lint's warning, which said so only under "add" or "both", says so under auto.
    assert hot_add_findings(lendee_xml(pref64=False), auto) == [
        "warning: policy.hotplug: no 64-bit prefetchable window is reserved on the root ports"]
    [finding] = [f for f in lint.lint([bare], config=parse(auto)) if f.check is Check.HOTPLUG]
    assert finding.why.endswith('policy.hotplug = "auto" attaches no GPU live here until one '
                                "is reserved.")
    assert "pref64-reserve=64G" in finding.fix
    # Not where something else keeps it from hot-add: lint's note says that.
    assert hot_add_findings(lendee_xml(pref64=False, machine="pc-i440fx-7.2"), auto) == []


def test_the_running_lendee_turns_auto_into_hot_unplug_or_not() -> None:
    """The seam for the agent: once it has seen that the lendee's GPU plugins honour
    their node label and its nvidia-smi supports drain, "auto" takes hot-unplug too."""
    from tests.unit.hotplug_scaffold import LINT_CONFIG, lendee_xml
    auto = parse(LINT_CONFIG.replace('hotplug = "add"', ""))
    how, why = lint.hotplug_capability(lint.parse_domain(lendee_xml()), auto)
    policy = Policy(hotplug=how, hotplug_why=f'policy.hotplug = "auto": {why}')
    both = lint.unplug_at_run_time(auto, policy, plugins_pausable=True, drain_supported=True)
    assert (both.hotplug, both.hotplug_why) == (Hotplug.BOTH, (
        'policy.hotplug = "auto": gpu-node hot-adds, and hot-unplugs since its GPU plugins '
        "honour nvidia.com/gpu.deploy.device-plugin and its nvidia-smi supports drain"))
    assert lint.changes(both.hotplug, both.regrow, None).startswith(
        "live (hot-add and hot-unplug)")
    add = lint.unplug_at_run_time(auto, both, plugins_pausable=True, drain_supported=False)
    assert (add.hotplug, add.hotplug_why) == (Hotplug.ADD, (
        'policy.hotplug = "auto": gpu-node hot-adds only: its nvidia-smi does not support '
        "drain"))
    assert lint.unplug_at_run_time(auto, policy, plugins_pausable=False,
                                   drain_supported=False).hotplug_why.endswith(
        "its GPU plugins do not honour nvidia.com/gpu.deploy.device-plugin and its "
        "nvidia-smi does not support drain")
    # Where the definition allows no hot-add, or hot-plug was set by hand: unchanged.
    none = Policy(hotplug=Hotplug.NONE, hotplug_why="x")
    assert lint.unplug_at_run_time(auto, none, plugins_pausable=True,
                                   drain_supported=True) is none
    by_hand = Policy(hotplug=Hotplug.ADD)
    assert lint.unplug_at_run_time(parse(LINT_CONFIG), by_hand, plugins_pausable=True,
                                   drain_supported=True) is by_hand


def test_a_vm_that_is_no_owner_passing_through_a_lent_gpu_warns(host: Any, cfg: Config) -> None:
    """An old Windows VM, kept but not configured, still has gpu-b: hostagent never frees
    it for that VM, so its start fails while the lendee holds it."""
    xmls = {**clean_set(), "old-win": domain("old-win", gpu("02", rom_off=False))}
    found = only([f for f in run(xmls, host, cfg) if f.domain == "old-win"])
    assert (found.check, found.severity) == (Check.NOT_AN_OWNER, Severity.WARNING)
    assert found.what == ("old-win passes through gpu-b (0000:02:00.0, 0000:02:00.1), which "
                          "gpu-node borrows, but is not an owner")
    assert "[owners.old-win]" in found.fix and "gpu-b" in found.fix
    # One tied to the GPU by its user alias counts too (the lab's stand-ins).
    tied = domain("old-win", ["<disk type='file' device='disk'><source file='/x.img'/>"
                              "<target dev='vdb' bus='virtio'/>"
                              "<alias name='ua-hostagent-gpu-c'/></disk>"])
    found = only([f for f in run({**clean_set(), "old-win": tied}, host, cfg)
                  if f.domain == "old-win"])
    assert found.check is Check.NOT_AN_OWNER and "gpu-c" in found.what
    # A GPU the lendee does not borrow is that VM's business; without a config, nothing.
    text = textwrap.dedent(CONFIG).replace('gpus = ["gpu-a", "gpu-b", "gpu-c"]',
                                           'gpus = ["gpu-a", "gpu-c"]', 1)
    assert not [f for f in run(xmls, host, parse(text)) if f.domain == "old-win"]
    assert not [f for f in run(xmls, host) if f.check is Check.NOT_AN_OWNER]
