// flash-cce fused CUDA kernels, compiled by MLX (NVRTC) through
// mx.fast.cuda_kernel: this file is the `header`, the kernel bodies in
// cuda.py only call cce::fwd / cce::bwd.
//
// Layout: a block of BM = 128 tokens times a stretch of the vocabulary,
// 256 threads = 8 warps as 4 (tokens) x 2 (vocabulary); each warp owns a
// 32 x 64 tile of the logits and computes it with tensor cores
// (mma.sync m16n8k16, bf16/fp16 in, float32 accumulate), operands staged in
// shared memory by cp.async (dense) or dequantized there from 4/8-bit words.
//
// fwd: logits tile by tile, online max / sum per token (per warp, merged at
//      the end) and the target's logit: outputs per-split (max, sum), so the
//      log-sum-exp of a split is max + log(sum); the splits are merged in MLX.
// bwd: for 512 vocabulary rows at a time, phase A recomputes the logits and
//      writes D = (softmax - onehot) * dz (dz: derivative of the soft cap)
//      into shared memory; phase B multiplies D [128 x 512] by the same head
//      rows [512 x H] in 128-column slices and adds g * (D @ W) into the
//      float32 hidden gradient with atomics. [N, V] is never written.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda/std/cstdint>
#include <cuda/std/limits>

namespace cce {

constexpr float kInf = cuda::std::numeric_limits<float>::infinity();
constexpr int NT = 256;          // threads per block
constexpr int BM = 128;          // tokens per block
constexpr int BN = 128;          // vocabulary rows per logits tile
constexpr int BK = 64;           // hidden columns per phase-A step
constexpr int PAD = 8;           // elements of padding per shared row (16 bytes: no ldmatrix bank conflicts)
constexpr int LDK = BK + PAD;    // row stride of the phase-A staging tiles
constexpr int RC = 512;          // vocabulary rows per backward chunk
constexpr int LDD = RC + PAD;    // row stride of D
constexpr int BH = 128;          // hidden columns per phase-B output tile
constexpr int KB = 64;           // vocabulary rows per phase-B step
constexpr int LDW = BH + PAD;    // row stride of the phase-B staging tile
constexpr int NSLICE = RC / KB;  // 64-row vocabulary slices of a chunk

constexpr int FWD_SMEM = 2 * (BM + BN) * LDK * 2 + 4 * BM * 4 + BM * 4;
constexpr int STAGE_A = 2 * (BM + BN) * LDK * 2;
constexpr int STAGE_B = 2 * KB * LDW * 2;
constexpr int STAGE = STAGE_A > STAGE_B ? STAGE_A : STAGE_B;
constexpr int BWD_SMEM = BM * LDD * 2 + STAGE + 3 * BM * 4 + 4 * NSLICE * 4 + (NSLICE + 1) * 4;
// cuda.py passes these sizes; Hopper allows 227 KiB of shared memory per block.
static_assert(FWD_SMEM == 76288 && BWD_SMEM == 208548, "update FWD_SMEM / BWD_SMEM in cuda.py");
static_assert(BWD_SMEM <= 232448, "too much shared memory");

__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }

template <typename T>
struct Mma;

template <>
struct Mma<__nv_bfloat16> {
  static __device__ __forceinline__ void run(float* c, const uint32_t* a, const uint32_t* b) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
  static __device__ __forceinline__ uint32_t pack(float x, float y) {
    __nv_bfloat162 v = __floats2bfloat162_rn(x, y);
    return *reinterpret_cast<uint32_t*>(&v);
  }
};

template <>
struct Mma<__half> {
  static __device__ __forceinline__ void run(float* c, const uint32_t* a, const uint32_t* b) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
  static __device__ __forceinline__ uint32_t pack(float x, float y) {
    __half2 v = __floats2half2_rn(x, y);
    return *reinterpret_cast<uint32_t*>(&v);
  }
};

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void ldsm4(uint32_t* r, const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(p)));
}

__device__ __forceinline__ void ldsm4t(uint32_t* r, const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(p)));
}

// 16 bytes global -> shared, asynchronously; zero-filled when !ok.
__device__ __forceinline__ void cp16(void* dst, const void* src, bool ok) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(dst)), "l"(src),
               "r"(ok ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void cp_wait1() { asm volatile("cp.async.wait_group 1;\n" ::: "memory"); }

__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}
__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}

