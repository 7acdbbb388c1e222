"""Configuration: every accepted shape, and a message that names the key for each mistake."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from hostagent.core import config
from hostagent.core.config import ConfigError, DrainTimeoutAction, parse, parse_duration

MINIMAL = """
[lendee]
domain = "gpu-node"
gpus = ["gpu-a"]

[gpus.gpu-a]
pci = "0000:01:00.0"
"""

TWO_OWNERS = """
[lendee]
domain = "gpu-node"
gpus = ["gpu-a", "gpu-b", "gpu-c"]

[gpus.gpu-a]
pci = "0000:01:00.0"
functions = ["0000:01:00.1"]

[gpus.gpu-b]
pci = "0000:02:00.0"
functions = ["0000:02:00.1"]

[gpus.gpu-c]
pci = "0000:03:00.0"

[owners.gaming1]
gpus = ["gpu-a"]

[owners.gaming2]
gpus = ["gpu-b"]
"""


def error(text: str) -> str:
    with pytest.raises(ConfigError) as info:
        parse(textwrap.dedent(text), "test.toml")
    return str(info.value)


# --- what is accepted ----------------------------------------------------------------


def test_docstring_example_parses() -> None:
    assert config.__doc__ is not None
    example = config.__doc__.split("::\n", 1)[1].split("\nRules", 1)[0]
    cfg = parse(textwrap.dedent(example), "example")
    assert cfg.lendee.gpus == ("gpu-a", "gpu-b", "gpu-c")
    assert cfg.gpus["gpu-a"].name == "RTX 3050"
    assert cfg.kubernetes is not None
    assert cfg.kubernetes.kubeconfig == Path("/etc/rancher/k3s/k3s.yaml")


def test_minimal_gets_defaults() -> None:
    cfg = parse(MINIMAL, "test.toml")
    assert cfg.source == "test.toml"
    assert cfg.libvirt_uri == "qemu:///system"
    assert cfg.hook_socket == Path("/run/hostagent/hook.sock")
    assert cfg.control_socket == Path("/run/hostagent/control.sock")
    assert cfg.state_file == Path("/var/lib/hostagent/state.toml")
    assert cfg.spool_dir == Path("/var/lib/hostagent/spool")
    assert cfg.lendee.node == "gpu-node"
    assert cfg.owners == {}
    assert cfg.timeouts == config.Timeouts()
    assert cfg.timeouts.guest_agent == 180.0
    assert cfg.policy.relend_delay == 30.0
    assert cfg.policy.force_off_after is None
    assert cfg.policy.on_drain_timeout is DrainTimeoutAction.PROCEED
    # No [kubernetes] section: VM-only.
    assert cfg.kubernetes is None
    kube = parse(MINIMAL + "[kubernetes]\n").kubernetes
    assert kube is not None
    assert kube.kubeconfig is None
    assert kube.annotation_prefix == "hostagent.io/"
    assert kube.gpu_resource == "nvidia.com/gpu"
    assert kube.drain_emptydir is True
    assert kube.drain_unmanaged is False


def test_every_key_set() -> None:
    cfg = parse(
        """
        libvirt_uri = "qemu:///system?socket=/tmp/lab/libvirt-sock"
        hook_socket = "/tmp/lab/hook.sock"
        control_socket = "/tmp/lab/control.sock"
        state_dir = "/tmp/lab/state"

        [lendee]
        domain = "worker"
        node = "k8s-worker"
        gpus = ["gpu-a"]

        [gpus.gpu-a]
        pci = "0000:01:00.0"
        uuid = "GPU-1234"
        name = "RTX 3050"

        [timeouts]
        guest_agent = "90s"
        shutdown = "1m30s"
        start = "500ms"
        drain = "1.5m"
        ready = "1h"

        [policy]
        relend_delay = "0s"
        force_off_after = "5m"
        on_drain_timeout = "abort"

        [kubernetes]
        kubeconfig = "/etc/rancher/k3s/k3s.yaml"
        annotation_prefix = "example.org/"
        gpu_resource = "example.org/gpu"
        drain_emptydir = false
        drain_unmanaged = true
        """
    )
    assert cfg.libvirt_uri.endswith("libvirt-sock")
    assert cfg.state_file == Path("/tmp/lab/state/state.toml")
    assert cfg.lendee == config.Lendee(domain="worker", node="k8s-worker", gpus=("gpu-a",))
    assert cfg.gpus["gpu-a"] == config.Gpu(
        label="gpu-a", pci="0000:01:00.0", uuid="GPU-1234", name="RTX 3050"
    )
    assert cfg.timeouts == config.Timeouts(
        guest_agent=90.0, shutdown=90.0, start=0.5, drain=90.0, ready=3600.0
    )
    assert cfg.policy == config.Policy(
        relend_delay=0.0, force_off_after=300.0, on_drain_timeout=DrainTimeoutAction.ABORT
    )
    assert cfg.kubernetes == config.Kubernetes(
        kubeconfig=Path("/etc/rancher/k3s/k3s.yaml"),
        annotation_prefix="example.org/",
        gpu_resource="example.org/gpu",
        drain_emptydir=False,
        drain_unmanaged=True,
    )


def test_empty_strings_mean_unset() -> None:
    cfg = parse(MINIMAL + '[policy]\nforce_off_after = ""\n[kubernetes]\nkubeconfig = ""\n')
    assert cfg.policy.force_off_after is None
    assert cfg.kubernetes is not None
    assert cfg.kubernetes.kubeconfig is None


def test_helpers() -> None:
    cfg = parse(TWO_OWNERS)
    assert cfg.owners_of("gpu-a") == ("gaming1",)
    assert cfg.owners_of("gpu-b") == ("gaming2",)
    assert cfg.owners_of("gpu-c") == ()  # only the lendee uses it
    assert cfg.gpus_of("gpu-node") == ("gpu-a", "gpu-b", "gpu-c")
    assert cfg.gpus_of("gaming2") == ("gpu-b",)
    assert cfg.gpus_of("some-other-vm") == ()
    assert cfg.shared_gpus("gaming1") == {"gpu-a"}
    assert cfg.shared_gpus("some-other-vm") == frozenset()
    assert cfg.gpus["gpu-a"].pci_functions == ("0000:01:00.0", "0000:01:00.1")


def test_owner_keeps_a_gpu_the_lendee_does_not_borrow() -> None:
    cfg = parse(TWO_OWNERS.replace('gpus = ["gpu-a", "gpu-b", "gpu-c"]', 'gpus = ["gpu-c"]'))
    assert cfg.shared_gpus("gaming1") == frozenset()
    assert cfg.owners_of("gpu-a") == ("gaming1",)


def test_owners_may_share_a_gpu() -> None:
    # A Windows and a Linux gaming VM on one card: they take turns.
    cfg = parse(TWO_OWNERS + '[owners.gaming-win]\ngpus = ["gpu-c", "gpu-a"]\n')
    assert cfg.owners_of("gpu-a") == ("gaming1", "gaming-win")
    assert cfg.owners_of("gpu-c") == ("gaming-win",)
    assert cfg.shared_gpus("gaming-win") == {"gpu-a", "gpu-c"}


def test_lendee_min_gpus_and_the_partial_lending_policy() -> None:
    cfg = parse(TWO_OWNERS)
    assert cfg.lendee.min_gpus == 1
    assert cfg.policy.partial is True
    assert cfg.policy.regrow is config.Regrow.WHEN_IDLE
    cfg = parse(TWO_OWNERS.replace('gpus = ["gpu-a", "gpu-b", "gpu-c"]',
                                   'gpus = ["gpu-a", "gpu-b", "gpu-c"]\nmin_gpus = 3')
                + '[policy]\npartial = false\nregrow = "never"\n')
    assert cfg.lendee.min_gpus == 3
    assert cfg.policy.partial is False
    assert cfg.policy.regrow is config.Regrow.NEVER
    assert parse(MINIMAL + '[policy]\nregrow = "always"\n').policy.regrow == "always"


def test_gpu_references_by_pci_address() -> None:
    cfg = parse(
        """
        [lendee]
        domain = "gpu-node"
        gpus = ["01:00.0", "0000:0A:00.0"]

        [gpus.gpu-a]
        pci = "0000:01:00.0"
        functions = ["0000:01:00.1"]

        [owners.gaming1]
        gpus = ["0000:01:00.0"]

        [owners.gaming2]
        gpus = ["0000:0a:00.0"]
        """
    )
    # A declared GPU's address means that GPU; another address is a one-function GPU.
    assert cfg.lendee.gpus == ("gpu-a", "0000:0a:00.0")
    assert cfg.gpus["0000:0a:00.0"] == config.Gpu(label="0000:0a:00.0", pci="0000:0a:00.0")
    assert cfg.shared_gpus("gaming1") == {"gpu-a"}
    assert cfg.shared_gpus("gaming2") == {"0000:0a:00.0"}


def test_pci_addresses_are_canonical() -> None:
    cfg = parse(MINIMAL.replace("0000:01:00.0", "0A:1f.7"))
    assert cfg.gpus["gpu-a"].pci == "0000:0a:1f.7"


def test_unreferenced_gpu_is_allowed() -> None:
    cfg = parse(MINIMAL + '[gpus.spare]\npci = "0000:05:00.0"\n')
    assert "spare" in cfg.gpus


def test_quoted_names() -> None:
    cfg = parse(MINIMAL + '[owners."win 11"]\ngpus = ["gpu-a"]\n')
    assert cfg.owners_of("gpu-a") == ("win 11",)


def test_config_is_frozen() -> None:
    cfg = parse(MINIMAL)
    with pytest.raises(AttributeError):
        cfg.libvirt_uri = "x"  # type: ignore[misc]


# --- durations -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("500ms", 0.5), ("90s", 90), ("2m", 120), ("1h", 3600), ("1h30m", 5400), ("0s", 0),
     ("1.5s", 1.5), (" 3m ", 180), ("1m500ms", 60.5)],
)  # fmt: skip
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "90", "1.5", "s", "90 s", "90sec", "-5s", "1d", "2M", "m5"])
def test_parse_duration_refuses(text: str) -> None:
    with pytest.raises(ValueError, match='write "|e.g.'):
        parse_duration(text)


def test_bare_number_suggests_the_unit() -> None:
    with pytest.raises(ValueError, match='write "90s"'):
        parse_duration("90")


# --- every mistake names the file, the key and the fix ---------------------------------


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        config.load(tmp_path / "config.toml")
    message = str(info.value)
    assert str(tmp_path / "config.toml") in message
    assert "hostagent config init" in message


def test_load_reads_the_file(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    path.write_text(MINIMAL)
    assert config.load(path).source == str(path)


def test_load_refuses_non_utf8(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    path.write_bytes(MINIMAL.encode() + b"# caf\xe9\n")
    with pytest.raises(ConfigError, match="UTF-8"):
        config.load(path)


def test_load_unreadable(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        config.load(tmp_path)  # a directory


def test_toml_syntax_error_has_line_and_column() -> None:
    with pytest.raises(ConfigError) as info:
        parse("[lendee]\ndomain = gpu-node\n", "test.toml")
    e = info.value
    assert (e.line, e.column) == (2, 10)
    assert str(e).startswith("test.toml:2:10: not valid TOML")
    assert '"domain = gpu-node"' in str(e)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (  # a typo, and the key it probably meant
            MINIMAL + '[timeouts]\nguest_agnet = "3m"\n',
            'test.toml: timeouts.guest_agnet: unknown key; did you mean "guest_agent"?',
        ),
        (
            MINIMAL + "[timeout]\n",
            'test.toml: timeout: unknown key; did you mean "timeouts"?',
        ),
        (  # nothing close: list what is known
            MINIMAL + "[policy]\nzzz = 1\n",
            (
                "test.toml: policy.zzz: unknown key; known keys here: relend_delay, force_off_after,"
                " on_drain_timeout"
            ),
        ),
        (  # a top-level key written after a section header lands in that section
            MINIMAL + 'state_dir = "/var/lib/x"\n',
            (
                "test.toml: gpus.gpu-a.state_dir: unknown key; state_dir is a top-level key:"
                " move it above the first [section]"
            ),
        ),
        (
            MINIMAL + '[timeouts]\ndrain = "90"\n',
            'test.toml: timeouts.drain: "90" has no unit; write "90s" for seconds',
        ),
        (
            MINIMAL + "[timeouts]\ndrain = 90\n",
            'test.toml: timeouts.drain: expected a duration string, got an integer; write "90s"',
        ),
        (
            MINIMAL + '[timeouts]\ndrain = "soon"\n',
            'test.toml: timeouts.drain: "soon" is not a duration; write a number with a unit',
        ),
        (
            MINIMAL + '[timeouts]\nready = "0s"\n',
            "test.toml: timeouts.ready: must be longer than zero",
        ),
        (
            MINIMAL + "[kubernetes]\ndrain_emptydir = 'yes'\n",
            "test.toml: kubernetes.drain_emptydir: expected true or false, got a string",
        ),
        (
            MINIMAL + '[kubernetes]\nannotation_prefix = "hostagent.io"\n',
            (
                'test.toml: kubernetes.annotation_prefix: "hostagent.io" does not end with "/";'
                ' write "hostagent.io/"'
            ),
        ),
        (
            MINIMAL + '[policy]\non_drain_timeout = "wait"\n',
            (
                'test.toml: policy.on_drain_timeout: "wait" is not allowed;'
                " write one of: proceed, abort"
            ),
        ),
        (
            'state_dir = "var/lib/hostagent"\n' + MINIMAL,
            'test.toml: state_dir: "var/lib/hostagent" is a relative path',
        ),
        (
            "libvirt_uri = 1\n" + MINIMAL,
            "test.toml: libvirt_uri: expected a string, got an integer",
        ),
        (
            'libvirt_uri = ""\n' + MINIMAL,
            "test.toml: libvirt_uri: is empty",
        ),
        (
            'libvirt_uri = "qemu:///system"\n',
            'test.toml: lendee: missing; add [lendee] with domain = "gpu-node"',
        ),
        (
            '[lendee]\ngpus = ["gpu-a"]\n',
            'test.toml: lendee.domain: missing; add domain = "gpu-node" under [lendee]',
        ),
        (
            '[lendee]\ndomain = "gpu-node"\ngpus = []\n',
            "test.toml: lendee.gpus: is empty; list GPU labels from [gpus] or PCI addresses",
        ),
        (
            '[lendee]\ndomain = "gpu-node"\ngpus = "gpu-a"\n',
            'test.toml: lendee.gpus: expected an array, got a string; write it in brackets: ["gpu-a"]',
        ),
        (
            MINIMAL.replace('["gpu-a"]', '["gpu-a", 2]'),
            "test.toml: lendee.gpus[1]: expected a string, got an integer",
        ),
        (
            MINIMAL.replace('["gpu-a"]', '["gpu-a", "gpu-a"]'),
            'test.toml: lendee.gpus[1]: "gpu-a" is listed twice; remove one',
        ),
        (  # the same GPU by label and by address
            MINIMAL.replace('["gpu-a"]', '["gpu-a", "01:00.0"]'),
            "test.toml: lendee.gpus[1]: GPU gpu-a is already listed at lendee.gpus[0]",
        ),
        (
            MINIMAL.replace("0000:01:00.0", "0000:01:00"),
            (
                'test.toml: gpus.gpu-a.pci: "0000:01:00" is not a PCI address;'
                ' write it as domain:bus:device.function, e.g. "0000:01:00.0"'
            ),
        ),
        (
            MINIMAL + 'functions = ["0000:01:00.1", "01:20.1"]\n',
            'test.toml: gpus.gpu-a.functions[1]: "01:20.1" is not a PCI address',
        ),
        (
            MINIMAL.replace('pci = "0000:01:00.0"', ""),
            'test.toml: gpus.gpu-a.pci: missing; add pci = "0000:01:00.0" under [gpus.gpu-a]',
        ),
        (
            MINIMAL + 'uuid = ""\n',
            "test.toml: gpus.gpu-a.uuid: is empty",
        ),
        (
            '[lendee]\ndomain = "gpu-node"\ngpus = ["gpu-a"]\n[gpus]\ngpu-a = "0000:01:00.0"\n',
            (
                "test.toml: gpus.gpu-a: expected a table, got a string;"
                " write it as a [gpus.gpu-a] section"
            ),
        ),
        (
            MINIMAL + '[gpus.gpu-b]\npci = "0000:02:00.0"\nfunctions = ["0000:01:00.0"]\n',
            (
                "test.toml: gpus.gpu-b.functions[0]: 0000:01:00.0 is already a function of GPU gpu-a"
                " (gpus.gpu-a.pci); a PCI function belongs to one GPU"
            ),
        ),
        (
            MINIMAL.replace('["gpu-a"]', '["gpu-a", "gpu-b"]'),
            (
                'test.toml: lendee.gpus[1]: unknown GPU "gpu-b"; define it as a [gpus.gpu-b] section'
                " or use one of: gpu-a"
            ),
        ),
        (
            TWO_OWNERS + '[owners.gaming3]\ngpus = ["gpu-c", "gpu-x"]\n',
            'test.toml: owners.gaming3.gpus[1]: unknown GPU "gpu-x"',
        ),
        (
            TWO_OWNERS + '[owners.gaming3]\ngpus = ["gpu-c", "gpu-a", "gpu-c"]\n',
            'test.toml: owners.gaming3.gpus[2]: "gpu-c" is listed twice; remove one',
        ),
        (
            MINIMAL.replace('gpus = ["gpu-a"]', 'gpus = ["gpu-a"]\nmin_gpus = 2'),
            (
                "test.toml: lendee.min_gpus: 2 is not between 1 and the 1 GPU(s) in lendee.gpus;"
                " write a number from 1 to 1 (1, the default, runs the lendee whenever a GPU is"
                " free)"
            ),
        ),
        (
            TWO_OWNERS.replace('gpus = ["gpu-a", "gpu-b", "gpu-c"]',
                               'gpus = ["gpu-a", "gpu-b", "gpu-c"]\nmin_gpus = 0'),
            "test.toml: lendee.min_gpus: 0 is not between 1 and the 3 GPU(s) in lendee.gpus;"
            " write a number from 1 to 3",
        ),
        (
            MINIMAL.replace('gpus = ["gpu-a"]', 'gpus = ["gpu-a"]\nmin_gpus = "1"'),
            "test.toml: lendee.min_gpus: expected an integer, got a string; write a whole number"
            " without quotes",
        ),
        (
            MINIMAL.replace('gpus = ["gpu-a"]', 'gpus = ["gpu-a"]\nmin_gpus = true'),
            "test.toml: lendee.min_gpus: expected an integer, got a boolean",
        ),
        (
            MINIMAL + '[policy]\nregrow = "idle"\n',
            'test.toml: policy.regrow: "idle" is not allowed; write one of: when-idle, always,'
            " never",
        ),
        (
            MINIMAL + '[policy]\npartial = "yes"\n',
            "test.toml: policy.partial: expected true or false, got a string",
        ),
        (
            TWO_OWNERS + '[owners.gpu-node]\ngpus = ["gpu-c"]\n',
            (
                "test.toml: owners.gpu-node: gpu-node is the lendee, and the lendee cannot also own"
                " GPUs; remove [owners.gpu-node]"
            ),
        ),
        (
            TWO_OWNERS + "[owners.gaming3]\ngpus = []\n",
            "test.toml: owners.gaming3.gpus: is empty",
        ),
        (
            TWO_OWNERS + "[owners.gaming3]\n",
            'test.toml: owners.gaming3.gpus: missing; add gpus = ["gpu-a"] under [owners.gaming3]',
        ),
        (
            TWO_OWNERS.replace(
                '[owners.gaming1]\ngpus = ["gpu-a"]', '[owners.gaming1]\ngpus = ["01:00.1"]'
            ),
            (
                "test.toml: owners.gaming1.gpus[0]: 0000:01:00.1 is not a GPU but another function of"
                ' GPU gpu-a; list "gpu-a" instead'
            ),
        ),
        (
            MINIMAL + '[owners."a b"]\ngpus = ["gpu-a"]\nnode = "x"\n',
            'test.toml: owners."a b".node: unknown key',
        ),
    ],
)
def test_mistakes(text: str, expected: str) -> None:
    assert error(text).startswith(expected)


def test_error_parts() -> None:
    with pytest.raises(ConfigError) as info:
        parse(MINIMAL + '[timeouts]\ndrain = "90"\n', "test.toml")
    e = info.value
    assert e.source == "test.toml"
    assert e.key == "timeouts.drain"
    assert e.line is None


# --- the control socket's group and the SSH endpoint -----------------------------------


def test_control_group_and_ssh_endpoint() -> None:
    cfg = parse(MINIMAL)
    assert (cfg.control_group, cfg.ssh, cfg.ssh_host_key) == (None, None, None)
    cfg = parse('control_group = "hostagent"\n' + MINIMAL + '[ssh]\nlisten = "127.0.0.1:2222"\n')
    assert cfg.control_group == "hostagent"
    assert cfg.ssh is not None
    assert cfg.ssh.address == ("127.0.0.1", 2222)
    assert cfg.ssh.authorized_keys == Path("/etc/hostagent/authorized_keys")
    assert cfg.ssh_host_key == Path("/var/lib/hostagent/ssh_host_ed25519_key")
    cfg = parse(MINIMAL + '[ssh]\nlisten = 2222\nhost_key = "/etc/hostagent/key"\n'
                'authorized_keys = "/etc/hostagent/keys"\n')
    assert cfg.ssh is not None
    assert cfg.ssh.address == ("", 2222)
    assert cfg.ssh_host_key == Path("/etc/hostagent/key")
    assert cfg.ssh.authorized_keys == Path("/etc/hostagent/keys")
    cfg = parse(MINIMAL + '[ssh]\nlisten = "[::1]:2222"\n')
    assert cfg.ssh is not None and cfg.ssh.address == ("::1", 2222)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (MINIMAL + "[ssh]\n", 'test.toml: ssh.listen: missing; add listen = "0.0.0.0:2222" under [ssh]'),
        (MINIMAL + "[ssh]\nlisten = 70000\n", "test.toml: ssh.listen: 70000 is not a TCP port; write a number from 1 to 65535"),
        (MINIMAL + '[ssh]\nlisten = "2222"\n', 'test.toml: ssh.listen: "2222" is not an address to listen on; write host:port, e.g. "127.0.0.1:9477", "[::1]:9477" or ":9477" for every address'),
        (MINIMAL + '[ssh]\nlisten = ":2222"\nauthorized_keys = "keys"\n', 'test.toml: ssh.authorized_keys: "keys" is a relative path; write the full path from /'),
        (MINIMAL + '[ssh]\nlisten = ":2222"\nauthorised_keys = "/k"\n', 'test.toml: ssh.authorised_keys: unknown key; did you mean "authorized_keys"?'),
        ('control_group = "wheel users"\n' + MINIMAL, 'test.toml: control_group: "wheel users" is not a group name; write a name, e.g. "hostagent"'),
        ("control_group = 100\n" + MINIMAL, "test.toml: control_group: expected a string, got an integer; put the value in double quotes"),
    ],
)
def test_ssh_and_group_mistakes(text: str, expected: str) -> None:
    assert error(text) == expected


def test_control_verbs_says_what_control_group_may_do() -> None:
    # The README and the module promise status/hold/resume to the group, and no more.
    assert parse(MINIMAL).control_verbs == {"status", "hold", "resume", "lend"}
    cfg = parse('control_group = "hostagent"\ncontrol_verbs = ["status", "play", "release"]\n'
                + MINIMAL)
    assert cfg.control_verbs == {"status", "play", "release"}
    assert parse('control_verbs = ["lend"]\n' + MINIMAL).control_verbs == {"resume", "lend"}
    assert parse("control_verbs = []\n" + MINIMAL).control_verbs == frozenset()


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('control_verbs = ["status", "shell"]\n' + MINIMAL,
         'test.toml: control_verbs[1]: "shell" is not a control verb; write one of status, '
         'play, release, hold, resume, lend, reclaim, reserve, cancel-any, or '
         '"reserve:gaming1" for one VM'),
        ('control_verbs = ["status:gaming1"]\n' + MINIMAL,
         'test.toml: control_verbs[0]: "status:gaming1" does not scope a verb to a VM; only '
         'play, release, reserve, cancel-any name a VM: write e.g. "reserve:gaming1"'),
        ('control_verbs = ["reserve:gaming9"]\n' + MINIMAL,
         'test.toml: control_verbs: "gaming9" is not an owner VM; list some of the [owners] '
         '(none yet)'),
        ('control_verbs = "status"\n' + MINIMAL,
         'test.toml: control_verbs: expected an array, got a string; write it in brackets: '
         '["status"]'),
        ('control_verbs = ["hold", "hold"]\n' + MINIMAL,
         'test.toml: control_verbs[1]: "hold" is listed twice; remove one'),
    ],
)
def test_control_verbs_mistakes(text: str, expected: str) -> None:
    assert error(text) == expected


def test_the_cdi_refresh_is_one_command_line_run_in_the_lendee() -> None:
    base = '[lendee]\ndomain = "gpu-node"\ngpus = ["0000:01:00.0"]\n'
    assert parse(base, "t.toml").lendee.cdi_refresh == ""
    command = "nvidia-ctk cdi generate --output=/var/run/cdi/nvidia.yaml"
    assert parse(base + f'cdi_refresh = "{command}"\n', "t.toml").lendee.cdi_refresh == command
    for bad, said in (('"a\\nb"', "not one command line"), ("1", "expected a string"),
                      (f'"{"x" * 1001}"', "at most 1000")):
        with pytest.raises(ConfigError) as info:
            parse(base + f"cdi_refresh = {bad}\n", "t.toml")
        assert info.value.key == "lendee.cdi_refresh" and said in str(info.value)
