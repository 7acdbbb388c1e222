"""hostagent: lends idle passthrough GPUs to a Kubernetes worker VM."""
