// Paged MLA attention over the latent cache, read in place (no gather of the blocks).
//
// For each sequence: its queries (1 at decode, k+1 for MTP verification, more for a chunk)
// attend causally over the sequence's cached latents, block by block, with an online softmax
// per (query, head). Each block is read from memory once and stays in cache while every query
// and head of the sequence uses it; heads and keys are tiled in registers (below). Sequences are independent and each is reduced in a fixed
// order, so a sequence's result does not depend on the rest of the batch.
//
// bfloat16 latents are widened in registers as they are loaded (vec.h: exact, the 16 bits moved
// up), so the arithmetic is the float32 path's on the same values; a widened float32 copy of
// each block cost a scalar pass over all its rows and pushed the block out of L1.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "vec.h"
#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

using dsv4::bf16;
using dsv4::widen;

// Heads and keys are tiled so that each loaded vector feeds several FMAs: the score tile
// holds HB heads x TB keys of dot products in registers (one load of each key's chunk serves
// HB heads, one load of each query chunk TB keys), and the value tile HB heads x 16 output
// channels over all the block's keys (one key chunk serves HB heads). Absorbed MLA is
// multi-query attention: every head reads the same latents, so this is where the reuse is.
// Per (query, head) the sums still run in a fixed order, independent of the batch.
constexpr int HB = 4;  // heads per tile
// keys per score tile: HB * TB accumulators + TB keys + 1 query fit the 16 ymm registers of
// AVX2, or the 32 of AVX-512 (its ymm16-31); a tile's sums run in the same order either way
#if defined(DSV4_VEC_AVX512)
constexpr int TB = 6;
#else
constexpr int TB = 3;
#endif

#if defined(__AVX2__) && defined(__FMA__)
inline float hsum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_hadd_ps(lo, lo);
  lo = _mm_hadd_ps(lo, lo);
  return _mm_cvtss_f32(lo);
}

#endif

// out[h * ld + t] = sc * dot(q[h], kv[t]) for h < NH, t < NT.
template <int NH, int NT, typename K>
inline void score_tile(const float* q, const K* kv, int64_t width, float* out, int64_t ld,
                       float sc) {
  float sums[NH][NT];
  int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
  __m256 acc[NH][NT];
  for (int h = 0; h < NH; ++h)
    for (int t = 0; t < NT; ++t) acc[h][t] = _mm256_setzero_ps();
  for (; i + 8 <= width; i += 8) {
    __m256 k[NT];
    for (int t = 0; t < NT; ++t) k[t] = dsv4::load8(kv + t * width + i);
    for (int h = 0; h < NH; ++h) {
      const __m256 qv = _mm256_loadu_ps(q + h * width + i);
      for (int t = 0; t < NT; ++t) acc[h][t] = _mm256_fmadd_ps(qv, k[t], acc[h][t]);
    }
  }
  for (int h = 0; h < NH; ++h)
    for (int t = 0; t < NT; ++t) sums[h][t] = hsum(acc[h][t]);
#else
  for (int h = 0; h < NH; ++h)
    for (int t = 0; t < NT; ++t) sums[h][t] = 0.f;
#endif
  for (int h = 0; h < NH; ++h)
    for (int t = 0; t < NT; ++t) {
      float s = sums[h][t];
      for (int64_t j = i; j < width; ++j) s += q[h * width + j] * widen(kv[t * width + j]);
      out[h * ld + t] = s * sc;
    }
}

template <int NH, typename K>
inline void score_rows(const float* q, const K* kv, int64_t width, int64_t keys, float* out,
                       int64_t ld, float sc) {
  int64_t t = 0;
  for (; t + TB <= keys; t += TB)
    score_tile<NH, TB, K>(q, kv + t * width, width, out + t, ld, sc);
  for (; t < keys; ++t) score_tile<NH, 1, K>(q, kv + t * width, width, out + t, ld, sc);
}

