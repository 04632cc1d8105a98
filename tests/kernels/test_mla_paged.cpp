// MLA kernels over paged latent caches (cpu::LatentCache: bf16 or fp32 pages in any order,
// padded rows, T not a multiple of the page size): bit-identical to the contiguous fp32 cache of
// the same (bf16-valued) data, in both ISA copies; store_latent_row and the page checks.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "kernels/mla_test_util.h"
#include "megadecode/base/bf16.h"
#include "megadecode/base/error.h"
#include "megadecode/kernels/cpu/mla.h"

namespace md::cpu {
namespace {

// ---- Paged latent caches (LatentCache with bf16 or fp32 pages) ------------------------------
// A paged cache holding the same values as the contiguous fp32 cache must give exactly its bits:
// a bf16 element widens to fp32 exactly and meets the same arithmetic in the same order. These
// tests compare bit patterns (no tolerance); the float64 tests above cover the contiguous cache.

// A problem whose cache values are bf16-exact, so a bf16 page can hold them losslessly.
Problem make_bf16_problem(const MlaDims& d, int T, uint64_t seed) {
  Problem pb = make_problem(d, T, seed);
  for (auto& x : pb.cache) x = round_bf16(x);  // NaN padding stays NaN
  return pb;
}

// pb's cache rows copied, through store_latent_row, into pages of page_rows rows in a scrambled
// order: ids are a fixed permutation of [0, npages + 2) (two spare pages, never referenced), row
// stride R + P + 5 (differs from pb.ldc), and a page stride with 64 spare bytes. Everything not
// written (row padding, rows past T, spare pages) holds NaN, so a misaddressed read shows.
struct PagedCache {
  std::vector<unsigned char> bytes;
  std::vector<int32_t> pages;
  LatentCache lc;

  PagedCache(const Problem& pb, int page_rows, bool bf16) {
    const MlaDims& d = pb.d;
    const int64_t ld = d.R + d.P + 5;
    const int npages = std::max(1, (pb.T + page_rows - 1) / page_rows);
    const int nalloc = npages + 2;
    std::vector<int32_t> ids(static_cast<size_t>(nalloc));
    for (int i = 0; i < nalloc; ++i) ids[i] = i;
    std::mt19937_64 rng(static_cast<uint64_t>(pb.T * 131 + page_rows));
    std::shuffle(ids.begin(), ids.end(), rng);
    if (nalloc > 1 && ids[0] == 0) std::swap(ids[0], ids[1]);  // never the identity at the start
    pages.assign(ids.begin(), ids.begin() + npages);
    lc.bf16 = bf16;
    lc.ld = ld;
    lc.page_rows = page_rows;
    lc.page_stride = page_rows * ld * static_cast<int64_t>(lc.elem_bytes()) + 64;
    bytes.resize(static_cast<size_t>(lc.page_stride) * nalloc);
    const size_t n = bytes.size() / lc.elem_bytes();
    if (bf16) {
      std::vector<md::bf16> nan(n, 0x7fc0);
      std::memcpy(bytes.data(), nan.data(), n * 2);
    } else {
      std::vector<float> nan(n, std::numeric_limits<float>::quiet_NaN());
      std::memcpy(bytes.data(), nan.data(), n * 4);
    }
    lc.base = bytes.data();
    lc.pages = pages.data();
    for (int t = 0; t < pb.T; ++t) store_latent_row(lc, t, pb.cache.data() + t * pb.ldc, d.R + d.P);
  }
};

uint32_t bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
}

// Bit-for-bit equality of two output buffers (NaN where neither kernel wrote).
void expect_same_bits(const std::vector<float>& got, const std::vector<float>& want,
                      const char* what) {
  ASSERT_EQ(got.size(), want.size());
  size_t bad = 0, first = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (bits(got[i]) != bits(want[i]) && bad++ == 0) first = i;
  }
  EXPECT_EQ(bad, 0u) << what << ": " << bad << " of " << got.size() << " values differ, first at "
                     << first << " (" << got[first] << " vs " << want[first] << ")";
}

// The ISA copies the paged tests run: both forced explicitly (a CPU without AVX2 runs the portable
// copy twice).
constexpr const char* kPagedIsas[] = {"avx2", "portable"};

