"""README tells the truth about the code, and cannot drift from it unnoticed.

The Debian section's TOML goes through the agent's own loader; the NixOS section's
`services.hostagent` is evaluated by Nix (it uses neither lib nor pkgs) and must be the
same configuration, once the module's two conveniences are spelled as TOML keys. Every
other TOML snippet is checked by the loader too, every Nix snippet parses, the table of
commands is each command's `--help` summary, and the figures README quotes from the
code (connection limits, exit statuses, health checks, the hook's sentence) are read
from it.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import textwrap
import tomllib
from pathlib import Path
from typing import Any

import pytest
import tomli_w

from hostagent.service import agent, serving
from hostagent import cli
from hostagent.core import config, health
from hostagent.surfaces import control, metrics, ssh
from hostagent.core.machine import verdict
from hostagent.core.model import Phase, State, Topology
from tests.packaging.readme import (
    block,
    blocks,
    README,
    section,
)

NIX = shutil.which("nix-instantiate")


def toml_example() -> dict[str, Any]:
    return tomllib.loads(block("Installing on Debian", "toml"))


def test_the_debian_example_is_a_valid_config() -> None:
    cfg = config.parse(block("Installing on Debian", "toml"), "README.md")
    assert cfg.lendee.domain == "gpu-node"
    assert set(cfg.owners) == {"gaming1", "gaming2"}
    assert cfg.kubernetes is not None and cfg.control_group == "hostagent"


def test_the_readme_shows_how_to_follow_the_agent() -> None:
    nixos = section("Installing on NixOS")
    assert "journalctl -u hostagent -f" in nixos
    assert "journalctl -u hostagent HOSTAGENT_VM=gaming1" in nixos
    debian = section("Installing on Debian")
    assert "make install" in debian and "systemctl restart libvirtd" in debian


@pytest.mark.skipif(NIX is None, reason="nix-instantiate is not installed (Debian package nix-bin)")
def test_the_nixos_example_is_the_same_configuration(tmp_path: Path) -> None:
    example = tmp_path / "configuration.nix"
    example.write_text(block("Installing on NixOS", "nix", "services.hostagent"))
    assert NIX is not None
    out = subprocess.run(
        [NIX, "--eval", "--strict", "--json", "--expr",
         # Only this attribute is read: `imports` and the rest are never evaluated.
         f"(import {example}).services.hostagent"],
        capture_output=True, text=True, timeout=60, check=False,
    )
    assert out.returncode == 0, out.stderr
    hostagent = json.loads(out.stdout)
    assert hostagent["enable"] is True
    # The module's conveniences, as the TOML file spells them.
    settings = hostagent["settings"]
    settings["control_group"] = hostagent["controlSocketGroup"]
    expected = toml_example()
    # kubeconfigFile reaches the agent as kubernetes.kubeconfig (through systemd's
    # credentials, so the path differs); both examples name one.
    assert expected["kubernetes"].pop("kubeconfig").startswith("/")
    assert hostagent["kubeconfigFile"].startswith("/")
    assert settings == expected
    config.parse(tomli_w.dumps(settings))


# --- snippets ------------------------------------------------------------------------


def test_every_toml_snippet_is_taken_by_the_agent() -> None:
    """Each TOML block parses, and the agent takes it: a fragment (a [verify] or
    [metrics] section) as part of the Debian example."""
    base = toml_example()
    snippets = blocks("toml")
    assert len(snippets) >= 5
    for snippet in snippets:
        table = tomllib.loads(textwrap.dedent(snippet))
        if "lendee" not in table:
            merged = json.loads(json.dumps(base))
            for key, value in table.items():
                if isinstance(value, dict):
                    merged.setdefault(key, {}).update(value)
                else:
                    merged[key] = value
            table = merged
        config.parse(tomli_w.dumps(table), "README.md")


@pytest.mark.skipif(NIX is None, reason="nix-instantiate is not installed (Debian package nix-bin)")
def test_every_nix_snippet_parses(tmp_path: Path) -> None:
    assert NIX is not None
    snippets = blocks("nix")
    assert len(snippets) >= 3
    for i, snippet in enumerate(snippets):
        text = snippet if snippet.lstrip().startswith("{") else "{\n" + snippet + "}\n"
        f = tmp_path / f"snippet{i}.nix"
        f.write_text(text)
        out = subprocess.run([NIX, "--parse", str(f)], capture_output=True, text=True,
                             timeout=60, check=False)
        assert out.returncode == 0, f"{snippet}\n{out.stderr}"


def test_the_flake_snippet_names_what_the_flake_gives() -> None:
    snippet = block("Installing on NixOS", "nix", "inputs.hostagent")
    flake = (README.parent / "flake.nix").read_text()
    assert "hostagent.nixosModules.default" in snippet and "nixosModules.default =" in flake
    assert 'inputs.hostagent.inputs.nixpkgs.follows = "nixpkgs"' in snippet
    assert "inputs.nixpkgs.url" in flake  # the input that `follows` replaces


# --- the table of commands -----------------------------------------------------------


def help_summaries(parser: argparse.ArgumentParser, prefix: str = "hostagent") -> dict[str, str]:
    """Each command as README's table writes it (its positional arguments included),
    and its summary in `hostagent --help`."""
    out: dict[str, str] = {}
    for action in parser._actions:
        if not isinstance(action, argparse._SubParsersAction):
            continue
        for choice in action._choices_actions:
            sub = action.choices[choice.dest]
            if any(isinstance(a, argparse._SubParsersAction) for a in sub._actions):
                out |= help_summaries(sub, f"{prefix} {choice.dest}")
                continue
            words = [prefix, choice.dest] + [
                a.metavar if a.nargs is None else f"[{a.metavar} ...]"
                for a in sub._actions if not a.option_strings]
            out[" ".join(str(w) for w in words)] = str(choice.help)
    return out


def test_the_table_of_commands_is_each_commands_help_summary() -> None:
    rows = dict(re.findall(r"^\| `(hostagent [^`]+)` \| (.+) \|$", section("Commands"), re.M))
    assert rows == help_summaries(cli._parser())


# --- claims read from the code ---------------------------------------------------------


def test_the_connection_limits_are_the_codes() -> None:
    text = section("Watching it: metrics, health, history")
    assert (f"It serves {metrics.MAX_CONNECTIONS} connections at once, "
            f"{metrics.MAX_PER_SOURCE} per address") in text
    assert (f"on the SSH port ({ssh.MAX_CONNECTIONS} connections at once; at most "
            f"{ssh.MAX_UNAUTHENTICATED} of them\nstill logging in, {ssh.MAX_PER_PREFIX} of "
            f"those from one /24 or /64, each with {ssh.LOGIN_TIMEOUT:g} s to log in, the "
            f"oldest\nclosed for a newer one; {ssh.MAX_PER_KEY} per key, one command each, "
            f"{ssh.MAX_RUNNING} commands at once; health\nchecked at most once a second "
            "however often it is asked)") in text
    assert health.MAX_AGE == 1


def test_which_control_requests_are_journaled() -> None:
    text = " ".join(section("Home automation: `hostagent play` and the SSH endpoint").split())
    assert ("Each request but `status` (which dashboards poll) is journaled with who sent it, "
            f"up to {control.REQUESTS_BURST} per user every {control.REQUESTS_INTERVAL:g} s "
            "and then a count of the rest") in text


def test_every_ssh_exit_status_is_listed() -> None:
    text = " ".join(section("Home automation: `hostagent play` and the SSH endpoint").split())
    listed = {int(n) for n in re.findall(
        r"\b(\d+) (?:done|failed|a malformed|a verb|the agent)", text)}
    assert listed == {int(s) for s in ssh.ExitStatus}


# What README says each health check looks at, by the name the agent gives it.
HEALTH = {
    "libvirt": "libvirt answers a call",
    "hook socket": "the hook socket accepts a connection",
    "last lend verified": "the last lend was verified",
    "state file": "the state file takes saves",
    "domains": "every domain the configuration names is defined",
    "control group": "the `control_group` exists",
    "kubernetes": "the Kubernetes API answers",
}


def test_every_health_check_is_described() -> None:
    # The agent adds them, and the endpoints it serves (the control group's).
    source = Path(agent.__file__).read_text() + Path(serving.__file__).read_text()
    assert set(re.findall(r'health\.add\("([^"]+)"', source)) == set(HEALTH)
    text = " ".join(section("Watching it: metrics, health, history").split())
    for what in HEALTH.values():
        assert what in text


def test_the_deferred_start_shows_the_agents_own_sentence() -> None:
    """What README shows `virsh start gaming1` print is the hook's sentence for a lent
    lendee, as the agent words it."""
    shown = " ".join(section("What `virsh start` says while a GPU is reclaimed").split())
    topo = Topology(lendee="gpu-node", lendee_gpus=frozenset({"gpu-a", "gpu-b"}),
                    owners={"gaming1": frozenset({"gpu-a"})})
    state = State(phase=Phase.LENT, agent_up=True, lent=frozenset({"gpu-a", "gpu-b"}))
    decision, sentence = verdict(state, "gaming1", topo=topo)
    assert decision == "defer"
    assert f"unexpected exit status 1: {sentence}" in shown
    assert "error: Failed to start domain 'gaming1'" in shown


def test_a_newcomer_installs_make_and_git_first() -> None:
    steps = section("The two commands")
    assert steps.index("apt-get install -y make git") < steps.index("git clone") \
        < steps.index("make demo")


def test_the_debian_install_edits_and_checks_before_enabling() -> None:
    steps = block("Installing on Debian", "sh")
    order = ["make install", "hostagent config init", "/etc/hostagent/config.toml",
             "hostagent check-config", "hostagent lint", "systemctl enable --now hostagent"]
    assert [steps.index(s) for s in order] == sorted(steps.index(s) for s in order)
    prose = section("Installing on Debian")
    before = prose[:prose.index("- **Host boot and shutdown**")]
    for prerequisite in ("org.qemu.guest_agent.0", "guest-exec", "nvidia-smi"):
        assert prerequisite in before


def test_the_lab_by_hand_uses_the_venv_and_says_how_to_take_it_down() -> None:
    text = section("The lab")
    assert ".venv/bin/python -m tests.lab.lab" in text and "Ctrl-C" in text


# --- figures: README quotes bench/RESULTS.md, the last complete `make bench` -------------

RESULTS = README.parent / "bench" / "RESULTS.md"


def results() -> dict[str, dict[str, list[str]]]:
    """RESULTS.md's tables: the first header cell → {each row's first cell → its cells}."""
    tables: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] | None = None
    for line in RESULTS.read_text().splitlines():
        if not line.startswith("|"):
            current = None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if current is None:
            current = tables.setdefault(cells[0], {"": cells})
        elif not set(line) <= set("|-"):
            current[cells[0]] = cells
    return tables


def median_max(text: str) -> tuple[str, str]:
    m = re.fullmatch(r"median ([\d.]+) (?:s|ms), max ([\d.]+) (?:s|ms)", text)
    assert m, text
    return m[1], m[2]


def latest_table() -> list[list[str]]:
    """README's "Latest" table of the benchmarks, as RESULTS.md has it."""
    t = results()
    hook = {name: dict(zip(t["hook"][""], cells, strict=True)) for name, cells in t["hook"].items()}
    swap, agent_ = t["the partial swap"], t["the agent"]
    rows = [
        ["hook p99 with the agent up, over a bare `python3 -I -S`",
         f"{hook['agent up']['Δp99 ms']} ms",
         f"{hook['agent up']['budget']} ms: {hook['agent up']['verdict']}"],
        ["hook p99, agent absent / hung",
         f"{hook['agent absent']['Δp99 ms']} / {hook['agent hung']['Δp99 ms']} ms",
         f"{hook['agent hung']['budget']} ms: {hook['agent absent']['verdict']} / "
         f"{hook['agent hung']['verdict']}"],
    ]
    for leg, what in (("reclaim", "reclaim: `virsh start gaming1` → gaming1 running"),
                      ("partial lend", "partial lend: gaming1 running → gpu-node uncordoned "
                                       "with gpu-b and gpu-c"),
                      ("regrow", "regrow: gaming1 off → gpu-node uncordoned with all three")):
        total, _ = median_max(swap[f"{leg}: total"][1])
        # hostagent's own part: the overhead less the lab proxy's cost (bench/cycle.py);
        # results of before it was measured apart give the overhead whole.
        own = swap.get(f"{leg}: hostagent's part") or swap[f"{leg}: overhead"]
        over, worst = median_max(own[1])
        rows.append([what, f"{total} s, of which hostagent {over} ms (max {worst})",
                     own[2].removeprefix("budget ")])
    storm = next(k for k in agent_ if k.startswith("reconnect storm"))
    answered = agent_["answered within the hook's budget"]
    spooled, lost = agent_["spooled (budget ran out first), lost"][1].split(", ")
    idle = next(k for k in agent_ if k.startswith("agent idle"))
    rows += [
        ["hook events absorbed", agent_["hook events absorbed"][1], ""],
        [storm.replace("reconnect storm: ", ""),
         f"{answered[1]} hooks answered within the budget, {spooled} spooled, {lost} lost",
         "within budget: " + answered[2].split(";")[0]],
        [f"{idle} (Kubernetes on)", agent_[idle][1], agent_[idle][2].removeprefix("budget ")],
        ["import of `hostagent run`", agent_["import of `hostagent run`"][1], ""],
    ]
    return rows