// B fragments of four 16-column groups from one ldmatrix.x4 each.
__device__ __forceinline__ void split_b(uint32_t (&b)[8][2], int nj, const uint32_t (&r)[4]) {
  b[2 * nj][0] = r[0];
  b[2 * nj][1] = r[1];
  b[2 * nj + 1][0] = r[2];
  b[2 * nj + 1][1] = r[3];
}

// acc[32 x 64] += a[2 x m16] * b[8 x n8], one k16 step of a warp's tile.
template <typename T>
__device__ __forceinline__ void mma_tile(float (&acc)[2][8][4], const uint32_t (&a)[2][4], const uint32_t (&b)[8][2]) {
#pragma unroll
  for (int mi = 0; mi < 2; ++mi)
#pragma unroll
    for (int ni = 0; ni < 8; ++ni) Mma<T>::run(acc[mi][ni], a[mi], b[ni]);
}

// A fragments: 32 rows x 16 columns at column kk of a row-major tile.
template <typename T>
__device__ __forceinline__ void load_a(uint32_t (&a)[2][4], const T* a_s, int lda, int kk, int lane) {
#pragma unroll
  for (int mi = 0; mi < 2; ++mi) ldsm4(a[mi], a_s + (mi * 16 + (lane & 15)) * lda + kk + (lane >> 4) * 8);
}

// acc[32 x 64] += A[32 x BK] * B[64 x BK]^T, A and B row-major with the
// reduction (hidden) dimension contiguous (B holds head rows).
template <typename T>
__device__ __forceinline__ void mma_nt(float (&acc)[2][8][4], const T* a_s, int lda, const T* b_s, int ldb,
                                       int lane) {
#pragma unroll
  for (int kk = 0; kk < BK; kk += 16) {
    uint32_t a[2][4], b[8][2];
    load_a<T>(a, a_s, lda, kk, lane);
#pragma unroll
    for (int nj = 0; nj < 4; ++nj) {
      uint32_t r[4];
      ldsm4(r, b_s + (nj * 16 + (lane & 7) + ((lane >> 4) << 3)) * ldb + kk + ((lane >> 3) & 1) * 8);
      split_b(b, nj, r);
    }
    mma_tile<T>(acc, a, b);
  }
}

// acc[32 x 64] += A[32 x KB] * B[KB x 64], A row-major (D), B row-major with
// the output (hidden) dimension contiguous (head rows).
template <typename T>
__device__ __forceinline__ void mma_nn(float (&acc)[2][8][4], const T* a_s, int lda, const T* b_s, int ldb,
                                       int lane) {
#pragma unroll
  for (int kk = 0; kk < KB; kk += 16) {
    uint32_t a[2][4], b[8][2];
    load_a<T>(a, a_s, lda, kk, lane);
#pragma unroll
    for (int nj = 0; nj < 4; ++nj) {
      uint32_t r[4];
      ldsm4t(r, b_s + (kk + (lane & 7) + ((lane >> 3) & 1) * 8) * ldb + nj * 16 + (lane >> 4) * 8);
      split_b(b, nj, r);
    }
    mma_tile<T>(acc, a, b);
  }
}

__device__ __forceinline__ void zero(float (&acc)[2][8][4]) {
#pragma unroll
  for (int mi = 0; mi < 2; ++mi)
#pragma unroll
    for (int ni = 0; ni < 8; ++ni)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mi][ni][e] = 0.f;
}

// Row of the block (0..BM) that accumulator fragment (mi, hf) of this lane
// holds; its columns are wn * 64 + ni * 8 + 2 * tq + {0, 1}.
__device__ __forceinline__ int frag_row(int wm, int mi, int hf, int g) { return wm * 32 + mi * 16 + hf * 8 + g; }

// Head rows into shared memory, 16 bytes (8 columns) per chunk, 4 chunks per
// thread. QB = 0: dense rows by cp.async. QB = 4 / 8: affine-quantized rows
// (packed uint32 words, one scale and offset per group of gsz columns),
// fetched into registers before a step's matrix work and dequantized into
// shared memory after it, so the loads overlap the tensor-core work.
template <typename T, int QB>
struct Rows {
  const void* w;
  const T* sc;
  const T* bi;
  int H, V, gsz;
  uint32_t q[4][QB == 8 ? 2 : 1];
  float s[4], b[4];

