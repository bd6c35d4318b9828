// Eight float32 lanes loaded from float32 or bfloat16 storage and stored back, so a kernel
// templated on its storage type widens a vector at a time and runs the same float32 arithmetic
// for both. bfloat16 -> float32 is exact (the 16 bits moved up); float32 -> bfloat16 rounds to
// nearest even with NaN -> 0x7fc0, bit for bit c10::BFloat16(float), so a kernel's bfloat16
// output is its float32 result rounded once, as torch's `.to(torch.bfloat16)` rounds it.
//
// The ISA is chosen at compile time: the kernels are built with -march=native on the machine
// that runs them (build.py); AVX-512F adds 16-lane helpers, AVX2 + FMA gives the 8-lane ones,
// anything else the scalar path. Every lane runs the same float32 operations in the same order
// at any width, so the paths agree bit for bit.
// `build_lacks()` names an instruction set the build assumed and this CPU lacks (a cached build
// copied from another machine), so importing it fails instead of dying of SIGILL.
#pragma once
#include <c10/util/BFloat16.h>

#include <cstdint>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

namespace dsv4 {

using bf16 = c10::BFloat16;

inline float widen(float x) { return x; }
inline float widen(bf16 x) { return static_cast<float>(x); }
inline void put(float* p, float v) { *p = v; }
inline void put(bf16* p, float v) { *p = bf16(v); }

// a * b + c, fused where the build has FMA: the scalar tails then round as the vector lanes do,
// whatever the compiler makes of a loop for one storage type or the other
inline float madd(float a, float b, float c) {
#if defined(__FMA__)
  return __builtin_fmaf(a, b, c);
#else
  return a * b + c;
#endif
}

#if defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
// 16 lanes where a kernel has an AVX-512 loop (mhc); the 8-lane helpers below serve the rest
#define DSV4_VEC_AVX512 1

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }

inline __m512 load16(const bf16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }

inline void store16(bf16* p, __m512 v) {
  const __m512i b = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  const __m512i bias = _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(b, bias), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  r = _mm512_mask_blend_epi32(nan, r, _mm512_set1_epi32(0x7fc0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
#define DSV4_VEC_AVX2 1
#if defined(DSV4_VEC_AVX512)
constexpr const char* VEC_PATH = "avx512";  // the widest helpers this build has
#else
constexpr const char* VEC_PATH = "avx2";
#endif

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

inline __m256 load8(const bf16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }

inline void store8(bf16* p, __m256 v) {
  const __m256i b = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  const __m256i bias = _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(b, bias), 16);
  const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), _mm256_castps_si256(nan));
  // 32 -> 16 bits: packus works per 128-bit lane, the permute brings lanes 0 and 2 together
  r = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(r));
}

inline float hsum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_hadd_ps(lo, lo);
  lo = _mm_hadd_ps(lo, lo);
  return _mm_cvtss_f32(lo);
}
#else
constexpr const char* VEC_PATH = "scalar";
#endif

// The first instruction set this build was compiled for that the running CPU lacks, or nullptr.
inline const char* build_lacks() {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#if defined(__AVX512F__)
  if (!__builtin_cpu_supports("avx512f")) return "avx512f";
#endif
#if defined(__AVX512BW__)
  if (!__builtin_cpu_supports("avx512bw")) return "avx512bw";
#endif
#if defined(__AVX512VL__)
  if (!__builtin_cpu_supports("avx512vl")) return "avx512vl";
#endif
#if defined(__AVX2__)
  if (!__builtin_cpu_supports("avx2")) return "avx2";
#endif
#if defined(__FMA__)
  if (!__builtin_cpu_supports("fma")) return "fma";
#endif
#endif
  return nullptr;
}

}  // namespace dsv4
