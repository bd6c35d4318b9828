// mHC (manifold-constrained hyper-connections) around every V4 block, one pass per token.
//
// In torch each step of the stream mix is an op over [T, n, n] or [T, n, D] tensors: the
// Sinkhorn normalisation alone is 6 ops per iteration (20 iterations in V4), tiny reductions
// over a dim of 4 that cost far more in dispatch than in arithmetic. Here a token's whole
// chain runs in registers: hc_pre (sigmoid gates, softmax + Sinkhorn of the n x n mix, the
// weighted collapse of the streams) and hc_post (the block output into every stream on top of
// the mixed old streams). The arithmetic is the torch path's (layers/mhc.py) in the same order;
// only exp and the compiler's FMA contraction may differ in the last bit. Tokens are
// independent, so a token's result does not depend on the rest of the batch.
//
// The streams (and the block output) are float32 or bfloat16: bfloat16 is widened 8 channels
// at a time (vec.h), every sum runs in float32 and the result is rounded once on the way out.
// The gates and the mix (post, comb) stay float32, as the reference applies them (the torch
// fallback rounds them to bfloat16 first, and its bfloat16 matmul and sums round each step).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "vec.h"

namespace {

using dsv4::bf16;

constexpr int64_t MAX_N = 16;  // hc_mult (4 in V4); the n x n mix lives on the stack

inline float sigmoid(float x) { return 1.f / (1.f + std::exp(-x)); }

void check(const torch::Tensor& t, const char* what, bool bf16_ok = false) {
  const auto st = t.scalar_type();
  const bool dtype = st == at::kFloat || (bf16_ok && st == at::kBFloat16);
  if (t.device().type() != at::kCPU || !dtype || !t.is_contiguous())
    throw std::invalid_argument(std::string(what) + " must be a contiguous " +
                                (bf16_ok ? "float32 or bfloat16" : "float32") + " CPU tensor");
}

// The gates and the Sinkhorn-normalised mix of one token from its logits row `m`.
void gates(const float* m, const float* b, const float* sc, int64_t n, int64_t iters, float eps,
           float* pre, float* post, float* c) {
  float sums[MAX_N];
  for (int64_t a = 0; a < n; ++a) {
    pre[a] = sigmoid(m[a] * sc[0] + b[a]) + eps;
    post[a] = 2.f * sigmoid(m[n + a] * sc[1] + b[n + a]);
  }
  // softmax over each row, + eps
  for (int64_t r = 0; r < n; ++r) {
    float* row = c + r * n;
    float mxv = -INFINITY;
    for (int64_t k = 0; k < n; ++k) {
      row[k] = m[2 * n + r * n + k] * sc[2] + b[2 * n + r * n + k];
      mxv = std::max(mxv, row[k]);
    }
    float s = 0.f;
    for (int64_t k = 0; k < n; ++k) {
      row[k] = std::exp(row[k] - mxv);
      s += row[k];
    }
    for (int64_t k = 0; k < n; ++k) row[k] = row[k] / s + eps;
  }
  auto by_columns = [&]() {
    for (int64_t k = 0; k < n; ++k) sums[k] = 0.f;
    for (int64_t r = 0; r < n; ++r)
      for (int64_t k = 0; k < n; ++k) sums[k] += c[r * n + k];
    for (int64_t r = 0; r < n; ++r)
      for (int64_t k = 0; k < n; ++k) c[r * n + k] /= sums[k] + eps;
  };
  by_columns();
  for (int64_t it = 1; it < iters; ++it) {
    for (int64_t r = 0; r < n; ++r) {
      float s = 0.f;
      for (int64_t k = 0; k < n; ++k) s += c[r * n + k];
      for (int64_t k = 0; k < n; ++k) c[r * n + k] /= s + eps;
    }
    by_columns();
  }
}

// y [D] = sum_a w[a] * x[a] over n rows of x [n, D], in the order a = 0, 1, ...
template <typename S>
void collapse(const S* x, const float* w, int64_t n, int64_t d, S* y) {
  int64_t e = 0;
#if defined(DSV4_VEC_AVX512)
  for (; e + 16 <= d; e += 16) {
    __m512 acc = _mm512_mul_ps(_mm512_set1_ps(w[0]), dsv4::load16(x + e));
    for (int64_t a = 1; a < n; ++a)
      acc = _mm512_fmadd_ps(_mm512_set1_ps(w[a]), dsv4::load16(x + a * d + e), acc);
    dsv4::store16(y + e, acc);
  }
#endif
#if defined(DSV4_VEC_AVX2)
  for (; e + 8 <= d; e += 8) {
    __m256 acc = _mm256_mul_ps(_mm256_set1_ps(w[0]), dsv4::load8(x + e));
    for (int64_t a = 1; a < n; ++a)
      acc = _mm256_fmadd_ps(_mm256_set1_ps(w[a]), dsv4::load8(x + a * d + e), acc);
    dsv4::store8(y + e, acc);
  }
#endif
  for (; e < d; ++e) {
    float acc = w[0] * dsv4::widen(x[e]);
    for (int64_t a = 1; a < n; ++a) acc = dsv4::madd(w[a], dsv4::widen(x[a * d + e]), acc);
    dsv4::put(y + e, acc);
  }
}

template <typename S>
void pre_rows(const float* mx, const float* b, const float* sc, const S* st, int64_t t,
              int64_t n, int64_t d, int64_t iters, float eps, S* co, float* po, float* cm) {
  const int64_t width = (2 + n) * n;
  at::parallel_for(0, t, 16, [&](int64_t lo, int64_t hi) {
    float pre[MAX_N];
    for (int64_t i = lo; i < hi; ++i) {
      gates(mx + i * width, b, sc, n, iters, eps, pre, po + i * n, cm + i * n * n);
      collapse(st + i * n * d, pre, n, d, co + i * d);
    }
  });
}

// One token: y[a] = sum_j c[j, a] * x[j] + p[a] * o for every stream a, which is a
// collapse of the old streams with column a of the mix, then the block output on top
template <typename S>
void post_token(const S* o, const S* x, const float* p, const float* c, int64_t n, int64_t d,
                S* y) {
  float w[MAX_N];
  for (int64_t a = 0; a < n; ++a) {
    for (int64_t j = 0; j < n; ++j) w[j] = c[j * n + a];
    S* ya = y + a * d;
    int64_t e = 0;
#if defined(DSV4_VEC_AVX512)
    for (; e + 16 <= d; e += 16) {
      __m512 acc = _mm512_mul_ps(_mm512_set1_ps(w[0]), dsv4::load16(x + e));
      for (int64_t j = 1; j < n; ++j)
        acc = _mm512_fmadd_ps(_mm512_set1_ps(w[j]), dsv4::load16(x + j * d + e), acc);
      dsv4::store16(ya + e, _mm512_fmadd_ps(_mm512_set1_ps(p[a]), dsv4::load16(o + e), acc));
    }
#endif
#if defined(DSV4_VEC_AVX2)
    for (; e + 8 <= d; e += 8) {
      __m256 acc = _mm256_mul_ps(_mm256_set1_ps(w[0]), dsv4::load8(x + e));
      for (int64_t j = 1; j < n; ++j)
        acc = _mm256_fmadd_ps(_mm256_set1_ps(w[j]), dsv4::load8(x + j * d + e), acc);
      dsv4::store8(ya + e, _mm256_fmadd_ps(_mm256_set1_ps(p[a]), dsv4::load8(o + e), acc));
    }
#endif
    for (; e < d; ++e) {
      float acc = w[0] * dsv4::widen(x[e]);
      for (int64_t j = 1; j < n; ++j) acc = dsv4::madd(w[j], dsv4::widen(x[j * d + e]), acc);
      dsv4::put(ya + e, dsv4::madd(p[a], dsv4::widen(o[e]), acc));
    }
  }
}

}  // namespace

