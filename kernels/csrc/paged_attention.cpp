// Fused CPU paged attention: walks each sequence's block table, reading every cached key/value once.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <vector>

template <typename T>
static void run(const T* q, const T* kc, const T* vc, T* out, const int64_t* qstart, const int64_t* qlen,
                const int64_t* ctx, const int64_t* bt, int64_t S, int64_t H, int64_t Hk, int64_t D, int64_t NB,
                int64_t bs, int64_t max_nb, float scale) {
  const int64_t G = H / Hk;
  at::parallel_for(0, S * Hk, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf, sc, acc, row(D);
    for (int64_t w = begin; w < end; ++w) {
      const int64_t s = w / Hk, hk = w % Hk, nq = qlen[s], L = ctx[s], t0 = qstart[s], R = nq * G;
      const int64_t* table = bt + s * max_nb;
      qf.resize(R * D); sc.resize(R * L); acc.assign(R * D, 0.f);
      for (int64_t i = 0; i < nq; ++i)
        for (int64_t g = 0; g < G; ++g) {
          const T* src = q + ((t0 + i) * H + hk * G + g) * D;
          float* dst = qf.data() + (i * G + g) * D;
          for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<float>(src[d]) * scale;
        }
      for (int64_t p = 0; p < L; ++p) {
        const T* k = kc + ((hk * NB + table[p / bs]) * bs + p % bs) * D;
        for (int64_t d = 0; d < D; ++d) row[d] = static_cast<float>(k[d]);
        for (int64_t r = 0; r < R; ++r) {
          const float* qr = qf.data() + r * D;
          float dot = 0.f;
          for (int64_t d = 0; d < D; ++d) dot += qr[d] * row[d];
          sc[r * L + p] = dot;
        }
      }
      for (int64_t r = 0; r < R; ++r) {
        const int64_t lim = L - nq + r / G + 1;
        float* sr = sc.data() + r * L;
        float m = -INFINITY, sum = 0.f;
        for (int64_t p = 0; p < lim; ++p) m = sr[p] > m ? sr[p] : m;
        for (int64_t p = 0; p < lim; ++p) { sr[p] = std::exp(sr[p] - m); sum += sr[p]; }
        const float inv = 1.f / sum;
        for (int64_t p = 0; p < lim; ++p) sr[p] *= inv;
        for (int64_t p = lim; p < L; ++p) sr[p] = 0.f;
      }
      for (int64_t p = 0; p < L; ++p) {
        const T* v = vc + ((hk * NB + table[p / bs]) * bs + p % bs) * D;
        for (int64_t d = 0; d < D; ++d) row[d] = static_cast<float>(v[d]);
        for (int64_t r = 0; r < R; ++r) {
          const float wgt = sc[r * L + p];
          float* ar = acc.data() + r * D;
          for (int64_t d = 0; d < D; ++d) ar[d] += wgt * row[d];
        }
      }
      for (int64_t i = 0; i < nq; ++i)
        for (int64_t g = 0; g < G; ++g) {
          T* dst = out + ((t0 + i) * H + hk * G + g) * D;
          const float* a = acc.data() + (i * G + g) * D;
          for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(a[d]);
        }
    }
  });
}

void paged_attention_cpu(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor out,
                         torch::Tensor qstart, torch::Tensor qlen, torch::Tensor ctx, torch::Tensor block_tables,
                         double scale) {
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous() && out.is_contiguous());
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type(), "q and cache dtypes differ");
  const int64_t S = qstart.size(0), H = q.size(1), D = q.size(2), Hk = k_cache.size(0), NB = k_cache.size(1);
  const int64_t bs = k_cache.size(2), max_nb = block_tables.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_attention_cpu", [&] {
    run<scalar_t>(q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                  out.data_ptr<scalar_t>(), qstart.data_ptr<int64_t>(), qlen.data_ptr<int64_t>(),
                  ctx.data_ptr<int64_t>(), block_tables.data_ptr<int64_t>(), S, H, Hk, D, NB, bs, max_nb,
                  static_cast<float>(scale));
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention_cpu", &paged_attention_cpu, "Paged attention of short queries over their blocks (CPU)");
}