def test_the_latest_benchmarks_are_bench_results() -> None:
    text = section("Benchmarks")
    table = text[text.index("| | figure | budget |"):].split("\n\n", 1)[0].splitlines()[2:]
    readme = [[c.strip() for c in line.strip().strip("|").split("|")] for line in table]
    expected = latest_table()
    assert readme == expected, "README's table, from bench/RESULTS.md:\n" + "\n".join(
        f"| {' | '.join(r)} |" for r in expected)
    measured = re.search(r"^Measured (.*?) at commit (\w+)", RESULTS.read_text(), re.M)
    assert measured, "bench/RESULTS.md names the commit it measured"
    assert f"commit {measured[2]}" in text


def capacity_tables() -> list[list[list[str]]]:
    """README's capacity tables, as bench/RESULTS.md has the model's: the goals by
    configuration, and the lent share and the unplanned wait per load."""
    t = results()
    goals = next(v for k, v in t.items() if k.startswith("capacity: goals"))
    names = goals[""][1:]
    first = ["configuration (10 % fallback)", *(row for row in goals if row)]
    by_config = [first] + [[name, *(goals[row][1 + i] for row in goals if row)]
                           for i, name in enumerate(names)]
    bands = [next(v for k, v in t.items() if k.startswith(f"capacity: {band} load"))
             for band in ("light", "medium", "saturated")]
    share, wait = "lent share: median / 10th percentile", "unplanned wait for the GPU: median / 90th"
    outside = "outside the reclaimed GPU: median / 90th (all weeks)"
    columns = bands[0][""][1:]
    loads = [["configuration", "lent share, light / medium / saturated (median / 10th)",
              "wait for the GPU, light / medium / saturated (median / 90th)",
              "jobs killed outside the reclaimed GPU, 60 weeks"]]
    for i, name in enumerate(columns):
        killed = 0
        for b in bands:
            found = re.search(r"\((\d+)\)", b[outside][1 + i])
            assert found, b[outside]
            killed += int(found[1])
        loads.append([name, "; ".join(b[share][1 + i] for b in bands),
                      "; ".join(b[wait][1 + i] for b in bands), str(killed)])
    return [by_config, loads]


