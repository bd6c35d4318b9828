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
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <stdexcept>
#include <tuple>
#include <vector>

namespace {

constexpr int64_t MAX_N = 16;  // hc_mult (4 in V4); the n x n mix lives on the stack

inline float sigmoid(float x) { return 1.f / (1.f + std::exp(-x)); }

void check(const torch::Tensor& t, const char* what) {
  if (t.device().type() != at::kCPU || t.scalar_type() != at::kFloat || !t.is_contiguous())
    throw std::invalid_argument(std::string(what) + " must be a contiguous float32 CPU tensor");
}

}  // namespace

// mixes [T, (2 + n) n] (pre | post | comb logits), base [(2 + n) n], scale [3], streams [T, n, D]
// -> (collapsed [T, D], post [T, n], comb [T, n, n])
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> hc_pre(
    const torch::Tensor& mixes, const torch::Tensor& base, const torch::Tensor& scale,
    const torch::Tensor& streams, int64_t iters, double hc_eps) {
  check(mixes, "mixes");
  check(base, "base");
  check(scale, "scale");
  check(streams, "streams");
  const int64_t t = streams.size(0), n = streams.size(1), d = streams.size(2);
  if (n > MAX_N || mixes.size(0) != t || mixes.size(1) != (2 + n) * n)
    throw std::invalid_argument("hc_pre: mixes must be [T, (2 + n) * n] for streams [T, n, D]");
  auto collapsed = torch::empty({t, d}, streams.options());
  auto post = torch::empty({t, n}, streams.options());
  auto comb = torch::empty({t, n, n}, streams.options());
  const float* mx = mixes.data_ptr<float>();
  const float* b = base.data_ptr<float>();
  const float* sc = scale.data_ptr<float>();
  const float* st = streams.data_ptr<float>();
  float* co = collapsed.data_ptr<float>();
  float* po = post.data_ptr<float>();
  float* cm = comb.data_ptr<float>();
  const float eps = static_cast<float>(hc_eps);
  const int64_t width = (2 + n) * n;
  at::parallel_for(0, t, 16, [&](int64_t lo, int64_t hi) {
    float pre[MAX_N], c[MAX_N * MAX_N], sums[MAX_N];
    for (int64_t i = lo; i < hi; ++i) {
      const float* m = mx + i * width;
      for (int64_t a = 0; a < n; ++a) {
        pre[a] = sigmoid(m[a] * sc[0] + b[a]) + eps;
        po[i * n + a] = 2.f * sigmoid(m[n + a] * sc[1] + b[n + a]);
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
      for (int64_t k = 0; k < n * n; ++k) cm[i * n * n + k] = c[k];
      const float* x = st + i * n * d;
      float* y = co + i * d;
      for (int64_t e = 0; e < d; ++e) y[e] = pre[0] * x[e];
      for (int64_t a = 1; a < n; ++a)
        for (int64_t e = 0; e < d; ++e) y[e] += pre[a] * x[a * d + e];
    }
  });
  return {collapsed, post, comb};
}

// out [T, D], streams [T, n, D], post [T, n], comb [T, n, n]
// -> new streams [T, n, D]: post[a] * out + sum_j comb[j, a] * streams[j]
torch::Tensor hc_post(const torch::Tensor& out, const torch::Tensor& streams,
                      const torch::Tensor& post, const torch::Tensor& comb) {
  check(out, "out");
  check(streams, "streams");
  check(post, "post");
  check(comb, "comb");
  const int64_t t = streams.size(0), n = streams.size(1), d = streams.size(2);
  if (out.size(0) != t || out.size(1) != d || comb.size(1) != n)
    throw std::invalid_argument("hc_post: shapes of out, streams and comb do not agree");
  auto res = torch::empty_like(streams);
  const float* o = out.data_ptr<float>();
  const float* st = streams.data_ptr<float>();
  const float* p = post.data_ptr<float>();
  const float* cm = comb.data_ptr<float>();
  float* r = res.data_ptr<float>();
  at::parallel_for(0, t, 16, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      const float* x = st + i * n * d;
      const float* c = cm + i * n * n;
      for (int64_t a = 0; a < n; ++a) {
        float* y = r + (i * n + a) * d;
        for (int64_t e = 0; e < d; ++e) y[e] = c[a] * x[e];
        for (int64_t j = 1; j < n; ++j) {
          const float w = c[j * n + a];
          for (int64_t e = 0; e < d; ++e) y[e] += w * x[j * d + e];
        }
        const float pa = p[i * n + a];
        const float* ob = o + i * d;
        for (int64_t e = 0; e < d; ++e) y[e] = pa * ob[e] + y[e];
      }
    }
  });
  return res;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("hc_pre", &hc_pre, "mHC pre: gates, Sinkhorn mix, collapse (float32)");
  m.def("hc_post", &hc_post, "mHC post: block output into the mixed streams (float32)");
}