struct PagedCase {
  int page_rows;
  bool bf16;
};
constexpr PagedCase kPagedCases[] = {{16, true}, {64, true}, {16, false}, {64, false}};

std::string paged_name(const PagedCase& c) {
  return std::string(c.bf16 ? "bf16" : "fp32") + " pages of " + std::to_string(c.page_rows);
}

void check_paged_decode(const MlaDims& d, int T, int h0, int h1, uint64_t seed) {
  const Problem pb = make_bf16_problem(d, T, seed);
  const auto q = random_queries(1, d.H * (d.N + d.P), d, seed + 1);
  for (const PagedCase& pc : kPagedCases) {
    const PagedCache paged(pb, pc.page_rows, pc.bf16);
    for (const char* isa : kPagedIsas) {
      ScopedIsa scoped(isa);
      SCOPED_TRACE(testing::Message() << "T=" << T << " heads [" << h0 << "," << h1 << ") "
                                      << paged_name(pc) << " isa " << mla_isa());
      const auto want = run_decode(pb, q.data(), T, h0, h1);
      std::vector<float> got(want.size(), std::numeric_limits<float>::quiet_NaN());
      std::vector<float> scratch(static_cast<size_t>(T) + 2 * d.R);
      mla_decode_absorbed(q.data(), paged.lc, T, pb.kv_b.data(), d, h0, h1, got.data(),
                          scratch.data());
      expect_same_bits(got, want, "decode_absorbed");
    }
  }
}

TEST(MlaPaged, DecodeAbsorbedBitIdentical) {
  for (int T : {1, 15, 16, 17, 100, 300}) check_paged_decode(kSmall, T, 0, kSmall.H, 2000 + T);
  check_paged_decode(kSmall, 130, 1, 3, 2100);
  MlaDims d = kReal;
  d.H = 4;
  for (int T : {37, 200}) check_paged_decode(d, T, 0, d.H, 2200 + T);
}

// Partials over mla_split_rows' splits (and over rows [t0, t1) not on block starts, whose blocks
// then cross pages), then the merge: every partial and the merged output bit for bit.
TEST(MlaPaged, DecodePartialAndMergeBitIdentical) {
  for (const MlaDims& d : {kSmall, MlaDims{4, 128, 64, 128, 512}}) {
    for (int T : {17, 100, 300}) {
      const Problem pb = make_bf16_problem(d, T, 2300 + T + d.R);
      const auto q = random_queries(1, d.H * (d.N + d.P), d, 2301 + T);
      const int h0 = 1, h1 = d.H, nh = h1 - h0;
      const int64_t stride = int64_t(nh) * (d.R + 2);
      for (const PagedCase& pc : kPagedCases) {
        const PagedCache paged(pb, pc.page_rows, pc.bf16);
        for (const char* isa : kPagedIsas) {
          ScopedIsa scoped(isa);
          std::vector<float> ws(mla_partial_scratch_floats(d, nh));
          for (int S : {1, 3, 5}) {
            SCOPED_TRACE(testing::Message() << "R=" << d.R << " T=" << T << " S=" << S << " "
                                            << paged_name(pc) << " isa " << mla_isa());
            std::vector<float> pw(static_cast<size_t>(S) * stride, std::nanf("")), pg = pw;
            for (int i = 0; i < S; ++i) {
              int t0 = 0, t1 = 0;
              mla_split_rows(T, S, i, &t0, &t1);
              mla_decode_partial(q.data(), pb.view(), t0, t1, pb.kv_b.data(), d, h0, h1,
                                 pw.data() + i * stride, ws.data());
              mla_decode_partial(q.data(), paged.lc, t0, t1, pb.kv_b.data(), d, h0, h1,
                                 pg.data() + i * stride, ws.data());
            }
            expect_same_bits(pg, pw, "partials");
            std::vector<float> ow(static_cast<size_t>(d.H) * d.V, std::nanf("")), og = ow;
            std::vector<float> acc(static_cast<size_t>(d.R));
            mla_decode_merge(pw.data(), stride, S, pb.kv_b.data(), d, h0, h1, ow.data(),
                             acc.data());
            mla_decode_merge(pg.data(), stride, S, pb.kv_b.data(), d, h0, h1, og.data(),
                             acc.data());
            expect_same_bits(og, ow, "merged");
          }
          for (auto [t0, t1] : {std::pair{5, T}, std::pair{T / 3, T - 1}, std::pair{9, 9}}) {
            SCOPED_TRACE(testing::Message()
                         << "R=" << d.R << " T=" << T << " rows [" << t0 << "," << t1 << ") "
                         << paged_name(pc) << " isa " << mla_isa());
            std::vector<float> pw(static_cast<size_t>(stride), std::nanf("")), pg = pw;
            mla_decode_partial(q.data(), pb.view(), t0, t1, pb.kv_b.data(), d, h0, h1, pw.data(),
                               ws.data());
            mla_decode_partial(q.data(), paged.lc, t0, t1, pb.kv_b.data(), d, h0, h1, pg.data(),
                               ws.data());
            expect_same_bits(pg, pw, "unaligned partial");
          }
        }
      }
    }
  }
}

