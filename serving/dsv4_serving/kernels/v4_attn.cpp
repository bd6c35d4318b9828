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

void check(const torch::Tensor& t, const char* name, int64_t dim, torch::ScalarType dtype) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
  TORCH_CHECK(t.dim() == dim, name, " must have ", dim, " dims");
  TORCH_CHECK(t.scalar_type() == dtype, name, " has the wrong dtype");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

}  // namespace

// out[k] = q . r[k] for four rows at once: four independent chains, each q load used four
// times, one transposed reduction
inline void dot4(const float* q, const float* const* r, int64_t n, float* out) {
#if defined(__AVX2__) && defined(__FMA__)
  if (n % 8 == 0) {
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps(), s2 = _mm256_setzero_ps(),
           s3 = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; i += 8) {
      const __m256 qv = _mm256_loadu_ps(q + i);
      s0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(r[0] + i), s0);
      s1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(r[1] + i), s1);
      s2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(r[2] + i), s2);
      s3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(r[3] + i), s3);
    }
    const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(s0, s1), _mm256_hadd_ps(s2, s3));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1)));
    return;
  }
#endif
  for (int k = 0; k < 4; ++k) out[k] = dot(q, r[k], n);
}

// Rotate the trailing 2 * half channels of x [D] in pairs by (c, sign * s), as
// layers/rope.py:rotate_tail_interleaved: (x0 c - x1 s, x1 c + x0 s) (sign -1: the inverse).
inline void rotate_tail(float* x, int64_t D, int64_t half, const float* c, const float* s,
                        float sign) {
  float* p = x + D - 2 * half;
  for (int64_t i = 0; i < half; ++i) {
    const float x0 = p[2 * i], x1 = p[2 * i + 1], si = sign * s[i];
    p[2 * i] = x0 * c[i] + x1 * -si;
    p[2 * i + 1] = x1 * c[i] + x0 * si;
  }
}

// out[h] = sum_j p[h][j] * rows[j], accumulated in registers 64 channels at a time
inline void weighted_sum(float* out, const float* p, const float* const* rows, int64_t n,
                         int64_t D) {
#if defined(__AVX2__) && defined(__FMA__)
  int64_t c = 0;
  for (; c + 64 <= D; c += 64) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(),
           a3 = _mm256_setzero_ps(), a4 = _mm256_setzero_ps(), a5 = _mm256_setzero_ps(),
           a6 = _mm256_setzero_ps(), a7 = _mm256_setzero_ps();
    for (int64_t j = 0; j < n; ++j) {
      const __m256 w = _mm256_set1_ps(p[j]);
      const float* r = rows[j] + c;
      a0 = _mm256_fmadd_ps(w, _mm256_loadu_ps(r), a0);
      a1 = _mm256_fmadd_ps(w, _mm256_loadu_ps(r + 8), a1);
      a2 = _mm256_fmadd_ps(w, _mm256_loadu_ps(r + 16), a2);
      a3 = _mm256_fmadd_ps(w, _mm256_loadu_ps(r + 24), a3);
      a4 = _mm256_fmadd_ps(w, _mm256_loadu_ps(r + 32), a4);
      a5 = _mm256_fmadd_ps(w, _mm256_loadu_ps(r + 40), a5);
      a6 = _mm256_fmadd_ps(w, _mm256_loadu_ps(r + 48), a6);
      a7 = _mm256_fmadd_ps(w, _mm256_loadu_ps(r + 56), a7);
    }
    _mm256_storeu_ps(out + c, a0);
    _mm256_storeu_ps(out + c + 8, a1);
    _mm256_storeu_ps(out + c + 16, a2);
    _mm256_storeu_ps(out + c + 24, a3);
    _mm256_storeu_ps(out + c + 32, a4);
    _mm256_storeu_ps(out + c + 40, a5);
    _mm256_storeu_ps(out + c + 48, a6);
    _mm256_storeu_ps(out + c + 56, a7);
  }
  for (; c < D; ++c) {
    float a = 0.f;
    for (int64_t j = 0; j < n; ++j) a += p[j] * rows[j][c];
    out[c] = a;
  }
#else
  for (int64_t c = 0; c < D; ++c) {
    float a = 0.f;
    for (int64_t j = 0; j < n; ++j) a += p[j] * rows[j][c];
    out[c] = a;
  }
#endif
}