def markdown_table(rows: list[list[str]]) -> str:
    return "\n".join([f"| {' | '.join(rows[0])} |", "|---" * len(rows[0]) + "|",
                      *(f"| {' | '.join(r)} |" for r in rows[1:])])


def test_the_capacity_tables_are_bench_results() -> None:
    text = section("Benchmarks")
    for table in capacity_tables():
        assert markdown_table(table) in text, (
            "README's capacity table, from bench/RESULTS.md:\n" + markdown_table(table))


def test_the_timeline_is_a_partial_swap() -> None:
    """README's docs/timeline.svg, `make demo`'s two lendees: gpu-node keeps gpu-b while
    gaming1 plays on gpu-a, and holds both before and after; gpu-node-b holds gpu-c
    throughout, never letting it go."""
    import xml.etree.ElementTree as ET

    ns = "{http://www.w3.org/2000/svg}"
    root = ET.parse(README.parent / "docs" / "timeline.svg").getroot()
    rows = {g.get("data-gpu"): [(float(r.get("x", 0)), float(r.get("x", 0)) + float(r.get("width", 0)),
                                 r.get("data-holder"))
                                for r in g.findall(f"{ns}rect[@class='segment']")]
            for g in root.iter(f"{ns}g") if g.get("class") == "row"}
    assert set(rows) == {"gpu-a", "gpu-b", "gpu-c"}
    games = [(a, b) for a, b, who in rows["gpu-a"] if who == "gaming1"]
    assert len(games) == 1
    middle = sum(games[0]) / 2
    assert any(a <= middle <= b and who == "gpu-node" for a, b, who in rows["gpu-b"])
    lent_a = [(a, b) for a, b, who in rows["gpu-a"] if who == "gpu-node"]
    assert lent_a[0][1] <= games[0][0] and lent_a[-1][0] >= games[0][1]
    assert [who for _, _, who in rows["gpu-c"]] == ["gpu-node-b"]
    (a, b, _), = rows["gpu-c"]
    assert a <= games[0][0] and b >= lent_a[-1][1] - 1  # from before the game to the end


