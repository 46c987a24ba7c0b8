"""The ``cuda-gemm`` row kernel: one fused online-softmax step per logit block.

``kernel_step(z, m, l)`` returns ``(m', a, l', P)`` for a ``[rows, cols]``
block of logits: the running max and sum rescaled by ``a`` and
``P = exp(z - m') * dz`` in ``z``'s dtype. The source is self-contained, so
``nvrtc`` compiles it once per machine and keeps the cubin; it runs through
``mx.fast.precompiled_cuda_kernel`` (CUDA only: ``row_kernel()`` is None
elsewhere, and ``cuda_gemm`` then takes its compiled MLX step).
"""

from typing import Optional, Tuple

import mlx.core as mx

from . import nvrtc as _nvrtc

# One thread block per token row of a [rows, cols] logit block: max, then
# exp / sum / P in a second read (the row is in L2 by then). Vectorized by
# 16 bytes when the row length allows; scalar otherwise. Self-contained (no
# headers: bf16 and f16 convert by bit pattern and PTX), so NVRTC compiles
# it in a fraction of a second and ``nvrtc`` keeps the cubin on disk.
ROW_SOURCE = r"""
typedef unsigned short u16;
constexpr int NT = 256;

struct F32 {
  typedef float S;
  static __device__ __forceinline__ float load(S x) { return x; }
  static __device__ __forceinline__ S store(float f) { return f; }
};
struct BF16 {
  typedef u16 S;
  static __device__ __forceinline__ float load(S x) { return __uint_as_float(((unsigned)x) << 16); }
  static __device__ __forceinline__ S store(float f) {  // round to nearest even, as MLX
    unsigned u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (S)0x7fc0;
    u += 0x7fffu + ((u >> 16) & 1u);
    return (S)(u >> 16);
  }
};
struct F16 {
  typedef u16 S;
  static __device__ __forceinline__ float load(S x) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x));
    return f;
  }
  static __device__ __forceinline__ S store(float f) {
    S h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
  }
};

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

// scaled, soft-capped logit and d logit / d raw (cap <= 0 means none)
__device__ __forceinline__ float capped(float r, float scale, float cap, float* dz) {
  float z = r * scale;
  float d = scale;
  if (cap > 0.f) {
    float t = tanhf(z / cap);
    z = cap * t;
    d = scale * (1.f - t * t);
  }
  *dz = d;
  return z;
}

__device__ __forceinline__ float block_reduce(float v, float* red, bool is_max) {
  for (int o = 16; o > 0; o >>= 1) {
    float w = __shfl_xor_sync(0xffffffffu, v, o);
    v = is_max ? fmaxf(v, w) : v + w;
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) red[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < NT / 32 ? red[lane] : (is_max ? neg_inf() : 0.f);
    for (int o = 16; o > 0; o >>= 1) {
      float w = __shfl_xor_sync(0xffffffffu, v, o);
      v = is_max ? fmaxf(v, w) : v + w;
    }
    if (lane == 0) red[32] = v;
  }
  __syncthreads();
  float out = red[32];
  __syncthreads();  // red is reused by the next reduction
  return out;
}

template <class C>
__device__ void online_step(const typename C::S* z, const float* m, const float* l,
                            const float* prm, typename C::S* p, float* m_out, float* a_out,
                            float* l_out, int ncol) {
  typedef typename C::S S;
  const float scale = prm[0], cap = prm[1];
  __shared__ float red[33];
  constexpr int VEC = 16 / sizeof(S);
  const int row = blockIdx.x, tid = threadIdx.x;
  const S* zr = z + (size_t)row * ncol;
  S* pr = p + (size_t)row * ncol;
  const bool vec = (ncol % VEC) == 0;
  const int nvec = vec ? ncol / VEC : 0;
  float dz;

  float mx = neg_inf();
  if (vec) {
    for (int c = tid; c < nvec; c += NT) {
      uint4 u = reinterpret_cast<const uint4*>(zr)[c];
      const S* x = reinterpret_cast<const S*>(&u);
#pragma unroll
      for (int k = 0; k < VEC; ++k) mx = fmaxf(mx, capped(C::load(x[k]), scale, cap, &dz));
    }
  } else {
    for (int c = tid; c < ncol; c += NT) mx = fmaxf(mx, capped(C::load(zr[c]), scale, cap, &dz));
  }
  mx = block_reduce(mx, red, true);
  const float m_old = m[row];
  const float m_new = fmaxf(m_old, mx);

  float s = 0.f;
  if (vec) {
    for (int c = tid; c < nvec; c += NT) {
      uint4 u = reinterpret_cast<const uint4*>(zr)[c];
      const S* x = reinterpret_cast<const S*>(&u);
      uint4 o;
      S* y = reinterpret_cast<S*>(&o);
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        float e = __expf(capped(C::load(x[k]), scale, cap, &dz) - m_new);
        s += e;
        y[k] = C::store(e * dz);
      }
      reinterpret_cast<uint4*>(pr)[c] = o;
    }
  } else {
    for (int c = tid; c < ncol; c += NT) {
      float e = __expf(capped(C::load(zr[c]), scale, cap, &dz) - m_new);
      s += e;
      pr[c] = C::store(e * dz);
    }
  }
  s = block_reduce(s, red, false);
  if (tid == 0) {
    const float a = m_old == neg_inf() ? 0.f : __expf(m_old - m_new);
    m_out[row] = m_new;
    a_out[row] = a;
    l_out[row] = l[row] * a + s;
  }
}

#define ROWS(NAME, C)                                                                  \
  extern "C" __global__ void __launch_bounds__(NT)                                     \
      NAME(const C::S* z, const float* m, const float* l, const float* prm, C::S* p,   \
           float* m_out, float* a_out, float* l_out, int ncol) {                       \
    online_step<C>(z, m, l, prm, p, m_out, a_out, l_out, ncol);                        \
  }
ROWS(cce_rows_float32, F32)
ROWS(cce_rows_bfloat16, BF16)
ROWS(cce_rows_float16, F16)
"""


def row_kernel() -> Optional[bytes]:
    """The row kernel's cubin for this GPU (None: not here; the MLX step is used)."""
    return _nvrtc.cubin("cce_rows", ROW_SOURCE)


def kernel_step(
    z: mx.array,
    m: mx.array,
    l: mx.array,
    softcap: Optional[float] = None,
    logit_scale: Optional[float] = None,
) -> Tuple[mx.array, mx.array, mx.array, mx.array]:
    """The CUDA row kernel: ``(z, m, l) -> (m', a, l', P)`` with ``P`` in ``z``'s dtype."""
    rows, cols = z.shape
    prm = mx.array(
        [
            1.0 if logit_scale is None else float(logit_scale),
            0.0 if softcap is None else float(softcap),
        ],
        dtype=mx.float32,
    )
    p, m_new, a, l_new = mx.fast.precompiled_cuda_kernel(
        name=f"cce_rows_{str(z.dtype).rsplit('.', 1)[-1]}",
        compiled_source=row_kernel(),
        inputs=[z, m, l, prm],
        output_shapes=[z.shape, (rows,), (rows,), (rows,)],
        output_dtypes=[z.dtype, mx.float32, mx.float32, mx.float32],
        scalars=[int(cols)],
        grid=(256 * rows, 1, 1),
        threadgroup=(256, 1, 1),
        ensure_row_contiguous=True,
    )
    return m_new, a, l_new, p
