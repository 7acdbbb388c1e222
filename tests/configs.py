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


def lendee_toml(domain: str = "gpu-node", gpus: Sequence[str] = ("gpu-a", "gpu-b"), *,
                uuids: bool = True) -> str:
    """`[lendee]` lending `gpus` to `domain`, and a `[gpus.<label>]` table for each."""
    lent = ", ".join(f'"{label}"' for label in gpus)
    text = f'[lendee]\ndomain = "{domain}"\ngpus = [{lent}]\n'
    for label in gpus:
        text += f'\n[gpus.{label}]\npci = "0000:{ord(label[-1]) - ord("a") + 1:02x}:00.0"\n'
        if uuids:
            text += f'uuid = "{UUIDS[label]}"\n'
    return text


# gpu-node borrowing three GPUs; gaming1 owns gpu-a, gaming2 gpu-b, gpu-c no one.
THREE_GPUS_TWO_OWNERS = lendee_toml(gpus=("gpu-a", "gpu-b", "gpu-c")) + """
[owners.gaming1]
gpus = ["gpu-a"]

[owners.gaming2]
gpus = ["gpu-b"]
"""