// acc[h * dv + c] += sum over t < keys of p[h * ld + t] * kv[t * width + c], for h < NH.
template <int NH, typename K>
inline void value_tile(float* acc, int64_t dv, const float* p, int64_t ld, const K* kv,
                       int64_t width, int64_t keys) {
  int64_t c = 0;
#if defined(DSV4_VEC_AVX512)
  // 64 channels x NH heads in zmm registers: each channel still sums its keys in order with
  // one FMA each, as the 8-lane loop below does, so the widths agree bit for bit
  for (; c + 64 <= dv; c += 64) {
    __m512 a[NH][4];
    for (int h = 0; h < NH; ++h)
      for (int u = 0; u < 4; ++u) a[h][u] = _mm512_loadu_ps(acc + h * dv + c + 16 * u);
    for (int64_t t = 0; t < keys; ++t) {
      __m512 k[4];
      for (int u = 0; u < 4; ++u) k[u] = dsv4::load16(kv + t * width + c + 16 * u);
      for (int h = 0; h < NH; ++h) {
        const __m512 pv = _mm512_set1_ps(p[h * ld + t]);
        for (int u = 0; u < 4; ++u) a[h][u] = _mm512_fmadd_ps(pv, k[u], a[h][u]);
      }
    }
    for (int h = 0; h < NH; ++h)
      for (int u = 0; u < 4; ++u) _mm512_storeu_ps(acc + h * dv + c + 16 * u, a[h][u]);
  }
#endif
#if defined(__AVX2__) && defined(__FMA__)
  for (; c + 16 <= dv; c += 16) {
    __m256 a[NH][2];
    for (int h = 0; h < NH; ++h) {
      a[h][0] = _mm256_loadu_ps(acc + h * dv + c);
      a[h][1] = _mm256_loadu_ps(acc + h * dv + c + 8);
    }
    for (int64_t t = 0; t < keys; ++t) {
      const __m256 k0 = dsv4::load8(kv + t * width + c);
      const __m256 k1 = dsv4::load8(kv + t * width + c + 8);
      for (int h = 0; h < NH; ++h) {
        const __m256 pv = _mm256_broadcast_ss(p + h * ld + t);
        a[h][0] = _mm256_fmadd_ps(pv, k0, a[h][0]);
        a[h][1] = _mm256_fmadd_ps(pv, k1, a[h][1]);
      }
    }
    for (int h = 0; h < NH; ++h) {
      _mm256_storeu_ps(acc + h * dv + c, a[h][0]);
      _mm256_storeu_ps(acc + h * dv + c + 8, a[h][1]);
    }
  }
#endif
  for (; c < dv; ++c)
    for (int h = 0; h < NH; ++h) {
      float s = acc[h * dv + c];
      for (int64_t t = 0; t < keys; ++t) s += p[h * ld + t] * widen(kv[t * width + c]);
      acc[h * dv + c] = s;
    }
}

// One query (all heads) over `keys` consecutive latents `kv`: online-softmax update of its
// running max `m`, sum `l` and unnormalised output `acc` [heads, dv]. `sbuf` holds
// heads x ld scores, then the probabilities.
template <typename K>
void attend_block(const float* q, const K* kv, int64_t heads, int64_t width, int64_t dv,
                  int64_t keys, float sc, float* sbuf, int64_t ld, float* m, float* l,
                  float* acc) {
  int64_t h = 0;
  for (; h + HB <= heads; h += HB)
    score_rows<HB, K>(q + h * width, kv, width, keys, sbuf + h * ld, ld, sc);
  for (; h < heads; ++h) score_rows<1, K>(q + h * width, kv, width, keys, sbuf + h * ld, ld, sc);
  for (h = 0; h < heads; ++h) {
    float* s = sbuf + h * ld;
    float mx = m[h];
    for (int64_t t = 0; t < keys; ++t) mx = std::max(mx, s[t]);
    const float rescale = std::exp(m[h] - mx);
    float sum = l[h] * rescale;
    for (int64_t t = 0; t < keys; ++t) {
      s[t] = std::exp(s[t] - mx);
      sum += s[t];
    }
    if (rescale != 1.f) {
      float* a = acc + h * dv;
      for (int64_t c = 0; c < dv; ++c) a[c] *= rescale;
    }
    m[h] = mx;
    l[h] = sum;
  }
  for (h = 0; h + HB <= heads; h += HB)
    value_tile<HB, K>(acc + h * dv, dv, sbuf + h * ld, ld, kv, width, keys);
  for (; h < heads; ++h) value_tile<1, K>(acc + h * dv, dv, sbuf + h * ld, ld, kv, width, keys);
}

