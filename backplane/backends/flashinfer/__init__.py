"""FlashInfer backends: attention, MLA, SSM decode and GDN prefill on FlashInfer kernels."""