// mixes [T, (2 + n) n] (pre | post | comb logits), base [(2 + n) n], scale [3], streams [T, n, D]
// -> (collapsed [T, D], post [T, n], comb [T, n, n]); collapsed has the streams' dtype
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> hc_pre(
    const torch::Tensor& mixes, const torch::Tensor& base, const torch::Tensor& scale,
    const torch::Tensor& streams, int64_t iters, double hc_eps) {
  check(mixes, "mixes");
  check(base, "base");
  check(scale, "scale");
  check(streams, "streams", true);
  const int64_t t = streams.size(0), n = streams.size(1), d = streams.size(2);
  if (n > MAX_N || mixes.size(0) != t || mixes.size(1) != (2 + n) * n)
    throw std::invalid_argument("hc_pre: mixes must be [T, (2 + n) * n] for streams [T, n, D]");
  auto collapsed = torch::empty({t, d}, streams.options());
  auto post = torch::empty({t, n}, mixes.options());
  auto comb = torch::empty({t, n, n}, mixes.options());
  const float* mx = mixes.data_ptr<float>();
  const float* b = base.data_ptr<float>();
  const float* sc = scale.data_ptr<float>();
  float* po = post.data_ptr<float>();
  float* cm = comb.data_ptr<float>();
  const float eps = static_cast<float>(hc_eps);
  if (streams.scalar_type() == at::kFloat)
    pre_rows(mx, b, sc, streams.data_ptr<float>(), t, n, d, iters, eps,
             collapsed.data_ptr<float>(), po, cm);
  else
    pre_rows(mx, b, sc, streams.data_ptr<at::BFloat16>(), t, n, d, iters, eps,
             collapsed.data_ptr<at::BFloat16>(), po, cm);
  return {collapsed, post, comb};
}

