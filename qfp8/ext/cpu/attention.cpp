// torch binding of the FP8 decode-attention kernel (kernel.h, DecodeAttention).
//
// qfp8::fp8_decode_attention (schema in qfp8/library/attention.py): one query
// token per sequence, [B, Hq, 1, D], against FP8 key/value caches
// [B, Hkv, S, D] with float32 scales ([1] per tensor or [B, Hkv, 1, 1] per
// head) and an optional mask broadcastable to [B, 1, 1, S] (bool: True
// attends; float: added to the scores). Returns [B, Hq, 1, D] in the query's
// dtype. The Python wrapper validates the arguments (ValueError naming the
// sizes); the checks here only keep a direct call from reading out of bounds.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <limits>

#include "bindings.h"
#include "kernel.h"

namespace qfp8 {
namespace {

at::Tensor fp8_decode_attention(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                                const at::Tensor& key_scale, const at::Tensor& value_scale,
                                const c10::optional<at::Tensor>& mask, double scaling) {
  TORCH_CHECK(query.dim() == 4 && query.size(2) == 1, "qfp8.fp8_decode_attention: query must be [B, Hq, 1, D], got ",
              query.sizes());
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.sizes() == value_cache.sizes(),
              "qfp8.fp8_decode_attention: key and value caches must be [B, Hkv, S, D] alike, got ", key_cache.sizes(),
              " and ", value_cache.sizes());
  TORCH_CHECK(key_cache.scalar_type() == value_cache.scalar_type(),
              "qfp8.fp8_decode_attention: key and value caches differ in dtype");
  const int64_t B = query.size(0), Hq = query.size(1), D = query.size(3);
  const int64_t Hkv = key_cache.size(1), S = key_cache.size(2);
  TORCH_CHECK(key_cache.size(0) == B && key_cache.size(3) == D && Hkv > 0 && Hq % Hkv == 0,
              "qfp8.fp8_decode_attention: query ", query.sizes(), " does not fit caches ", key_cache.sizes());
  const int format = fp8_format(key_cache.scalar_type(), "qfp8.fp8_decode_attention: the key cache");
  const at::Tensor q = (query.to(at::kFloat) * scaling).contiguous();
  const at::Tensor k = key_cache.contiguous().view(at::kByte);
  const at::Tensor v = value_cache.contiguous().view(at::kByte);
  at::Tensor ks = key_scale.to(at::kFloat).reshape({-1});
  at::Tensor vs = value_scale.to(at::kFloat).reshape({-1});
  TORCH_CHECK((ks.numel() == 1 || ks.numel() == B * Hkv) && (vs.numel() == 1 || vs.numel() == B * Hkv),
              "qfp8.fp8_decode_attention: scales must have 1 or B * Hkv = ", B * Hkv, " elements, got ", ks.numel(),
              " and ", vs.numel());
  // One per tensor, the other per head (a layer with only one static scale): both per head.
  const bool per_head = ks.numel() != 1 || vs.numel() != 1;
  if (per_head) {
    ks = ks.expand({B * Hkv});
    vs = vs.expand({B * Hkv});
  }
  ks = ks.contiguous();
  vs = vs.contiguous();
  at::Tensor additive;
  if (mask.has_value() && mask->defined()) {
    const at::Tensor& m = *mask;
    TORCH_CHECK(m.dim() == 4 && m.size(1) == 1 && m.size(2) == 1 && m.size(3) == S && (m.size(0) == 1 || m.size(0) == B),
                "qfp8.fp8_decode_attention: mask must broadcast to [B, 1, 1, S] = [", B, ", 1, 1, ", S, "], got ",
                m.sizes());
    if (m.scalar_type() == at::kBool) {
      additive = at::zeros(m.sizes(), m.options().dtype(at::kFloat))
                     .masked_fill_(m.logical_not(), -std::numeric_limits<float>::infinity());
    } else {
      additive = m.to(at::kFloat);
    }
    additive = additive.expand({B, 1, 1, S}).reshape({B, S}).contiguous();
  }
  const int64_t G = Hq / Hkv;
  at::Tensor scores = at::empty({B * Hkv, G, S}, q.options());
  at::Tensor out = at::empty({B, Hq, 1, D}, q.options());
  DecodeAttention a;
  a.q = q.data_ptr<float>();
  a.k = k.data_ptr<uint8_t>();
  a.v = v.data_ptr<uint8_t>();
  a.B = B;
  a.Hq = Hq;
  a.Hkv = Hkv;
  a.S = S;
  a.D = D;
  a.format = format;
  a.k_scale = ks.data_ptr<float>();
  a.v_scale = vs.data_ptr<float>();
  a.per_head_scale = per_head;
  a.mask = additive.defined() ? additive.data_ptr<float>() : nullptr;
  a.scores = scores.data_ptr<float>();
  a.out = out.data_ptr<float>();
  const DecodeAttentionFn fn = decode_attention_for_current_isa();
  // One task per (sequence, KV head); each is computed whole by one thread.
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) { fn(a, begin, end); });
  return out.to(query.scalar_type());
}

}  // namespace
}  // namespace qfp8

TORCH_LIBRARY_IMPL(qfp8, CPU, m) { m.impl("fp8_decode_attention", &qfp8::fp8_decode_attention); }
