"""Triton backends: our own paged attention and MLA kernels, mamba-ssm's and fla's kernels."""