template <typename scalar_t>
void run(const torch::Tensor& q, const torch::Tensor& pool, const torch::Tensor& table,
         const torch::Tensor& qsl, const torch::Tensor& lens, double scale, int64_t dv,
         torch::Tensor& out) {
  const int64_t heads = q.size(1), width = q.size(2), bs = pool.size(1);
  const int64_t seqs = lens.size(0), max_blocks = table.size(1);
  const float* qp = q.data_ptr<float>();
  const scalar_t* pp = pool.data_ptr<scalar_t>();
  const int32_t* tp = table.data_ptr<int32_t>();
  const int32_t* sp = qsl.data_ptr<int32_t>();
  const int32_t* lp = lens.data_ptr<int32_t>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, seqs, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> sbuf(heads * bs);
    std::vector<float> m, l;
    for (int64_t s = begin; s < end; ++s) {
      const int64_t q0 = sp[s], n = sp[s + 1] - q0, len = lp[s];
      if (n <= 0) continue;
      const int64_t rows = n * heads;
      m.assign(rows, -std::numeric_limits<float>::infinity());
      l.assign(rows, 0.f);
      float* acc = op + q0 * heads * dv;
      std::fill(acc, acc + rows * dv, 0.f);
      const int64_t nblocks = (len + bs - 1) / bs;
      TORCH_CHECK(nblocks <= max_blocks, "sequence ", s, " needs ", nblocks, " blocks, table has ", max_blocks);
      for (int64_t b = 0; b < nblocks; ++b) {
        const int64_t blk = tp[s * max_blocks + b];
        const scalar_t* kv = pp + blk * bs * width;
        const int64_t first = b * bs;
        for (int64_t j = 0; j < n; ++j) {
          // query j sits at position len - n + j and sees keys up to it
          const int64_t visible = std::min(bs, len - n + j + 1 - first);
          if (visible <= 0) continue;
          attend_block(qp + (q0 + j) * heads * width, kv, heads, width, dv, visible, sc,
                       sbuf.data(), bs, m.data() + j * heads, l.data() + j * heads,
                       acc + j * heads * dv);
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
        float* a = acc + r * dv;
        for (int64_t i = 0; i < dv; ++i) a[i] *= inv;
      }
    }
  });
}

}  // namespace

torch::Tensor paged_mla_attention(torch::Tensor q, torch::Tensor pool, torch::Tensor table,
                                  torch::Tensor qsl, torch::Tensor lens, double scale,
                                  int64_t dv) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == torch::kFloat && q.is_contiguous(),
              "q must be a contiguous float32 [T, H, D] tensor");
  TORCH_CHECK(pool.dim() == 3 && pool.size(2) == q.size(2) && pool.is_contiguous(),
              "pool must be a contiguous [blocks, block_size, D] tensor with q's D");
  TORCH_CHECK(pool.size(1) <= 256, "block size above 256 is not supported");
  TORCH_CHECK(table.scalar_type() == torch::kInt && qsl.scalar_type() == torch::kInt &&
                  lens.scalar_type() == torch::kInt,
              "block table, query start locations and lengths must be int32");
  TORCH_CHECK(dv > 0 && dv <= q.size(2), "dv must be in (0, D]");
  table = table.contiguous();
  auto out = torch::empty({q.size(0), q.size(1), dv}, q.options());
  if (pool.scalar_type() == torch::kFloat) {
    run<float>(q, pool, table, qsl, lens, scale, dv, out);
  } else if (pool.scalar_type() == torch::kBFloat16) {
    run<bf16>(q, pool, table, qsl, lens, scale, dv, out);
  } else {
    TORCH_CHECK(false, "pool dtype must be float32 or bfloat16");
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  if (const char* isa = dsv4::build_lacks())
    throw std::runtime_error(std::string("this build of paged_mla needs ") + isa +
                             ", which this CPU lacks (a cached build from another machine?)");
  m.def("paged_mla_attention", &paged_mla_attention);
}
