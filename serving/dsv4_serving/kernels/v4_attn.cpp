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
//
// q and the key rows are float32 or bfloat16 (each on its own: the cache may be stored in
// another dtype than the model's). bfloat16 rows are widened 8 or 16 channels at a time (vec.h), all
// arithmetic is float32, and a bfloat16 output is the float32 result rounded once. Heads are
// tiled (HT a tile): a key row is loaded and widened once for the tile's heads, not once per
// head; each (head, key) dot product and each output channel's sum keeps its order, so every
// tile width and the AVX-512 and AVX2 builds give the same bits.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "vec.h"

namespace {

using dsv4::bf16;

#if defined(DSV4_VEC_AVX512)
constexpr const char* PATH = "avx512";  // the value sums in 16 lanes, 4 heads a tile
#elif defined(DSV4_VEC_AVX2)
constexpr const char* PATH = "avx2";  // 8 lanes, 2 heads a tile
#else
constexpr const char* PATH = "scalar";
#endif

template <typename K>
inline float dot(const float* a, const K* b, int64_t n) {
  int64_t i = 0;
  float s = 0.f;
#if defined(DSV4_VEC_AVX2)
  __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), dsv4::load8(b + i), s0);
    s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), dsv4::load8(b + i + 8), s1);
  }
  for (; i + 8 <= n; i += 8) {
    s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), dsv4::load8(b + i), s0);
  }
  s = dsv4::hsum(_mm256_add_ps(s0, s1));
#endif
  for (; i < n; ++i) s = dsv4::madd(a[i], dsv4::widen(b[i]), s);
  return s;
}

bool is_float_or_bf16(const torch::Tensor& t) {
  return t.scalar_type() == torch::kFloat32 || t.scalar_type() == torch::kBFloat16;
}

void check(const torch::Tensor& t, const char* name, int64_t dim, torch::ScalarType dtype) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
  TORCH_CHECK(t.dim() == dim, name, " must have ", dim, " dims");
  TORCH_CHECK(t.scalar_type() == dtype, name, " has the wrong dtype");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

// out[k] = q . r[k] for four rows at once: four independent chains, each q load used four
// times, one transposed reduction
template <typename K>
inline void dot4(const float* q, const K* const* r, int64_t n, float* out) {
#if defined(DSV4_VEC_AVX2)
  if (n % 8 == 0) {
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps(), s2 = _mm256_setzero_ps(),
           s3 = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; i += 8) {
      const __m256 qv = _mm256_loadu_ps(q + i);
      s0 = _mm256_fmadd_ps(qv, dsv4::load8(r[0] + i), s0);
      s1 = _mm256_fmadd_ps(qv, dsv4::load8(r[1] + i), s1);
      s2 = _mm256_fmadd_ps(qv, dsv4::load8(r[2] + i), s2);
      s3 = _mm256_fmadd_ps(qv, dsv4::load8(r[3] + i), s3);
    }
    const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(s0, s1), _mm256_hadd_ps(s2, s3));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1)));
    return;
  }
#endif
  for (int k = 0; k < 4; ++k) out[k] = dot(q, r[k], n);
}

// dot4 for NH heads at once: out[h][k] = q[h] . r[k]. Each row chunk is loaded (and widened)
// once for all NH heads instead of once per head; every (head, row) sum runs as in dot4 (one
// chain over the chunks, the same reduction), so the results are dot4's bit for bit. NH * 4
// accumulators: NH = 4 needs the 32 vector registers of AVX-512 (its ymm16-31).
template <int NH, typename K>
inline void dot4_heads(const float* const* q, const K* const* r, int64_t n, float* const* out) {
#if defined(DSV4_VEC_AVX2)
  if (n % 8 == 0) {
    __m256 s[NH][4];
    for (int h = 0; h < NH; ++h)
      for (int k = 0; k < 4; ++k) s[h][k] = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; i += 8) {
      __m256 rv[4];
      for (int k = 0; k < 4; ++k) rv[k] = dsv4::load8(r[k] + i);
      for (int h = 0; h < NH; ++h) {
        const __m256 qv = _mm256_loadu_ps(q[h] + i);
        for (int k = 0; k < 4; ++k) s[h][k] = _mm256_fmadd_ps(qv, rv[k], s[h][k]);
      }
    }
    for (int h = 0; h < NH; ++h) {
      const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(s[h][0], s[h][1]),
                                      _mm256_hadd_ps(s[h][2], s[h][3]));
      _mm_storeu_ps(out[h], _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1)));
    }
    return;
  }