def test_every_python_command_names_the_interpreter_that_has_the_project() -> None:
    """A Debian 12 machine has no `python` on PATH, and the system `python3` lacks the
    project's packages: README's commands run the venv's interpreter."""
    text = " ".join(README.read_text().split())
    bare = re.findall(r"(?<![\w/.])python3? -m [\w.]+", text)
    assert not bare, f"README runs {bare} with an interpreter that lacks the project"


def test_the_shutdown_timeout_is_said_to_be_per_guest_unless_parallel() -> None:
    shutdown = section("Host boot and shutdown")
    nix = block("Host boot and shutdown", "nix", "shutdownTimeout")
    assert "parallelShutdown" in nix and "for all guests" not in nix
    said = " ".join(shutdown.split())
    assert "applies the timeout to each guest in turn" in said
    assert "PARALLEL_SHUTDOWN=" in said


def test_the_switches_are_said_to_be_those_of_mqtt_vms() -> None:
    """A switch exists only for an owner MQTT may command (homeassistant.components):
    README said one per owner."""
    said = " ".join(section("Home Assistant over MQTT").split())
    assert "a switch per owner VM that `vms` lists" in said
    assert "binary sensor \"running\" instead" in said
    from hostagent.surfaces import homeassistant
    cfg = config.parse(textwrap.dedent('''
        [lendee]
        domain = "gpu-node"
        gpus = ["0000:01:00.0", "0000:02:00.0"]
        [owners.gaming1]
        gpus = ["0000:01:00.0"]
        [owners.gaming2]
        gpus = ["0000:02:00.0"]
        [mqtt]
        broker = "mqtt://127.0.0.1"
        vms = ["gaming1"]
        '''))
    platforms = {c["name"]: c["p"] for c in homeassistant.components(
        homeassistant.surface(cfg, version="0", host="tower")).values()}
    assert (platforms["gaming1"], platforms["gaming2"]) == ("switch", "binary_sensor")


