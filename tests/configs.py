"""The configuration text several unit and control-plane tests start from: GPUs lent
to one lendee, each GPU at the PCI address its letter gives (gpu-a at 0000:01:00.0,
gpu-b at 0000:02:00.0, …) and, unless told not to, with its UUID below. Each test adds
the sections it is about."""

from __future__ import annotations

from collections.abc import Sequence

UUID_A = "GPU-5f2ab1c4-0000-4000-8000-00000000000a"
UUID_B = "GPU-5f2ab1c4-0000-4000-8000-00000000000b"
UUID_C = "GPU-5f2ab1c4-0000-4000-8000-00000000000c"
UUIDS = {"gpu-a": UUID_A, "gpu-b": UUID_B, "gpu-c": UUID_C}


def gpus_toml(gpus: Sequence[str], *, uuids: bool = True, functions: bool = False) -> str:
    """A `[gpus.<label>]` table for each of `gpus`: its PCI address, its UUID unless
    `uuids` is false, and with `functions` its audio function (.1) that moves with it."""
    text = ""
    for label in gpus:
        slot = f"0000:{ord(label[-1]) - ord('a') + 1:02x}:00"
        text += f'\n[gpus.{label}]\npci = "{slot}.0"\n'
        if uuids:
            text += f'uuid = "{UUIDS[label]}"\n'
        if functions:
            text += f'functions = ["{slot}.1"]\n'
    return text


def lendee_toml(domain: str = "gpu-node", gpus: Sequence[str] = ("gpu-a", "gpu-b"), *,
                uuids: bool = True, functions: bool = False) -> str:
    """`[lendee]` lending `gpus` to `domain`, and a `[gpus.<label>]` table for each."""
    lent = ", ".join(f'"{label}"' for label in gpus)
    return (f'[lendee]\ndomain = "{domain}"\ngpus = [{lent}]\n'
            + gpus_toml(gpus, uuids=uuids, functions=functions))


def three_gpus_two_owners(*, uuids: bool = True, functions: bool = False) -> str:
    """gpu-node borrowing three GPUs; gaming1 owns gpu-a, gaming2 gpu-b, gpu-c no one."""
    return lendee_toml(gpus=("gpu-a", "gpu-b", "gpu-c"), uuids=uuids,
                       functions=functions) + """
[owners.gaming1]
gpus = ["gpu-a"]

[owners.gaming2]
gpus = ["gpu-b"]
"""


THREE_GPUS_TWO_OWNERS = three_gpus_two_owners()
