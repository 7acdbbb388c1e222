"""The GPU inventory: NVML through a fake library, sysfs through a fake tree, UUIDs in the
configuration; and, where a real NVIDIA GPU is present, NVML itself."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from hostagent.host import gpus
from hostagent.core.config import ConfigError, parse
from hostagent.host.gpus import NvmlGpu, NvmlUnavailable

REPO = Path(__file__).resolve().parents[3]


class FakeNvml:
    """The slice of pynvml that hostagent calls, over a list of cards."""

    def __init__(self, cards: list[dict[str, Any]], *, fail_init: str | None = None) -> None:
        self.cards = cards
        self.fail_init = fail_init
        self.shut = False

    def nvmlInit(self) -> None:
        if self.fail_init:
            raise RuntimeError(self.fail_init)

    def nvmlShutdown(self) -> None:
        self.shut = True

    def nvmlSystemGetDriverVersion(self) -> str:
        return "580.95.05"

    def nvmlDeviceGetCount(self) -> int:
        return len(self.cards)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> dict[str, Any]:
        return self.cards[i]

    def nvmlDeviceGetUUID(self, h: dict[str, Any]) -> str:
        return str(h["uuid"])

    def nvmlDeviceGetName(self, h: dict[str, Any]) -> bytes:
        return str(h["name"]).encode()  # older pynvml returns bytes

    def nvmlDeviceGetPciInfo(self, h: dict[str, Any]) -> SimpleNamespace:
        return SimpleNamespace(busId=h["bus"])

    def nvmlDeviceGetMemoryInfo(self, h: dict[str, Any]) -> SimpleNamespace:
        return SimpleNamespace(total=h["mib"] << 20)


CARDS = [
    {"uuid": "GPU-aaaa", "name": "NVIDIA GeForce GTX 960", "bus": "00000000:05:00.0", "mib": 4096},
    {"uuid": "GPU-bbbb", "name": "NVIDIA GeForce RTX 3050", "bus": "00000000:0A:00.0", "mib": 8192},
]


def test_canonical_pci_accepts_nvml_lspci_and_short_forms() -> None:
    assert gpus.canonical_pci("00000000:0A:00.0") == "0000:0a:00.0"
    assert gpus.canonical_pci("0000:0a:00.1") == "0000:0a:00.1"
    assert gpus.canonical_pci("0a:00.0") == "0000:0a:00.0"
    assert gpus.canonical_pci("GPU-aaaa") is None


def test_nvml_lists_cards_in_its_order_with_canonical_addresses() -> None:
    fake = FakeNvml(CARDS)
    found = gpus.read_nvml(fake)
    assert found == [
        NvmlGpu(index=0, uuid="GPU-aaaa", pci="0000:05:00.0", name="NVIDIA GeForce GTX 960",
                memory_mib=4096, driver_version="580.95.05"),
        NvmlGpu(index=1, uuid="GPU-bbbb", pci="0000:0a:00.0", name="NVIDIA GeForce RTX 3050",
                memory_mib=8192, driver_version="580.95.05"),
    ]
    assert fake.shut


def test_nvml_that_cannot_start_says_why() -> None:
    with pytest.raises(NvmlUnavailable, match="NVML did not start: Driver Not Loaded"):
        gpus.read_nvml(FakeNvml([], fail_init="Driver Not Loaded"))


def test_sysfs_lists_display_devices_with_driver_and_iommu_group(sysfs: Any) -> None:
    sysfs.gpu("01", group="12").gpu("02", group="13", driver="nvidia", device="1401")
    sysfs.add("0000:00:1f.3", cls=0x040300, device="a348", driver="snd_hda_intel", group="13")
    sysfs.add("0000:03:00.0", cls=0x020000, device="15b8", driver="e1000e")  # no IOMMU
    found = gpus.sysfs_gpus(sysfs.root)
    assert [(d.address, d.ids, d.driver, d.iommu_group, d.group_members) for d in found] == [
        ("0000:01:00.0", "10de:2584", "vfio-pci", "12", ("0000:01:00.1",)),
        ("0000:02:00.0", "10de:1401", "nvidia", "13", ("0000:00:1f.3", "0000:02:00.1")),
    ]
    nic = gpus.pci_device("0000:03:00.0", sysfs.root)
    assert nic is not None and nic.iommu_group is None and not nic.is_display
    assert gpus.pci_device("0000:09:00.0", sysfs.root) is None
    assert gpus.slot_functions("0000:01:00.0", sysfs.root) == ["0000:01:00.0", "0000:01:00.1"]


def test_inventory_text_shows_nvml_order_warning_and_what_nvml_misses(sysfs: Any) -> None:
    sysfs.gpu("05", driver="nvidia").gpu("0a", driver="nvidia").gpu("0b")
    inv = gpus.inventory(sysfs.root, FakeNvml(CARDS))
    text = gpus.format_inventory(inv)
    assert "NVIDIA driver 580.95.05" in text
    lines = text.splitlines()
    assert lines[2].split()[:3] == ["0", "GPU-aaaa", "0000:05:00.0"]
    assert lines[3].split()[:3] == ["1", "GPU-bbbb", "0000:0a:00.0"]
    assert "use UUIDs in CUDA_VISIBLE_DEVICES" in text
    # The vfio-bound card NVML cannot see, from sysfs.
    assert "Display devices NVML does not see (sysfs):" in text
    assert "0000:0b:00.0  10de:2584  vfio-pci  0000:0b:00.1     11" in text
    # Each card's other functions, NVML's too: they move with it.
    assert lines[2].split()[-1] == "0000:05:00.1"
    data = gpus.inventory_json(inv)
    assert [g["uuid"] for g in data["nvml"]["gpus"]] == ["GPU-aaaa", "GPU-bbbb"]
    assert [d["functions"] for d in data["pci"]] == [[f"0000:{b}:00.1"] for b in ("05", "0a", "0b")]
    assert data["pci"][2]["class_code"] == "0x030000"
    assert "CUDA" in data["warning"]
    json.dumps(data)


def test_inventory_without_nvml_shows_sysfs(sysfs: Any) -> None:
    sysfs.gpu("01", group="12")
    text = gpus.format_inventory(gpus.inventory(sysfs.root, FakeNvml([], fail_init="no lib")))
    assert text.startswith("NVML: no GPU (NVML did not start: no lib)")
    assert "Display devices (sysfs):" in text and "0000:01:00.1" in text


def test_inventory_with_nothing_says_so_plainly(sysfs: Any) -> None:
    text = gpus.format_inventory(gpus.inventory(sysfs.root, FakeNvml([], fail_init="no lib")))
    assert text.startswith("No GPU found: NVML sees none (NVML did not start: no lib) and "
                           "sysfs lists no display device")


def test_cli_gpus_json_on_a_fake_tree_without_nvml(sysfs: Any, tmp_path: Path) -> None:
    sysfs.gpu("01", group="12")
    out = subprocess.run([sys.executable, "-m", "hostagent.cli", "gpus", "--json",
                          "--sysfs", str(sysfs.root)], capture_output=True, text=True,
                         cwd=REPO, check=False)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert [d["address"] for d in data["pci"]] == ["0000:01:00.0"]
    empty = tmp_path / "empty"
    (empty / "bus/pci/devices").mkdir(parents=True)
    none = subprocess.run([sys.executable, "-m", "hostagent.cli", "gpus", "--sysfs",
                           str(empty)], capture_output=True, text=True, cwd=REPO, check=False)
    if data["nvml"]["available"] and data["nvml"]["gpus"]:
        return  # a real GPU host: NVML's cards are listed whatever the tree says
    assert none.returncode == 1
    assert none.stdout.startswith("No GPU found")


# --- UUIDs in the configuration ----------------------------------------------------------

BY_UUID = """
[lendee]
domain = "gpu-node"
gpus = ["gpu-a", "GPU-bbbb"]

