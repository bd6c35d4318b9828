// W8A8 linear: y = (int8(x) @ w.T) * x_scale * w_scale in one call, the activation quantized
// per token inside the kernel (symmetric, amax / 127, round half to even, clamp to +-127).
//
// The weight is read as stored (int8 [N, K], rows contiguous): the micro-kernel streams a few
// rows at once and reuses each loaded weight vector for several tokens, so no repacked copy is
// kept. Integer accumulation is exact, and every float step (the division by the scale, the
// int32 -> float conversion, the two scale products in that order, the final cast) is the one
// the pure-torch path (`layers/quant/methods.py`) performs, so the result is bitwise that path's.
//
// Two int8 dot products, picked at compile time (-march=native):
// - AVX-512 VNNI: vpdpbusd (u8 x s8, 4 products summed into int32, no saturation) with the
//   activation offset to unsigned (x + 128) and 128 * rowsum(w) subtracted at the end (the
//   rowsum comes from the same weight loads: one more vpdpbusd with ones per weight vector).
// - AVX2: vpmaddubsw on |w| (unsigned) and sign(x, w) (signed), then vpmaddwd with ones into
//   int32. Pairs stay below 2 * 128 * 127 < 2^15, so the int16 step never saturates (w may be
//   -128: its |w| is 128 as an unsigned byte; x is clamped to +-127).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace {

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define W8A8_VNNI 1
constexpr int64_t KSTEP = 64;
constexpr int NB = 4;  // weight rows per micro-kernel
constexpr uint8_t OFFSET = 128;
const char* const PATH = "avx512-vnni";
#elif defined(__AVX2__)
#define W8A8_AVX2 1
constexpr int64_t KSTEP = 32;
constexpr int NB = 2;
constexpr uint8_t OFFSET = 0;
const char* const PATH = "avx2";
#else
constexpr int64_t KSTEP = 1;
constexpr int NB = 1;
constexpr uint8_t OFFSET = 0;
const char* const PATH = "scalar";
#endif
constexpr int MB = 4;          // tokens per micro-kernel
constexpr int64_t MCHUNK = 128;  // tokens per pass over the weight (their codes stay in L2)

// ---- per-token quantization -------------------------------------------------------------

float row_amax(const float* x, int64_t k) {
  int64_t i = 0;
  float m = 0.f;
#if defined(__AVX2__)
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 v0 = _mm256_setzero_ps(), v1 = _mm256_setzero_ps();
  for (; i + 16 <= k; i += 16) {
    v0 = _mm256_max_ps(v0, _mm256_and_ps(_mm256_loadu_ps(x + i), absmask));
    v1 = _mm256_max_ps(v1, _mm256_and_ps(_mm256_loadu_ps(x + i + 8), absmask));
  }
  v0 = _mm256_max_ps(v0, v1);
  float lanes[8];
  _mm256_storeu_ps(lanes, v0);
  for (float l : lanes) m = std::max(m, l);
#endif
  for (; i < k; ++i) m = std::max(m, std::fabs(x[i]));
  return m;
}

inline int32_t quantize_one(float v, float s) {
  float q = std::nearbyint(v / s);  // round half to even, as torch.round
  q = std::min(127.f, std::max(-127.f, q));
  return static_cast<int32_t>(q);
}

// codes[i] = clamp(round(x[i] / s)) + OFFSET for i < k, 0 up to kp
void quantize_row(const float* x, int64_t k, int64_t kp, float s, uint8_t* codes) {
  int64_t i = 0;
#if defined(__AVX2__)
  const __m256 vs = _mm256_set1_ps(s), lo = _mm256_set1_ps(-127.f), hi = _mm256_set1_ps(127.f);
  const __m256i off = _mm256_set1_epi8(static_cast<char>(OFFSET));
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  auto q8 = [&](const float* p) {
    __m256 v = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(p), vs),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    return _mm256_cvtps_epi32(_mm256_min_ps(hi, _mm256_max_ps(lo, v)));
  };
  for (; i + 32 <= k; i += 32) {
    __m256i a = _mm256_packs_epi32(q8(x + i), q8(x + i + 8));
    __m256i b = _mm256_packs_epi32(q8(x + i + 16), q8(x + i + 24));
    __m256i c = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(a, b), order);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + i), _mm256_add_epi8(c, off));
  }
