# The README's NixOS example (less its `imports` line): the flake's `checks` evaluate
# it with the module and build its checked /etc/hostagent/config.toml.
# tests/packaging/test_nix.py checks that the two stay the same.
{
  virtualisation.libvirtd.enable = true;

  services.hostagent = {
    enable = true;
    settings = {
      lendee = {
        domain = "gpu-node";
        gpus = [ "gpu-a" "gpu-b" ];
      };
      gpus.gpu-a = {
        pci = "0000:01:00.0";
        functions = [ "0000:01:00.1" ];
        name = "RTX 3050";
      };
      gpus.gpu-b = {
        pci = "0000:02:00.0";
        functions = [ "0000:02:00.1" ];
      };
      owners.gaming1.gpus = [ "gpu-a" ];
      owners.gaming2.gpus = [ "gpu-b" ];
      policy.relend_delay = "30s";
      kubernetes.gpu_resource = "nvidia.com/gpu";
    };
    # Read by systemd when the service starts: it never enters the Nix store.
    kubeconfigFile = "/run/secrets/hostagent-kubeconfig";
    # Its members may run `hostagent status`, `hold` and `resume`.
    controlSocketGroup = "hostagent";
  };
  users.users.alice = {
    isNormalUser = true;
    extraGroups = [ "hostagent" ];
  };
}
