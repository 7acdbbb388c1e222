"""Every command README shows is either run by a test or listed here with why it cannot
run on this machine.

A command is each line of README's shell blocks (```sh, a bare block's `$ ` lines, Home
Assistant's `shell_command`s), continuations joined and comments dropped, and each inline
code span that begins with a program a reader runs and has an argument. `RUN` maps a
pattern of commands to the test that runs them and a string that test's source must hold
(what it runs); `NOT_RUN` gives the reason for the rest. A command README gains that no
entry covers fails here, as does an entry that no command of README matches any more.
The commands that need no guest (the help pages, `pydoc`) run here.
"""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path


import hostagent
from hostagent.surfaces import ssh
from tests.packaging.readme import README, block, section
from tests.packaging.readme import (
    commands,
)

REPO = README.parent
VENV = REPO / ".venv"

README_LAB = "tests/lab/test_readme_lab.py::test_the_first_real_swap_and_its_undo_as_readme_says"
COMMANDS_LAB = "tests/lab/test_readme_commands_lab.py"
HOLD = f"{COMMANDS_LAB}::test_hold_reclaim_and_lend_as_readme_says"
HERE = "tests/packaging/test_readme_commands.py"

# pattern (a whole command) -> the test that runs it, and what its source must hold.
RUN: list[tuple[str, str, str]] = [
    (r"hostagent (COMMAND )?--help", f"{HERE}::test_each_help_page_is_the_programs",
     '"--help"'),
    (r"hostagent --version", f"{HERE}::test_the_version_is_the_installed_programs",
     '"--version"'),
    (r"hostagent run", README_LAB, "lab.start_agent()"),
    (r"hostagent status", README_LAB, '"status"'),
    (r"hostagent play( VM| gaming1)?", README_LAB, '"play", "gaming1"'),
    (r"hostagent release (VM|gaming1)", README_LAB, '"release", "gaming1"'),
    (r"hostagent (hold|resume|lend|reclaim)", HOLD, '"reclaim"'),
    (r"hostagent reserve (VM|gaming1 --at 20:00|gaming1 --cancel)", HOLD, '"--cancel"'),
    (r"hostagent reserve gaming1 (--at 20:00 --every weekdays|--cancel --all)",
     "tests/unit/cli/test_cli.py::test_reserve_takes_a_series_and_cancels_one_or_all",
     '"--every", "weekdays"'),
    (r"hostagent check-config", README_LAB, '"check-config"'),
    (r"hostagent lint( \[DOMAIN \.\.\.\]| \[VM…\])?", README_LAB, '"lint"'),
    (r"hostagent gpus( \[--json\])?",
     "tests/lab/test_whole_cards_lab.py::test_a_card_leaves_the_lendee_with_every_function",
     '"gpus", "--json"'),
    (r"hostagent config init( \[--lendee VM\] \[--output PATH\] \[--force\])?",
     "tests/lab/test_verify_lab.py::test_config_init_and_lint_on_lab_domains_with_hostdevs",
     '"init"'),
    (r"hostagent history",
     "tests/lab/test_observability_lab.py::test_metrics_health_and_history_follow_a_cycle",
     '"history"'),
    (r"hostagent unmark-node", README_LAB, '"unmark-node"'),
    (r"virsh start( gaming1)?",
     "tests/lab/test_agent.py::test_full_cycle_gaming1_plays_while_gpu_node_keeps_the_rest",
     'lab.ask("gaming1")'),
    (r"virsh start gaming-win",
     "tests/lab/test_agent.py::test_gaming2_mid_game_leaves_gpu_c_and_a_second_owner_is_refused",
     'lab.ask("gaming-win")'),
    (r"virsh autostart --disable VM", HOLD, "virsh autostart --disable VM"),
    (r"journalctl -u hostagent -f", HOLD, '"journalctl -u hostagent -f"'),
    (r"journalctl -u hostagent HOSTAGENT_VM=gaming1", HOLD, "HOSTAGENT_VM=gaming1"),
    (r"journalctl -u hostagent HOSTAGENT_EVENT=reserve", HOLD, "HOSTAGENT_EVENT=reserve"),
    (r"journalctl -u hostagent HOSTAGENT_EVENT=ssh", HOLD, "HOSTAGENT_EVENT=ssh"),
    (r"journalctl -u hostagent HOSTAGENT_VIA=mqtt", HOLD, "HOSTAGENT_VIA=mqtt"),
    (r"journalctl -u hostagent HOSTAGENT_EVENT=hotplug",
     "tests/lab/test_hotplug_lab.py::test_a_regrow_by_hot_add_lends_the_freed_gpu_without_a_restart",
     "HOSTAGENT_EVENT=hotplug"),
    (r"journalctl -D|\.venv/bin/python -m tests\.lab\.lab /tmp/mylab",
     f"{COMMANDS_LAB}::test_a_lab_by_hand_comes_up_and_goes_down_as_readme_says",
     '"tests.lab.lab"'),
    (r"kubectl apply -f deploy/rbac\.yaml|sed 's/@NODE@/gpu-node/g' deploy/rbac-node\.yaml "
     r"\| kubectl apply -f -", README_LAB, "apply -f"),
    (r"(k3s kubectl|token=\$\(k3s kubectl .*|ca=\$\(grep .*|cat > hostagent\.kubeconfig <<EOF)",
     README_LAB, "create token"),
    (r"kubectl --kubeconfig /etc/hostagent/kubeconfig auth can-i patch nodes/gpu-node",
     README_LAB,
     "auth can-i"),
    (r"kubectl get nodes -o wide", README_LAB, '"get", "nodes", "-o", "wide"'),
    (r"kubectl (get events|describe node gpu-node)", HOLD, '"kubectl describe node gpu-node"'),
    (r"kubectl get (resourceclaims|resourceslices -o yaml)",
     "tests/lab/test_dra_lab.py::test_a_dra_node_through_reclaim_partial_lend_and_regrow",
     '"kubectl get resourceclaims"'),
    (r"ssh -i /config/ssh/button_key .* hostagent@gaming-host\.lan (play|release) gaming1",
     "tests/lab/test_control_lab.py::test_home_automation_over_ssh_with_openssh_and_asyncssh",
     "hostagent@gaming-host.lan"),
    (r"ssh -i phone_key -p 2222 hostagent@host reserve gaming1 20:00", HOLD, "phone_key"),
    (r'ssh-keygen -t ed25519 -N "" -f /config/ssh/button_key', HOLD, "ssh-keygen"),
    (r"make (install|uninstall)",
     "tests/packaging/test_install.py::test_reinstall_keeps_the_config_then_uninstall_keeps_it_too",
     '"uninstall"'),
    (r"/opt/hostagent/bin/python -m pydoc hostagent\.surfaces\.ssh",
     f"{HERE}::test_the_pydoc_command_shows_the_module_with_the_installed_interpreter",
     "pydoc"),
    (r"chmod 600", "tests/unit/surfaces/test_mqtt.py", "chmod 600"),
]

