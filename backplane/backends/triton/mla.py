"""Multi-head latent attention (DeepSeek) in Triton, weight-absorbed, over the latent cache.

The key of head ``h`` is ``[c @ w_uk[h]^T, k_pe]`` and its value ``c @ w_uv[h]^T``
for the cached latent ``c``. Absorbing ``w_uk`` into the query
(``q_abs = q_nope @ w_uk[h]``) makes the score ``q_abs . c + q_pe . k_pe``, and
absorbing ``w_uv`` into the output (``out = (p @ c) @ w_uv[h]^T``) leaves one
shared "kv head" of width ``kv_lora_rank`` (+ the rotary part): attention reads
the latent cache directly, never an expanded K/V. Both prefill/extend and
decode use this form, with the paged kernels of
:mod:`backplane.backends.triton.attention_kernels` (their two-part key and a value that
is a view of the key's storage exist for this module):

* ``_kv_append_kernel`` writes ``kv_c`` and ``k_pe`` into the latent cache;
* ``_prefill_kernel`` per (sequence, query block, head), causal over the pages;
* ``_decode_kernel``, split-KV (the splits merged in the same launch), one program per
  (sequence, block of 16 heads, split) so that each latent page is read once per
  head block rather than once per head.

The two absorptions are batched matmuls (torch) around the Triton attention.
"""

from __future__ import annotations

import torch

from backplane.backends.triton import attention_launch as paged
from backplane.core.contract import cached_op, finish_output, output_buffer
from backplane.core.families import MLABackend, MLALayerSpec
from backplane.core.forward_context import get_forward_context


@cached_op(
    "backplane_triton::mla",
    mutates_args=("latent_cache", "out"),
    output_shape=MLABackend.output_shape,
)
def latent_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    latent_cache: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    scale: float,
    kv_scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Append the latent and rotary key to the cache and attend, weight-absorbed.

    :param q_nope: ``[T, H, qk_nope_head_dim]``.
    :param q_pe: ``[T, H, qk_rope_head_dim]``.
    :param kv_c: ``[T, kv_lora_rank]``.
    :param k_pe: ``[T, qk_rope_head_dim]``.
    :param latent_cache: ``[P, page, kv_lora_rank + qk_rope_head_dim]``, written at ``slot_mapping``.
    :param w_uk: ``[H, qk_nope_head_dim, kv_lora_rank]``.
    :param w_uv: ``[H, v_head_dim, kv_lora_rank]``.
    :param scale: softmax scale.
    :param kv_scale: a ``float8_e4m3fn`` cache holds ``row / kv_scale`` (the
        kernels append it so and read it back times ``kv_scale``); other
        dtypes ignore it.
    :param out: optional ``[T, H, v_head_dim]`` buffer.
    :return: the output or the empty sentinel.
    """
    batch = get_forward_context().batch
    T, H, _ = q_nope.shape
    rank = kv_c.shape[-1]
    buf = output_buffer(out, (T, H, w_uv.shape[1]), q_nope.dtype, q_nope.device)
    n = batch.num_tokens
    latent_plane = latent_cache[..., :rank]
    rope_plane = latent_cache[..., rank:]
    paged.kv_append(kv_c, latent_plane, batch.slot_mapping, n, k_scale=kv_scale)
    paged.kv_append(k_pe, rope_plane, batch.slot_mapping, n, k_scale=kv_scale)
    if n > 0:
        # q_abs[t, h] = q_nope[t, h] @ w_uk[h]: [H, n, dn] @ [H, dn, L], viewed back as [n, H, L].
        q_abs = torch.bmm(q_nope[:n].transpose(0, 1), w_uk.to(q_nope.dtype)).transpose(0, 1)
        o_lat = torch.empty((H, n, rank), dtype=q_nope.dtype, device=q_nope.device)
        o_view = o_lat.transpose(0, 1)  # [n, H, L], written row by row by the kernels
        qpe = q_pe[:n]
        # the value is the latent: one scale for keys and values
        kwargs = dict(
            scale=scale, group=H, q_pe=qpe, kpe_plane=rope_plane, k_scale=kv_scale, v_scale=kv_scale
        )
        paged.paged_prefill(batch, q_abs, latent_plane, latent_plane, o_view, **kwargs)
        paged.paged_decode(
            batch, q_abs, latent_plane, latent_plane, o_view,
            num_splits=paged._FORCED_SPLITS["value"] or None, **kwargs,
        )  # fmt: skip
        # out[t, h] = o_lat[h, t] @ w_uv[h]^T
        buf[:n].copy_(torch.bmm(o_lat, w_uv.to(o_lat.dtype).transpose(1, 2)).transpose(0, 1))
    return finish_output(out, buf, n)


class TritonMLABackend(MLABackend):
    """Weight-absorbed MLA with the Triton paged kernels (prefill/extend and split-KV decode)."""

    name = "triton"
    supports_fp8_kv_cache = True

    def forward(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        kv_c: torch.Tensor,
        k_pe: torch.Tensor,
        latent_cache: torch.Tensor,
        w_uk: torch.Tensor,
        w_uv: torch.Tensor,
        layer: MLALayerSpec,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Append the latent and attend; see :meth:`MLABackend.forward`."""
        return latent_attention(
            q_nope,
            q_pe,
            kv_c,
            k_pe,
            latent_cache,
            w_uk,
            w_uv,
            float(layer.scale),
            float(layer.kv_scale),
            out,
        )

    def dynamic_ops(self) -> tuple:
        """The MLA op runs eagerly between captured graph segments."""
        return (torch.ops.backplane_triton.mla.default,)