#endif
  for (int h = 0; h < NH; ++h) dot4(q[h], r, n, out[h]);
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
template <typename K>
inline void weighted_sum(float* out, const float* p, const K* const* rows, int64_t n,
                         int64_t D) {
  int64_t c = 0;
#if defined(DSV4_VEC_AVX2)
  for (; c + 64 <= D; c += 64) {
    __m256 a[8];
    for (int u = 0; u < 8; ++u) a[u] = _mm256_setzero_ps();
    for (int64_t j = 0; j < n; ++j) {
      const __m256 w = _mm256_set1_ps(p[j]);
      const K* r = rows[j] + c;
      for (int u = 0; u < 8; ++u) a[u] = _mm256_fmadd_ps(w, dsv4::load8(r + 8 * u), a[u]);
    }
    for (int u = 0; u < 8; ++u) _mm256_storeu_ps(out + c + 8 * u, a[u]);
  }
  for (; c + 8 <= D; c += 8) {
    __m256 a = _mm256_setzero_ps();
    for (int64_t j = 0; j < n; ++j)
      a = _mm256_fmadd_ps(_mm256_set1_ps(p[j]), dsv4::load8(rows[j] + c), a);
    _mm256_storeu_ps(out + c, a);
  }
#endif
  for (; c < D; ++c) {
    float a = 0.f;
    for (int64_t j = 0; j < n; ++j) a = dsv4::madd(p[j], dsv4::widen(rows[j][c]), a);
    out[c] = a;
  }
}

// weighted_sum for NH heads at once (out[h] = sum_j p[h][j] * rows[j]): each row chunk is
// loaded and widened once for all of them. Per channel the sum runs over j in order with one
// FMA each from zero, as in weighted_sum, at 16 lanes (AVX-512) or 8: bit for bit the same.
template <int NH, typename K>
inline void weighted_sum_heads(float* const* out, const float* const* p, const K* const* rows,
                               int64_t n, int64_t D) {
  int64_t c = 0;
#if defined(DSV4_VEC_AVX512)
  for (; c + 64 <= D; c += 64) {
    __m512 a[NH][4];
    for (int h = 0; h < NH; ++h)
      for (int u = 0; u < 4; ++u) a[h][u] = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; ++j) {
      __m512 rv[4];
      for (int u = 0; u < 4; ++u) rv[u] = dsv4::load16(rows[j] + c + 16 * u);
      for (int h = 0; h < NH; ++h) {
        const __m512 w = _mm512_set1_ps(p[h][j]);
        for (int u = 0; u < 4; ++u) a[h][u] = _mm512_fmadd_ps(w, rv[u], a[h][u]);
      }
    }
    for (int h = 0; h < NH; ++h)
      for (int u = 0; u < 4; ++u) _mm512_storeu_ps(out[h] + c + 16 * u, a[h][u]);
  }
#endif
  if (c == 0) {  // no AVX-512 loop ran: head by head
    for (int h = 0; h < NH; ++h) weighted_sum(out[h], p[h], rows, n, D);
  } else if (c < D) {  // the channels left, head by head
    std::vector<const K*> shifted(rows, rows + n);
    for (auto& r : shifted) r += c;
    for (int h = 0; h < NH; ++h) weighted_sum(out[h] + c, p[h], shifted.data(), n, D - c);
  }
}

// dst [n] float32 <- src [n] (widened), and back (rounded once for bfloat16)
template <typename S>
inline void to_floats(const S* src, int64_t n, float* dst) {
  int64_t i = 0;
#if defined(DSV4_VEC_AVX2)
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, dsv4::load8(src + i));
#endif
  for (; i < n; ++i) dst[i] = dsv4::widen(src[i]);
}

template <typename S>
inline void from_floats(const float* src, int64_t n, S* dst) {
  int64_t i = 0;
#if defined(DSV4_VEC_AVX2)
  for (; i + 8 <= n; i += 8) dsv4::store8(dst + i, _mm256_loadu_ps(src + i));
#endif
  for (; i < n; ++i) dsv4::put(dst + i, src[i]);
}

// heads per tile of the score and value loops (dot4_heads, weighted_sum_heads)
#if defined(DSV4_VEC_AVX512)
constexpr int HT = 4;
#else
constexpr int HT = 2;
#endif

// logits l[h][j] = scale * q[h] . rows[j] for NH heads from h0 (l: H x n, row-major)
template <int NH, typename K>
inline void head_logits(const float* qt, const K* const* rows, int64_t n, int64_t D, int64_t h0,
                        float* logit, float scale) {
  const float* qh[NH];
  float* lh[NH];
  for (int h = 0; h < NH; ++h) {
    qh[h] = qt + (h0 + h) * D;
    lh[h] = logit + (h0 + h) * n;
  }
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
    float* o[NH];
    for (int h = 0; h < NH; ++h) o[h] = lh[h] + j;
    dot4_heads<NH>(qh, rows + j, D, o);
  }
  for (int h = 0; h < NH; ++h) {
    for (int64_t k = j; k < n; ++k) lh[h][k] = dot(qh[h], rows[k], D);
    for (int64_t k = 0; k < n; ++k) lh[h][k] *= scale;
  }
}