# pattern -> why no test runs it here.
MACHINE_SYSTEMD = ("talks to the machine's own systemd, which the tests leave alone; the lab "
                   "runs its agent as systemd would (in hostagent.service's control group, "
                   "stopped by SIGTERM) and restarts its own libvirtd")
NOT_RUN: list[tuple[str, str]] = [
    (r"apt-get update && apt-get install -y make git|apt-get install --no-install-recommends "
     r"python3-venv .*", "installs Debian packages on the machine itself."),
    (r"git clone REPOSITORY-URL .*", "REPOSITORY-URL stands for wherever the reader found "
     "this repository, and this machine reaches no network."),
    (r"editor /etc/hostagent/config\.toml", "a person edits the file."),
    (r"groupadd --system hostagent", "adds a group to the machine's own user database, which the tests must "
     "leave as it was (tests/lab/test_lab.py checks)."),
    (r"systemctl (enable --now hostagent|restart libvirtd|stop hostagent|edit hostagent|"
     r"show -p Requires libvirt-guests|is-system-running)"
     r"|systemctl stop hostagent && hostagent unmark-node( --kubeconfig \S+)?",
     f"it {MACHINE_SYSTEMD}."),
    (r"systemctl restart nvidia-container-toolkit-cdi-generator\.service",
     "a value for lendee.cdi_refresh, run in a NixOS lendee's guest with NVIDIA's toolkit; "
     "tests/lab/test_hotplug_lab.py runs the lab's nvidia-ctk cdi generate there instead."),
    (r"rm -rf /etc/hostagent /var/lib/hostagent", "removes the machine's own /etc/hostagent "
     "and /var/lib/hostagent."),
    (r"nixos-rebuild switch", "switches the machine's own NixOS system; this is Debian."),
    (r"nix flake check", "fetches nixpkgs, and this machine reaches no network; "
     "tests/packaging/test_nix.py evaluates what it checks."),
    (r"helm install (gpu-operator|nvidia-dra-driver-gpu) .*", "installs NVIDIA's charts into a real cluster with a container "
     "runtime and GPUs; the lab's cluster has neither."),
    (r"make test", "it is the whole suite, these tests among them."),
    (r"make setup", "make test runs it before every run of the suite."),
    (r"make explore", "its draws are random and many, so it runs for long and differs every "
     "run; make test runs the same property tests with fixed draws."),
    (r"make fuzz", "runs each parser's fuzzer for 50,000 examples, many minutes; make test "
     "runs the same fuzzers with fewer examples."),
    (r"make mutate", "it reruns the unit tests of core/ and host/ for each of thousands of "
     "mutants, hours on 2 cores; make test runs those unit tests once."),
    (r"virsh destroy", "it names the power-off `drain.stop = \"power-off\"` makes, not a "
     "step to take; test_kube_lab.py::test_reclaim_drains_like_kubectl_and_the_return_"
     "uncordons reclaims so."),
    (r"virsh undefine", "it names what a reader may have done to an old VM, not a step "
     "to take; tests/unit/service/test_stale_entries.py checks what follows an owner "
     "libvirt no longer has."),
    (r"make bench", "runs for many minutes and rewrites bench/RESULTS.md; "
     "test_readme.py::test_the_figures_measure_the_code_of_head checks it measured HEAD."),
    (r"make demo|\.venv/bin/python -m tests\.lab\.demo --svg docs/timeline\.svg",
     "a swap and a regrow with the control plane, two lendees, minutes of guests the "
     "suite spends in test_readme_lab.py, test_observability_lab.py (history --svg) and "
     "test_lendees_lab.py (the other node's pods) already; "
     "test_readme.py::test_the_timeline_is_a_partial_swap checks the drawing it made."),
]


