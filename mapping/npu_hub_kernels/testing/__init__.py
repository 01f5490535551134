"""Test-only helpers for the cards on machines without an NPU: never imported by the runtime package.

- `emulation`: an emulated `torch_npu` and "npu" device on the CPU (docs/torch-npu-ops.md), for the
  test suite, the demo and the bench;
- `tiny_models`: tiny random-weight models of every mapped family, built from configs.

An Ascend install neither imports nor needs this package (tests/test_card_pieces.py holds the runtime
to that). The emulation leans on private torch hooks and is tested with torch 2.13 only.
"""