template <int NH, typename K>
inline void head_outputs(float* ot, const float* logit, const K* const* rows, int64_t n,
                         int64_t D, int64_t h0) {
  float* oh[NH];
  const float* ph[NH];
  for (int h = 0; h < NH; ++h) {
    oh[h] = ot + (h0 + h) * D;
    ph[h] = logit + (h0 + h) * n;
  }
  weighted_sum_heads<NH>(oh, ph, rows, n, D);
}

struct Rows {
  int64_t T, H, D, K, E, half;
  const int64_t* ki;
  const int64_t* ci;
  const float* sink;
  const float* cos;  // nullptr: no rope
  const float* sin;
  float scale;
};

// Every query row of q [T, H, D] over its window keys ksrc[ki[t]] then entries csrc[ci[t]].
template <typename Q, typename K>
void attend(const Rows& a, const Q* qp, const K* kp, const K* cp, Q* op) {
  const int64_t H = a.H, D = a.D, K_ = a.K, E = a.E, half = a.half;
  at::parallel_for(0, a.T, 1, [&](int64_t lo, int64_t hi) {
    std::vector<const K*> rows(K_ + E);
    std::vector<float> logit(H * (K_ + E));
    std::vector<float> qbuf(H * D), obuf(H * D);
    for (int64_t t = lo; t < hi; ++t) {
      int64_t n = 0;
      for (int64_t j = 0; j < K_; ++j) {
        const int64_t r = a.ki[t * K_ + j];
        if (r >= 0) rows[n++] = kp + r * D;
      }
      for (int64_t j = 0; j < E; ++j) {
        const int64_t r = a.ci[t * E + j];
        if (r >= 0) rows[n++] = cp + r * D;
      }
      const float* qt;
      if constexpr (std::is_same<Q, float>::value) qt = qp + t * H * D;
      if (a.cos != nullptr || !std::is_same<Q, float>::value) {
        to_floats(qp + t * H * D, H * D, qbuf.data());
        if (a.cos != nullptr)
          for (int64_t h = 0; h < H; ++h)
            rotate_tail(qbuf.data() + h * D, D, half, a.cos + t * half, a.sin + t * half, 1.f);
        qt = qbuf.data();
      }
      int64_t h0 = 0;
      for (; h0 + HT <= H; h0 += HT)
        head_logits<HT>(qt, rows.data(), n, D, h0, logit.data(), a.scale);
      for (; h0 < H; ++h0) head_logits<1>(qt, rows.data(), n, D, h0, logit.data(), a.scale);
      float* ot;
      if constexpr (std::is_same<Q, float>::value)
        ot = op + t * H * D;
      else
        ot = obuf.data();
      for (int64_t h = 0; h < H; ++h) {
        float* l = logit.data() + h * n;
        float m = a.sink[h];
        for (int64_t j = 0; j < n; ++j) m = std::max(m, l[j]);
        float z = 0.f;
        for (int64_t j = 0; j < n; ++j) {
          l[j] = std::exp(l[j] - m);
          z += l[j];
        }
        z += std::exp(a.sink[h] - m);
        const float inv = 1.f / z;
        for (int64_t j = 0; j < n; ++j) l[j] *= inv;
      }
      for (h0 = 0; h0 + HT <= H; h0 += HT)
        head_outputs<HT>(ot, logit.data(), rows.data(), n, D, h0);
      for (; h0 < H; ++h0) head_outputs<1>(ot, logit.data(), rows.data(), n, D, h0);
      if (a.cos != nullptr)
        for (int64_t h = 0; h < H; ++h)
          rotate_tail(ot + h * D, D, half, a.cos + t * half, a.sin + t * half, -1.f);
      if constexpr (!std::is_same<Q, float>::value) from_floats(ot, H * D, op + t * H * D);
    }
  });
}

template <typename Q>
void attend_q(const Rows& a, const torch::Tensor& q, const torch::Tensor& ksrc,
              const torch::Tensor& csrc, torch::Tensor& out) {
  const Q* qp = q.data_ptr<Q>();
  Q* op = out.data_ptr<Q>();
  if (ksrc.scalar_type() == torch::kFloat32)
    attend<Q, float>(a, qp, ksrc.data_ptr<float>(), csrc.data_ptr<float>(), op);
  else
    attend<Q, bf16>(a, qp, ksrc.data_ptr<bf16>(), csrc.data_ptr<bf16>(), op);
}

}  // namespace