TEST(MlaPaged, PrefillBitIdentical) {
  struct Shape {
    MlaDims d;
    int T0, Tq, h0, h1;
  };
  MlaDims real4 = kReal;
  real4.H = 4;
  const Shape shapes[] = {{kSmall, 0, 70, 0, kSmall.H}, {kSmall, 45, 1, 0, kSmall.H},
                          {kSmall, 45, 5, 1, 4},        {kSmall, 61, 70, 0, kSmall.H},
                          {real4, 40, 70, 1, 3},        {real4, 3, 1, 0, 4}};
  for (const Shape& sh : shapes) {
    const MlaDims& d = sh.d;
    const Problem pb = make_bf16_problem(d, sh.T0 + sh.Tq, 2400 + sh.T0 + sh.Tq + d.R);
    const int64_t ldq = d.H * (d.N + d.P) + 5, ldo = d.H * d.V + 7;
    const auto q = random_queries(sh.Tq, ldq, d, 2401 + sh.Tq);
    for (const PagedCase& pc : kPagedCases) {
      const PagedCache paged(pb, pc.page_rows, pc.bf16);
      for (const char* isa : kPagedIsas) {
        ScopedIsa scoped(isa);
        for (bool round : {false, true}) {
          SCOPED_TRACE(testing::Message()
                       << "R=" << d.R << " T0=" << sh.T0 << " Tq=" << sh.Tq << " round=" << round
                       << " " << paged_name(pc) << " isa " << mla_isa());
          std::vector<float> want(static_cast<size_t>(sh.Tq) * ldo, std::nanf("")), got = want;
          mla_prefill(q.data(), ldq, sh.Tq, sh.T0, pb.view(), pb.kv_b.data(), d, sh.h0, sh.h1,
                      want.data(), ldo, round);
          mla_prefill(q.data(), ldq, sh.Tq, sh.T0, paged.lc, pb.kv_b.data(), d, sh.h0, sh.h1,
                      got.data(), ldo, round);
          expect_same_bits(got, want, "prefill");
        }
      }
    }
  }
}

