# hostagent and its libvirt hook, built from this repository.
#
#   pkgs.callPackage ./nix/package.nix { }
#
# The hook lands in $out/libexec/hostagent/qemu-hook with a store-path interpreter:
# libvirtd runs hooks with a fixed PATH, where `#!/usr/bin/env python3` finds nothing
# on NixOS. nix/module.nix links it into libvirt's qemu.d/.
{
  lib,
  python3Packages,
}:

let
  project = (lib.importTOML ../pyproject.toml).project;
in
python3Packages.buildPythonApplication {
  pname = project.name;
  inherit (project) version;
  pyproject = true;

  # Only what the build reads: editing tests or docs does not rebuild the package.
  src = lib.fileset.toSource {
    root = ../.;
    fileset = lib.fileset.unions [
      ../pyproject.toml
      ../README.md
      ../hostagent
      ../hooks/qemu
    ];
  };

  build-system = [ python3Packages.setuptools ];

  # pyproject.toml's [project] dependencies, as nixpkgs names them: exactly those
  # (tests/unit/test_nix_dependencies.py compares the two lists).
  dependencies = [
    python3Packages.libvirt # libvirt-python
    python3Packages.asyncssh
    python3Packages.kubernetes-asyncio
    python3Packages.nvidia-ml-py
    python3Packages.tomli-w
    # systemd-python; called `systemd` before nixpkgs renamed it.
    (python3Packages.systemd-python or python3Packages.systemd)
    python3Packages.prometheus-client
    python3Packages.aiomqtt
  ];

  # The hook imports the standard library only: the bare interpreter, not the
  # application's wrapped environment, and -I -S keep its start fast and isolated.
  postInstall = ''
    install -Dm0755 hooks/qemu $out/libexec/hostagent/qemu-hook
    substituteInPlace $out/libexec/hostagent/qemu-hook \
      --replace-fail '#!/usr/bin/python3 -IS' '#!${python3Packages.python.interpreter} -IS'
  '';

  # The test suite needs the lab (root, a private libvirtd, QEMU guests): `make test`
  # runs it. Here: the modules import.
  pythonImportsCheck = [
    "hostagent.service.agent"
    "hostagent.cli"
  ];

  meta = {
    description = project.description;
    license = lib.licenses.mit;
    mainProgram = "hostagent";
    platforms = lib.platforms.linux;
  };
}
