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
    };
}