// q [T, H, D] float32, ksrc [Rk, D], kidx [T, K] int64, csrc [Rc, D], cidx [T, E] int64,
// sink [H] float32, cos / sin [T, half] (or empty: q is rotated, the output stays rotated)
// -> out [T, H, D]. With cos / sin each query head is rotated by its row's angle first and
// the output rotated back, as the torch path does around its attention.
torch::Tensor v4_attn(const torch::Tensor& q, const torch::Tensor& ksrc, const torch::Tensor& kidx,
                      const torch::Tensor& csrc, const torch::Tensor& cidx,
                      const torch::Tensor& sink, double scale, const torch::Tensor& cos,
                      const torch::Tensor& sin) {
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
  const bool rope = cos.numel() > 0;
  int64_t half = 0;
  if (rope) {
    check(cos, "cos", 2, torch::kFloat32);
    check(sin, "sin", 2, torch::kFloat32);
    half = cos.size(1);
    TORCH_CHECK(cos.size(0) == T && sin.sizes() == cos.sizes() && 2 * half <= D, "cos / sin");
  }
  TORCH_CHECK(kidx.numel() == 0 || kidx.max().item<int64_t>() < ksrc.size(0), "window row");
  TORCH_CHECK(cidx.numel() == 0 || cidx.max().item<int64_t>() < csrc.size(0), "entry row");
  auto out = torch::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float* kp = ksrc.data_ptr<float>();
  const float* cp = csrc.data_ptr<float>();
  const int64_t* ki = kidx.data_ptr<int64_t>();
  const int64_t* ci = cidx.data_ptr<int64_t>();
  const float* sp = sink.data_ptr<float>();
  const float* cosp = rope ? cos.data_ptr<float>() : nullptr;
  const float* sinp = rope ? sin.data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, T, 1, [&](int64_t lo, int64_t hi) {
    std::vector<const float*> rows(K + E);
    std::vector<float> logit(H * (K + E));
    std::vector<float> qbuf(H * D);
    for (int64_t t = lo; t < hi; ++t) {
      int64_t n = 0;
      for (int64_t j = 0; j < K; ++j) {
        const int64_t r = ki[t * K + j];
        if (r >= 0) rows[n++] = kp + r * D;
      }
      for (int64_t j = 0; j < E; ++j) {
        const int64_t r = ci[t * E + j];
        if (r >= 0) rows[n++] = cp + r * D;
      }
      const float* qt = qp + t * H * D;
      if (rope) {
        std::copy(qt, qt + H * D, qbuf.data());
        for (int64_t h = 0; h < H; ++h)
          rotate_tail(qbuf.data() + h * D, D, half, cosp + t * half, sinp + t * half, 1.f);
        qt = qbuf.data();
      }
      for (int64_t h = 0; h < H; ++h) {
        float* l = logit.data() + h * n;
        int64_t j = 0;
        for (; j + 4 <= n; j += 4) dot4(qt + h * D, rows.data() + j, D, l + j);
        for (; j < n; ++j) l[j] = dot(qt + h * D, rows[j], D);
        for (j = 0; j < n; ++j) l[j] *= sc;
      }
      float* ot = op + t * H * D;
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
        weighted_sum(ot + h * D, l, rows.data(), n, D);
        if (rope) rotate_tail(ot + h * D, D, half, cosp + t * half, sinp + t * half, -1.f);
      }
    }
  });
  return out;
}

// x [T, ..., D] float32 -> a copy with each row's trailing 2 * half channels rotated by that
// row's cos / sin [T, half] (inverse: by the negative angle), as rotate_tail_interleaved
torch::Tensor rope_tail(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                        bool inverse) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat32 && x.is_contiguous(),
              "x must be contiguous float32 on the CPU");
  TORCH_CHECK(x.dim() >= 2, "x must be [T, ..., D]");
  check(cos, "cos", 2, torch::kFloat32);
  check(sin, "sin", 2, torch::kFloat32);
  const int64_t T = x.size(0), D = x.size(-1), half = cos.size(1);
  const int64_t M = T ? x.numel() / (T * D) : 0;
  TORCH_CHECK(cos.size(0) == T && sin.sizes() == cos.sizes() && 2 * half <= D, "cos / sin");
  auto out = x.clone();
  float* op = out.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const float sign = inverse ? -1.f : 1.f;
  at::parallel_for(0, T, 64, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t)
      for (int64_t m = 0; m < M; ++m)
        rotate_tail(op + (t * M + m) * D, D, half, cp + t * half, sp + t * half, sign);
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("v4_attn", &v4_attn, "V4 attention over gathered window and entry rows, with sinks");
  m.def("rope_tail", &rope_tail, "rotate the trailing channels in pairs (interleaved rope)");
}
