// fp8 block-scaled linear: y = x @ (e4m3(w) * scale[block]).T in one call, float32.
//
// For each block of 4 output rows the weight is dequantized once into a thread-local float
// buffer (e4m3 -> float32 by moving the exponent and mantissa bits into place and scaling by
// 2^120, exact for normals and subnormals; then times the block's scale, the same float product
// as the pure-torch path's), then every token runs over it with FMAs. The dequantized values
// are the oracle's exactly; only the summation order differs (float32 rounding).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <array>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

constexpr int NR = 4;  // rows per block
constexpr int MR = 2;  // tokens per micro-kernel

inline float e4m3(uint8_t b) {
  uint32_t bits = (uint32_t(b & 0x80) << 24) | (uint32_t(b & 0x7f) << 20);
  float f;
  std::memcpy(&f, &bits, 4);
  return f * 0x1p120f;
}

// rows r0..r0+nr of w (bytes, row stride ldw) times their block scales, into out [nr][k]
void dequant(const uint8_t* w, int64_t ldw, const float* s, int64_t lds, int64_t bn, int64_t bk,
             int64_t r0, int64_t nr, int64_t k, float* out) {
  for (int64_t j = 0; j < nr; ++j) {
    const uint8_t* row = w + (r0 + j) * ldw;
    const float* srow = s + ((r0 + j) / bn) * lds;
    float* o = out + j * k;
    for (int64_t c0 = 0; c0 < k; c0 += bk) {
      const int64_t c1 = std::min(k, c0 + bk);
      const float sc = srow[c0 / bk];
      int64_t i = c0;
#if defined(__AVX2__)
      const __m256i sign = _mm256_set1_epi32(0x80), em = _mm256_set1_epi32(0x7f);
      const __m256 pow = _mm256_set1_ps(0x1p120f), vs = _mm256_set1_ps(sc);
      for (; i + 8 <= c1; i += 8) {
        long long raw;
        std::memcpy(&raw, row + i, 8);
        const __m256i v = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(raw));
        const __m256i bits = _mm256_or_si256(_mm256_slli_epi32(_mm256_and_si256(v, sign), 24),
                                             _mm256_slli_epi32(_mm256_and_si256(v, em), 20));
        const __m256 f = _mm256_mul_ps(_mm256_castsi256_ps(bits), pow);
        _mm256_storeu_ps(o + i, _mm256_mul_ps(f, vs));
      }
#endif
      for (; i < c1; ++i) o[i] = e4m3(row[i]) * sc;
    }
  }
}

#if defined(__AVX2__) && defined(__FMA__)
inline void reduce8(const __m256* v, float* out) {
  const __m256 h01 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 h23 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  _mm256_storeu_ps(out, _mm256_add_ps(_mm256_permute2f128_ps(h01, h23, 0x20),
                                      _mm256_permute2f128_ps(h01, h23, 0x31)));
}
#endif

// out[m][j] = sum_k x[m][k] * wd[j][k], for mr <= MR tokens and nr <= NR rows
void micro(const float* x, int64_t ldx, int64_t mr, const float* wd, int64_t nr, int64_t k,
           float (*out)[NR]) {
#if defined(__AVX2__) && defined(__FMA__)
  __m256 acc[MR * NR];
  for (int i = 0; i < MR * NR; ++i) acc[i] = _mm256_setzero_ps();
  int64_t i = 0;
  if (mr == MR && nr == NR) {
    for (; i + 8 <= k; i += 8) {
      const __m256 x0 = _mm256_loadu_ps(x + i), x1 = _mm256_loadu_ps(x + ldx + i);
      for (int j = 0; j < NR; ++j) {
        const __m256 wv = _mm256_loadu_ps(wd + j * k + i);
        acc[j] = _mm256_fmadd_ps(x0, wv, acc[j]);
        acc[NR + j] = _mm256_fmadd_ps(x1, wv, acc[NR + j]);
      }
    }
  } else {
    for (; i + 8 <= k; i += 8)
      for (int64_t m = 0; m < mr; ++m) {
        const __m256 xv = _mm256_loadu_ps(x + m * ldx + i);
        for (int64_t j = 0; j < nr; ++j)
          acc[m * NR + j] = _mm256_fmadd_ps(xv, _mm256_loadu_ps(wd + j * k + i), acc[m * NR + j]);
      }
  }
  alignas(32) float total[MR * NR];
  reduce8(acc, total);
  for (int64_t m = 0; m < mr; ++m)
    for (int64_t j = 0; j < nr; ++j) {
      float s = total[m * NR + j];
      for (int64_t t = i; t < k; ++t) s += x[m * ldx + t] * wd[j * k + t];
      out[m][j] = s;
    }
#else
  for (int64_t m = 0; m < mr; ++m)
    for (int64_t j = 0; j < nr; ++j) {
      float s = 0.f;
      for (int64_t t = 0; t < k; ++t) s += x[m * ldx + t] * wd[j * k + t];
      out[m][j] = s;
    }
#endif
}

}  // namespace