#endif
  for (; i < k; ++i) codes[i] = static_cast<uint8_t>(quantize_one(x[i], s) + OFFSET);
  std::memset(codes + k, 0, kp - k);
}

// ---- int8 micro-kernels: acc[m][j] = sum_k code(x_m)[k] * w_j[k] (exact int32) ----------

#if defined(W8A8_VNNI)
// the lane sums of 16 accumulators, out[i] = sum(v[i]), by a transpose-and-add tree (45
// instructions instead of 16 horizontal reductions of about 8 each: with K of a few hundred
// the reductions would cost as much as the products)
__attribute__((always_inline)) inline void reduce16(const __m512i* v, int32_t* out) {
  __m512i p[8], q[4];
  for (int i = 0; i < 8; ++i)
    p[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(v[2 * i], v[2 * i + 1]),
                            _mm512_unpackhi_epi32(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)  // 128-bit lane L of q[g]: partial sums of v[4g..4g+3]
    q[i] = _mm512_add_epi32(_mm512_unpacklo_epi64(p[2 * i], p[2 * i + 1]),
                            _mm512_unpackhi_epi64(p[2 * i], p[2 * i + 1]));
  constexpr int EVEN = 0 | (2 << 2) | (0 << 4) | (2 << 6), ODD = 1 | (3 << 2) | (1 << 4) | (3 << 6);
  const __m512i u0 = _mm512_add_epi32(_mm512_shuffle_i32x4(q[0], q[1], EVEN),
                                      _mm512_shuffle_i32x4(q[0], q[1], ODD));
  const __m512i u1 = _mm512_add_epi32(_mm512_shuffle_i32x4(q[2], q[3], EVEN),
                                      _mm512_shuffle_i32x4(q[2], q[3], ODD));
  _mm512_storeu_si512(out, _mm512_add_epi32(_mm512_shuffle_i32x4(u0, u1, EVEN),
                                            _mm512_shuffle_i32x4(u0, u1, ODD)));
}

// one 64-byte step of K: every weight vector is loaded once and used by the MR tokens
template <int MR, int NR, bool RS, bool TAIL>
__attribute__((always_inline)) inline void step(const uint8_t* xc, int64_t kp, const int8_t* w,
                                                int64_t ldw, int64_t i, __mmask64 mask,
                                                __m512i* acc, __m512i* sums) {
  const __m512i ones = _mm512_set1_epi8(1);
  __m512i wv[NR];
  for (int j = 0; j < NR; ++j) {
    wv[j] = TAIL ? _mm512_maskz_loadu_epi8(mask, w + j * ldw + i)
                 : _mm512_loadu_si512(w + j * ldw + i);
    if (RS) sums[j] = _mm512_dpbusd_epi32(sums[j], ones, wv[j]);
  }
  for (int m = 0; m < MR; ++m) {
    const __m512i xv = _mm512_loadu_si512(xc + m * kp + i);
    for (int j = 0; j < NR; ++j)
      acc[m * NB + j] = _mm512_dpbusd_epi32(acc[m * NB + j], xv, wv[j]);
  }
}

// RS: also sum the weight rows (the first token block of a row block), for the offset
template <int MR, int NR, bool RS>
void micro_rs(const uint8_t* xc, int64_t kp, const int8_t* w, int64_t ldw, int64_t k,
              int32_t* rs, int32_t (*out)[NB]) {
  __m512i acc[MB * NB], sums[NB];
  for (int i = 0; i < MB * NB; ++i) acc[i] = _mm512_setzero_si512();
  for (int j = 0; j < NB; ++j) sums[j] = _mm512_setzero_si512();
  int64_t i = 0;
  for (; i + KSTEP <= k; i += KSTEP) step<MR, NR, RS, false>(xc, kp, w, ldw, i, 0, acc, sums);
  if (i < k) step<MR, NR, RS, true>(xc, kp, w, ldw, i, ~0ULL >> (KSTEP - (k - i)), acc, sums);
  if (RS)
    for (int j = 0; j < NR; ++j) rs[j] = _mm512_reduce_add_epi32(sums[j]);
  alignas(64) int32_t total[MB * NB];
  reduce16(acc, total);
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NR; ++j) out[m][j] = total[m * NB + j] - 128 * rs[j];
}

