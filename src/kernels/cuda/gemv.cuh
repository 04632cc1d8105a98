// The weight-streaming matrix-vector product of the CUDA tiles: rows [r0, r1) of a weight matrix
// times B activation rows, the block's warps over the matrix rows and the lanes over the columns
// (16 bytes of weights a lane at a time, a "unit": 8 bf16; 16 int8 or FP8 codes; 32 int4 or
// MXFP4 codes), fp32 accumulation, one warp butterfly per (row, token row). bf16 and quantized
// matrices whose rows are whole 16-byte units stream through kStages shared-memory stages filled
// by bulk async copies (port::bulk_copy_g2s on mbarriers), kStages - 1 chunks ahead of the one
// being computed; other matrices (fp32 router, unaligned bf16 rows) are read from global memory
// directly. A quantized unit lies inside one scale group (groups are multiples of 32 columns);
// its scale is read from global memory (1/16 to 1/64 of the bytes, cached).
//
// Summation order: per lane, its units in ascending order. A bf16 unit's 8 products are added
// left to right into the lane's sum; a quantized unit's products of unscaled codes (exact small
// integers, or FP8 values) and activations are added left to right into a unit sum, which is
// multiplied by the unit's scale and added to the lane's sum. Then the warp butterfly; for rows
// wider than a stage, the segments' sums in ascending order. It depends only on the matrix width
// and format, so every executor that runs a tile gets the same bits; against the CPU kernels
// (whose runs are shorter) it is an fp32 reordering.
#pragma once
#include "common.cuh"

MD_CUDA_BEGIN

// A weight stream: rows [r0, r1) of a matrix (w null: none).
struct StreamRef {
  const DevWeight* w = nullptr;
  uint32_t r0 = 0, r1 = 0;  // 32 bits, as the plan's rows (registers: the kernels are at ptxas's limit)
  bool tile_end = false;  // not a stream: "the tile ends here" (what follows is Pipe::after_tile)
};

// What a GEMV is followed by, for its tail (gemv_block): the tile's next GEMV, the end of the
// tile (then the next instruction's first stream, which the megakernel knows), or unknown.
MD_DEV StreamRef then_stream(const DevWeight& w, int64_t r0, int64_t r1) {
  return StreamRef{&w, uint32_t(r0), uint32_t(r1), false};
}
MD_DEV StreamRef then_tile_end() {
  return StreamRef{nullptr, 0, 0, true};
}

// The stages' state, kept by every thread of a block (all threads run the same waits, so their
// copies agree): the parity of the next wait on each stage, the stage where the next stream's
// chunk 0 goes (chunk k of a stream goes to stage (base + k) % kStages, so a stream can start
// in the stages its predecessor frees at its tail), and a prefetch in flight: the first chunks of
// a GEMV issued before it started (before its tile's inputs were ready, or during the tail of the
// GEMV before it).
struct Pipe {
  uint32_t parity = 0;  // bit s: the parity of the next wait on stage s
  uint32_t base = 0;
  const void* pre_data = nullptr;
  uint32_t pre_r0 = 0, pre_r1 = 0;  // 32 bits, as StreamRef's
  int pre_n = 0;          // chunks in flight in stages base .. base + pre_n - 1
  bool pre_next = false;  // the prefetch is the next instruction's (issued at this tile's end)
  // The megakernel: the first stream of the next instruction in the block's queue (none for the
  // phase kernel and the queue's last instruction).
  StreamRef after_tile;
};

