"""The emulated torch_npu ops: one module per card, named after the card's package, its ops in `__all__`."""