template <int MR, int NR>
void micro(const uint8_t* xc, int64_t kp, const int8_t* w, int64_t ldw, int64_t k,
           bool rowsum, int32_t* rs, int32_t (*out)[NB]) {
  if (rowsum) {
    micro_rs<MR, NR, true>(xc, kp, w, ldw, k, rs, out);
  } else {
    micro_rs<MR, NR, false>(xc, kp, w, ldw, k, rs, out);
  }
}
#elif defined(W8A8_AVX2)
// out[i] = sum(v[i]) for 8 accumulators: a horizontal-add tree, 9 instructions for 8 sums
inline void reduce8(const __m256i* v, int32_t* out) {
  const __m256i h01 = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
  const __m256i h23 = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out),
                      _mm256_add_epi32(_mm256_permute2x128_si256(h01, h23, 0x20),
                                       _mm256_permute2x128_si256(h01, h23, 0x31)));
}

template <int MR, int NR>
void micro(const uint8_t* xc, int64_t kp, const int8_t* w, int64_t ldw, int64_t k, bool,
           int32_t*, int32_t (*out)[NB]) {
  __m256i acc[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NR; ++j) acc[m][j] = _mm256_setzero_si256();
  const __m256i ones = _mm256_set1_epi16(1);
  alignas(32) int8_t tail[NR][KSTEP];
  for (int64_t i = 0; i < k; i += KSTEP) {
    __m256i wv[NR], aw[NR];
    for (int j = 0; j < NR; ++j) {
      if (i + KSTEP <= k) {
        wv[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + j * ldw + i));
      } else {  // the row's last bytes, zero-padded (never read past the row)
        std::memset(tail[j], 0, KSTEP);
        std::memcpy(tail[j], w + j * ldw + i, k - i);
        wv[j] = _mm256_load_si256(reinterpret_cast<const __m256i*>(tail[j]));
      }
      aw[j] = _mm256_abs_epi8(wv[j]);
    }
    for (int m = 0; m < MR; ++m) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xc + m * kp + i));
      for (int j = 0; j < NR; ++j) {
        const __m256i p = _mm256_maddubs_epi16(aw[j], _mm256_sign_epi8(xv, wv[j]));
        acc[m][j] = _mm256_add_epi32(acc[m][j], _mm256_madd_epi16(p, ones));
      }
    }
  }
  __m256i all[MB * NB];
  for (int i = 0; i < MB * NB; ++i) all[i] = _mm256_setzero_si256();
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NR; ++j) all[m * NB + j] = acc[m][j];
  alignas(32) int32_t sums8[MB * NB];
  reduce8(all, sums8);
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NR; ++j) out[m][j] = sums8[m * NB + j];
}
#else
template <int MR, int NR>
void micro(const uint8_t* xc, int64_t kp, const int8_t* w, int64_t ldw, int64_t k, bool,
           int32_t*, int32_t (*out)[NB]) {
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NR; ++j) {
      int32_t s = 0;
      const int8_t* xs = reinterpret_cast<const int8_t*>(xc + m * kp);
      for (int64_t i = 0; i < k; ++i) s += int32_t(xs[i]) * int32_t(w[j * ldw + i]);
      out[m][j] = s;
    }
}
#endif

