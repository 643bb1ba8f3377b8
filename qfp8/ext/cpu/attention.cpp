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

#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

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

// qfp8::fp8_compensated_quantize (reference and meaning in qfp8/library/attention.py): each row
// [B, H, T, D] of states / scale rounded to FP8 channel by channel in order[h], every rounding error fed
// into the channels still to round through the upper triangular factor[h]. One row is D^2 / 2 multiply-adds;
// R rows of one head go together (8 when there are that many: prefill), held channel-major so that each
// feed is an R-wide multiply-add (vectorized by the compiler) rather than a short loop per row.
constexpr int64_t kRows = 8;

template <typename Fp8, int64_t R>
void compensated_rows(const float* x, const float* scale, bool per_head, const float* factor, const int64_t* order,
                      uint8_t* out, int64_t H, int64_t T, int64_t D, int64_t begin, int64_t end) {
  const float fmax = static_cast<float>(std::numeric_limits<Fp8>::max());
  std::vector<float> block(D * R);  // block[t * R + r]: channel order[t] of row r
  float* __restrict b = block.data();
  // Tasks are (sequence, head, group of R tokens).
  const int64_t groups = (T + R - 1) / R;
  for (int64_t task = begin; task < end; ++task) {
    const int64_t bh = task / groups, t0 = (task % groups) * R, h = bh % H;
    const int64_t rows = std::min(R, T - t0);
    const float s = scale[per_head ? bh : 0];
    const float limit = s * fmax;
    const int64_t* ord = order + h * D;
    const float* f = factor + h * D * D;
    const float* src = x + (bh * T + t0) * D;
    uint8_t* dst = out + (bh * T + t0) * D;
    for (int64_t t = 0; t < D; ++t)
      for (int64_t r = 0; r < R; ++r) b[t * R + r] = r < rows ? src[r * D + ord[t]] : 0.0f;
    for (int64_t t = 0; t < D; ++t) {
      float error[R];
      const float pivot = f[t * D + t];
      for (int64_t r = 0; r < R; ++r) {
        const float value = b[t * R + r];
        const Fp8 code(std::min(std::max(value / s, -fmax), fmax));  // NaN passes through as NaN
        if (r < rows) dst[r * D + ord[t]] = code.x;
        const float kept = std::min(std::max(value, -limit), limit);
        const float e = (kept - static_cast<float>(code) * s) / pivot;
        error[r] = std::isfinite(e) ? e : 0.0f;
      }
      const float* __restrict ft = f + t * D;
      for (int64_t u = t + 1; u < D; ++u) {
        const float w = ft[u];
        float* __restrict bu = b + u * R;
        for (int64_t r = 0; r < R; ++r) bu[r] -= error[r] * w;
      }
    }
  }
}

at::Tensor fp8_compensated_quantize(const at::Tensor& states, const at::Tensor& scale, const at::Tensor& factor,
                                    const at::Tensor& order, c10::ScalarType dtype) {
  const char* op = "qfp8.fp8_compensated_quantize";
  TORCH_CHECK(states.dim() == 4, op, ": states must be [B, H, T, D], got ", states.sizes());
  const int64_t B = states.size(0), H = states.size(1), T = states.size(2), D = states.size(3);
  TORCH_CHECK(factor.dim() == 3 && factor.size(0) == H && factor.size(1) == D && factor.size(2) == D, op,
              ": factor must be [H, D, D] = [", H, ", ", D, ", ", D, "], got ", factor.sizes());
  TORCH_CHECK(order.dim() == 2 && order.size(0) == H && order.size(1) == D, op, ": order must be [H, D] = [", H, ", ",
              D, "], got ", order.sizes());
  TORCH_CHECK(scale.numel() == 1 || scale.numel() == B * H, op, ": scale must have 1 or B * H = ", B * H,
              " elements, got ", scale.numel());
  TORCH_CHECK(dtype == at::kFloat8_e4m3fn || dtype == at::kFloat8_e5m2, op,
              ": dtype must be float8_e4m3fn or float8_e5m2, got ", dtype);
  const at::Tensor x = states.to(at::kFloat).contiguous();
  const at::Tensor s = scale.to(at::kFloat).contiguous();
  const at::Tensor f = factor.to(at::kFloat).contiguous();
  const at::Tensor o = order.to(at::kLong).contiguous();
  const int64_t* ord = o.data_ptr<int64_t>();
  for (int64_t i = 0; i < H * D; ++i)  // a bad order would write outside its row
    TORCH_CHECK(ord[i] >= 0 && ord[i] < D, op, ": order holds ", ord[i], ", outside [0, ", D, ")");
  at::Tensor out = at::empty({B, H, T, D}, states.options().dtype(at::kByte));
  const bool per_head = s.numel() != 1;
  const bool e4m3 = dtype == at::kFloat8_e4m3fn, wide = T >= kRows;
  auto run = wide ? (e4m3 ? &compensated_rows<c10::Float8_e4m3fn, kRows> : &compensated_rows<c10::Float8_e5m2, kRows>)
                  : (e4m3 ? &compensated_rows<c10::Float8_e4m3fn, 1> : &compensated_rows<c10::Float8_e5m2, 1>);
  const int64_t R = wide ? kRows : 1;
  // Row groups are independent; a decode step has B * H single rows, too few to be worth threads.
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, R * D * D));
  at::parallel_for(0, B * H * ((T + R - 1) / R), grain, [&](int64_t begin, int64_t end) {
    run(x.data_ptr<float>(), s.data_ptr<float>(), per_head, f.data_ptr<float>(), ord, out.data_ptr<uint8_t>(), H, T,
        D, begin, end);
  });
  return out.view(dtype);
}

}  // namespace
}  // namespace qfp8

TORCH_LIBRARY_IMPL(qfp8, CPU, m) {
  m.impl("fp8_decode_attention", &qfp8::fp8_decode_attention);
  m.impl("fp8_compensated_quantize", &qfp8::fp8_compensated_quantize);
}
