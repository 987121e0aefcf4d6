"""The C kernels, one room for every family (loaded by `native.build.load_library`, bound by
`native.kernel_slot.KernelSlot`): `simd.h`, the SIMD vocabulary they share; one `<family>.c` per op
family with its parts as `<family>_*.h`: the linear kernels (gemm_kernel, quant_kernel), attention
(paged_attention), the fused elementwise ops (fused_kernel), LoRA (lora_kernel), the decoder stack
(decoder_stack) and the greedy argmax (argmax_kernel). Each file's header states its semantics, shapes
and code paths; the Python module that binds it holds its torch twin."""
