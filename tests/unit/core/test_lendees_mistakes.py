"""Each mistake in ``[lendees.NAME]`` is named once, alone, and what spans the sections is
still checked when one section is wrong; and a view reaches through IOMMU groups as far
as they chain. The configuration is tests/unit/lendees_scaffold.py's."""

from __future__ import annotations

import dataclasses

import pytest

from hostagent.core.config import Config, ConfigError, parse
from hostagent.core.lendees import view
from tests.unit.lendees_scaffold import GPUS, TWO

LENT_TWICE = ("t.toml: lendees.node-b.gpus[0]: GPU gpu-a is already lent to lendees.node-a.gpus; "
              "a GPU belongs to one lendee: remove it from one of them")
DOMAIN = ("t.toml: lendees.node-a.domain: not a key here; the section's name is the lendee's "
          "domain: remove it, or name the section [lendees.vm]")


def problems(text: str) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse(text, "t.toml")
    return [str(p) for p in info.value.problems]


def test_lendees_that_is_no_table_is_named_not_a_crash() -> None:
    assert problems("lendees = 3\n" + GPUS) == [
        "t.toml: lendees: expected a table, got an integer; write entries as [lendees.NAME] "
        "sections",
        't.toml: lendee: missing; add [lendee] with domain = "gpu-node" and gpus = ["gpu-a"] '
        "(or a [lendees.NAME] section for each of several worker VMs)",
    ]


def test_a_domain_key_is_named_once_and_nothing_else_in_its_section() -> None:
    assert problems('[lendees.node-a]\ndomain = "vm"\ngpus = ["gpu-a"]\n' + GPUS) == [DOMAIN]


def test_beside_a_refused_domain_key_the_sections_are_still_checked_together() -> None:
    text = ('[lendees.node-a]\ndomain = "vm"\ngpus = ["gpu-a"]\n'
            '[lendees.node-b]\ngpus = ["gpu-a"]\n' + GPUS)
    assert problems(text) == [DOMAIN, LENT_TWICE]


def test_beside_a_bad_key_the_sections_are_still_checked_together() -> None:
    text = ('[lendees.node-a]\ngpus = ["gpu-a"]\nmin_gpus = "x"\n'
            '[lendees.node-b]\ngpus = ["gpu-a"]\n' + GPUS)
    assert problems(text) == [
        "t.toml: lendees.node-a.min_gpus: expected an integer, got a string; write a whole "
        "number without quotes",
        LENT_TWICE,
    ]


def test_each_view_holds_its_own_lendee_as_the_lendee() -> None:
    cfg = parse(TWO)
    assert cfg.view("node-b").lendee == cfg.lendees["node-b"]
    assert view(cfg, "node-b").lendee.node == "k8s-b"


def test_a_view_reaches_through_iommu_groups_as_far_as_they_chain() -> None:
    """gpu-a shares group 1 with gpu-d, and gpu-d group 2 with gpu-c: an owner of gpu-c
    takes gpu-a from node-a too, though they share no group themselves."""
    cfg = parse(TWO)
    groups = {"gpu-a": ("1",), "gpu-b": ("3",), "gpu-c": ("2",), "gpu-d": ("1", "2")}
    chained: Config = dataclasses.replace(cfg, gpus={
        label: dataclasses.replace(gpu, iommu_groups=groups[label])
        for label, gpu in cfg.gpus.items()})
    a = view(chained, "node-a")
    assert {d: o.gpus for d, o in a.owners.items()} == {
        "gaming1": ("gpu-a",), "both": ("gpu-a", "gpu-c"), "elsewhere": ("gpu-d",)}


def test_after_a_domain_lent_twice_the_next_sections_are_still_checked() -> None:
    text = ('[lendee]\ndomain = "node-a"\ngpus = ["gpu-b"]\n[lendees.node-a]\ngpus = ["gpu-a"]\n'
            '[lendees.node-c]\ngpus = ["gpu-b"]\n' + GPUS)
    assert problems(text) == [
        "t.toml: lendees.node-a: node-a is already the lendee of [lendee]; a worker VM is one "
        "lendee: remove one of them",
        "t.toml: lendees.node-c.gpus[0]: GPU gpu-b is already lent to lendee.gpus; a GPU "
        "belongs to one lendee: remove it from one of them",
    ]


def test_a_refused_domain_key_names_no_lendee_while_the_rest_is_checked() -> None:
    """The section is read without its refused key: its lendee is still the section's
    name, so a section of that other name is no second lendee of one VM."""
    text = ('[lendees.node-a]\ndomain = "node-b"\ngpus = ["gpu-a"]\n'
            '[lendees.node-b]\ngpus = ["gpu-b"]\n' + GPUS)
    assert problems(text) == [
        "t.toml: lendees.node-a.domain: not a key here; the section's name is the lendee's "
        "domain: remove it, or name the section [lendees.node-b]"]