[gpus.gpu-a]
uuid = "GPU-aaaa"
functions = ["0000:05:00.1"]
"""


def test_a_gpu_by_uuid_alone_is_placed_where_nvml_sees_it() -> None:
    cfg = parse(textwrap.dedent(BY_UUID))
    assert cfg.gpus["gpu-a"].pci is None
    assert cfg.lendee.gpus == ("gpu-a", "GPU-bbbb")
    placed = gpus.resolve_uuids(cfg, gpus.read_nvml(FakeNvml(CARDS)))
    assert placed.gpus["gpu-a"].pci_functions == ("0000:05:00.0", "0000:05:00.1")
    assert placed.gpus["GPU-bbbb"].pci == "0000:0a:00.0"


def test_a_uuid_nvml_does_not_see_needs_an_address() -> None:
    cfg = parse(textwrap.dedent(BY_UUID))
    with pytest.raises(ConfigError) as info:
        gpus.resolve_uuids(cfg, [], nvml_error="NVML did not start: no lib")
    assert str(info.value) == (
        "<config>: gpus.gpu-a: NVML on this host does not see GPU-aaaa (NVML did not start: "
        "no lib); a GPU bound to vfio-pci is invisible to NVML: add its pci address "
        "(`hostagent gpus` lists the display devices, `lspci -D` all)")


def test_a_card_that_moved_slots_is_refused() -> None:
    cfg = parse(textwrap.dedent("""
        [lendee]
        domain = "gpu-node"
        gpus = ["gpu-a"]

        [gpus.gpu-a]
        pci = "0000:01:00.0"
        uuid = "GPU-aaaa"
        """))
    with pytest.raises(ConfigError, match=r"gpus.gpu-a.pci: GPU-aaaa \(NVIDIA GeForce GTX 960\) "
                       r"is at 0000:05:00.0, not 0000:01:00.0; the card moved"):
        gpus.resolve_uuids(cfg, gpus.read_nvml(FakeNvml(CARDS)))
    # NVML not seeing it is fine when the address is given (it is bound to vfio-pci).
    assert gpus.resolve_uuids(cfg, []).gpus["gpu-a"].pci == "0000:01:00.0"


def test_config_refuses_a_gpu_with_neither_address_nor_uuid_and_a_uuid_twice() -> None:
    with pytest.raises(ConfigError, match=r'gpus.gpu-a.pci: missing; add pci = "0000:01:00.0" '
                       r'under \[gpus.gpu-a\] \(see lspci -D\), or uuid = "GPU-..."'):
        parse('[lendee]\ndomain = "n"\ngpus = ["gpu-a"]\n[gpus.gpu-a]\nname = "x"\n')
    with pytest.raises(ConfigError, match="gpus.gpu-b.uuid: GPU-aaaa is already the UUID of "
                       "GPU gpu-a"):
        parse('[lendee]\ndomain = "n"\ngpus = ["gpu-a", "gpu-b"]\n[gpus.gpu-a]\nuuid = '
              '"GPU-aaaa"\n[gpus.gpu-b]\nuuid = "GPU-aaaa"\n')


# --- the real thing ------------------------------------------------------------------------


def _nvml_reason() -> str | None:
    try:
        found = gpus.read_nvml()
    except NvmlUnavailable as e:
        return f"no NVIDIA GPU here: {e}"
    return None if found else "NVML started but lists no GPU"


NO_NVML = _nvml_reason()


@pytest.mark.skipif(NO_NVML is not None, reason=str(NO_NVML))
def test_nvml_on_a_real_gpu() -> None:
    found = gpus.read_nvml()
    assert [g.index for g in found] == list(range(len(found)))
    for g in found:
        assert g.uuid.startswith(("GPU-", "MIG-")), g.uuid
        assert gpus.canonical_pci(g.pci) == g.pci
        assert g.memory_mib > 0 and g.name and g.driver_version
    # sysfs agrees: each card NVML sees is a display device at that address.
    # (A container may hide the PCI tree; then there is nothing to compare.)
    on_bus = {d.address for d in gpus.sysfs_gpus()}
    if on_bus:
        assert {g.pci for g in found} <= on_bus


# --- the whole text and JSON of one host ------------------------------------------------

WARNING = ("The index is NVML's and nvidia-smi's (PCI bus order). CUDA numbers GPUs fastest "
           "first by default, so an index can name a different card there: use UUIDs in "
           "CUDA_VISIBLE_DEVICES (or set CUDA_DEVICE_ORDER=PCI_BUS_ID).")


def host(sysfs: Any) -> gpus.Inventory:
    """NVML sees the GTX 960 at 05 (with its audio and USB functions); sysfs also has an
    unbound card at 0b and a 3D controller at 0c on vfio-pci, both in IOMMU group 11
    with a bridge, and a card at 0d outside any IOMMU group."""
    sysfs.gpu("05", driver="nvidia").gpu("0b", audio=False, driver=None, group="11")
    sysfs.add("0000:05:00.2", cls=0x0c0330, device="1ad6", driver="xhci_hcd", group="5")
    sysfs.add("0000:0c:00.0", cls=0x030200, device="1eb8", driver="vfio-pci", group="11")
    sysfs.add("0000:00:1c.0", cls=0x060400, device="a110", driver="pcieport", group="11")
    sysfs.add("0000:0d:00.0", cls=0x030000, device="1c82", driver=None)  # IOMMU off
    return gpus.inventory(sysfs.root, FakeNvml(CARDS[:1]))


def test_the_text_of_a_host(sysfs: Any) -> None:
    assert gpus.format_inventory(host(sysfs)) == "\n".join([
        "NVIDIA driver 580.95.05, as NVML sees it:",
        "  INDEX  UUID      PCI           NAME                    MEMORY    OTHER FUNCTIONS",
        "  0      GPU-aaaa  0000:05:00.0  NVIDIA GeForce GTX 960  4096 MiB  0000:05:00.1, "
        "0000:05:00.2",
        "",
        "note: " + WARNING,
        "",
        "Display devices NVML does not see (sysfs):",
        "  PCI           IDS        DRIVER    OTHER FUNCTIONS  IOMMU GROUP  ALSO IN THE GROUP",
        "  0000:0b:00.0  10de:2584  none      -                11           0000:00:1c.0, "
        "0000:0c:00.0",
        "  0000:0c:00.0  10de:1eb8  vfio-pci  -                11           0000:00:1c.0, "
        "0000:0b:00.0",
        "  0000:0d:00.0  10de:1c82  none      -                -            -",
        "",
        "Every function of a card's slot moves with it (hostagent lends and reclaims them "
        "together).",
    ])


def test_the_json_of_a_host(sysfs: Any) -> None:
    assert gpus.inventory_json(host(sysfs)) == {
        "nvml": {"available": True, "error": None, "gpus": [{
            "index": 0, "uuid": "GPU-aaaa", "pci": "0000:05:00.0",
            "name": "NVIDIA GeForce GTX 960", "memory_mib": 4096,
            "driver_version": "580.95.05", "functions": ["0000:05:00.1", "0000:05:00.2"]}]},
        "pci": [
            {"address": "0000:05:00.0", "class_code": "0x030000", "vendor": "10de",
             "device": "2584", "driver": "nvidia", "iommu_group": "5",
             "group_members": ["0000:05:00.1", "0000:05:00.2"],
             "functions": ["0000:05:00.1", "0000:05:00.2"]},
            {"address": "0000:0b:00.0", "class_code": "0x030000", "vendor": "10de",
             "device": "2584", "driver": None, "iommu_group": "11",
             "group_members": ["0000:00:1c.0", "0000:0c:00.0"], "functions": []},
            {"address": "0000:0c:00.0", "class_code": "0x030200", "vendor": "10de",
             "device": "1eb8", "driver": "vfio-pci", "iommu_group": "11",
             "group_members": ["0000:00:1c.0", "0000:0b:00.0"], "functions": []},
            {"address": "0000:0d:00.0", "class_code": "0x030000", "vendor": "10de",
             "device": "1c82", "driver": None, "iommu_group": None, "group_members": [],
             "functions": []},
        ],
        "warning": WARNING,
    }


def test_nvml_that_lists_nothing_says_so(sysfs: Any) -> None:
    sysfs.gpu("0b", audio=False)
    inv = gpus.inventory(sysfs.root, FakeNvml([]))
    assert gpus.format_inventory(inv) == "\n".join([
        "NVML: no GPU (it lists none)",
        "",
        "Display devices (sysfs):",
        "  PCI           IDS        DRIVER    OTHER FUNCTIONS  IOMMU GROUP  ALSO IN THE GROUP",
        "  0000:0b:00.0  10de:2584  vfio-pci  -                11           -",
    ])
    data = gpus.inventory_json(inv)
    assert (data["nvml"], data["warning"]) == ({"available": True, "error": None, "gpus": []},
                                               None)
    empty = gpus.Inventory(nvml=[], nvml_error=None, pci=[])
    assert gpus.format_inventory(empty) == (
        "No GPU found: NVML sees none (it lists none) and sysfs lists no display device "
        "(class 0x03) under /sys/bus/pci/devices. Is this the host (not a container), and is "
        "the card seated and powered?")


def test_a_domain_is_read_as_hex() -> None:
    assert gpus.canonical_pci("0010:01:00.0") == "0010:01:00.0"
    assert gpus.canonical_pci("000000a0:01:00.0") == "00a0:01:00.0"


def test_pynvml_is_the_library_unless_another_is_given(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml(CARDS[:1]))
    assert [g.uuid for g in gpus.read_nvml()] == ["GPU-aaaa"]
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml raises ImportError
    with pytest.raises(NvmlUnavailable) as info:
        gpus.read_nvml()
    assert str(info.value).startswith("pynvml is not installed (")
    assert str(info.value).endswith("): install nvidia-ml-py")


def test_nvml_failing_while_listing_says_so_and_shuts_down() -> None:
    class Broken(FakeNvml):
        def nvmlDeviceGetCount(self) -> int:
            raise RuntimeError("GPU is lost")

    fake = Broken(CARDS)
    with pytest.raises(NvmlUnavailable) as info:
        gpus.read_nvml(fake)
    assert str(info.value) == "NVML failed while listing GPUs: GPU is lost"
    assert fake.shut


def test_every_gpu_by_uuid_is_placed_whatever_comes_before_it() -> None:
    cfg = parse(textwrap.dedent("""
        [lendee]
        domain = "gpu-node"
        gpus = ["gpu-x", "gpu-y", "gpu-a", "gpu-b"]

        [gpus.gpu-x]
        pci = "0000:01:00.0"

        [gpus.gpu-y]
        pci = "0000:02:00.0"
        uuid = "GPU-yyyy"

        [gpus.gpu-a]
        uuid = "GPU-aaaa"

        [gpus.gpu-b]
        uuid = "GPU-bbbb"
        """))
    placed = gpus.resolve_uuids(cfg, gpus.read_nvml(FakeNvml(CARDS)))
    assert [placed.gpus[g].pci for g in ("gpu-x", "gpu-y", "gpu-a", "gpu-b")] == [
        "0000:01:00.0", "0000:02:00.0", "0000:05:00.0", "0000:0a:00.0"]
    # Without a reason from NVML, the refusal says none.
    with pytest.raises(ConfigError) as info:
        gpus.resolve_uuids(cfg, [])
    assert str(info.value) == (
        "<config>: gpus.gpu-a: NVML on this host does not see GPU-aaaa; a GPU bound to "
        "vfio-pci is invisible to NVML: add its pci address (`hostagent gpus` lists the "
        "display devices, `lspci -D` all)")


def test_the_host_reads_every_placed_gpu_whatever_comes_before_it(sysfs: Any) -> None:
    sysfs.gpu("05").gpu("0a")
    cfg = parse(textwrap.dedent("""
        [lendee]
        domain = "gpu-node"
        gpus = ["gpu-a", "gpu-b"]

        [gpus.gpu-a]
        uuid = "GPU-aaaa"

        [gpus.gpu-b]
        pci = "0000:0a:00.0"
        """))
    placed = gpus.on_host(cfg, sysfs.root)
    assert placed.gpus["gpu-a"].pci is None  # not placed yet: left as it is
    assert placed.gpus["gpu-b"].pci_functions == ("0000:0a:00.0", "0000:0a:00.1")


def test_a_function_of_another_gpus_card_is_refused_naming_it(sysfs: Any) -> None:
    sysfs.gpu("01").gpu("02")
    cfg = parse(textwrap.dedent("""
        [lendee]
        domain = "gpu-node"
        gpus = ["gpu-a", "gpu-b"]

        [gpus.gpu-a]
        pci = "0000:01:00.0"

        [gpus.gpu-b]
        pci = "0000:02:00.0"
        functions = ["0000:01:00.1"]
        """), "c.toml")
    with pytest.raises(ConfigError) as info:
        gpus.on_host(cfg, sysfs.root)
    assert str(info.value) == ("c.toml: gpus.gpu-b.functions: 0000:01:00.1 is a function of "
                               "GPU gpu-a's card; remove it here: it moves with gpu-a")


def test_a_card_outside_any_iommu_group_has_none(sysfs: Any) -> None:
    sysfs.add("0000:01:00.0", driver="vfio-pci")  # the IOMMU is off
    cfg = parse('[lendee]\ndomain = "n"\ngpus = ["gpu-a"]\n[gpus.gpu-a]\npci = "0000:01:00.0"\n')
    assert gpus.on_host(cfg, sysfs.root).gpus["gpu-a"].iommu_groups == ()


def test_what_sysfs_leaves_out_or_garbles_is_read_as_unknown(sysfs: Any) -> None:
    sysfs.add("0000:01:00.0", group="7")
    dev = sysfs.root / "bus/pci/devices/0000:01:00.0"
    (dev / "vendor").unlink()
    (dev / "device").write_text("")
    (dev / "class").write_text("a VGA card\n")
    shutil.rmtree(sysfs.root / "kernel/iommu_groups/7/devices")
    found = gpus.pci_device("0000:01:00.0", sysfs.root)
    assert found is not None
    assert (found.ids, found.class_code, found.iommu_group, found.group_members) == (
        "?:?", 0, "7", ())