  __device__ __forceinline__ void async_dense(T* dst, int v, int col) const {
    const bool ok = v < V && col < H;
    const T* src = reinterpret_cast<const T*>(w) + (ok ? (size_t)v * H + col : 0);
    cp16(dst, src, ok);
  }
  __device__ __forceinline__ void fetch(int i, int v, int col) {
    const bool ok = v < V && col < H;
    if (ok) {
      constexpr int per_word = QB ? 32 / QB : 1;
      const uint32_t* wq = reinterpret_cast<const uint32_t*>(w) + (size_t)v * (H / per_word) + col / per_word;
      q[i][0] = __ldg(wq);
      if constexpr (QB == 8) q[i][QB == 8 ? 1 : 0] = __ldg(wq + 1);
      const size_t gi = (size_t)v * (H / gsz) + col / gsz;
      s[i] = to_f(sc[gi]);
      b[i] = to_f(bi[gi]);
    } else {
      q[i][0] = 0u;
      if constexpr (QB == 8) q[i][QB == 8 ? 1 : 0] = 0u;
      s[i] = 0.f;
      b[i] = 0.f;
    }
  }
  __device__ __forceinline__ void store(int i, T* dst) const {
    float x[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const uint32_t word = (QB == 8) ? q[i][QB == 8 ? (e >> 2) : 0] : q[i][0];
      const int shift = (QB == 8) ? 8 * (e & 3) : 4 * e;
      const uint32_t mask = (QB == 8) ? 0xffu : 0xfu;
      x[e] = fmaf(s[i], (float)((word >> shift) & mask), b[i]);
    }
    uint4 p;
    p.x = Mma<T>::pack(x[0], x[1]);
    p.y = Mma<T>::pack(x[2], x[3]);
    p.z = Mma<T>::pack(x[4], x[5]);
    p.w = Mma<T>::pack(x[6], x[7]);
    *reinterpret_cast<uint4*>(dst) = p;
  }
};

// Scaled and soft-capped logit of a raw one, and d logit / d raw.
__device__ __forceinline__ float cap_logit(float s, float scale, float cap, float* dz) {
  float z = s * scale;
  if (cap > 0.f) {
    const float th = tanhf(z / cap);
    *dz = scale * (1.f - th * th);
    return cap * th;
  }
  *dz = scale;
  return z;
}

// Stage buffers of one pipeline step. Each thread moves 4 chunks of 16 bytes
// (8 columns); CPR chunks make a row of the tile, LD is its row stride.
template <int CPR, int LD, typename T, int QB>
__device__ __forceinline__ void issue_rows(Rows<T, QB>& rows, T* dst, int v_row0, int col0, int tid) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int c = tid + i * NT, r = c / CPR, c8 = (c % CPR) * 8;
    if constexpr (QB == 0)
      rows.async_dense(dst + r * LD + c8, v_row0 + r, col0 + c8);
    else
      rows.fetch(i, v_row0 + r, col0 + c8);
  }
}

// Quantized rows fetched by issue_rows, dequantized into dst.
template <int CPR, int LD, typename T, int QB>
__device__ __forceinline__ void store_rows(const Rows<T, QB>& rows, T* dst, int tid) {
  if constexpr (QB != 0) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int c = tid + i * NT, r = c / CPR, c8 = (c % CPR) * 8;
      rows.store(i, dst + r * LD + c8);
    }
  }
}

// BM hidden rows (tokens n0...) x BK columns from k0 into dst, by cp.async.
template <typename T>
__device__ __forceinline__ void issue_hidden(T* dst, const T* hid, int n0, int N, int H, int k0, int tid) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int c = tid + i * NT, r = c >> 3, c8 = (c & 7) << 3;
    const int n = n0 + r;
    cp16(dst + r * LDK + c8, hid + (n < N ? (size_t)n * H + k0 + c8 : 0), n < N);
  }
}