def test_the_permissions_are_the_shipped_rbac() -> None:
    """README named a kubeconfig of "a user that may cordon the node and evict its pods"
    and listed no manifest; the shipped one is applied as written."""
    said = " ".join(README.read_text().split())
    assert "kubectl apply -f deploy/rbac.yaml" in said
    assert "may cordon the node and evict its pods" not in said
    assert (README.parent / "deploy" / "rbac.yaml").exists()


def test_the_opening_says_what_the_default_regrow_does() -> None:
    """README's first paragraph says how the lendee takes a freed GPU back by default:
    live where it can hot-plug (hotplug "auto"), else once no pod on the node uses a GPU,
    with no bound (regrow_max_wait unset) that would kill the jobs left."""
    opening = " ".join(README.read_text().split("\n\n")[1].split())
    policy = config.parse('[lendee]\ndomain = "d"\ngpus = ["0000:01:00.0"]\n').policy
    assert policy.regrow.value == "when-idle" and policy.regrow_max_wait is None
    assert policy.hotplug.value == "auto"
    assert ("live where it can hot-plug, elsewhere by default once no pod on the node uses "
            "a GPU, however long that takes") in opening


def test_the_dashboard_card_names_what_a_real_discovery_creates() -> None:
    """README's card had ids no Home Assistant made; they are those that a real one
    (2025.4) creates from the device's discovery in tests/integration, which make test
    runs."""
    from tests.unit.homeassistant_scaffold import ENTITIES
    card = block("Home Assistant over MQTT", "yaml", "type: entities")
    named = re.findall(r"entity: (\S+)", card)
    assert named and set(named) <= ENTITIES, sorted(set(named) - ENTITIES)


