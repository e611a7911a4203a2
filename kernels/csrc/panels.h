// The panel layout that bf16_panels.h and int8_panels.h read (header only; cpp_build hashes csrc/*.h into every build
// name): a row-major weight [N, K] as panels of kPanelWidth outputs, each group of G consecutive K values of the
// panel's outputs side by side in one line (G = 2 for bf16 pairs, 4 for int8 quads).
#pragma once
#include <ATen/Parallel.h>
#include <cstdint>

constexpr int64_t kPanelWidth = 64;  // outputs of a panel: four 64-byte vectors of 16 lanes

// dst[((n / kPanelWidth) * KG + k / G) * G kPanelWidth + (n % kPanelWidth) * G + k % G] = f(src[n * K + k]), KG =
// ceil(K / G); dst's padding (outputs past N, K up to a multiple of G) is left as the caller filled it.
template <int G, typename T, typename F>
void sluice_pack_panels(const T* src, int64_t N, int64_t K, T* dst, F&& f) {
  const int64_t P = (N + kPanelWidth - 1) / kPanelWidth, KG = (K + G - 1) / G;
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t c = 0; c < kPanelWidth && p * kPanelWidth + c < N; ++c) {
        const T* row = src + (p * kPanelWidth + c) * K;
        T* col = dst + p * KG * G * kPanelWidth + G * c;
        for (int64_t k = 0; k < K; ++k) col[(k / G) * G * kPanelWidth + k % G] = f(row[k]);
      }
  });
}