// The double-buffered pipeline every loop here runs: step s + 1's loads fill
// one stage while step s's tensor-core work (mma(s, stage)) reads the other;
// quantized rows are dequantized into their stage (finish) after the work
// they overlap; epilogue(s) runs before the stage is reused.
template <class Issue, class Finish, class Work, class Epilogue>
__device__ __forceinline__ void pipeline(int total, Issue issue, Finish finish, Work mma, Epilogue epilogue) {
  if (total > 0) {
    issue(0, 0);
    finish(0);
  }
  cp_commit();
  for (int s = 0; s < total; ++s) {
    const int st = s & 1;
    if (s + 1 < total) issue(s + 1, st ^ 1);
    cp_commit();
    cp_wait1();
    __syncthreads();
    mma(s, st);
    if (s + 1 < total) finish(st ^ 1);
    epilogue(s);
    __syncthreads();
  }
}

// One [BM tokens x BN head rows] logits tile per nk steps of BK hidden
// columns: step s is tile s / nk (head rows tile_row0(s / nk)...), columns
// (s % nk) * BK. tile_done(s / nk) sees the finished tile in acc.
template <typename T, int QB, class TileRow, class TileDone>
__device__ __forceinline__ void logits_tiles(float (&acc)[2][8][4], Rows<T, QB>& rows, T* sA, T* sB,
                                             const T* hid, int n0, int N, int H, int ntiles, TileRow tile_row0,
                                             TileDone tile_done) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wm = warp & 3, wn = warp >> 2;
  const int nk = H / BK;
  zero(acc);
  pipeline(
      ntiles * nk,
      [&](int s, int st) {
        const int k0 = (s % nk) * BK;
        issue_hidden<T>(sA + st * BM * LDK, hid, n0, N, H, k0, tid);
        issue_rows<BK / 8, LDK>(rows, sB + st * BN * LDK, tile_row0(s / nk), k0, tid);
      },
      [&](int st) { store_rows<BK / 8, LDK>(rows, sB + st * BN * LDK, tid); },
      [&](int s, int st) {
        mma_nt<T>(acc, sA + st * BM * LDK + wm * 32 * LDK, LDK, sB + st * BN * LDK + wn * 64 * LDK, LDK, lane);
      },
      [&](int s) {
        if (s % nk == nk - 1) {
          tile_done(s / nk);
          zero(acc);
        }
      });
}

// Online softmax: fold a tile row's logits into its running (max, sum of
// exp). A quad of lanes holds the row's 64 columns, 16 each (z).
__device__ __forceinline__ void online_update(float& m, float& l, const float (&z)[16]) {
  float bmax = -kInf;
#pragma unroll
  for (int e = 0; e < 16; ++e) bmax = fmaxf(bmax, z[e]);
  bmax = quad_max(bmax);
  const float mnew = fmaxf(m, bmax);
  const float ms = (mnew == -kInf) ? 0.f : mnew;  // an all -inf row stays (-inf, 0)
  float sum = 0.f;
#pragma unroll
  for (int e = 0; e < 16; ++e) sum += __expf(z[e] - ms);
  l = l * __expf(m - ms) + quad_sum(sum);
  m = mnew;
}

// Two (max, sum of exp) pairs of one row as one.
__device__ __forceinline__ void merge_online(float m0, float l0, float m1, float l1, float& m, float& l) {
  m = fmaxf(m0, m1);
  const float ms = (m == -kInf) ? 0.f : m;
  l = l0 * __expf(m0 - ms) + l1 * __expf(m1 - ms);
}

