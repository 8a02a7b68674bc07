"""Quantised weights and caches: FP8 (e4m3) projections and KV caches.

:mod:`~backplane.models.quant.fp8` holds the number format (quantise,
dequantise, scale layouts), :mod:`~backplane.models.quant.scheme` reads a
checkpoint's ``quantization_config`` into an :class:`~backplane.models.quant.scheme.Fp8Scheme`
(and refuses the methods backplane does not run),
:mod:`~backplane.models.quant.projection` runs a quantised projection,
:mod:`~backplane.models.quant.loading` converts a model's projections and
feeds it an FP8 checkpoint (or quantises a full-precision one on load), and
:mod:`~backplane.models.quant.kv_cache` sets an FP8 KV cache on the
attention layers.
"""
