"""The lab guest: Debian's cloud kernel and an initramfs with busybox and a real qemu-ga.

Built from Debian packages (downloaded with `apt-get download`, never installed on
the host) and cached under `.lab/image/<hash>`, where the hash covers the package
versions and the guest files, so it is rebuilt only when one of them changes.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
GUEST = HERE / "guest"
PACKAGES = ("linux-image-cloud-amd64", "busybox-static", "qemu-guest-agent")
# What the guest needs; their dependencies are found in the modules themselves.
MODULES = ("virtio_pci", "virtio_console", "virtio_blk")


@dataclass(frozen=True)
class GuestImage:
    kernel: Path
    initrd: Path


def _run(*argv: str, cwd: Path | None = None) -> str:
    return subprocess.run(argv, cwd=cwd, check=True, capture_output=True, text=True).stdout


def _candidate(package: str) -> tuple[str, str]:
    """The package apt would download, resolving the kernel metapackage to its image."""
    if package == "linux-image-cloud-amd64":
        deps = _run("apt-cache", "depends", package)
        package = next(line.split(":", 1)[1].strip() for line in deps.splitlines()
                       if line.strip().startswith("Depends:") and "linux-image-" in line)
    policy = _run("apt-cache", "policy", package)
    version = next(line.split(":", 1)[1].strip() for line in policy.splitlines()
                   if line.strip().startswith("Candidate:"))
    if version == "(none)":
        raise RuntimeError(f"apt has no candidate for {package}: run `apt-get update`")
    return package, version


def _inputs_hash(pins: list[tuple[str, str]]) -> str:
    h = hashlib.sha256()
    for name, version in pins:
        h.update(f"{name}={version}\n".encode())
    for f in sorted(GUEST.iterdir()) + [Path(__file__)]:
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:16]


def build(cache: Path) -> GuestImage:
    pins = [_candidate(p) for p in PACKAGES]
    out = cache / "image" / _inputs_hash(pins)
    image = GuestImage(out / "vmlinuz", out / "initrd.img")
    if image.kernel.exists() and image.initrd.exists():
        return image
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        work = Path(tmp)
        debs = work / "debs"
        debs.mkdir()
        # _apt cannot write into root's private temp dir; download as root quietly.
        _run("apt-get", "download", "-q", "-o", "APT::Sandbox::User=root",
             *(f"{n}={v}" for n, v in pins), cwd=debs)
        pkg = work / "pkg"
        for deb in sorted(debs.iterdir()):
            _run("dpkg-deb", "-x", str(deb), str(pkg))
        root = work / "root"
        _assemble(pkg, root)
        out.mkdir(parents=True, exist_ok=True)
        kernel = next((pkg / "boot").glob("vmlinuz-*"))
        shutil.copyfile(kernel, out / "vmlinuz.tmp")
        (out / "initrd.img.tmp").write_bytes(_cpio_gz(root))
        os.replace(out / "vmlinuz.tmp", image.kernel)
        os.replace(out / "initrd.img.tmp", image.initrd)
    return image


def _assemble(pkg: Path, root: Path) -> None:
    for d in ("bin", "sbin", "usr/bin", "usr/sbin", "lib/modules", "lib64", "etc", "proc",
              "sys", "dev", "run", "tmp"):
        (root / d).mkdir(parents=True, exist_ok=True)
    shutil.copy2(pkg / "bin/busybox", root / "bin/busybox")
    shutil.copy2(GUEST / "init", root / "init")
    shutil.copy2(GUEST / "shutdown", root / "sbin/shutdown")
    shutil.copy2(GUEST / "nvidia-smi", root / "usr/bin/nvidia-smi")
    qga = pkg / "usr/sbin/qemu-ga"
    shutil.copy2(qga, root / "usr/sbin/qemu-ga")
    # qemu-ga is dynamically linked: bring the host's copies of its libraries,
    # which are the same Debian release's (qemu-system-x86 depends on them).
    for line in _run("ldd", str(qga)).splitlines():
        parts = line.split()
        lib = parts[2] if "=>" in parts and len(parts) > 2 else parts[0]
        if lib.startswith("/"):
            dest = root / lib.lstrip("/")
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(os.path.realpath(lib), dest)
    available = {ko.stem: ko for ko in (pkg / "lib/modules").glob("*/kernel/**/*.ko")}
    order: list[str] = []
    for name in MODULES:
        _load_order(name, available, order)
    for name in order:
        shutil.copy2(available[name], root / "lib/modules" / f"{name}.ko")
    # busybox insmod does not resolve dependencies: init loads in this order.
    (root / "lib/modules/order").write_text("\n".join(order) + "\n")


def _load_order(name: str, available: dict[str, Path], order: list[str]) -> None:
    if name in order:
        return
    if name not in available:
        raise RuntimeError(f"the kernel package has no module {name}")
    found = re.search(rb"depends=([\w,-]*)", available[name].read_bytes())
    for dep in filter(None, (found.group(1).decode() if found else "").split(",")):
        _load_order(dep, available, order)
    order.append(name)


def _cpio_gz(root: Path) -> bytes:
    listing = "\n".join(sorted(str(p.relative_to(root)) for p in root.rglob("*"))) + "\n"
    cpio = subprocess.run(["cpio", "-o", "-H", "newc", "--quiet"], cwd=root,
                          input=listing.encode(), check=True, capture_output=True).stdout
    buf = io.BytesIO()
    with gzip.GzipFile(fileobj=buf, mode="wb", compresslevel=6, mtime=0) as gz:
        gz.write(cpio)
    return buf.getvalue()


if __name__ == "__main__":
    img = build(Path(os.environ.get("HOSTAGENT_LAB_CACHE", ".lab")).resolve())
    print(img.kernel, img.initrd)
