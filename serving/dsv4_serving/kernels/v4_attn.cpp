// DeepSeek V4 attention over gathered key rows, read in place.
//
// For each query row t and head h:
//   out[t, h] = sum_j p_j * key_j,  p = softmax({scale * q[t, h] . key_j} U {sink[h]})
// over the keys j = ksrc[kidx[t, :]] (the sliding window) then csrc[cidx[t, :]] (the
// compressed entries the query sees); an index of -1 is no key. Keys are values (V4 shares
// its K=V head). Every key row is read once per query row and used by all its heads while it
// is in cache; no gathered copy, no score tensor, no mask tensor. Rows are independent and
// each is reduced in a fixed order (window keys, then entries, then the sink), so a row's
// result does not depend on the rest of the batch or on the thread count.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cmath>
#include <limits>
#include <vector>

namespace {

inline float dot(const float* a, const float* b, int64_t n) {
#if defined(__AVX2__) && defined(__FMA__)
  __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
    s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
  }
  for (; i + 8 <= n; i += 8) {
    s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
  }
  s0 = _mm256_add_ps(s0, s1);
  __m128 lo = _mm256_castps256_ps128(s0), hi = _mm256_extractf128_ps(s0, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_hadd_ps(lo, lo);
  lo = _mm_hadd_ps(lo, lo);
  float s = _mm_cvtss_f32(lo);
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
#else
  float s = 0.f;
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
#endif
}

// y += p * x
inline void axpy(float* y, float p, const float* x, int64_t n) {
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 vp = _mm256_set1_ps(p);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(y + i, _mm256_fmadd_ps(vp, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
  }
  for (; i < n; ++i) y[i] += p * x[i];
#else
  for (int64_t i = 0; i < n; ++i) y[i] += p * x[i];
#endif
}

void check(const torch::Tensor& t, const char* name, int64_t dim, torch::ScalarType dtype) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
  TORCH_CHECK(t.dim() == dim, name, " must have ", dim, " dims");
  TORCH_CHECK(t.scalar_type() == dtype, name, " has the wrong dtype");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

}  // namespace

// q [T, H, D] float32, ksrc [Rk, D], kidx [T, K] int64, csrc [Rc, D], cidx [T, E] int64,
// sink [H] float32 -> out [T, H, D]
torch::Tensor v4_attn(const torch::Tensor& q, const torch::Tensor& ksrc, const torch::Tensor& kidx,
                      const torch::Tensor& csrc, const torch::Tensor& cidx,
                      const torch::Tensor& sink, double scale) {
  check(q, "q", 3, torch::kFloat32);
  check(ksrc, "ksrc", 2, torch::kFloat32);
  check(kidx, "kidx", 2, torch::kInt64);
  check(csrc, "csrc", 2, torch::kFloat32);
  check(cidx, "cidx", 2, torch::kInt64);
  check(sink, "sink", 1, torch::kFloat32);
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t K = kidx.size(1), E = cidx.size(1);
  TORCH_CHECK(kidx.size(0) == T && cidx.size(0) == T, "one index row per query row");
  TORCH_CHECK(ksrc.size(1) == D && (csrc.size(1) == D || E == 0), "key width != head dim");
  TORCH_CHECK(sink.size(0) == H, "one sink per head");
  auto out = torch::zeros_like(q);
  const float* qp = q.data_ptr<float>();
  const float* kp = ksrc.data_ptr<float>();
  const float* cp = csrc.data_ptr<float>();
  const int64_t* ki = kidx.data_ptr<int64_t>();
  const int64_t* ci = cidx.data_ptr<int64_t>();
  const float* sp = sink.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t nk = ksrc.size(0), nc = csrc.size(0);
  TORCH_CHECK(kidx.numel() == 0 || kidx.max().item<int64_t>() < nk, "window row out of range");
  TORCH_CHECK(cidx.numel() == 0 || cidx.max().item<int64_t>() < nc, "entry row out of range");
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, T, 1, [&](int64_t lo, int64_t hi) {
    std::vector<const float*> rows(K + E);
    std::vector<float> logit(H * (K + E));
    for (int64_t t = lo; t < hi; ++t) {
      int64_t n = 0;
      for (int64_t j = 0; j < K; ++j) {
        const int64_t r = ki[t * K + j];
        if (r < 0) continue;
        rows[n++] = kp + r * D;
      }
      for (int64_t j = 0; j < E; ++j) {
        const int64_t r = ci[t * E + j];
        if (r < 0) continue;
        rows[n++] = cp + r * D;
      }
      const float* qt = qp + t * H * D;
      for (int64_t j = 0; j < n; ++j) {
        for (int64_t h = 0; h < H; ++h) logit[h * n + j] = dot(qt + h * D, rows[j], D) * sc;
      }
      for (int64_t h = 0; h < H; ++h) {
        float* l = logit.data() + h * n;
        float m = sp[h];
        for (int64_t j = 0; j < n; ++j) m = std::max(m, l[j]);
        float z = 0.f;
        for (int64_t j = 0; j < n; ++j) {
          l[j] = std::exp(l[j] - m);
          z += l[j];
        }
        z += std::exp(sp[h] - m);
        const float inv = 1.f / z;
        for (int64_t j = 0; j < n; ++j) l[j] *= inv;
      }
      float* ot = op + t * H * D;
      for (int64_t j = 0; j < n; ++j) {
        for (int64_t h = 0; h < H; ++h) axpy(ot + h * D, logit[h * n + j], rows[j], D);
      }
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("v4_attn", &v4_attn, "V4 attention over gathered window and entry rows, with sinks");
}
