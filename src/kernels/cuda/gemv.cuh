// The weight-streaming matrix-vector product of the CUDA tiles: rows [r0, r1) of a weight matrix
// times B activation rows, the block's warps over the matrix rows and the lanes over the columns
// (16 bytes of weights a lane at a time), fp32 accumulation, one warp butterfly per (row, token
// row). bf16 matrices whose rows are whole 16-byte units stream through kStages shared-memory
// stages filled by bulk async copies (port::bulk_copy_g2s on mbarriers), kStages - 1 chunks ahead
// of the one being computed; other matrices (fp32 router, unaligned rows) are read from global
// memory directly. MXFP4 (K3's experts) is not implemented on CUDA yet (a device trap).
//
// Summation order: per lane, its 8-column groups in ascending order, each group's 8 products
// added left to right; then the warp butterfly; for rows wider than a stage, the segments' sums
// in ascending order. It depends only on the matrix width, so every executor that runs a tile gets
// the same bits; against the CPU kernels it is an fp32 reordering.
#pragma once
#include "common.cuh"

MD_CUDA_BEGIN

// The phase bits of the stages' mbarriers, kept by every thread of a block (all threads run the
// same waits, so their copies agree). init_pipe() once per kernel launch per block.
struct Pipe {
  uint32_t parity = 0;  // bit s: the parity of the next wait on stage s
};

MD_DEV port::Mbar* stage_bars() {
  return reinterpret_cast<port::Mbar*>(port::smem() + kStages * kStageBytes);
}
MD_DEV uint8_t* stage(uint32_t s) {
  return port::smem() + s * kStageBytes;
}

MD_DEV void init_pipe() {
  if (port::thread_id() == 0) {
    for (uint32_t s = 0; s < kStages; ++s) port::mbar_init(&stage_bars()[s], 1);
    port::mbar_init_fence();
  }
  port::sync_block();
}

// 8 bf16 weights (16 bytes) dotted with 8 activations, added left to right to acc.
MD_DEV float dot8(const uint16_t* w, const float* x, float acc) {
  for (int i = 0; i < 8; ++i) acc += bf16f(w[i]) * x[i];
  return acc;
}

inline constexpr int kTokenBlock = 8;  // activation rows per pass over a chunk (registers)

