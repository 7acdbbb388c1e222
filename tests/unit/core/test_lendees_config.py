"""Several lendees in the configuration: ``[lendees.NAME]``, the single ``[lendee]``
unchanged beside them, the mistakes that span them, and each lendee's view."""

from __future__ import annotations

import dataclasses
import textwrap

import pytest

from hostagent.core.config import Config, ConfigError, Gpu, parse
from hostagent.core.lendees import lendee_of, view
from tests.unit.lendees_scaffold import GPUS, TWO

def problems(text: str) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse(textwrap.dedent(text), "t.toml")
    return [str(p) for p in info.value.problems]


def test_each_lendee_by_its_domain_with_its_own_node_and_gpus() -> None:
    cfg = parse(TWO)
    assert list(cfg.lendees) == ["node-a", "node-b"]
    assert cfg.lendees["node-a"].node == "node-a"
    assert cfg.lendees["node-b"].node == "k8s-b"
    assert cfg.lendees["node-b"].gpus == ("gpu-b", "gpu-c")
    assert cfg.lendees["node-b"].min_gpus == 2
    assert cfg.lendee is cfg.lendees["node-a"]  # the first, for what asks for one
    assert lendee_of(cfg, "gpu-c") == "node-b" and lendee_of(cfg, "gpu-d") is None
    assert cfg.gpus_of("node-b") == ("gpu-b", "gpu-c")
    assert cfg.shared_gpus("both") == {"gpu-a", "gpu-c"}


def test_the_single_lendee_is_the_lendee_named_by_its_domain() -> None:
    single = parse('[lendee]\ndomain = "gpu-node"\ngpus = ["gpu-a"]\n' + GPUS)
    named = parse('[lendees.gpu-node]\ngpus = ["gpu-a"]\n' + GPUS)
    assert single.lendees == named.lendees == {"gpu-node": single.lendee}
    assert single.lendee == named.lendee
    # One lendee: its view is the configuration itself, every owner kept.
    assert single.view("gpu-node") is single


def test_the_single_lendee_may_stand_beside_several_and_comes_first() -> None:
    cfg = parse('[lendee]\ndomain = "gpu-node"\ngpus = ["gpu-d"]\n' + TWO)
    assert list(cfg.lendees) == ["gpu-node", "node-a", "node-b"]


def test_a_view_holds_its_lendee_and_the_owners_of_its_gpus_restricted_to_them() -> None:
    cfg = parse(TWO)
    a, b = cfg.view("node-a"), cfg.view("node-b")
    assert a.lendee == cfg.lendees["node-a"] and list(a.lendees) == ["node-a"]
    assert {d: o.gpus for d, o in a.owners.items()} == {
        "gaming1": ("gpu-a",), "both": ("gpu-a",),
        "elsewhere": ("gpu-d",),  # it needs no lendee's GPU: kept by the first, to start it
    }
    assert {d: o.gpus for d, o in b.owners.items()} == {"gaming2": ("gpu-b",), "both": ("gpu-c",)}
    assert b.gpus == cfg.gpus  # GPUs are named alike in every view


def test_an_owner_claims_through_an_iommu_group_in_the_view() -> None:
    cfg = parse(TWO)
    # gpu-d shares gpu-b's IOMMU group: "elsewhere" takes gpu-b from node-b when it runs.
    gpus = dict(cfg.gpus)
    gpus["gpu-b"] = dataclasses.replace(gpus["gpu-b"], iommu_groups=("12",))
    gpus["gpu-d"] = dataclasses.replace(gpus["gpu-d"], iommu_groups=("12",))
    grouped: Config = dataclasses.replace(cfg, gpus=gpus)
    assert "elsewhere" in view(grouped, "node-b").owners
    assert "elsewhere" not in view(grouped, "node-a").owners
    assert isinstance(grouped.gpus["gpu-d"], Gpu)