def test_every_share_readme_quotes_is_a_bench_result() -> None:
    """Each percentage README gives with decimals is a figure of bench/RESULTS.md, as
    written there (README said 99.6 % where the benchmark measured 99.64 %)."""
    quoted = set(re.findall(r"(\d+\.\d+) ?%", README.read_text()))
    measured = set(re.findall(r"(\d+\.\d+) ?%", RESULTS.read_text()))
    assert quoted and quoted <= measured, sorted(quoted - measured)


def test_the_figures_measure_the_code_of_head() -> None:
    """bench/RESULTS.md names the commit it measured: hostagent/, hooks/ and bench/ are the
    same there as at HEAD (RESULTS.md itself aside), so that the figures are measured
    again when the code they measure changes. It named a commit eleven behind."""
    if shutil.which("git") is None or not (README.parent / ".git").exists():
        pytest.skip("not a git checkout: the commit bench/RESULTS.md names cannot be compared")
    measured = re.search(r"^Measured .*? at commit ([0-9a-f]+)(-dirty)?", RESULTS.read_text(),
                         re.M)
    assert measured, "bench/RESULTS.md names the commit it measured"
    assert not measured[2], "bench/RESULTS.md was measured on a tree with uncommitted changes"
    changed = subprocess.run(
        ["git", "-C", str(README.parent), "diff", "--name-only", measured[1], "HEAD", "--",
         "hostagent", "hooks", "bench", ":(exclude)bench/RESULTS.md"],
        capture_output=True, text=True, check=True).stdout.split()
    assert changed == [], (f"changed since {measured[1]}, which bench/RESULTS.md measured: "
                           f"{changed}: run make bench again")
