{
  description = "hostagent: lends idle passthrough GPUs to a Kubernetes worker VM and gives each back to its gaming VM on demand";

  inputs.nixpkgs.url = "github:NixOS/nixpkgs/nixos-unstable";

  outputs =
    { self, nixpkgs }:
    let
      systems = [
        "x86_64-linux"
        "aarch64-linux"
      ];
      forAllSystems = f: nixpkgs.lib.genAttrs systems (system: f nixpkgs.legacyPackages.${system});
    in
    {
      # pkgs.hostagent, which the module then uses by default.
      overlays.default = final: _prev: { hostagent = final.callPackage ./nix/package.nix { }; };

      packages = forAllSystems (pkgs: {
        default = pkgs.callPackage ./nix/package.nix { };
      });

      # Built with the importing system's own nixpkgs (pkgs.hostagent if the overlay
      # is applied): one Python package set on the machine, not two.
      nixosModules.default = ./nix/module.nix;

      # `nix flake check`: the package builds (nixpkgs' runtime-dependency check and
      # the import check of hostagent.service.agent), and the README's example (nix/example.nix)
      # is a NixOS system with no failed assertion whose config.toml the agent's own
      # check-config accepts. The lab tests need root, libvirtd and QEMU guests: `make
      # test`, not here.
      checks = forAllSystems (
        pkgs:
        let
          inherit (pkgs.stdenv.hostPlatform) system;
          lib = nixpkgs.lib;
          example = nixpkgs.lib.nixosSystem {
            modules = [
              self.nixosModules.default
              ./nix/example.nix
              {
                nixpkgs.hostPlatform = lib.mkDefault system;
                # What any system needs and the example leaves out.
                boot.loader.grub.enable = lib.mkDefault false;
                fileSystems."/" = lib.mkDefault {
                  device = "none";
                  fsType = "tmpfs";
                };
                system.stateVersion = lib.mkDefault "24.11";
              }
            ];
          };
          failed = map (a: a.message) (builtins.filter (a: !a.assertion) example.config.assertions);
        in
        {
          package = self.packages.${system}.default;
          example-config =
            if failed == [ ] then
              example.config.environment.etc."hostagent/config.toml".source
            else
              throw "nix/example.nix: failed assertions:\n- ${lib.concatStringsSep "\n- " failed}";
        }
      );
    };
}
