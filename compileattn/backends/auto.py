"""``auto``: the backend chosen per step regime from measurements.

On the CPU only ``reference`` exists. On CUDA the choice per regime lives in ``AUTO_TABLE``;
every entry names the benchmark result it came from (benchmarks/results/).
"""
from __future__ import annotations

from .base import AttentionBackend
from ..kv_cache import AttentionSpec
from .registry import first_supporting, get_backend, resolve

#: regime -> backends in order of preference (first importable + supporting wins, per layer).
#: Source, H200: benchmarks/results/decode_attention.md: the Triton decode kernel is 0.87-1.10x
#: FlashInfer's GPU time and up to 4.5x faster than FlashAttention-4, which has no split-KV on
#: Hopper (13.2 vs 59.0 us at batch 1 / context 4096); uniform decode is captured whole in the
#: full-graph mode, so Triton's host launch cost (op_overhead.md) is not paid per step there.
#: Mixed/prefill steps run the op eagerly between pieces, where FA4's ~10 us direct call beats
#: Triton's 29-81 us of host time per call (op_overhead.md).
AUTO_TABLE = {
    "cpu": ("reference",),
    "cuda_decode": ("triton", "flash", "reference"),
    "cuda_mixed": ("flash", "triton", "reference"),
}


class AutoBackend(AttentionBackend):
    name = "auto"

    def __init__(self, device_type: str = "cpu"):
        super().__init__(device_type)
        self._candidates: dict[str, list[AttentionBackend]] = {}

    def _regime(self, metadata) -> str:
        if self.device_type != "cuda":
            return "cpu"
        return "cuda_decode" if metadata.is_uniform_decode else "cuda_mixed"

    def candidates(self, regime: str) -> list[AttentionBackend]:
        found = self._candidates.get(regime)
        if found is None:
            found = []
            for name in AUTO_TABLE[regime]:
                try:
                    found.append(get_backend(name, self.device_type))
                except ImportError:
                    continue
            self._candidates[regime] = found
        return found

    @property
    def cuda_graph_capturable(self) -> bool:  # type: ignore[override]
        decode = self.candidates("cuda_decode") if self.device_type == "cuda" else []
        return bool(decode) and decode[0].cuda_graph_capturable

    def capturable_for(self, cache, metadata) -> bool:
        return resolve(metadata.plan_for(self), cache).cuda_graph_capturable

    def plan(self, metadata, buffers):
        chosen = self.candidates(self._regime(metadata))[0]
        metadata.plan_for(chosen)
        return chosen

    def _public(self) -> AttentionBackend:
        return self.candidates("cpu" if self.device_type != "cuda" else "cuda_mixed")[0]

    def write_kv_cache(self, key, value, key_cache, value_cache, slot_mapping) -> None:
        self._public().write_kv_cache(key, value, key_cache, value_cache, slot_mapping)

    def varlen_attention(self, q, k, v, out, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table,
                         max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left, softcap) -> None:
        """The public op under ``auto``: the regime's first backend, with the usual fallback."""
        spec = AttentionSpec(q.shape[1], k.shape[-2], q.shape[-1], softmax_scale, window_left, softcap, causal)
        block_size = k.shape[1] if block_table is not None else 256  # contiguous K/V: no page constraint
        first_supporting(self._public(), spec, q.dtype, q.device, block_size).varlen_attention(
            q, k, v, out, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, max_seqlen_q, max_seqlen_k,
            softmax_scale, causal, window_left, softcap)

    def forward(self, query, key, value, output, cache, metadata) -> None:
        resolve(metadata.plan_for(self), cache).forward(query, key, value, output, cache, metadata)

    def write_layer_kv(self, key, value, cache, metadata) -> None:
        resolve(metadata.plan_for(self), cache).write_layer_kv(key, value, cache, metadata)

    def attend(self, query, output, cache, metadata) -> None:
        resolve(metadata.plan_for(self), cache).attend(query, output, cache, metadata)