using Micro = void (*)(const uint8_t*, int64_t, const int8_t*, int64_t, int64_t, bool, int32_t*,
                       int32_t (*)[NB]);

template <int MR, int... NRs>
constexpr std::array<Micro, sizeof...(NRs)> row_of(std::integer_sequence<int, NRs...>) {
  return {&micro<MR, NRs + 1>...};
}

template <int... MRs>
constexpr std::array<std::array<Micro, NB>, sizeof...(MRs)> table_of(
    std::integer_sequence<int, MRs...>) {
  return {row_of<MRs + 1>(std::make_integer_sequence<int, NB>{})...};
}

static_assert(MB * NB == 16 || KSTEP != 64, "reduce16 takes a 4 x 4 tile");
static_assert(MB * NB == 8 || KSTEP != 32, "reduce8 takes a 4 x 2 tile");
const auto MICRO = table_of(std::make_integer_sequence<int, MB>{});

template <typename out_t>
void gemm(const uint8_t* codes, int64_t kp, const float* xs, int64_t m0, int64_t mn,
          const int8_t* w, int64_t ldw, const float* ws, int64_t n, int64_t k, out_t* y) {
  const int64_t blocks = (n + NB - 1) / NB;
  // a thread's share is worth waking it for above ~256K multiply-adds
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 18) / std::max<int64_t>(1, mn * k * NB));
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    int32_t acc[MB][NB];
    int32_t rs[NB] = {0};
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * NB, nr = std::min<int64_t>(NB, n - n0);
      const int8_t* wb = w + n0 * ldw;
      for (int64_t mm = 0; mm < mn; mm += MB) {
        const int64_t mr = std::min<int64_t>(MB, mn - mm);
        MICRO[mr - 1][nr - 1](codes + mm * kp, kp, wb, ldw, k, mm == 0, rs, acc);
        for (int64_t i = 0; i < mr; ++i) {
          const float sx = xs[m0 + mm + i];
          out_t* row = y + (m0 + mm + i) * n + n0;
          for (int64_t j = 0; j < nr; ++j)
            row[j] = static_cast<out_t>(static_cast<float>(acc[i][j]) * sx * ws[n0 + j]);
        }
      }
    }
  });
}

template <typename in_t>
void run(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& ws,
         const c10::optional<torch::Tensor>& x_scale, torch::Tensor& y) {
  const int64_t m = x.size(0), k = x.size(1), n = w.size(0), ldx = x.stride(0);
  const int64_t kp = (k + KSTEP - 1) / KSTEP * KSTEP;
  const in_t* xp = x.data_ptr<in_t>();
  const int8_t* wp = w.data_ptr<int8_t>();
  const int64_t ldw = w.stride(0);
  const float* wsp = ws.data_ptr<float>();
  // the calling thread's buffers, grown as needed (no allocation per call)
  thread_local std::vector<float> scales, row;
  thread_local std::vector<uint8_t> codes;
  if (scales.size() < size_t(m)) scales.resize(m);
  if (!std::is_same<in_t, float>::value && row.size() < size_t(k)) row.resize(k);
  if (codes.size() < size_t(std::min(m, MCHUNK) * kp + KSTEP)) codes.resize(std::min(m, MCHUNK) * kp + KSTEP);
  for (int64_t m0 = 0; m0 < m; m0 += MCHUNK) {
    const int64_t mn = std::min(MCHUNK, m - m0);
    for (int64_t i = 0; i < mn; ++i) {
      const float* xr;
      if constexpr (std::is_same<in_t, float>::value) {
        xr = xp + (m0 + i) * ldx;
      } else {
        const in_t* src = xp + (m0 + i) * ldx;
        for (int64_t j = 0; j < k; ++j) row[j] = static_cast<float>(src[j]);
        xr = row.data();
      }
      float s;
      if (x_scale.has_value()) {
        s = x_scale->data_ptr<float>()[m0 + i];
      } else {
        s = std::max(row_amax(xr, k), 1e-8f) / 127.f;
      }
      scales[m0 + i] = s;
      quantize_row(xr, k, kp, s, codes.data() + i * kp);
    }
    if (y.scalar_type() == torch::kFloat) {
      gemm(codes.data(), kp, scales.data(), m0, mn, wp, ldw, wsp, n, k, y.data_ptr<float>());
    } else {
      gemm(codes.data(), kp, scales.data(), m0, mn, wp, ldw, wsp, n, k,
           y.data_ptr<at::BFloat16>());
    }
  }
}

}  // namespace