// q [T, H, D] float32 or bfloat16, ksrc [Rk, D] and csrc [Rc, D] float32 or bfloat16 (one
// dtype for both), kidx [T, K] int64, cidx [T, E] int64, sink [H] float32, cos / sin [T, half]
// float32 (or empty: q is rotated, the output stays rotated) -> out [T, H, D] in q's dtype.
// With cos / sin each query head is rotated by its row's angle first and the output rotated
// back, as the torch path does around its attention.
torch::Tensor v4_attn(const torch::Tensor& q, const torch::Tensor& ksrc, const torch::Tensor& kidx,
                      const torch::Tensor& csrc, const torch::Tensor& cidx,
                      const torch::Tensor& sink, double scale, const torch::Tensor& cos,
                      const torch::Tensor& sin) {
  TORCH_CHECK(is_float_or_bf16(q) && is_float_or_bf16(ksrc), "q and ksrc: float32 or bfloat16");
  check(q, "q", 3, q.scalar_type());
  check(ksrc, "ksrc", 2, ksrc.scalar_type());
  check(kidx, "kidx", 2, torch::kInt64);
  check(csrc, "csrc", 2, ksrc.scalar_type());
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
  const Rows rows{T,
                  H,
                  D,
                  K,
                  E,
                  half,
                  kidx.data_ptr<int64_t>(),
                  cidx.data_ptr<int64_t>(),
                  sink.data_ptr<float>(),
                  rope ? cos.data_ptr<float>() : nullptr,
                  rope ? sin.data_ptr<float>() : nullptr,
                  static_cast<float>(scale)};
  if (q.scalar_type() == torch::kFloat32)
    attend_q<float>(rows, q, ksrc, csrc, out);
  else
    attend_q<bf16>(rows, q, ksrc, csrc, out);
  return out;
}

namespace {

// every row of x [T, M, D]: its trailing 2 * half channels rotated by cos / sin [T, half]
template <typename S>
void rope_rows(S* x, int64_t T, int64_t M, int64_t D, int64_t half, const float* cp,
               const float* sp, float sign) {
  at::parallel_for(0, T, 64, [&](int64_t lo, int64_t hi) {
    std::vector<float> buf(2 * half);
    for (int64_t t = lo; t < hi; ++t)
      for (int64_t m = 0; m < M; ++m) {
        S* tail = x + (t * M + m) * D + D - 2 * half;
        if constexpr (std::is_same<S, float>::value) {
          rotate_tail(tail, 2 * half, half, cp + t * half, sp + t * half, sign);
        } else {
          to_floats(tail, 2 * half, buf.data());
          rotate_tail(buf.data(), 2 * half, half, cp + t * half, sp + t * half, sign);
          from_floats(buf.data(), 2 * half, tail);
        }
      }
  });
}

}  // namespace

// x [T, ..., D] float32 or bfloat16 -> a copy with each row's trailing 2 * half channels
// rotated by that row's cos / sin [T, half] (inverse: by the negative angle), as
// rotate_tail_interleaved (bfloat16: rotated in float32, rounded once)
torch::Tensor rope_tail(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                        bool inverse) {
  TORCH_CHECK(x.device().is_cpu() && is_float_or_bf16(x) && x.is_contiguous(),
              "x must be contiguous float32 or bfloat16 on the CPU");
  TORCH_CHECK(x.dim() >= 2, "x must be [T, ..., D]");
  check(cos, "cos", 2, torch::kFloat32);
  check(sin, "sin", 2, torch::kFloat32);
  const int64_t T = x.size(0), D = x.size(-1), half = cos.size(1);
  const int64_t M = T ? x.numel() / (T * D) : 0;
  TORCH_CHECK(cos.size(0) == T && sin.sizes() == cos.sizes() && 2 * half <= D, "cos / sin");
  auto out = x.clone();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const float sign = inverse ? -1.f : 1.f;
  if (x.scalar_type() == torch::kFloat32)
    rope_rows(out.data_ptr<float>(), T, M, D, half, cp, sp, sign);
  else
    rope_rows(out.data_ptr<bf16>(), T, M, D, half, cp, sp, sign);
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  if (const char* isa = dsv4::build_lacks())
    throw std::runtime_error(std::string("this build of v4_attn needs ") + isa +
                             ", which this CPU lacks (a cached build from another machine?)");
  m.def("v4_attn", &v4_attn, "V4 attention over gathered window and entry rows, with sinks");
  m.def("rope_tail", &rope_tail, "rotate the trailing channels in pairs (interleaved rope)");
  m.attr("path") = PATH;
}
