// bf16 linears from weights packed once into panels (AVX512-BF16): bf16_gemv.cpp includes it inside its namespace
// on that tier, after bf16_to_float.
//
// A row-major weight makes a few rows of x a dot product per output (bf16_dp_tile.h: sixteen lanes summed at the
// end of every output) and leaves x rows re-read from L2 for every few weight rows. Packed into panels of
// kPanel outputs, each K pair of the panel's outputs in one 64-byte line (w[n][k], w[n][k + 1] side by side), a
// pair of x broadcast to every lane is `vdpbf16ps`-ed with four such lines into the sums of 64 outputs of one
// row: no reduction, the panel streamed once per four x rows in memory order, x rows from L1. Measured on
// AVX512-BF16 without AMX (docs/benchmarks.md, cpu_tiers) it is faster than the GEMV and than oneDNN's bf16
// matmul at every row count, one row to prefill. Each output sums its K products pairwise in K order in one
// fp32 lane, whatever the row count or tile, so a row's result is the same in any batch; bias added in fp32,
// rounded to bf16 to nearest even (as the matmul does).

constexpr int64_t kPanel = kPanelWidth;  // outputs of a panel (panels.h): four vectors of 16
constexpr int64_t kPanelXBytes = 1 << 18;  // x rows a task keeps in L2 across the panels it runs (256 KiB)

// [ceil(N / kPanel), ceil(K / 2), kPanel, 2] bf16: w[n][k] at ((n / kPanel) * K2 + k / 2) * 2 kPanel +
// (n % kPanel) * 2 + k % 2; the outputs past N and the odd K's last pair padded with zeros.
torch::Tensor pack_panels(const torch::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16 && w.is_contiguous() && w.device().is_cpu(),
              "pack_panels: a contiguous CPU bf16 weight [N, K]");
  const int64_t N = w.size(0), K = w.size(1), P = (N + kPanel - 1) / kPanel, K2 = (K + 1) / 2;
  auto out = torch::zeros({P, K2, kPanel, 2}, w.options());
  sluice_pack_panels<2>(reinterpret_cast<const uint16_t*>(w.data_ptr()), N, K,
                        reinterpret_cast<uint16_t*>(out.data_ptr()), [](uint16_t v) { return v; });
  return out;
}

// The sums of M x rows against one panel: acc[m][v] holds outputs [16 v, 16 v + 16) of row m.
template <int M>
inline void panel_tile(const uint16_t* x, int64_t ldx, const uint16_t* panel, int64_t K, __m512 (&acc)[M][4]) {
  for (int m = 0; m < M; ++m)
    for (int v = 0; v < 4; ++v) acc[m][v] = _mm512_setzero_ps();
  auto step = [&](const uint16_t* line, const int32_t* pairs) {
    __m512bh wv[4];
    for (int v = 0; v < 4; ++v) wv[v] = (__m512bh)_mm512_loadu_si512(line + 32 * v);
    for (int m = 0; m < M; ++m) {
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(pairs[m]);
      for (int v = 0; v < 4; ++v) acc[m][v] = _mm512_dpbf16_ps(acc[m][v], xb, wv[v]);
    }
  };
  int64_t k = 0;
  for (; k + 2 <= K; k += 2) {
    int32_t pairs[M];
    for (int m = 0; m < M; ++m) std::memcpy(pairs + m, x + m * ldx + k, 4);
    step(panel + k * kPanel, pairs);
  }
  if (k < K) {  // odd K: the last value with a zero beside it (the panel's padding is zero too)
    int32_t pairs[M];
    for (int m = 0; m < M; ++m) pairs[m] = x[m * ldx + k];
    step(panel + k * kPanel, pairs);
  }
}

// Rows [m0, m0 + M) of y, outputs [n0, n0 + n) (n <= kPanel), from the tile's sums: bias in fp32, bf16 (nearest even).
template <int M>
inline void panel_store(const __m512 (&acc)[M][4], const uint16_t* bias, int64_t n0, int64_t n, uint16_t* y,
                        int64_t ldy) {
  for (int v = 0; v < 4 && 16 * v < n; ++v) {
    const __mmask16 mask = n - 16 * v >= 16 ? static_cast<__mmask16>(0xFFFF)
                                            : static_cast<__mmask16>((1u << (n - 16 * v)) - 1);
    const __m512 b = bias ? sluice_load_bf16(bias + n0 + 16 * v, mask) : _mm512_setzero_ps();
    for (int m = 0; m < M; ++m) {
      const __m256bh out = _mm512_cvtneps_pbh(_mm512_add_ps(acc[m][v], b));
      _mm256_mask_storeu_epi16(y + m * ldy + n0 + 16 * v, mask, (__m256i)out);
    }
  }
}

// y[M, N] = x[M, K] · W[N, K]ᵀ (+ bias) from W's panels: tasks of (a block of x rows that stays in L2, a panel),
// the block's rows four at a time against the panel.
void panels_product(const uint16_t* x, int64_t ldx, int64_t M, const uint16_t* panels, int64_t K, int64_t N,
                    const uint16_t* bias, uint16_t* y) {
  const int64_t P = (N + kPanel - 1) / kPanel, K2 = (K + 1) / 2;
  const int64_t most = std::max<int64_t>(4, kPanelXBytes / (2 * K) / 4 * 4);  // rows of x in kPanelXBytes
  const int64_t blocks = (M + most - 1) / most;
  const int64_t block = ((M + blocks - 1) / blocks + 3) / 4 * 4;  // blocks of even size, in whole tiles
  at::parallel_for(0, blocks * P, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = t / P, p = t % P, m1 = std::min(M, (b + 1) * block);
      const uint16_t* panel = panels + p * K2 * 2 * kPanel;
      const int64_t n0 = p * kPanel, n = std::min(kPanel, N - n0);
      sluice_row_tiles<4>(b * block, m1, [&](auto tile, int64_t m) {
        constexpr int T = decltype(tile)::value;
        __m512 acc[T][4];
        panel_tile<T>(x + m * ldx, ldx, panel, K, acc);
        panel_store<T>(acc, bias, n0, n, y + m * N, N);
      });
    }
  });
}