MD_DEV port::Mbar* stage_bars() {
  return reinterpret_cast<port::Mbar*>(port::smem() + kStages * kStageBytes);
}
// A word of the block's own after the stages' mbarriers in their 128-byte area (the megakernel's
// stop verdict; the tiles own work()).
inline constexpr uint32_t kBlockWordOffset = (kStages * sizeof(port::Mbar) + 7) / 8 * 8;
static_assert(kBlockWordOffset + 4 <= 128, "the mbarriers and the block word exceed their area");
MD_DEV volatile uint32_t* block_word() {
  return reinterpret_cast<volatile uint32_t*>(port::smem() + kStages * kStageBytes +
                                              kBlockWordOffset);
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

MD_DEV bool quantized(const DevWeight& w) {
  return w.dtype == WDType::kMXFP4 || w.dtype == WDType::kInt4 || w.dtype == WDType::kInt8 ||
         w.dtype == WDType::kFp8;
}

// Elements per 16-byte unit of a streamed matrix: 8 bf16, 16 int8 / FP8, 32 int4 / MXFP4.
MD_DEV int64_t unit_elems(const DevWeight& w) {
  switch (w.dtype) {
    case WDType::kMXFP4:
    case WDType::kInt4:
      return 32;
    case WDType::kInt8:
    case WDType::kFp8:
      return 16;
    default:
      return 8;
  }
}

// Whether a matrix streams through the stages: bf16 or quantized rows of whole 16-byte units,
// aligned. (Quantized matrices always do: their groups are multiples of 32 columns.)
MD_DEV bool streamable(const DevWeight& w) {
  return (w.dtype == WDType::kBF16 || quantized(w)) && w.cols % unit_elems(w) == 0 &&
         (reinterpret_cast<uintptr_t>(w.data) % 16) == 0;
}

// An E8M0 scale byte as a float: 2^(s - 127) (s = 0: the subnormal 2^-127; 255: NaN).
MD_DEV float e8m0(uint8_t s) {
  if (s == 0) return port::u2f(1u << 22);
  if (s == 255) return port::u2f(0x7fc00000u);
  return port::u2f(uint32_t(s) << 23);
}

// An e2m1 code (bit 3 the sign): 0, 0.5, 1, 1.5, 2, 3, 4, 6.
MD_DEV float e2m1(uint32_t c) {
  const uint32_t m = c & 7u, e = m >> 1, f = m & 1u;
  const float mag = e == 0 ? 0.5f * float(f) : (1.0f + 0.5f * float(f)) * float(1u << (e - 1));
  return (c & 8u) ? -mag : mag;
}

// An integer code minus its offset (int4: c - 8, int8: c - 128), exactly: the code under the
// exponent of 2^23 is the float 2^23 + c, and 2^23 + offset is exact too, so one subtraction
// gives q (no conversion instruction, which an SM issues at a quarter of the FMA rate).
MD_DEV float code_minus(uint32_t c, float two23_plus_offset) {
  return port::u2f(0x4B000000u | c) - two23_plus_offset;
}
inline constexpr float kInt4Bias = 8388608.0f + 8.0f;
inline constexpr float kInt8Bias = 8388608.0f + 128.0f;

// An FP8 e4m3 byte's exact value (cpu::fp8_e4m3_value; 0x7f / 0xff, NaN, are refused at load).
// Normal (exponent field e > 0): the fields moved under fp32's exponent give 2^(e-127) (1 + m/8),
// and 120 more in the exponent make it 2^(e-7) (1 + m/8). Subnormal (e = 0): the same bits read
// as 2^-7 + m 2^-10, and twice that minus 2^-6 is m 2^-9, the value, exactly (no fp32 denormals,
// which a flush-to-zero build would drop).
MD_DEV float e4m3(uint32_t b) {
  const uint32_t m7 = b & 0x7fu;
  const float x = port::u2f((m7 << 20) + (120u << 23));
  const float mag = m7 >= 8u ? x : 2.0f * x - 0.015625f;
  return (b & 0x80u) ? -mag : mag;
}

// The unscaled values of 8 columns of a quantized unit: part p of a 4-bit unit's 32 codes (bytes
// 4p .. 4p + 3, low nibble first; p < 4), or of an 8-bit unit's 16 codes (bytes 8p .. 8p + 7;
// p < 2). Eight at a time: the phase kernel's registers are at the limit.
MD_DEV void decode8(WDType d, const uint8_t* unit, int p, float* v) {
  const auto* w = reinterpret_cast<const uint32_t*>(unit);
  if (d == WDType::kInt4 || d == WDType::kMXFP4) {
    const uint32_t word = w[p];
    for (int j = 0; j < 4; ++j) {
      const uint32_t b = (word >> (8 * j)) & 0xffu;
      if (d == WDType::kInt4) {
        v[2 * j] = code_minus(b & 15u, kInt4Bias);
        v[2 * j + 1] = code_minus(b >> 4, kInt4Bias);
      } else {
        v[2 * j] = e2m1(b & 15u);
        v[2 * j + 1] = e2m1(b >> 4);
      }
    }
  } else {
    for (int i = 0; i < 8; ++i) {
      const uint32_t b = (w[2 * p + i / 4] >> (8 * (i % 4))) & 0xffu;
      v[i] = d == WDType::kInt8 ? code_minus(b, kInt8Bias) : e4m3(b);
    }
  }
}

// The scale of row r's group holding column c (quantized formats).
MD_DEV float unit_scale(const DevWeight& w, int64_t r, int64_t c) {
  const uint32_t grp = w.group_shift >= 0 ? uint32_t(c) >> w.group_shift
                                          : uint32_t(c) / uint32_t(w.group);
  const int64_t i = r * w.row_groups + int64_t(grp);
  if (w.dtype == WDType::kMXFP4) return e8m0(w.scales[i]);
  if (w.dtype == WDType::kFp8) return reinterpret_cast<const float*>(w.scales)[i];
  return bf16f(reinterpret_cast<const uint16_t*>(w.scales)[i]);
}

inline constexpr int kTokenBlock = 4;  // activation rows per pass over a chunk (registers)

// A quantized unit (its 16-byte codes at `unit`, columns c .. c + E of row r) into the lanes'
// sums acc[t] of token rows t0 .. t0 + tn: per token row, the unit's products added left to right,
// times the scale, added to acc[t]. The codes are decoded once for all the token rows, 8 at a
// time.
template <class XRow>
MD_DEV void quant_unit(const DevWeight& w, const uint8_t* unit, int64_t r, int64_t c, int t0,
                       int tn, XRow xrow, float* acc) {
  const float sc = unit_scale(w, r, c);
  const int parts = int(unit_elems(w) / 8);
  float g[kTokenBlock] = {};
  for (int p = 0; p < parts; ++p) {
    float v[8];
    decode8(w.dtype, unit, p, v);
    for (int t = 0; t < kTokenBlock; ++t) {
      if (t >= tn) break;
      const float* x = xrow(t0 + t) + c + 8 * p;
      for (int i = 0; i < 8; ++i) g[t] += v[i] * x[i];
    }
  }
  for (int t = 0; t < kTokenBlock; ++t) {
    if (t >= tn) break;
    acc[t] = acc[t] + g[t] * sc;
  }
}

// How rows [r0, r1) of a streamable matrix go through the stages: chunks of whole rows (rpc per
// stage) or, for rows wider than a stage, segments of one row; chunk k goes to stage
// (Pipe::base + k) % kStages.
struct WeightStream {
  const uint8_t* base;
  int64_t cols, r0, r1, epu, row_bytes, rpc, seg_cols, nseg, nchunks;
  bool segmented;
  MD_DEV WeightStream(const DevWeight& w, int64_t r0_, int64_t r1_)
      : base(static_cast<const uint8_t*>(w.data)), cols(w.cols), r0(r0_), r1(r1_) {
    epu = unit_elems(w);
    row_bytes = cols / epu * 16;
    segmented = row_bytes > int64_t(kStageBytes);
    rpc = segmented ? 1 : int64_t(kStageBytes) / row_bytes;
    seg_cols = segmented ? int64_t(kStageBytes) / 16 * epu : cols;
    nseg = (cols + seg_cols - 1) / seg_cols;
    nchunks = segmented ? (r1 - r0) * nseg : (r1 - r0 + rpc - 1) / rpc;
  }
  MD_DEV void chunk(int64_t k, int64_t* row, int64_t* nr, int64_t* c0, int64_t* nc) const {
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
  }
  // One thread: chunk k into its stage, (stage0 + k) % kStages.
  MD_DEV void issue(int64_t k, uint32_t stage0) const {
    int64_t row, nr, c0, nc;
    chunk(k, &row, &nr, &c0, &nc);
    const uint32_t s = uint32_t((stage0 + uint64_t(k)) % kStages);
    const uint32_t bytes = uint32_t(nr * (nc / epu) * 16);
    // The stage's last readers passed a block barrier before this thread got here; the proxy
    // fence orders those generic reads before the copy's async-proxy writes.
    port::fence_async_shared();
    port::mbar_arrive_expect_tx(&stage_bars()[s], bytes);
    port::bulk_copy_g2s(stage(s), base + row * row_bytes + c0 / epu * 16, bytes,
                        &stage_bars()[s]);
  }
};

// Issues the first chunks of rows [r0, r1) of w (every thread calls it; thread 0 issues) while
// the stages are idle; gemv_block over the same rows then starts from them.
MD_DEV void prefetch(const DevWeight& w, int64_t r0, int64_t r1, Pipe& pipe) {
  if (pipe.pre_n || r1 <= r0 || !streamable(w)) return;
  const WeightStream ws(w, r0, r1);
  const int n = int(ws.nchunks < int64_t(kStages) ? ws.nchunks : int64_t(kStages));
  if (port::thread_id() == 0)
    for (int k = 0; k < n; ++k) ws.issue(k, pipe.base);
  pipe.pre_data = w.data;
  pipe.pre_r0 = uint32_t(r0);
  pipe.pre_r1 = uint32_t(r1);
  pipe.pre_n = n;
  pipe.pre_next = false;
}

// Waits out a prefetch nobody used (the stages must be idle before other chunks go in).
MD_DEV void drain(Pipe& pipe) {
  if (port::thread_id() == 0 && pipe.pre_n) port::note(port::Event::kPrefetchDrained);
  for (int i = 0; i < pipe.pre_n; ++i) {
    const uint32_t s = (pipe.base + uint32_t(i)) % kStages;
    port::mbar_wait(&stage_bars()[s], (pipe.parity >> s) & 1u);
    pipe.parity ^= 1u << s;
  }
  pipe.base = (pipe.base + uint32_t(pipe.pre_n)) % kStages;
  pipe.pre_n = 0;
  pipe.pre_next = false;
  port::sync_block();
}

// The stream a GEMV's tail prefetches: `then` itself, or at a tile's end the next instruction's
// first stream; null when there is none or it does not go through the stages.
MD_DEV const StreamRef* tail_target(const StreamRef& then, const Pipe& pipe) {
  const StreamRef* t = then.tile_end ? &pipe.after_tile : &then;
  if (!t->w || t->r1 <= t->r0 || !streamable(*t->w)) return nullptr;
  return t;
}

inline constexpr int kDirectUnroll = 8;  // weights a lane loads ahead on the direct path

// out(t, r, v) is called once per (token row t < B, matrix row r in [r0, r1)) by one lane.
// xrow(t): activation row t (cols floats). Every thread of the block calls it.
//
// `then` says what follows (then_stream, then_tile_end; default: unknown). Its first chunks are
// issued into the stages this GEMV frees at its tail, so they stream in while the last chunks
// compute and the block moves on (the next GEMV of the tile, or the megakernel's next
// instruction, which may still wait for its inputs: weights never do).
template <class XRow, class Out>
MD_DEV void gemv_block(const DevWeight& w, int64_t r0, int64_t r1, int B, XRow xrow, Out out,
                       Pipe& pipe, StreamRef then = {}) {
  // A prefetch of these very rows is where the stream starts; any other is waited out first.
  int64_t ahead = 0;
  if (pipe.pre_n && pipe.pre_data == w.data && pipe.pre_r0 == r0 && pipe.pre_r1 == r1 && B > 0) {
    ahead = pipe.pre_n;
    if (port::thread_id() == 0)
      port::note(pipe.pre_next ? port::Event::kPrefetchUsedNextTile : port::Event::kPrefetchUsed);
    pipe.pre_n = 0;
    pipe.pre_next = false;
  } else if (pipe.pre_n) {
    drain(pipe);
  }
  if (r1 <= r0 || B <= 0) return;
  const StreamRef* tail = tail_target(then, pipe);
  const int64_t cols = w.cols;
  const uint32_t lane = port::lane(), wid = port::warp_id(), nw = port::warps();
  if (quantized(w) && !streamable(w))
    port::trap("quantized weights with rows of a partial 16-byte unit or unaligned");
  if (!streamable(w)) {
    // Direct: warp per row, from global memory; the idle stages take what follows.
    if (tail) prefetch(*tail->w, tail->r0, tail->r1, pipe);
    pipe.pre_next = tail && then.tile_end;
    // Each lane loads kDirectUnroll of its weights (and their activations) before it uses any:
    // one load at a time in flight left a warp waiting a memory latency per 32 columns (the
    // router's 256 x 2304 fp32 rows took 1.4 ms a layer on an H200, 2026-12-04). The products
    // are added in the same order as one at a time: per lane, ascending columns.
    const bool f32 = w.dtype == WDType::kF32;
    const float* wf = static_cast<const float*>(w.data);
    const uint16_t* wh = static_cast<const uint16_t*>(w.data);
    for (int64_t r = r0 + wid; r < r1; r += nw) {
      for (int t0 = 0; t0 < B; t0 += kTokenBlock) {
        const int tn = B - t0 < kTokenBlock ? B - t0 : kTokenBlock;
        float acc[kTokenBlock] = {};
        const float* xs[kTokenBlock] = {};
        for (int t = 0; t < tn; ++t) xs[t] = xrow(t0 + t);
        const int64_t row = r * cols;
        int64_t c = lane;
        for (; c + (kDirectUnroll - 1) * port::kWarp < cols; c += kDirectUnroll * port::kWarp) {
          float wv[kDirectUnroll];
          for (int u = 0; u < kDirectUnroll; ++u) {
            const int64_t i = row + c + u * port::kWarp;
            wv[u] = f32 ? wf[i] : bf16f(wh[i]);
          }
          for (int t = 0; t < kTokenBlock; ++t) {
            if (t >= tn) break;
            float xv[kDirectUnroll];
            for (int u = 0; u < kDirectUnroll; ++u) xv[u] = xs[t][c + u * port::kWarp];
            for (int u = 0; u < kDirectUnroll; ++u) acc[t] += wv[u] * xv[u];
          }
        }
        for (; c < cols; c += port::kWarp) {
          const float wv = f32 ? wf[row + c] : bf16f(wh[row + c]);
          for (int t = 0; t < tn; ++t) acc[t] += wv * xs[t][c];
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
  // Staged (WeightStream): kStages chunks in flight ahead of the one being computed.
  const WeightStream st(w, r0, r1);
  const bool segmented = st.segmented;
  const int64_t nseg = st.nseg, nchunks = st.nchunks;
  float* partial = work();  // segmented rows: the running sums of the row, per token row
  const uint32_t base = pipe.base;
  if (port::thread_id() == 0)
    for (int64_t k = ahead; k < nchunks && k < int64_t(kStages); ++k) st.issue(k, base);
  // The tail: the stream that follows starts in the stages after this one's last chunk.
  const uint32_t tail_base = uint32_t((base + uint64_t(nchunks)) % kStages);
  int tail_n = 0;
  if (tail) {
    const int64_t n = WeightStream(*tail->w, tail->r0, tail->r1).nchunks;
    tail_n = int(n < int64_t(kStages) ? n : int64_t(kStages));
  }
  if (tail) {
    pipe.pre_data = tail->w->data;
    pipe.pre_r0 = tail->r0;
    pipe.pre_r1 = tail->r1;
  }
  for (int64_t k = 0; k < nchunks; ++k) {
    const uint32_t s = uint32_t((base + uint64_t(k)) % kStages);
    port::mbar_wait(&stage_bars()[s], (pipe.parity >> s) & 1u);
    pipe.parity ^= 1u << s;
    int64_t row, nr, c0, nc;
    st.chunk(k, &row, &nr, &c0, &nc);
    const uint8_t* ws = stage(s);
    const bool quant = quantized(w);
    const int64_t units = nc / st.epu;  // 16-byte units of a chunk row
    for (int64_t j = wid; j < nr; j += nw) {
      const int64_t r = row + j;
      for (int t0 = 0; t0 < B; t0 += kTokenBlock) {
        const int tn = B - t0 < kTokenBlock ? B - t0 : kTokenBlock;
        float acc[kTokenBlock] = {};
        for (int64_t g = lane; g < units; g += port::kWarp) {
          const uint8_t* u = ws + (j * units + g) * 16;
          const int64_t c = c0 + g * st.epu;
          if (quant) {
            quant_unit(w, u, r, c, t0, tn, xrow, acc);
          } else {
            const auto* w8 = reinterpret_cast<const uint16_t*>(u);
            for (int t = 0; t < tn; ++t) acc[t] = dot8(w8, xrow(t0 + t) + c, acc[t]);
          }
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
    if (k + int64_t(kStages) < nchunks) {
      if (port::thread_id() == 0) st.issue(k + int64_t(kStages), base);
    } else if (tail) {
      // Stage s is free for good: the next stream's chunks up to the one that maps to it (chunk
      // j sits in stage tail_base + j, which chunk nchunks + j - kStages of this one held).
      // (The stream is rebuilt here, at most kStages times a GEMV, rather than held in
      // registers through the loop.)
      const int64_t upto = k + int64_t(kStages) - nchunks + 1;
      const int n = int(upto < int64_t(tail_n) ? upto : int64_t(tail_n));
      if (n > pipe.pre_n) {
        if (port::thread_id() == 0) {
          const WeightStream tws(*tail->w, tail->r0, tail->r1);
          for (int j = pipe.pre_n; j < n; ++j) tws.issue(j, tail_base);
        }
        pipe.pre_n = n;
      }
    }
  }
  pipe.base = tail_base;
  pipe.pre_next = pipe.pre_n > 0 && then.tile_end;
}

MD_CUDA_END