TEST(MlaPaged, StoreLatentRowRoundTrips) {
  const MlaDims d{1, 4, 6, 4, 43};
  const Problem pb = make_bf16_problem(d, 40, 2500);
  for (const PagedCase& pc : kPagedCases) {
    SCOPED_TRACE(paged_name(pc));
    PagedCache paged(pb, pc.page_rows, pc.bf16);
    // bf16-valued rows read back exactly, in either storage, at the page table's addresses.
    for (int t = 0; t < pb.T; ++t) {
      const int64_t page = paged.pages[t / pc.page_rows], r = t % pc.page_rows;
      const unsigned char* want_addr = paged.bytes.data() + page * paged.lc.page_stride +
                                       r * paged.lc.ld * int64_t(paged.lc.elem_bytes());
      ASSERT_EQ(paged.lc.row(t), want_addr) << "row " << t;
      for (int j = 0; j < d.R + d.P; ++j) {
        const float x = pb.cache[t * pb.ldc + j];
        float y;
        if (pc.bf16) {
          bf16 h;
          std::memcpy(&h, static_cast<const unsigned char*>(paged.lc.row(t)) + 2 * j, 2);
          y = bf16_to_f32(h);
        } else {
          std::memcpy(&y, static_cast<const unsigned char*>(paged.lc.row(t)) + 4 * j, 4);
        }
        ASSERT_EQ(bits(y), bits(x)) << "row " << t << " col " << j;
      }
      // Only the n values given are written: the row's padding is untouched (NaN).
      float pad;
      if (pc.bf16) {
        bf16 h;
        std::memcpy(&h, static_cast<const unsigned char*>(paged.lc.row(t)) + 2 * (d.R + d.P), 2);
        pad = bf16_to_f32(h);
      } else {
        std::memcpy(&pad, static_cast<const unsigned char*>(paged.lc.row(t)) + 4 * (d.R + d.P), 4);
      }
      EXPECT_TRUE(std::isnan(pad)) << "row " << t;
    }
    // Values that are not bf16-exact round to nearest even in bf16 storage, stay as they are in
    // fp32 storage.
    const float odd[] = {1.0f + 0x1p-8f,
                         1.0f + 0x1p-8f + 0x1p-9f,
                         1.0f + 3 * 0x1p-8f,
                         -3.14159f,
                         1e-30f,
                         65504.5f,
                         std::numeric_limits<float>::infinity()};
    const int n = int(std::size(odd));
    store_latent_row(paged.lc, 7, odd, n);
    for (int j = 0; j < n; ++j) {
      float y;
      if (pc.bf16) {
        bf16 h;
        std::memcpy(&h, static_cast<const unsigned char*>(paged.lc.row(7)) + 2 * j, 2);
        EXPECT_EQ(h, f32_to_bf16(odd[j])) << j;
        y = bf16_to_f32(h);
        EXPECT_EQ(bits(y), bits(round_bf16(odd[j]))) << j;
      } else {
        std::memcpy(&y, static_cast<const unsigned char*>(paged.lc.row(7)) + 4 * j, 4);
        EXPECT_EQ(bits(y), bits(odd[j])) << j;
      }
    }
  }
  // 1 + 2^-8 is halfway between two bf16 values: ties go to even (down to 1), 1 + 3 * 2^-8 up.
  EXPECT_EQ(round_bf16(1.0f + 0x1p-8f), 1.0f);
  EXPECT_EQ(round_bf16(1.0f + 3 * 0x1p-8f), 1.0f + 4 * 0x1p-8f);
}

TEST(MlaPaged, ContiguousView) {
  std::vector<float> rows(static_cast<size_t>(40) * 7);
  for (auto [n, page_rows] : {std::pair{0, 16}, {1, 16}, {16, 16}, {17, 32}, {40, 48}}) {
    const LatentCache c = LatentCache::contiguous(rows.data(), 7, n);
    EXPECT_EQ(c.page_rows, page_rows) << n;
    EXPECT_FALSE(c.bf16);
    EXPECT_EQ(c.ld, 7);
    EXPECT_EQ(c.elem_bytes(), 4u);
    for (int t = 0; t < n; ++t) ASSERT_EQ(c.row(t), rows.data() + t * 7) << n << " row " << t;
  }
}

TEST(MlaPaged, RejectsBadPageRows) {
  const Problem pb = make_bf16_problem(kSmall, 20, 2600);
  PagedCache paged(pb, 16, true);
  LatentCache lc = paged.lc;
  lc.page_rows = 8;
  const auto q = random_queries(1, kSmall.H * (kSmall.N + kSmall.P), kSmall, 2601);
  std::vector<float> out(static_cast<size_t>(kSmall.H) * kSmall.V), scratch(20 + 2 * kSmall.R);
  EXPECT_THROW(mla_decode_absorbed(q.data(), lc, 20, pb.kv_b.data(), kSmall, 0, kSmall.H,
                                   out.data(), scratch.data()),
               Error);
  lc = paged.lc;
  lc.ld = kSmall.R + kSmall.P - 1;
  EXPECT_THROW(mla_prefill(q.data(), kSmall.H * (kSmall.N + kSmall.P), 1, 19, lc, pb.kv_b.data(),
                           kSmall, 0, kSmall.H, out.data(), kSmall.H * kSmall.V, false),
               Error);
}

}  // namespace
}  // namespace md::cpu