def _entries() -> list[tuple[str, str]]:
    return [(p, f"runs in {t}") for p, t, _ in RUN] + [(p, f"not run: {r}") for p, r in NOT_RUN]


def test_readme_commands_are_found() -> None:
    """The extraction itself: continuations joined, comments and heredocs dropped, a bare
    block's prompts read, Home Assistant's shell commands found."""
    found = commands()
    assert "make install" in found and "hostagent lint" in found
    assert any(c.startswith("apt-get install --no-install-recommends python3-venv")
               and c.endswith("libvirt-dev libsystemd-dev") for c in found)
    assert "virsh start gaming1" in found
    assert not [c for c in found if c.startswith(("apiVersion", "EOF", "#"))]
    assert sum("hostagent@gaming-host.lan" in c for c in found) == 2


def test_every_readme_command_is_run_or_said_why_not() -> None:
    wrong = {}
    for command in commands():
        covering = [what for pattern, what in _entries() if re.fullmatch(pattern, command)]
        if len(covering) != 1:
            wrong[command] = covering
    assert not wrong, ("each README command needs exactly one entry in RUN or NOT_RUN: "
                       f"{wrong}")


def test_every_entry_matches_a_readme_command() -> None:
    stale = [pattern for pattern, _ in _entries()
             if not any(re.fullmatch(pattern, c) for c in commands())]
    assert not stale, f"no README command matches {stale} any more"


def _source(test: str) -> str:
    path, _, name = test.partition("::")
    text = (REPO / path).read_text()
    if not name:
        return text
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return ast.get_source_segment(text, node) or ""
    raise AssertionError(f"{test}: no such test")


def test_each_command_run_names_a_test_that_runs_it() -> None:
    for pattern, test, evidence in RUN:
        assert evidence in _source(test), f"{test} does not run {pattern!r} ({evidence!r})"


def test_each_reason_is_a_plain_sentence() -> None:
    for pattern, reason in NOT_RUN:
        assert reason.endswith(".") and ". " not in reason and "\n" not in reason, pattern


# --- the commands that need no guest ---------------------------------------------------