@pytest.mark.parametrize(("text", "expected"), [
    (   # one GPU, two lendees
        '[lendees.node-a]\ngpus = ["gpu-a"]\n[lendees.node-b]\ngpus = ["gpu-b", "gpu-a"]\n' + GPUS,
        "t.toml: lendees.node-b.gpus[1]: GPU gpu-a is already lent to lendees.node-a.gpus; "
        "a GPU belongs to one lendee: remove it from one of them",
    ),
    (   # the same, by its address, and from [lendee]
        '[lendee]\ndomain = "n"\ngpus = ["gpu-a"]\n[lendees.node-b]\ngpus = ["01:00.0"]\n' + GPUS,
        "t.toml: lendees.node-b.gpus[0]: GPU gpu-a is already lent to lendee.gpus",
    ),
    (
        '[lendee]\ndomain = "node-a"\ngpus = ["gpu-b"]\n[lendees.node-a]\ngpus = ["gpu-a"]\n' + GPUS,
        "t.toml: lendees.node-a: node-a is already the lendee of [lendee]; a worker VM is one "
        "lendee: remove one of them",
    ),
    (
        '[lendees.node-a]\ngpus = ["gpu-a"]\n[lendees.node-b]\nnode = "node-a"\ngpus = ["gpu-b"]\n'
        + GPUS,
        "t.toml: lendees.node-b.node: node-a is already the node of [lendees.node-a]; each "
        "lendee is its own Kubernetes node: give one its own node name",
    ),
    (
        '[lendees.node-a]\ndomain = "vm"\ngpus = ["gpu-a"]\n' + GPUS,
        "t.toml: lendees.node-a.domain: not a key here; the section's name is the lendee's "
        "domain: remove it, or name the section [lendees.vm]",
    ),
    (
        '[lendees.node-a]\ngpus = ["gpu-a"]\nmin_gpus = 2\n' + GPUS,
        "t.toml: lendees.node-a.min_gpus: 2 is not between 1 and the 1 GPU(s) in "
        "lendees.node-a.gpus",
    ),
    (
        '[lendees.node-a]\ngpus = ["gpu-a"]\n[owners.node-a]\ngpus = ["gpu-b"]\n' + GPUS,
        "t.toml: owners.node-a: node-a is the lendee, and the lendee cannot also own GPUs",
    ),
    (
        '[lendees.node-a]\ngpus = ["gpu-z"]\n' + GPUS,
        't.toml: lendees.node-a.gpus[0]: unknown GPU "gpu-z"',
    ),
    (
        '[lendees.node-a]\nnode = "x"\n' + GPUS,
        't.toml: lendees.node-a.gpus: missing; add gpus = ["gpu-a"] under [lendees.node-a]',
    ),
    (
        "[lendees]\nnode-a = 3\n" + GPUS,
        "t.toml: lendees.node-a: expected a table, got an integer",
    ),
    (
        GPUS,
        't.toml: lendee: missing; add [lendee] with domain = "gpu-node" and gpus = ["gpu-a"] '
        "(or a [lendees.NAME] section for each of several worker VMs)",
    ),
])
def test_mistakes_name_the_key_and_the_other_one(text: str, expected: str) -> None:
    said = problems(text)
    assert any(p.startswith(expected) for p in said), said


def test_a_bad_lendee_section_is_not_also_said_missing() -> None:
    said = problems('[lendee]\ngpus = ["gpu-a"]\n[timeouts]\ndrain = "x"\n' + GPUS)
    assert any(p.startswith("t.toml: lendee.domain: missing") for p in said), said
    assert any(p.startswith("t.toml: timeouts.drain:") for p in said), said
    assert not any(p.startswith("t.toml: lendee: missing") for p in said), said


def test_each_lendee_may_reach_the_cluster_as_its_own_node() -> None:
    """deploy/rbac-node.yaml gives each node's ServiceAccount that node alone: a lendee's
    kubeconfig is its view's [kubernetes] kubeconfig; without one, the shared one."""
    cfg = parse(TWO.replace('node = "k8s-b"\n', 'node = "k8s-b"\nkubeconfig = "/etc/b.kubeconfig"\n')
                + '\n[kubernetes]\nkubeconfig = "/etc/a.kubeconfig"\n')
    a, b = cfg.view("node-a").kubernetes, cfg.view("node-b").kubernetes
    assert a is not None and b is not None
    assert (str(a.kubeconfig), str(b.kubeconfig)) == ("/etc/a.kubeconfig", "/etc/b.kubeconfig")
    single = parse('[lendee]\ndomain = "n"\ngpus = ["gpu-a"]\nkubeconfig = "/etc/n.kubeconfig"\n'
                   + GPUS + '\n[kubernetes]\n')
    assert single.kubernetes is not None and single.kubernetes.kubeconfig is None
    viewed = single.view("n").kubernetes
    assert viewed is not None and str(viewed.kubeconfig) == "/etc/n.kubeconfig"
    assert problems('[lendees.node-a]\ngpus = ["gpu-a"]\nkubeconfig = "b.kubeconfig"\n' + GPUS)[0] \
        .startswith('t.toml: lendees.node-a.kubeconfig: "b.kubeconfig" is a relative path')
