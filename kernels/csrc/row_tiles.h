// The row loop every CPU kernel's tiles share (header only; cpp_build hashes csrc/*.h into every build name).
#pragma once
#include <cstdint>
#include <type_traits>

// Rows [m0, m1) in tiles of R (1 to 4): f(std::integral_constant<int, R>{}, m) for each whole tile, then once with
// the 1 to R - 1 rows left. f is a generic lambda that reads its tile's rows as `decltype(r)::value`.
template <int R, typename F>
inline void sluice_row_tiles(int64_t m0, int64_t m1, F&& f) {
  static_assert(R >= 1 && R <= 4, "tiles of 1 to 4 rows");
  int64_t m = m0;
  for (; m + R <= m1; m += R) f(std::integral_constant<int, R>{}, m);
  const int64_t left = m1 - m;
  if constexpr (R > 1) if (left == 1) f(std::integral_constant<int, 1>{}, m);
  if constexpr (R > 2) if (left == 2) f(std::integral_constant<int, 2>{}, m);
  if constexpr (R > 3) if (left == 3) f(std::integral_constant<int, 3>{}, m);
}