// x [..., K]; w [N, K], or stacked [E, N, K] with ``index`` picking one (experts: no view made
// in Python); returns [..., N]. The shape work is here because each Python-side tensor op
// costs about as much as a small expert's whole product.
torch::Tensor w8a8_linear(torch::Tensor x, torch::Tensor w, torch::Tensor w_scale,
                          c10::optional<torch::Tensor> x_scale, int64_t index) {
  TORCH_CHECK(x.dim() >= 1 && (x.scalar_type() == torch::kFloat ||
                               x.scalar_type() == torch::kBFloat16),
              "x must be a float32 or bfloat16 [..., K] tensor");
  TORCH_CHECK(w.scalar_type() == torch::kChar && (w.dim() == 2 || (w.dim() == 3 && index >= 0)),
              "w must be an int8 [N, K] tensor, or [E, N, K] with an index");
  if (w.dim() == 3) {
    TORCH_CHECK(index < w.size(0) && w_scale.dim() == 2 && w_scale.size(0) == w.size(0),
                "index ", index, " out of ", w.size(0), " stacked weights (and scales)");
    w = w.select(0, index);
    w_scale = w_scale.select(0, index);
  }
  const int64_t k = x.size(-1);
  TORCH_CHECK(w.size(1) == k, "w must be an int8 [N, K] tensor with x's K");
  TORCH_CHECK(w_scale.scalar_type() == torch::kFloat && w_scale.numel() == w.size(0),
              "w_scale must be float32 with one scale per output row");
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = w.size(0);
  x = x.reshape({-1, k});
  if (x.stride(1) != 1) x = x.contiguous();
  if (w.stride(1) != 1) w = w.contiguous();
  w_scale = w_scale.contiguous();
  if (x_scale.has_value()) {
    TORCH_CHECK(x_scale->scalar_type() == torch::kFloat && x_scale->numel() == x.size(0),
                "x_scale must be float32 with one scale per token");
    x_scale = x_scale->contiguous();
  }
  auto y = torch::empty({x.size(0), w.size(0)}, x.options());
  if (x.size(0) > 0 && w.size(0) > 0) {
    if (x.scalar_type() == torch::kFloat) {
      run<float>(x, w, w_scale, x_scale, y);
    } else {
      run<at::BFloat16>(x, w, w_scale, x_scale, y);
    }
  }
  return y.view(shape);
}

// -march=native binds the build to the CPU it ran on; a cached build reused on a CPU without
// those instructions would die of SIGILL on first use, so importing it fails instead (the
// caller falls back to torch)
bool cpu_runs_this_build() {
#if defined(W8A8_VNNI)
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vnni");
#elif defined(W8A8_AVX2)
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
  return true;
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  if (!cpu_runs_this_build())
    throw std::runtime_error(std::string("this build of w8a8 needs ") + PATH +
                             ", which this CPU lacks (a cached build from another machine?)");
  m.def("w8a8_linear", &w8a8_linear, py::arg("x"), py::arg("w"), py::arg("w_scale"),
        py::arg("x_scale") = py::none(), py::arg("index") = -1);
  m.attr("path") = PATH;
}