// Forward: per split of the vocabulary, running (max, sum of exp) per token,
// and the target's (scaled, capped) logit.
template <typename T, int QB>
__device__ void fwd(const T* hid, const int32_t* tgt, const void* w, const T* sc, const T* bi, int N, int H,
                    int V, int gsz, const float* prm, float* m_out, float* l_out, float* zt_out) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sA = reinterpret_cast<T*>(smem_raw);                     // [2][BM][LDK] hidden rows
  T* sB = sA + 2 * BM * LDK;                                  // [2][BN][LDK] head rows
  float* sM = reinterpret_cast<float*>(sB + 2 * BN * LDK);   // [2][BM]
  float* sL = sM + 2 * BM;                                    // [2][BM]
  int* sT = reinterpret_cast<int*>(sL + 2 * BM);              // [BM]

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wm = warp & 3, wn = warp >> 2, g = lane >> 2, tq = lane & 3;
  const int n0 = blockIdx.x * BM;
  const int split = blockIdx.y, nsplit = gridDim.y;
  const int nvb = (V + BN - 1) / BN;
  const int jb0 = (int)((long long)split * nvb / nsplit);
  const int jb1 = (int)((long long)(split + 1) * nvb / nsplit);
  const float scale = prm[0], cap = prm[1];

  for (int r = tid; r < BM; r += NT) sT[r] = (n0 + r < N) ? tgt[n0 + r] : -1;

  Rows<T, QB> rows{w, sc, bi, H, V, gsz};
  float acc[2][8][4];
  float mrun[4], lrun[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    mrun[i] = -kInf;
    lrun[i] = 0.f;
  }

  logits_tiles<T, QB>(
      acc, rows, sA, sB, hid, n0, N, H, jb1 - jb0, [&](int j) { return (jb0 + j) * BN; },
      [&](int j) {
        const int v_base = (jb0 + j) * BN + wn * 64 + 2 * tq;
#pragma unroll
        for (int mi = 0; mi < 2; ++mi) {
#pragma unroll
          for (int hf = 0; hf < 2; ++hf) {
            const int r = frag_row(wm, mi, hf, g);
            const int tr = sT[r];
            float z[16];
#pragma unroll
            for (int ni = 0; ni < 8; ++ni) {
#pragma unroll
              for (int e = 0; e < 2; ++e) {
                const int v = v_base + ni * 8 + e;
                float dz;
                float zz = cap_logit(acc[mi][ni][hf * 2 + e], scale, cap, &dz);
                if (v >= V) zz = -kInf;
                if (v == tr) zt_out[n0 + r] = zz;
                z[ni * 2 + e] = zz;
              }
            }
            online_update(mrun[mi * 2 + hf], lrun[mi * 2 + hf], z);
          }
        }
      });

  if (tq == 0) {
#pragma unroll
    for (int idx = 0; idx < 4; ++idx) {
      const int r = frag_row(wm, idx >> 1, idx & 1, g);
      sM[wn * BM + r] = mrun[idx];
      sL[wn * BM + r] = lrun[idx];
    }
  }
  __syncthreads();
  for (int r = tid; r < BM; r += NT) {
    const int n = n0 + r;
    if (n < N) {
      float m, l;
      merge_online(sM[r], sL[r], sM[BM + r], sL[BM + r], m, l);
      m_out[(size_t)split * N + n] = m;
      l_out[(size_t)split * N + n] = l;
    }
  }
}

