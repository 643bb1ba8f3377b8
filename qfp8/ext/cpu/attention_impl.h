// The decode-attention algorithm of kernel.h (DecodeAttention), shared by the
// scalar and the AVX2 translation units. Ops supplies the inner loops:
//   factor(format)          what Ops::row's values must be multiplied by
//   row(src, D, format, dst) D FP8 bytes -> float32 (value / factor)
//   dot(a, b, D), axpy(alpha, x, y, D)
//   exp_shift(s, n, max)    s[i] = exp(s[i] - max) (-inf -> 0); returns the sum
// Two passes per task: the scores of every valid position (K read once), a
// softmax over them, then the weighted sum of V rows (V read once). A
// position's score is kept in scratch, [G][S] floats per task.
#pragma once

#include <algorithm>
#include <limits>
#include <vector>

#include "kernel.h"

namespace qfp8 {

constexpr float kMaskedBelow = -1e30f;  // additive mask values at or below this mean "masked"

template <class Ops>
void decode_attention_tasks(const DecodeAttention& a, int64_t task_begin, int64_t task_end) {
  const int64_t G = a.Hq / a.Hkv, S = a.S, D = a.D;
  const float factor = Ops::factor(a.format);
  const float neg_inf = -std::numeric_limits<float>::infinity();
  std::vector<float> row(D), acc(G * D), total(G);
  for (int64_t task = task_begin; task < task_end; ++task) {
    const int64_t b = task / a.Hkv, h = task % a.Hkv;
    const float ks = a.k_scale[a.per_head_scale ? task : 0] * factor;
    const float vs = a.v_scale[a.per_head_scale ? task : 0] * factor;
    const float* q = a.q + (b * a.Hq + h * G) * D;
    const uint8_t* keys = a.k + task * S * D;  // task == b * Hkv + h
    const uint8_t* values = a.v + task * S * D;
    const float* mask = a.mask ? a.mask + b * S : nullptr;
    float* scores = a.scores + task * G * S;
    for (int64_t s = 0; s < S; ++s) {
      const float bias = mask ? mask[s] : 0.0f;
      if (bias <= kMaskedBelow) {
        for (int64_t g = 0; g < G; ++g) scores[g * S + s] = neg_inf;
        continue;
      }
      Ops::row(keys + s * D, D, a.format, row.data());
      for (int64_t g = 0; g < G; ++g) scores[g * S + s] = Ops::dot(q + g * D, row.data(), D) * ks + bias;
    }
    for (int64_t g = 0; g < G; ++g) {
      float* sg = scores + g * S;
      const float top = S > 0 ? *std::max_element(sg, sg + S) : neg_inf;  // an empty cache: zeros
      if (top == neg_inf) {
        std::fill(sg, sg + S, 0.0f);
        total[g] = 0.0f;
      } else {
        total[g] = Ops::exp_shift(sg, S, top);
      }
    }
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t s = 0; s < S; ++s) {
      if (mask && mask[s] <= kMaskedBelow) continue;
      Ops::row(values + s * D, D, a.format, row.data());
      for (int64_t g = 0; g < G; ++g) Ops::axpy(scores[g * S + s], row.data(), acc.data() + g * D, D);
    }
    for (int64_t g = 0; g < G; ++g) {
      float* out = a.out + (b * a.Hq + h * G + g) * D;
      const float mult = total[g] > 0.0f ? vs / total[g] : 0.0f;
      for (int64_t d = 0; d < D; ++d) out[d] = acc[g * D + d] * mult;
    }
  }
}

}  // namespace qfp8