// out [T, D], streams [T, n, D] (both float32 or both bfloat16), post [T, n], comb [T, n, n]
// -> new streams [T, n, D]: post[a] * out + sum_j comb[j, a] * streams[j]
torch::Tensor hc_post(const torch::Tensor& out, const torch::Tensor& streams,
                      const torch::Tensor& post, const torch::Tensor& comb) {
  check(out, "out", true);
  check(streams, "streams", true);
  check(post, "post");
  check(comb, "comb");
  const int64_t t = streams.size(0), n = streams.size(1), d = streams.size(2);
  if (out.size(0) != t || out.size(1) != d || comb.size(1) != n || n > MAX_N)
    throw std::invalid_argument("hc_post: shapes of out, streams and comb do not agree");
  if (out.scalar_type() != streams.scalar_type())
    throw std::invalid_argument("hc_post: out and streams must have one dtype");
  auto res = torch::empty_like(streams);
  const float* p = post.data_ptr<float>();
  const float* cm = comb.data_ptr<float>();
  auto rows = [&](auto* o, const auto* st, auto* r) {
    at::parallel_for(0, t, 16, [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i)
        post_token(o + i * d, st + i * n * d, p + i * n, cm + i * n * n, n, d, r + i * n * d);
    });
  };
  if (streams.scalar_type() == at::kFloat)
    rows(out.data_ptr<float>(), streams.data_ptr<float>(), res.data_ptr<float>());
  else
    rows(out.data_ptr<at::BFloat16>(), streams.data_ptr<at::BFloat16>(),
         res.data_ptr<at::BFloat16>());
  return res;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  if (const char* isa = dsv4::build_lacks())
    throw std::runtime_error(std::string("this build of mhc needs ") + isa +
                             ", which this CPU lacks (a cached build from another machine?)");
  m.def("hc_pre", &hc_pre, "mHC pre: gates, Sinkhorn mix, collapse (float32 or bfloat16)");
  m.def("hc_post", &hc_post, "mHC post: block output into the mixed streams (float32 or bfloat16)");
  m.attr("path") = dsv4::VEC_PATH;
}
