// Paged MLA attention over the latent cache, read in place (no gather of the blocks).
//
// For each sequence: its queries (1 at decode, k+1 for MTP verification, more for a chunk)
// attend causally over the sequence's cached latents, block by block, with an online softmax
// per (query, head). Each block is read from memory once and stays in cache while every query
// and head of the sequence uses it. Sequences are independent and each is reduced in a fixed
// order, so a sequence's result does not depend on the rest of the batch.
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

// y = y * scale + p * x
inline void scale_axpy(float* y, float scale, float p, const float* x, int64_t n) {
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 vs = _mm256_set1_ps(scale), vp = _mm256_set1_ps(p);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 v = _mm256_mul_ps(_mm256_loadu_ps(y + i), vs);
    _mm256_storeu_ps(y + i, _mm256_fmadd_ps(vp, _mm256_loadu_ps(x + i), v));
  }
  for (; i < n; ++i) y[i] = y[i] * scale + p * x[i];
#else
  for (int64_t i = 0; i < n; ++i) y[i] = y[i] * scale + p * x[i];
#endif
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
    std::vector<float> block(std::is_same<scalar_t, float>::value ? 0 : bs * width);
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
        const float* kv;
        if constexpr (std::is_same<scalar_t, float>::value) {
          kv = pp + blk * bs * width;
        } else {
          const scalar_t* src = pp + blk * bs * width;
          for (int64_t i = 0; i < bs * width; ++i) block[i] = static_cast<float>(src[i]);
          kv = block.data();
        }
        const int64_t first = b * bs;
        for (int64_t j = 0; j < n; ++j) {
          // query j sits at position len - n + j and sees keys up to it
          const int64_t visible = std::min(bs, len - n + j + 1 - first);
          if (visible <= 0) continue;
          for (int64_t h = 0; h < heads; ++h) {
            const float* qv = qp + ((q0 + j) * heads + h) * width;
            const int64_t r = j * heads + h;
            float scores[256];
            float mx = m[r];
            for (int64_t t = 0; t < visible; ++t) {
              scores[t] = dot(qv, kv + t * width, width) * sc;
              mx = std::max(mx, scores[t]);
            }
            float* a = acc + r * dv;
            const float rescale = std::exp(m[r] - mx);
            float sum = l[r] * rescale;
            for (int64_t t = 0; t < visible; ++t) {
              const float p = std::exp(scores[t] - mx);
              sum += p;
              scale_axpy(a, t == 0 ? rescale : 1.f, p, kv + t * width, dv);
            }
            m[r] = mx;
            l[r] = sum;
          }
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
    run<at::BFloat16>(q, pool, table, qsl, lens, scale, dv, out);
  } else {
    TORCH_CHECK(false, "pool dtype must be float32 or bfloat16");
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_mla_attention", &paged_mla_attention);
}
