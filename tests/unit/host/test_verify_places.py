"""The in-guest check finds nvidia-smi where NixOS and the GPU operator put it, and says
where it looked when it is nowhere."""

from __future__ import annotations

from hostagent.host import verify
from hostagent.host.verify import Expected

A = Expected(label="gpu-a", uuid="GPU-aaaa", name="RTX 3050")
ANSWER = "GPU-aaaa, 00000000:01:00.0, NVIDIA GeForce RTX 3050\n"


class Guest:
    """A guest with nvidia-smi at `at` only; guest-exec's error for any other path."""

    def __init__(self, at: str | None) -> None:
        self.at = at
        self.tried: list[str] = []

    async def run(self, command: str) -> tuple[int, str, str]:
        self.tried.append(command)
        if command != self.at:
            raise RuntimeError(f"internal error: unable to execute QEMU agent command "
                               f"'guest-exec': Failed to execute child process “{command}” "
                               "(No such file or directory)")
        return 0, ANSWER, ""


def test_candidates_start_with_the_configured_command() -> None:
    assert verify.candidates("nvidia-smi") == ["nvidia-smi", *verify.PLACES]
    assert verify.candidates("/usr/bin/nvidia-smi")[:2] == [
        "/usr/bin/nvidia-smi", "/run/current-system/sw/bin/nvidia-smi"]
    assert len(verify.candidates("/usr/bin/nvidia-smi")) == len(verify.PLACES)


async def test_a_nixos_guest_is_found_in_its_system_profile() -> None:
    guest = Guest("/run/current-system/sw/bin/nvidia-smi")
    outcome = await verify.query([A], guest.run)
    assert outcome.ok
    assert guest.tried == ["nvidia-smi", "/run/current-system/sw/bin/nvidia-smi"]


async def test_the_gpu_operators_driver_container_is_found() -> None:
    guest = Guest("/run/nvidia/driver/usr/bin/nvidia-smi")
    assert (await verify.query([A], guest.run)).ok


async def test_nowhere_names_every_place_looked() -> None:
    guest = Guest(None)
    outcome = await verify.query([A], guest.run)
    assert not outcome.ok and outcome.problem is not None
    assert outcome.problem.startswith("nvidia-smi not found in the guest; looked for nvidia-smi, "
                                      "/run/current-system/sw/bin/nvidia-smi, "
                                      "/run/nvidia/driver/usr/bin/nvidia-smi, /usr/bin/nvidia-smi, "
                                      "/usr/local/nvidia/bin/nvidia-smi, /opt/bin/nvidia-smi")
    assert guest.tried == verify.candidates("nvidia-smi")


async def test_a_shell_saying_command_not_found_means_the_next_place() -> None:
    async def run(command: str) -> tuple[int, str, str]:
        if command == "/usr/bin/nvidia-smi":
            return 0, ANSWER, ""
        return 127, "", f"sh: {command}: command not found"

    assert (await verify.query([A], run)).ok


def test_an_nvidia_smi_that_ran_and_failed_decides() -> None:
    # It was found: its failure is the verdict, no other place is tried.
    outcome = verify.combine([A], [("nvidia-smi", (9, "", "NVIDIA-SMI has failed because it "
                                                   "couldn't communicate with the NVIDIA driver"))])
    assert outcome is not None and not outcome.ok
    assert outcome.problem is not None and "couldn't communicate" in outcome.problem
    assert verify.combine([A], [("nvidia-smi", (127, "", "not found"))]) is None
