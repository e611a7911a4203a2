// The scalar tier of nf4.cpp (no AVX2): chunks of 2 columns (x in its own order), one code at a time.
// Included by nf4.cpp after its constants.
#pragma once

constexpr int64_t kNf4Chunk = 2;
constexpr const char* kNf4Tier = "generic";

constexpr int kNf4MaxTileRows = 1;  // x rows a pass takes: more spill the sums

template <int MT>
constexpr int nf4_rows_for() { return 1; }

// R weight rows (codes with row stride ldw, absmax with row stride lda) over `len` columns against MT rows of xp
// (row stride ldx): out[m * ldo + r] += sum over those columns of table[code] * absmax * x.
template <int R, int MT>
inline void nf4_dots(const uint8_t* w, int64_t ldw, const at::BFloat16* am, int64_t lda, const float* table,
                     const float* xp, int64_t ldx, int64_t len, float* out,
                     int64_t ldo) {
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MT; ++m) {
      float acc = 0.f;
      for (int64_t b = 0; b < len / kNf4Block; ++b) {
        const float s = bf16_to_float(am[r * lda + b]);
        for (int64_t k = b * kNf4Block; k < (b + 1) * kNf4Block; k += 2) {
          const uint8_t byte = w[r * ldw + k / 2];
          acc += table[byte >> 4] * s * xp[m * ldx + k] + table[byte & 15] * s * xp[m * ldx + k + 1];
        }
      }
      out[m * ldo + r] += acc;
    }
}

template <typename T>
inline void nf4_dequant_row(const uint8_t* codes, const at::BFloat16* am, const float* table, int64_t K, T* out) {
  for (int64_t k = 0; k < K; k += 2) {
    const float s = bf16_to_float(am[k / kNf4Block]);
    out[k] = static_cast<T>(table[codes[k / 2] >> 4] * s);
    out[k + 1] = static_cast<T>(table[codes[k / 2] & 15] * s);
  }
}
