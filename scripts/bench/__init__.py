"""`make bench`: what the cards save (counted on fake tensors) and what they cost (timed), against a floor.

    python scripts/bench [--out .cache/bench] [--build build] [--readme README.md] [--tables docs/benchmarks.md]
        [--images docs/images] [--cards-dir kernel-cards] [--quick]
    cd scripts && python -m bench ...       # the same

Counted (mode "counted", not timed, the same on every host): for one full-size decoder layer of
Llama-3-8B, Qwen3-8B, Qwen3-30B-A3B and Mixtral-8x7B (random weights, nothing downloaded), forward
(in `torch.inference_mode()`: it stands for inference) and forward+backward (with grad), batch 1 and 8,
sequence 512 and 4096, bfloat16: the device operations and the bytes they read and write, for eager
transformers and for the kernelized layer under the torch_npu emulation, set against a floor; with the
backward, also the memory: bytes kept for backward and the peak of live bytes (`memory`). The
kernelized layer is the default path, what users get from kernelize alone (no other call). The layers run on fake
tensors (shapes, no data, no compute), so full sizes cost next to nothing; `accounting` says what counts
as an operation and how the emulation's internals are kept out. Rows per fused region kind (summed over
the layer's instances) and per layer; each card's floor and targets are defined in its bench spec
(`cards`), the decoder layer's in `floors` and `targets`.
Gradients are taken with `torch.autograd.grad` (w.r.t. the inputs and parameters), so accumulation into
`.grad` is not counted. MoE layers use transformers' eager experts loop (experts_implementation
"eager"); the experts sweep also shows transformers' default, grouped_mm.

Timed (mode "timed", medians of repeats after warm-up), host side on this machine: kernelize of a
32-layer model, per-call overhead of a kernelized module over its card function, the host cost of each card's call at
decode size against a bare module call issuing the same ops (ops stubbed, interleaved; held to 2 x), cold (fresh
process) and warm get_kernel of every card from an offline Hub cache, the torch-universal fallback against
eager on CPU tensors. Device side, on an Ascend host: per region and per decoder layer, eager against
kernelized, forward and forward+backward, synchronised, peak memory, and a short training loop. Off an
Ascend host the device part runs only with `--device-timing on`, on the emulation at small shapes,
labelled "emulated (not a device measurement)" and kept out of the summary.

Peer (the `peer` column): LLaMA-Factory's in-tree NPU kernels counted on the same layers, and their output
checked against eager on the tiny model families (`peer`); `--peer off` leaves them out.

Writes bench.csv (one row per measurement), bench.png, step.png and summary.md (every table) to --out; --tables
PATH writes the tables there too (docs/benchmarks.md), with the charts that --images DIR copies there (docs/images);
--readme PATH rewrites the part of PATH between `<!-- bench:begin -->` and `<!-- bench:end -->` with the targets met
and missed, the step chart and a link to the tables; --cards-dir writes each card's benchmark.md (its share of the
summary, which the build adds to its Hub README). A run over every model fails, naming them, when a counted target has
no row (its region occurs in no bench model).

Modules: `cards` (a package: one bench spec per card, `cards/<card package>.py`, holding everything the bench
knows about that card: its floor, targets, accounting rules, direct call and studies; the contract is its
docstring), `configs` (the models and shapes), `regions` (a decoder layer's fused regions and how they are
run), `floors` (the floor of a region and of the layer), `targets`, `accounting` (ops and bytes on fake
tensors), `memory` (saved and peak bytes on fake tensors), `counted`, `outside` (a region outside the decoder
layer, counted from the declaration its spec gives: the loss head, its chunk sweep, an extra column such as TRL's
fused LM head), `timed`, `peer` (LLaMA-Factory's kernels), `step` (a whole training step measured, its ops by
category), `step_study` (the step studies' rows), `step_validation` (the time model, `device_model`, against published
figures), `step_report` (the step's tables, step.png), `rows` (a measurement, bench.csv), `markdown` (cells and tables,
for `report` and `step_report`), `report` (summary, README section, card sections), `chart` (bench.png),
`long_context` (the longest trainable sequence per device: counted peaks at long sequence, Ulysses SP, the search),
`long_context_report` (its section, long_context.png), `__main__`
(the command). The modules other than the specs name
no card and no region: they iterate over `npu_hub_kernels.CARDS` and the specs; the specs declare, and import from the
bench only the declaration types and helpers of `cards.SPEC_IMPORTS`.
"""
