"""`python -m npu_hub_kernels selftest`: the cards against the eager math on this host's device (docs/selftest.md)."""
