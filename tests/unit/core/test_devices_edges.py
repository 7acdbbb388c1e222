"""GPU devices in domain XML (`hostagent.core.devices`) at their edges: which elements
count as a GPU's (only a PCI hostdev in subsystem mode by address; any device by alias),
addresses with attributes left out, a domain without devices or a name, the refusals'
words, and a device cut with its line only when it stands alone on it."""

from __future__ import annotations

import pytest

from hostagent.core.config import Gpu
from hostagent.core.devices import GpuNotInXml, elements_of, gpus_in, without

GPUS = {
    "gpu-a": Gpu(label="gpu-a", pci="0000:01:00.0", functions=("0000:01:00.1",)),
    "gpu-f": Gpu(label="gpu-f", pci="0001:05:03.2"),  # no part of its address is 0
}


def dom(devices: str, name: str = "<name>gpu-node</name>") -> str:
    return f"<domain>{name}<devices>{devices}</devices></domain>"


def test_an_address_is_read_from_each_of_its_attributes() -> None:
    f = "<hostdev mode='subsystem' type='pci'><source><address domain='0x1' bus='0x05' " \
        "slot='0x3' function='0x2'/></source></hostdev>"
    assert gpus_in(dom(f), GPUS) == {"gpu-f"}
    # An attribute left out is 0, as libvirt reads it.
    short = "<hostdev mode='subsystem' type='pci'><source><address bus='1'/></source></hostdev>"
    assert gpus_in(dom(short), GPUS) == {"gpu-a"}


@pytest.mark.parametrize("element", [
    "<hostdev mode='subsystem' type='usb'><source><address bus='1' device='0'/></source>"
    "</hostdev>",
    "<hostdev mode='capabilities' type='pci'><source><address bus='1'/></source></hostdev>",
    "<interface type='pci'><source><address bus='1'/></source></interface>",
    "<hostdev mode='subsystem' type='pci'><source/></hostdev>",
    "<hostdev mode='subsystem' type='pci'><source><address bus='x'/></source></hostdev>",
    "<controller type='usb'><alias/></controller>",
])
def test_what_is_no_gpus_device(element: str) -> None:
    assert gpus_in(dom(element), GPUS) == frozenset()


def test_a_hostdev_without_a_mode_is_in_subsystem_mode() -> None:
    bare = "<hostdev type='pci'><source><address bus='1' function='1'/></source></hostdev>"
    assert gpus_in(dom(bare), GPUS) == {"gpu-a"}


def test_a_domain_without_devices_holds_no_gpu() -> None:
    assert gpus_in("<domain><name>empty</name></domain>", GPUS) == frozenset()


def test_a_domain_without_a_name_is_called_the_domain() -> None:
    for cut in (without, elements_of):
        with pytest.raises(GpuNotInXml) as info:
            cut(dom("", name=""), {"gpu-f"}, GPUS)
        assert str(info.value).startswith("the domain's XML holds no device of GPU gpu-f "
                                          "(looked for <hostdev> 0001:05:03.2 or ")
        assert info.value.domain == "the domain"
        with pytest.raises(GpuNotInXml) as info:
            cut(dom("", name="<name> win11 </name>"), {"gpu-f"}, GPUS)
        assert info.value.domain == "win11"


def test_several_missing_gpus_are_each_named() -> None:
    with pytest.raises(GpuNotInXml) as info:
        without(dom(""), {"gpu-a", "gpu-f"}, GPUS)
    assert str(info.value) == (
        "gpu-node's XML holds no device of GPU gpu-a (looked for <hostdev> 0000:01:00.0 or "
        "<hostdev> 0000:01:00.1 or <alias name='ua-hostagent-gpu-a'/>); gpu-f (looked for "
        "<hostdev> 0001:05:03.2 or <alias name='ua-hostagent-gpu-f'/>): its definition must "
        "list every GPU the configuration gives it (run `hostagent lint`)")


def test_an_unknown_label_names_the_known_ones() -> None:
    for cut in (without, elements_of):
        with pytest.raises(KeyError) as info:
            cut(dom(""), {"gpu-z"}, GPUS)
        assert info.value.args == ("unknown GPU 'gpu-z': known are gpu-a, gpu-f",)


A_ALONE = "<controller type='usb'><alias name='ua-hostagent-gpu-a'/></controller>"


def test_a_device_sharing_its_line_on_one_side_keeps_the_line() -> None:
    before = f"<domain><devices>{A_ALONE}\n    <memballoon model='none'/>\n  </devices></domain>"
    assert without(before, {"gpu-a"}, GPUS) == (
        "<domain><devices>\n    <memballoon model='none'/>\n  </devices></domain>")
    after = f"<domain><devices>\n    {A_ALONE}</devices></domain>"  # and no newline at the end
    assert without(after, {"gpu-a"}, GPUS) == "<domain><devices>\n    </devices></domain>"


def test_a_device_alone_on_its_line_goes_with_the_line() -> None:
    xml = f"<domain><devices>\n    {A_ALONE}\n  </devices></domain>\n"
    assert without(xml, {"gpu-a"}, GPUS) == "<domain><devices>\n  </devices></domain>\n"
    assert elements_of(xml, {"gpu-a"}, GPUS) == [A_ALONE]