// x [..., K] float32; w e4m3 [N, K] (or stacked [E, N, K] with index); scale float32
// [ceil(N / bn), ceil(K / bk)] (or stacked); returns [..., N] float32
torch::Tensor fp8_linear(torch::Tensor x, torch::Tensor w, torch::Tensor scale, int64_t bn,
                         int64_t bk, int64_t index) {
  TORCH_CHECK(x.dim() >= 1 && x.scalar_type() == torch::kFloat, "x must be float32 [..., K]");
  TORCH_CHECK(w.element_size() == 1 && (w.dim() == 2 || (w.dim() == 3 && index >= 0)),
              "w must be an fp8 [N, K] tensor, or [E, N, K] with an index");
  TORCH_CHECK(bn > 0 && bk > 0, "block sizes must be positive");
  if (w.dim() == 3) {
    TORCH_CHECK(index < w.size(0) && scale.dim() == 3 && scale.size(0) == w.size(0),
                "index ", index, " out of ", w.size(0), " stacked weights (and scales)");
    w = w.select(0, index);
    scale = scale.select(0, index);
  }
  const int64_t k = x.size(-1), n = w.size(0);
  TORCH_CHECK(w.size(1) == k, "w must have x's K");
  TORCH_CHECK(scale.scalar_type() == torch::kFloat && scale.dim() == 2 &&
                  scale.size(0) == (n + bn - 1) / bn && scale.size(1) == (k + bk - 1) / bk,
              "scale must be float32 [ceil(N / bn), ceil(K / bk)]");
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  x = x.reshape({-1, k});
  if (x.stride(1) != 1) x = x.contiguous();
  if (w.stride(1) != 1) w = w.contiguous();
  scale = scale.contiguous();
  const int64_t m = x.size(0), ldx = x.stride(0), ldw = w.stride(0), lds = scale.size(1);
  auto y = torch::empty({m, n}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = static_cast<const uint8_t*>(w.data_ptr());
  const float* sp = scale.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t blocks = (n + NR - 1) / NR;
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 17) / std::max<int64_t>(1, (m + 1) * k * NR));
  if (m > 0 && n > 0) {
    at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
      thread_local std::vector<float> wd;
      if (wd.size() < size_t(NR * k)) wd.resize(NR * k);
      float out[MR][NR];
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t r0 = b * NR, nr = std::min<int64_t>(NR, n - r0);
        dequant(wp, ldw, sp, lds, bn, bk, r0, nr, k, wd.data());
        for (int64_t m0 = 0; m0 < m; m0 += MR) {
          const int64_t mr = std::min<int64_t>(MR, m - m0);
          micro(xp + m0 * ldx, ldx, mr, wd.data(), nr, k, out);
          for (int64_t i = 0; i < mr; ++i)
            for (int64_t j = 0; j < nr; ++j) yp[(m0 + i) * n + r0 + j] = out[i][j];
        }
      }
    });
  }
  return y.view(shape);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
#if defined(__AVX2__)
  if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma"))
    throw std::runtime_error("this build of fp8 needs AVX2 and FMA, which this CPU lacks");
#endif
  m.def("fp8_linear", &fp8_linear, py::arg("x"), py::arg("w"), py::arg("scale"), py::arg("bn"),
        py::arg("bk"), py::arg("index") = -1);
}