def test_each_help_page_is_the_programs() -> None:
    """`hostagent --help` and `hostagent COMMAND --help`, the installed program: each
    exits 0; the main page lists every command of README's table and every exit status."""
    program = str(VENV / "bin" / "hostagent")
    top = subprocess.run([program, "--help"], capture_output=True, text=True, timeout=60,
                         check=False)
    assert top.returncode == 0, top.stderr
    said = " ".join(top.stdout.split())
    table = re.findall(r"^\| `hostagent ([\w-]+)[^`]*` \|", README.read_text(), re.M)
    assert len(table) >= 15
    statuses = re.findall(r"^\| (\d+) \| (.+) \|$", README.read_text(), re.M)
    for status, _ in statuses:
        assert re.search(rf"\b{status}\b", said), f"--help does not list exit status {status}"
    for name in dict.fromkeys(table):
        assert name in said, f"--help does not list {name}"
        page = subprocess.run([program, name, "--help"], capture_output=True, text=True,
                              timeout=60, check=False)
        assert page.returncode == 0 and page.stdout.startswith(f"usage: hostagent {name}"), (
            name, page.stdout[:200], page.stderr)


def test_the_version_is_the_installed_programs() -> None:
    """`hostagent --version`, the installed program: the package's version, as the start
    record and `hostagent status` say it."""
    out = subprocess.run([str(VENV / "bin" / "hostagent"), "--version"], capture_output=True,
                         text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout == f"hostagent {hostagent.version()}\n", out.stdout


def test_the_pydoc_command_shows_the_module_with_the_installed_interpreter() -> None:
    """README's `pydoc` line, with `make install`'s venv where it names /opt/hostagent
    (the repository's venv is the same kind: the project installed in a venv) and the
    machine's PATH otherwise: the system's pydoc cannot import hostagent."""
    [line] = [c for c in commands() if "pydoc" in c]
    out = subprocess.run(["sh", "-c", line.replace("/opt/hostagent/", f"{VENV}/")],
                         capture_output=True, text=True, timeout=60, check=False,
                         env={"PATH": "/usr/local/bin:/usr/bin:/bin", "PAGER": "cat",
                              "TERM": "dumb"}, cwd="/")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "hostagent.surfaces.ssh" in out.stdout and "Security model" in out.stdout, out.stdout[:500]


def test_the_ssh_commands_readme_shows_are_the_grammar_it_states() -> None:
    """Each command README sends over SSH is one the endpoint takes, and the sentence
    on what it takes allows them all (`reserve gaming1 20:00` has three words)."""
    verbs = frozenset({"play", "release", "reserve", "status"})
    for command in commands():
        at = re.search(r" hostagent@\S+ (.+)$", command)
        if command.startswith("ssh ") and at:
            ssh.parse_command(at[1], verbs)
    said = " ".join(section("Home automation: `hostagent play` and the SSH endpoint").split())
    grammar = re.search(r"at most 256 printable ASCII characters, ([^:;.]+)", said)
    assert grammar, "README says what a command over SSH may be"
    assert "reserve" in grammar[1] and "time" in grammar[1], grammar[1]


def test_check_config_reads_the_debian_example_with_config_before_or_after(
        tmp_path: Path) -> None:
    """`hostagent check-config` on README's Debian example, `--config FILE` before and
    after the command ("goes before or after the command"), and on the example with the
    misspelling README's NixOS section quotes: its message as README prints it, exit 2."""
    program = str(VENV / "bin" / "hostagent")
    example = tmp_path / "config.toml"
    example.write_text(block("Installing on Debian", "toml"))
    said = set()
    for argv in ([program, "--config", str(example), "check-config"],
                 [program, "check-config", "--config", str(example)]):
        out = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
        assert out.returncode == 0, out.stdout + out.stderr
        said.add(out.stdout)
    assert said == {f"{example}: OK (2 GPUs, 2 owners, lendee gpu-node)\n"}, said
    quoted = re.search(r"\(`(policy\.relend_dealy: [^`]+)`\)", section("Installing on NixOS"))
    assert quoted, "README quotes check-config's message for a misspelled key"
    example.write_text(example.read_text().replace("relend_delay", "relend_dealy"))
    out = subprocess.run([program, "--config", str(example), "check-config"],
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 2, out.stdout + out.stderr
    assert quoted[1] in out.stdout + out.stderr, out.stdout + out.stderr
