"""`hostagent config init`: a starter configuration from domains with hostdevs, read back
through the configuration loader."""

from __future__ import annotations

import subprocess
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from hostagent.service import config_init
from hostagent.host import lint
from hostagent.core.config import parse
from hostagent.host.gpus import NvmlGpu
from tests.unit.domain_scaffold import domain, gpu, hostdev

REPO = Path(__file__).resolve().parents[3]

SEEN = [NvmlGpu(index=0, uuid="GPU-cccc", pci="0000:03:00.0", name="NVIDIA GeForce GTX 960",
                memory_mib=4096, driver_version="580.95.05")]


@pytest.fixture
def host(sysfs: Any) -> Any:
    sysfs.gpu("01").gpu("02").gpu("03", driver="nvidia")
    sysfs.add("0000:05:00.0", cls=0x0c0330, device="1242", group="5")  # a USB controller
    return sysfs


def domains(*xmls: str) -> list[lint.Domain]:
    return [lint.parse_domain(x) for x in xmls]


def three_vms() -> list[lint.Domain]:
    return domains(domain("gpu-node", gpu("01") + gpu("02") + gpu("03")),
                   domain("gaming1", gpu("01", rom_off=False) + [hostdev("0000:05:00.0")]),
                   domain("gaming2", gpu("02", rom_off=False)),
                   domain("desktop", []))


def test_starter_round_trips_through_the_loader(host: Any) -> None:
    text = config_init.starter_config(three_vms(), sysfs=host.root, nvml=SEEN,
                                      now=datetime(2026, 9, 13, 20, 0))
    cfg = parse(text, "starter")
    assert cfg.lendee.domain == "gpu-node"
    assert cfg.lendee.gpus == ("gpu-a", "gpu-b", "gpu-c")
    assert {o.domain: o.gpus for o in cfg.owners.values()} == {"gaming1": ("gpu-a",),
                                                               "gaming2": ("gpu-b",)}
    assert [(g.label, g.pci, g.functions, g.uuid) for g in cfg.gpus.values()] == [
        ("gpu-a", "0000:01:00.0", ("0000:01:00.1",), None),
        ("gpu-b", "0000:02:00.0", ("0000:02:00.1",), None),
        ("gpu-c", "0000:03:00.0", ("0000:03:00.1",), "GPU-cccc"),
    ]
    assert cfg.gpus["gpu-c"].name == "NVIDIA GeForce GTX 960"
    # The comments say what to check.
    assert text.startswith("# hostagent: a starter configuration by `hostagent config init`, "
                           "2026-09-13 20:00\n")
    assert ("# - the lendee: gpu-node, the domain that holds the most GPUs (3); run again with\n"
            "#   --lendee NAME if that is wrong.\n") in text
    assert ("# 0000:01:00.0: in gaming1, gpu-node; 10de:2584 on vfio-pci; IOMMU group 1; NVML does\n"
            "#   not see it: add its uuid by hand\n[gpus.gpu-a]\n") in text
    assert "# 0000:03:00.0: in gpu-node; 10de:2584 on nvidia; IOMMU group 3; 4096 MiB\n" in text
    assert max(len(line) for line in text.splitlines()) <= 88
    assert "# gaming1 passes through 0000:05:00.0, no GPU (per sysfs): left out." in text
    # And lint agrees with what it wrote.
    assert [f for f in lint.lint(three_vms(), sysfs=host.root, config=cfg)
            if f.severity is lint.Severity.ERROR] == []


def test_the_lendee_can_be_named_and_a_tie_must_be(host: Any) -> None:
    two = domains(domain("gpu-node", gpu("01")), domain("gaming1", gpu("01")))
    with pytest.raises(config_init.InitError, match=r"gaming1 and gpu-node each hold 1 GPU\(s\): "
                       "say which one is the lendee"):
        config_init.starter_config(two, sysfs=host.root)
    cfg = parse(config_init.starter_config(two, sysfs=host.root, lendee_name="gpu-node"))
    assert cfg.lendee.domain == "gpu-node" and list(cfg.owners) == ["gaming1"]
    with pytest.raises(config_init.InitError, match="--lendee nope: that domain has no GPU"):
        config_init.starter_config(two, sysfs=host.root, lendee_name="nope")


def test_a_gpu_two_owners_claim_is_owned_by_both(host: Any) -> None:
    doms = domains(domain("gpu-node", gpu("01") + gpu("02") + gpu("03")),
                   domain("gaming1", gpu("01")), domain("gaming-win", gpu("01") + gpu("02")))
    text = config_init.starter_config(doms, sysfs=host.root)
    cfg = parse(text)
    assert {o.domain: o.gpus for o in cfg.owners.values()} == {
        "gaming-win": ("gpu-a", "gpu-b"), "gaming1": ("gpu-a",)}
    assert cfg.owners_of("gpu-a") == ("gaming-win", "gaming1")
    assert ("# gpu-a is owned by gaming-win and gaming1: they take turns, and a start while "
            "another\n#   of them runs is refused.\n") in text
    assert "gpu-b is owned by" not in text
    # And lint agrees with what it wrote.
    assert lint.errors(lint.lint(doms, sysfs=host.root, config=cfg)) == []


def test_a_card_no_longer_on_the_host_is_kept_and_flagged(host: Any) -> None:
    text = config_init.starter_config(domains(domain("gpu-node", [hostdev("0000:09:00.0")])),
                                      sysfs=host.root)
    assert parse(text).gpus["gpu-a"].pci == "0000:09:00.0"
    assert "# Not on this host now: 0000:09:00.0." in text


def test_no_gpu_anywhere_is_an_error(host: Any) -> None:
    with pytest.raises(config_init.InitError, match="no domain in libvirt has a PCI <hostdev> "
                       "of a GPU"):
        config_init.starter_config(domains(domain("gpu-node", [])), sysfs=host.root)


def test_cli_never_overwrites_without_force(host: Any, tmp_path: Path) -> None:
    files = []
    for i, d in enumerate((domain("gpu-node", gpu("01") + gpu("02")),
                           domain("gaming1", gpu("01")))):
        (tmp_path / f"{i}.xml").write_text(d)
        files += ["--xml", str(tmp_path / f"{i}.xml")]
    target = tmp_path / "etc" / "config.toml"

    def init(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "hostagent.cli", "--config", str(target),
                               "config", "init", "--sysfs", str(host.root), *files, *args],
                              capture_output=True, text=True, cwd=REPO, check=False)

    first = init()
    assert first.returncode == 0, first.stderr
    assert parse(target.read_text()).lendee.gpus == ("gpu-a", "gpu-b")
    target.write_text("# mine\n")
    again = init()
    assert again.returncode == 1
    assert again.stderr == f"hostagent: {target} exists: left as it is (--force overwrites it)\n"
    assert target.read_text() == "# mine\n"
    assert init("--force").returncode == 0
    assert parse(target.read_text()).lendee.domain == "gpu-node"
    printed = init("--output", "-")
    assert printed.returncode == 0 and parse(printed.stdout).owners["gaming1"].gpus == ("gpu-a",)