// Backward: dh[n] += g[n] * sum_v (softmax - onehot)[n, v] * dz[n, v] * W[v]
// over this block's split of the vocabulary.
template <typename T, int QB>
__device__ void bwd(const T* hid, const int32_t* tgt, const float* lse, const float* gco, const void* w,
                    const T* sc, const T* bi, int N, int H, int V, int gsz, const float* prm, float* dh) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sD = reinterpret_cast<T*>(smem_raw);                           // [BM][LDD]
  unsigned char* stage = smem_raw + BM * LDD * 2;                   // staging, phase A or B
  T* sA = reinterpret_cast<T*>(stage);                              // [2][BM][LDK]
  T* sB = sA + 2 * BM * LDK;                                        // [2][BN][LDK]
  T* sW = reinterpret_cast<T*>(stage);                              // [2][KB][LDW]
  int* sT = reinterpret_cast<int*>(stage + STAGE);                  // [BM]
  float* sLse = reinterpret_cast<float*>(sT + BM);                  // [BM]
  float* sG = sLse + BM;                                            // [BM]
  float* sF = sG + BM;                                              // [4][NSLICE] max |D| per warp rows x slice
  int* sAct = reinterpret_cast<int*>(sF + 4 * NSLICE);              // active slices, count last

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wm = warp & 3, wn = warp >> 2, g = lane >> 2, tq = lane & 3;
  const int n0 = blockIdx.x * BM;
  const int split = blockIdx.y, nsplit = gridDim.y;
  const int nchunk = (V + RC - 1) / RC;
  const int c0 = (int)((long long)split * nchunk / nsplit);
  const int c1 = (int)((long long)(split + 1) * nchunk / nsplit);
  const float scale = prm[0], cap = prm[1], feps = prm[2], beps = prm[3];
  const int nhc = (H + BH - 1) / BH;

  for (int r = tid; r < BM; r += NT) {
    const int n = n0 + r;
    const bool ok = n < N;
    sT[r] = ok ? tgt[n] : -1;
    sLse[r] = ok ? lse[n] : kInf;  // rows past N get D = 0
    sG[r] = ok ? gco[n] : 0.f;
  }

  Rows<T, QB> rows{w, sc, bi, H, V, gsz};
  float acc[2][8][4];

  for (int c = c0; c < c1; ++c) {
    const int v0 = c * RC;
    // ---- phase A: D for [BM tokens x RC vocabulary rows], RC / BN tiles
    logits_tiles<T, QB>(
        acc, rows, sA, sB, hid, n0, N, H, RC / BN, [&](int jb) { return v0 + jb * BN; },
        [&](int jb) {
          const int col_base = jb * BN + wn * 64 + 2 * tq;  // column in D
          float dmax = 0.f;
#pragma unroll
          for (int mi = 0; mi < 2; ++mi) {
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
              const int r = frag_row(wm, mi, hf, g);
              const int tr = sT[r];
              const float lr = sLse[r];
#pragma unroll
              for (int ni = 0; ni < 8; ++ni) {
                float d[2];
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                  const int v = v0 + col_base + ni * 8 + e;
                  float dz;
                  const float zz = cap_logit(acc[mi][ni][hf * 2 + e], scale, cap, &dz);
                  d[e] = (v < V) ? (__expf(zz - lr) - (v == tr ? 1.f : 0.f)) * dz : 0.f;
                  dmax = fmaxf(dmax, fabsf(d[e]));
                }
                *reinterpret_cast<uint32_t*>(sD + r * LDD + col_base + ni * 8) = Mma<T>::pack(d[0], d[1]);
              }
            }
          }
          dmax = warp_max(dmax);
          if (lane == 0) sF[wm * NSLICE + jb * 2 + wn] = dmax;  // this warp's rows x 64 columns
        });
    // ---- phase B: dh[rows, slice] += g * D @ W[chunk rows, slice], over the
    // 64-row slices whose D is not negligible
    if (tid == 0) {
      int na = 0;
      for (int kk = 0; kk < NSLICE; ++kk) {
        float m = 0.f;
        for (int i = 0; i < 4; ++i) m = fmaxf(m, sF[i * NSLICE + kk]);
        if (v0 + kk * KB < V && !(beps > 0.f && m < beps)) sAct[na++] = kk;
      }
      sAct[NSLICE] = na;
    }
    __syncthreads();
    const int nact = sAct[NSLICE];
    zero(acc);
    pipeline(
        nhc * nact,
        [&](int s, int st) {
          issue_rows<BH / 8, LDW>(rows, sW + st * KB * LDW, v0 + sAct[s % nact] * KB, (s / nact) * BH, tid);
        },
        [&](int st) { store_rows<BH / 8, LDW>(rows, sW + st * KB * LDW, tid); },
        [&](int s, int st) {
          const int hc = s / nact, kk = sAct[s % nact];
          const bool skip = (feps > 0.f && sF[wm * NSLICE + kk] < feps) || (hc * BH + wn * 64 >= H);
          if (!skip) mma_nn<T>(acc, sD + wm * 32 * LDD + kk * KB, LDD, sW + st * KB * LDW + wn * 64, LDW, lane);
        },
        [&](int s) {
          if (s % nact != nact - 1) return;
          const int hc = s / nact;
#pragma unroll
          for (int mi = 0; mi < 2; ++mi) {
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
              const int r = frag_row(wm, mi, hf, g);
              const int n = n0 + r;
              const float gr = sG[r];
              if (n < N && gr != 0.f) {
#pragma unroll
                for (int ni = 0; ni < 8; ++ni) {
                  const int col = hc * BH + wn * 64 + ni * 8 + 2 * tq;
                  if (col < H)
                    atomicAdd(reinterpret_cast<float2*>(dh + (size_t)n * H + col),
                              make_float2(acc[mi][ni][hf * 2] * gr, acc[mi][ni][hf * 2 + 1] * gr));
                }
              }
            }
          }
          zero(acc);
        });
  }
}

}  // namespace cce
