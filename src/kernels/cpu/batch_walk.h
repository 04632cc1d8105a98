// The walk over a batch of vectors that every GEMV driver shares (matmul_avx2.cpp,
// matmul_avx512_tiles.h, q4_avx2.cpp, q4_avx512.cpp, qdot_avx2.cpp, qdot_avx512bf16.cpp). No
// intrinsics: each ISA file instantiates it with its own tiles. Internal linkage, as the other
// headers shared by ISA files.
#pragma once
#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace md::cpu::detail {
namespace {

// Vectors [0, nb) over rows [r0, r1), by calls tile(tall, j, nv, rc, rce) that run vectors
// [j, j + nv) over rows [rc, rce) (tall: std::true_type for the pass that streams the rows from
// DRAM, std::false_type for one that re-reads them from L2):
//  * nb <= kTileVecs: one streaming pass; every weight is used by one tile only.
//  * more: row chunks of chunk_rows rows outer, groups of kTileVecs vectors inner, so a chunk comes
//    from DRAM for the first group and from L2 for the others.
// A tile's result depends only on its row and vector, so the walk changes no bits.
template <int kTileVecs, class Tile>
void walk_batch(int nb, int64_t r0, int64_t r1, int64_t chunk_rows, const Tile& tile) {
  if (nb <= kTileVecs) {
    tile(std::true_type{}, 0, nb, r0, r1);
    return;
  }
  for (int64_t rc = r0; rc < r1; rc += chunk_rows) {
    const int64_t rce = std::min(r1, rc + chunk_rows);
    for (int j = 0; j < nb; j += kTileVecs) {
      const int nv = std::min(kTileVecs, nb - j);
      if (j == 0) {
        tile(std::true_type{}, j, nv, rc, rce);
      } else {
        tile(std::false_type{}, j, nv, rc, rce);
      }
    }
  }
}

}  // namespace
}  // namespace md::cpu::detail