// out(t, r, v) is called once per (token row t < B, matrix row r in [r0, r1)) by one lane.
// xrow(t): activation row t (cols floats). Every thread of the block calls it.
template <class XRow, class Out>
MD_DEV void gemv_block(const DevWeight& w, int64_t r0, int64_t r1, int B, XRow xrow, Out out,
                       Pipe& pipe) {
  if (r1 <= r0 || B <= 0) return;
  const int64_t cols = w.cols;
  const uint32_t lane = port::lane(), wid = port::warp_id(), nw = port::warps();
  if (w.dtype == WDType::kMXFP4) port::trap("MXFP4 weights are not implemented on CUDA yet");
  const bool staged = w.dtype == WDType::kBF16 && cols % 8 == 0 &&
                      (reinterpret_cast<uintptr_t>(w.data) % 16) == 0;
  if (!staged) {
    // Direct: warp per row, from global memory.
    for (int64_t r = r0 + wid; r < r1; r += nw) {
      for (int t0 = 0; t0 < B; t0 += kTokenBlock) {
        const int tn = B - t0 < kTokenBlock ? B - t0 : kTokenBlock;
        float acc[kTokenBlock] = {};
        for (int64_t c = lane; c < cols; c += port::kWarp) {
          const float wv = w.dtype == WDType::kF32
                               ? static_cast<const float*>(w.data)[r * cols + c]
                               : bf16f(static_cast<const uint16_t*>(w.data)[r * cols + c]);
          for (int t = 0; t < tn; ++t) acc[t] += wv * xrow(t0 + t)[c];
        }
        for (int t = 0; t < kTokenBlock; ++t) {
          if (t >= tn) break;
          const float v = port::warp_sum(acc[t]);
          if (lane == 0) out(t0 + t, r, v);
        }
      }
    }
    port::sync_block();
    return;
  }
  // Staged: the tile's rows are contiguous bytes; chunks are whole rows (rpc per stage) or, for
  // rows wider than a stage, segments of one row.
  const auto* base = static_cast<const uint8_t*>(w.data);
  const int64_t row_bytes = cols * 2, nrows = r1 - r0;
  const bool segmented = row_bytes > int64_t(kStageBytes);
  const int64_t rpc = segmented ? 1 : int64_t(kStageBytes) / row_bytes;
  const int64_t seg_cols = segmented ? int64_t(kStageBytes) / 2 : cols;
  const int64_t nseg = (cols + seg_cols - 1) / seg_cols;
  const int64_t nchunks = segmented ? nrows * nseg : (nrows + rpc - 1) / rpc;
  float* partial = work();  // segmented rows: the running sums of the row, per token row
  auto chunk_of = [&](int64_t k, int64_t* row, int64_t* nr, int64_t* c0, int64_t* nc) {
    if (segmented) {
      *row = r0 + k / nseg;
      *nr = 1;
      *c0 = (k % nseg) * seg_cols;
      *nc = cols - *c0 < seg_cols ? cols - *c0 : seg_cols;
    } else {
      *row = r0 + k * rpc;
      *nr = r1 - *row < rpc ? r1 - *row : rpc;
      *c0 = 0;
      *nc = cols;
    }
  };
  auto issue = [&](int64_t k) {
    int64_t row, nr, c0, nc;
    chunk_of(k, &row, &nr, &c0, &nc);
    const uint32_t s = uint32_t(k % kStages);
    const uint32_t bytes = uint32_t(nr * nc * 2);
    port::mbar_arrive_expect_tx(&stage_bars()[s], bytes);
    port::bulk_copy_g2s(stage(s), base + row * row_bytes + c0 * 2, bytes, &stage_bars()[s]);
  };
  if (port::thread_id() == 0)
    for (int64_t k = 0; k < nchunks && k < int64_t(kStages); ++k) issue(k);
  for (int64_t k = 0; k < nchunks; ++k) {
    const uint32_t s = uint32_t(k % kStages);
    port::mbar_wait(&stage_bars()[s], (pipe.parity >> s) & 1u);
    pipe.parity ^= 1u << s;
    int64_t row, nr, c0, nc;
    chunk_of(k, &row, &nr, &c0, &nc);
    const auto* ws = reinterpret_cast<const uint16_t*>(stage(s));
    for (int64_t j = wid; j < nr; j += nw) {
      const int64_t r = row + j;
      for (int t0 = 0; t0 < B; t0 += kTokenBlock) {
        const int tn = B - t0 < kTokenBlock ? B - t0 : kTokenBlock;
        float acc[kTokenBlock] = {};
        for (int64_t g = lane; g < nc / 8; g += port::kWarp) {
          const uint16_t* w8 = ws + j * nc + g * 8;
          for (int t = 0; t < tn; ++t) acc[t] = dot8(w8, xrow(t0 + t) + c0 + g * 8, acc[t]);
        }
        for (int t = 0; t < kTokenBlock; ++t) {
          if (t >= tn) break;
          const float v = port::warp_sum(acc[t]);
          if (lane != 0) continue;
          if (!segmented) {
            out(t0 + t, r, v);
          } else {
            const int64_t seg = k % nseg;
            const float sum = seg == 0 ? v : partial[t0 + t] + v;
            if (seg + 1 == nseg)
              out(t0 + t, r, sum);
            else
              partial[t0 + t] = sum;
          }
        }
      }
    }
    port::sync_block();  // every warp is done with stage s
    if (port::thread_id() == 0 && k + int64_t(kStages) < nchunks) issue(k + int64_t(kStages));
  }
}

MD_CUDA_END
