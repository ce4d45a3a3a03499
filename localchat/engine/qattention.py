"""Decoding on a quantized cache without materialising it: the "localchat_qattn" attention function.

While the engine decodes on a QuantizedKVCache it switches the model to this function (registered with
transformers' public `AttentionInterface`) and sets `defer` on the cache layers. A layer's `update` for a
one-token step then returns only its full-precision tail and leaves itself here; the function hands the
packed codes, scales and zeros to `kernels.qattn.decode_attention` (Triton on CUDA, the torch twin
elsewhere). Any other call (a prefill chunk, no deferred layer) is plain SDPA.
"""

from __future__ import annotations

import threading

from localchat.engine.attention import AttentionSwitch, plain, sdpa
from localchat.kernels.qattn import decode_attention
from localchat.kernels.quant import group_size

QATTN_IMPL = "localchat_qattn"
_pending = threading.local()


def defer(layer) -> None:
    """Called by QuantizedKVLayer.update: the next attention call of this thread reads `layer`."""
    _pending.layer = layer


def quant_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    layer = getattr(_pending, "layer", None)
    _pending.layer = None
    if layer is None:
        return sdpa(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    # one query against every kept unit: no mask is needed (decoding sees the whole cache)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    d = layer.head_dim
    out = decode_attention(query, layer.quantized(), key, value, layer.bits, group_size(d), scale, layer.inv_freq)
    return out, None


class FusedDecode:
    """Switch `model` to the fused attention and the layers of `cache` to defer, if both can; `close()` undoes."""

    def __init__(self, model, cache):
        from localchat.errors import UserError

        self.switch = None
        self.layers = [layer for layer in cache.layers if hasattr(layer, "defer")]
        if not self.layers or not plain(model.config):  # a policy's own attention is on
            return
        try:
            self.switch = AttentionSwitch(model, QATTN_IMPL, "_localchat_qattn", True, quant_attention)
        except (UserError, ValueError):
            return
        for layer in self.layers:
            layer.defer = True

    def close(self) -> None:
        for layer in self.layers:
            layer.defer = False
        _pending.layer = None
        if self.switch is not None:
            self.switch.close()
            self.switch = None
