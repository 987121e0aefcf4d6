"""The per-step batch types: what one forward pass is told about its tokens.

`ForwardBatch` (attention metadata + the LoRA slot mapping), `AttentionMetadata` and the torch path's
`GatherIndex`, `LoRABatchMapping` with its layouts, and `KVCacheSpec`. The model runner builds them;
layers, LoRA ops and models read them. The lowest layer of the package: it imports torch and the
standard library only, nothing of loraserve above it (tests/test_import_graph.py).
"""
