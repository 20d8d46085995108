// jaxext's two ops as XLA FFI handlers for the CPU: mul_constant, and linear's
// forward and backward. Loaded through jaxext.cpp_extension.load by
// jaxext/cpp_extension/_ops.py, which attaches the backward with jaxext.custom_vjp.
//
// Every handler accepts float32 and float64 (chosen at run time from the buffer's
// dtype) and returns an ffi::Error for anything else, and checks that the buffers'
// shapes fit together before touching them (an ffi::Error, never an out-of-bounds
// read or write, for a call with the wrong shapes). mul_constant splits large
// arrays, and linear large products (by blocks of rows), over XLA's intra-op thread
// pool.
//
// mul_constant takes its constant as a 0-d operand of x's dtype, not as an FFI
// attribute: an attribute is part of the compiled program, so every new value would
// compile (and keep) a new one; an operand is data, so one program serves all values.
//
// Batching: the handlers are called with vmap_method="expand_dims", so
// under jax.vmap every operand gets the same number of extra leading dimensions,
// each either the full batch size or 1 (an operand that is not batched). The
// results always have the full batch shape. Batch::offset maps a flat batch
// index to each operand's element offset, with stride 0 along its size-1 axes.

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// The leading (batch) dimensions of the results and one operand's strides over them.
class Batch {
 public:
  // `result_dims`: the dims of one result; `core_rank`: its trailing non-batch rank.
  Batch(ffi::AnyBuffer::Dimensions result_dims, size_t core_rank)
      : shape_(result_dims.begin(), result_dims.end() - core_rank) {}

  int64_t size() const {
    int64_t n = 1;
    for (int64_t d : shape_) n *= d;
    return n;
  }

  // Element strides of `operand` (trailing `core_rank` dims are one core block)
  // over the batch dims; 0 where the operand has size 1. Empty on a mismatch.
  std::vector<int64_t> strides(ffi::AnyBuffer::Dimensions dims, size_t core_rank) const {
    if (dims.size() != shape_.size() + core_rank) return {};
    int64_t block = 1;
    for (size_t i = shape_.size(); i < dims.size(); ++i) block *= dims[i];
    std::vector<int64_t> out(shape_.size() + 1, 0);
    out[shape_.size()] = 1;  // marks success even with no batch dims
    int64_t stride = block;
    for (size_t i = shape_.size(); i-- > 0;) {
      if (dims[i] != shape_[i] && dims[i] != 1) return {};
      out[i] = dims[i] == 1 ? 0 : stride;
      stride *= dims[i];
    }
    return out;
  }

  // Element offset of batch entry `flat` for an operand with `strides`.
  int64_t offset(int64_t flat, const std::vector<int64_t>& strides) const {
    int64_t off = 0;
    for (size_t i = shape_.size(); i-- > 0;) {
      off += (flat % shape_[i]) * strides[i];
      flat /= shape_[i];
    }
    return off;
  }

 private:
  std::vector<int64_t> shape_;
};

ffi::Error UnsupportedDtype(const char* op) {
  return ffi::Error::InvalidArgument(std::string(op) +
                                     ": only float32 and float64 are supported");
}

// ---------------------------------------------------------------- mul_constant

template <typename T>
void MulConstantKernel(const T* x, T* y, int64_t n, T c) {
  for (int64_t i = 0; i < n; ++i) y[i] = x[i] * c;
}

// Runs body(begin, end) over [0, n) in chunks on XLA's intra-op thread pool (the
// calling thread takes the first chunk) and returns when all are done. Small
// ranges, or no pool, run inline.
template <typename Body>
void ParallelFor(ffi::ThreadPool& pool, int64_t n, int64_t min_chunk, Body body) {
  const int64_t threads = pool.num_threads();
  int64_t chunks = threads < 1 ? 1 : threads + 1;  // the pool's threads and this one
  if (chunks > n / min_chunk) chunks = n / min_chunk;
  if (chunks <= 1) return body(int64_t{0}, n);
  const int64_t step = (n + chunks - 1) / chunks;
  std::mutex mutex;
  std::condition_variable done;
  int64_t pending = chunks - 1;
  for (int64_t k = 1; k < chunks; ++k) {
    const int64_t begin = k * step, end = begin + step < n ? begin + step : n;
    pool.Schedule([&, begin, end] {
      body(begin, end);
      std::lock_guard<std::mutex> lock(mutex);
      if (--pending == 0) done.notify_one();
    });
  }
  body(int64_t{0}, step);
  std::unique_lock<std::mutex> lock(mutex);
  done.wait(lock, [&] { return pending == 0; });
}

#ifndef JAXEXT_MIN_CHUNK
#define JAXEXT_MIN_CHUNK (int64_t{1} << 20)
#endif
constexpr int64_t kMinChunk = JAXEXT_MIN_CHUNK;  // elements per task, at least

// y = x * c in T, over the batch entries of a vmapped call (c is 0-d, or under vmap
// has one dimension per vmap level, each 1 or the batch size; so does x in front of
// its own dims). An unbatched call is one entry, split over the thread pool.
template <typename T>
void MulConstantTyped(ffi::ThreadPool& pool, const Batch& batch, const T* x,
                      const std::vector<int64_t>& sx, const T* c,
                      const std::vector<int64_t>& sc, T* y, int64_t block) {
  const int64_t entries = batch.size();
  for (int64_t k = 0; k < entries; ++k) {
    const T* in = x + batch.offset(k, sx);
    T* out = y + k * block;
    const T ck = c[batch.offset(k, sc)];
    ParallelFor(pool, block, kMinChunk,
                [=](int64_t b, int64_t e) { MulConstantKernel(in + b, out + b, e - b, ck); });
  }
}

ffi::Error MulConstantImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer c,
                           ffi::Result<ffi::AnyBuffer> y) {
  const ffi::DataType t = x.element_type();
  auto xd = x.dimensions(), cd = c.dimensions(), yd = y->dimensions();
  if (t != y->element_type() || xd.size() != yd.size() || cd.size() > yd.size()) {
    return ffi::Error::InvalidArgument("jaxext_mul_constant: result must match `x`");
  }
  if (c.element_type() != t) {
    return ffi::Error::InvalidArgument(
        "jaxext_mul_constant: the constant must be a scalar of `x`'s dtype");
  }
  // The constant's dims are the batch dims (none outside vmap); the rest are x's own.
  const size_t core_rank = yd.size() - cd.size();
  Batch batch(yd, core_rank);
  auto sx = batch.strides(xd, core_rank), sc = batch.strides(cd, 0);
  bool fits = !sx.empty() && !sc.empty();
  int64_t block = 1;
  for (size_t i = cd.size(); fits && i < yd.size(); ++i) {
    fits = xd[i] == yd[i];
    block *= yd[i];
  }
  if (!fits) return ffi::Error::InvalidArgument("jaxext_mul_constant: result must match `x`");
  switch (t) {
    case ffi::DataType::F32:
      MulConstantTyped(pool, batch, x.typed_data<float>(), sx, c.typed_data<float>(), sc,
                       y->typed_data<float>(), block);
      return ffi::Error::Success();
    case ffi::DataType::F64:
      MulConstantTyped(pool, batch, x.typed_data<double>(), sx, c.typed_data<double>(), sc,
                       y->typed_data<double>(), block);
      return ffi::Error::Success();
    default:
      return UnsupportedDtype("jaxext_mul_constant");
  }
}

// -------------------------------------------------------------------- linear
//
// Shapes of one batch entry: x (B, I), w (O, I), bias (O), y (B, O), g (B, O).
// All three products are C = A @ B with B row-major: y = x @ w^T, grad_x = g @ w,
// grad_w = g^T @ x (w^T and g^T are copied out first).
//
// GemmAcc adds A @ B to C in tiles of 4 rows x 2 vectors of C, kept in registers
// while it runs along K over a packed (contiguous) panel of B: the inner loop is
// 8 independent vector multiply-adds, with no reductions to reassociate. The
// vector width is a template parameter: 32 bytes (AVX with FMA) where the CPU has
// it, checked at run time, else 16 bytes (SSE2 / NEON), so the library stays
// portable without -march=native. -DJAXEXT_NO_FMA_PATH builds the 16-byte path alone.

template <typename T, int kBytes>
struct VecOf;
// Unaligned (aligned(alignof(T))) and allowed to alias T, so loads from T* are valid.
template <>
struct VecOf<float, 16> {
  typedef float type __attribute__((vector_size(16), aligned(4), may_alias));
};
template <>
struct VecOf<float, 32> {
  typedef float type __attribute__((vector_size(32), aligned(4), may_alias));
};
template <>
struct VecOf<double, 16> {
  typedef double type __attribute__((vector_size(16), aligned(8), may_alias));
};
template <>
struct VecOf<double, 32> {
  typedef double type __attribute__((vector_size(32), aligned(8), may_alias));
};

constexpr int64_t kPanel = 256;  // rows of B per packed panel

template <typename T, int kBytes>
__attribute__((always_inline)) inline void GemmAccBody(const T* a, const T* b, T* c, int64_t m,
                                                       int64_t k, int64_t n, T* packed) {
  using V = typename VecOf<T, kBytes>::type;
  constexpr int64_t L = kBytes / sizeof(T), C = 2 * L;
#define LOADV(p) (*reinterpret_cast<const V*>(p))
#define STOREV(p, v) (*reinterpret_cast<V*>(p) = (v))
  for (int64_t k0 = 0; k0 < k; k0 += kPanel) {
    const int64_t kp = k - k0 < kPanel ? k - k0 : kPanel;
    int64_t j0 = 0;
    for (; j0 + C <= n; j0 += C) {
      for (int64_t p = 0; p < kp; ++p)
        for (int64_t q = 0; q < C; ++q) packed[p * C + q] = b[(k0 + p) * n + j0 + q];
      int64_t r0 = 0;
      for (; r0 + 4 <= m; r0 += 4) {
        T* cr = c + r0 * n + j0;
        V c00 = LOADV(cr), c01 = LOADV(cr + L), c10 = LOADV(cr + n), c11 = LOADV(cr + n + L);
        V c20 = LOADV(cr + 2 * n), c21 = LOADV(cr + 2 * n + L);
        V c30 = LOADV(cr + 3 * n), c31 = LOADV(cr + 3 * n + L);
        const T* ar = a + r0 * k + k0;
        for (int64_t p = 0; p < kp; ++p) {
          const V b0 = LOADV(packed + p * C), b1 = LOADV(packed + p * C + L);
          const T x0 = ar[p], x1 = ar[k + p], x2 = ar[2 * k + p], x3 = ar[3 * k + p];
          c00 += x0 * b0;
          c01 += x0 * b1;
          c10 += x1 * b0;
          c11 += x1 * b1;
          c20 += x2 * b0;
          c21 += x2 * b1;
          c30 += x3 * b0;
          c31 += x3 * b1;
        }
        STOREV(cr, c00), STOREV(cr + L, c01), STOREV(cr + n, c10), STOREV(cr + n + L, c11);
        STOREV(cr + 2 * n, c20), STOREV(cr + 2 * n + L, c21);
        STOREV(cr + 3 * n, c30), STOREV(cr + 3 * n + L, c31);
      }
      for (; r0 < m; ++r0) {  // the last m % 4 rows
        T* cr = c + r0 * n + j0;
        V c0 = LOADV(cr), c1 = LOADV(cr + L);
        for (int64_t p = 0; p < kp; ++p) {
          const T x0 = a[r0 * k + k0 + p];
          c0 += x0 * LOADV(packed + p * C);
          c1 += x0 * LOADV(packed + p * C + L);
        }
        STOREV(cr, c0), STOREV(cr + L, c1);
      }
    }
#undef LOADV
#undef STOREV
    for (int64_t r = 0; j0 < n && r < m; ++r) {  // the last n % C columns
      T* cr = c + r * n;
      for (int64_t p = 0; p < kp; ++p) {
        const T x = a[r * k + k0 + p];
        const T* br = b + (k0 + p) * n;
        for (int64_t q = j0; q < n; ++q) cr[q] += x * br[q];
      }
    }
  }
}

template <typename T>
void GemmAccBase(const T* a, const T* b, T* c, int64_t m, int64_t k, int64_t n, T* packed) {
  GemmAccBody<T, 16>(a, b, c, m, k, n, packed);
}

#if defined(__x86_64__) && defined(__GNUC__) && !defined(JAXEXT_NO_FMA_PATH)
#define JAXEXT_HAVE_FMA_PATH 1
template <typename T>
__attribute__((target("avx2,fma"))) void GemmAccFma(const T* a, const T* b, T* c, int64_t m,
                                                    int64_t k, int64_t n, T* packed) {
  GemmAccBody<T, 32>(a, b, c, m, k, n, packed);
}
#endif

template <typename T>
void GemmAccRows(const T* a, const T* b, T* c, int64_t m, int64_t k, int64_t n) {
  std::vector<T> packed(static_cast<size_t>(kPanel * 64 / sizeof(T)));
#ifdef JAXEXT_HAVE_FMA_PATH
  static const bool fma = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (fma) return GemmAccFma(a, b, c, m, k, n, packed.data());
#endif
  GemmAccBase(a, b, c, m, k, n, packed.data());
}

#ifndef JAXEXT_GEMM_TASK_FLOPS
#define JAXEXT_GEMM_TASK_FLOPS (int64_t{1} << 23)
#endif

// c (m, n) = init (one row of n, or zeros if null) + a (m, k) @ b (k, n). Products of
// more than JAXEXT_GEMM_TASK_FLOPS are split by blocks of 4 rows over the thread pool.
template <typename T>
void Gemm(ffi::ThreadPool& pool, const T* a, const T* b, const T* init, T* c, int64_t m,
          int64_t k, int64_t n) {
  for (int64_t r = 0; r < m; ++r)
    for (int64_t q = 0; q < n; ++q) c[r * n + q] = init ? init[q] : T(0);
  const int64_t blocks = (m + 3) / 4;
  const int64_t block_flops = 8 * k * n > 0 ? 8 * k * n : 1;
  const int64_t min_blocks = JAXEXT_GEMM_TASK_FLOPS / block_flops + 1;
  ParallelFor(pool, blocks, min_blocks, [=](int64_t b0, int64_t b1) {
    const int64_t r0 = 4 * b0, r1 = 4 * b1 < m ? 4 * b1 : m;
    GemmAccRows(a + r0 * k, b, c + r0 * n, r1 - r0, k, n);
  });
}

// out (cols, rows) = in (rows, cols)^T
template <typename T>
void Transpose(const T* in, int64_t rows, int64_t cols, std::vector<T>& out) {
  out.resize(static_cast<size_t>(rows * cols));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t q = 0; q < cols; ++q) out[q * rows + r] = in[r * cols + q];
}

// The thread pool, and scratch memory reused across the batch entries of one call.
template <typename T>
struct Scratch {
  ffi::ThreadPool& pool;
  std::vector<T> transposed;
};

template <typename T>
void LinearForwardKernel(const T* x, const T* w, const T* bias, T* y, int64_t rows, int64_t in,
                         int64_t out, Scratch<T>& s) {
  Transpose(w, out, in, s.transposed);  // (I, O)
  Gemm(s.pool, x, s.transposed.data(), bias, y, rows, in, out);
}

template <typename T>
void LinearBackwardKernel(const T* x, const T* w, const T* g, T* gx, T* gw, T* gb, int64_t rows,
                          int64_t in, int64_t out, Scratch<T>& s) {
  Gemm<T>(s.pool, g, w, nullptr, gx, rows, out, in);  // grad_x = g @ w
  Transpose(g, rows, out, s.transposed);                // (O, B)
  Gemm<T>(s.pool, s.transposed.data(), x, nullptr, gw, out, rows, in);  // grad_w = g^T @ x
  for (int64_t o = 0; o < out; ++o) gb[o] = T(0);     // grad_bias = sum over rows of g
  for (int64_t b = 0; b < rows; ++b)
    for (int64_t o = 0; o < out; ++o) gb[o] += g[b * out + o];
}

template <typename T>
ffi::Error LinearForwardTyped(ffi::ThreadPool& pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer bias,
                              ffi::AnyBuffer y) {
  auto yd = y.dimensions();
  if (yd.size() < 2) return ffi::Error::InvalidArgument("jaxext_linear_forward: y must be 2-D");
  const int64_t rows = yd[yd.size() - 2], out = yd[yd.size() - 1];
  auto xd = x.dimensions();
  const int64_t in = xd.size() < 2 ? 0 : xd[xd.size() - 1];
  Batch batch(yd, 2);
  auto wd = w.dimensions(), bd = bias.dimensions();
  auto sx = batch.strides(xd, 2), sw = batch.strides(wd, 2), sb = batch.strides(bd, 1);
  // Every operand's core dims must fit y's (B, O): the loops below trust them.
  if (sx.empty() || sw.empty() || sb.empty() || xd[xd.size() - 2] != rows ||
      wd[wd.size() - 2] != out || wd[wd.size() - 1] != in || bd[bd.size() - 1] != out) {
    return ffi::Error::InvalidArgument(
        "jaxext_linear_forward: expected x (..., B, I), w (..., O, I), bias (..., O) for "
        "y (..., B, O)");
  }
  Scratch<T> scratch{pool, {}};
  const int64_t n = batch.size();
  for (int64_t k = 0; k < n; ++k) {
    LinearForwardKernel(x.typed_data<T>() + batch.offset(k, sx),
                        w.typed_data<T>() + batch.offset(k, sw),
                        bias.typed_data<T>() + batch.offset(k, sb),
                        y.typed_data<T>() + k * rows * out, rows, in, out, scratch);
  }
  return ffi::Error::Success();
}

ffi::Error LinearForwardImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer bias,
                             ffi::Result<ffi::AnyBuffer> y) {
  const ffi::DataType t = x.element_type();
  if (w.element_type() != t || bias.element_type() != t || y->element_type() != t) {
    return ffi::Error::InvalidArgument("jaxext_linear_forward: operands must share one dtype");
  }
  if (t == ffi::DataType::F32) return LinearForwardTyped<float>(pool, x, w, bias, *y);
  if (t == ffi::DataType::F64) return LinearForwardTyped<double>(pool, x, w, bias, *y);
  return UnsupportedDtype("jaxext_linear_forward");
}

template <typename T>
ffi::Error LinearBackwardTyped(ffi::ThreadPool& pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer g,
                               ffi::AnyBuffer gx, ffi::AnyBuffer gw, ffi::AnyBuffer gb) {
  auto gxd = gx.dimensions(), gwd = gw.dimensions();
  if (gxd.size() < 2 || gwd.size() < 2) {
    return ffi::Error::InvalidArgument("jaxext_linear_backward: results must be at least 2-D");
  }
  const int64_t rows = gxd[gxd.size() - 2], in = gxd[gxd.size() - 1];
  const int64_t out = gwd[gwd.size() - 2];
  Batch batch(gxd, 2);
  auto xd = x.dimensions(), wd = w.dimensions(), gd = g.dimensions(), gbd = gb.dimensions();
  auto sx = batch.strides(xd, 2), sw = batch.strides(wd, 2), sg = batch.strides(gd, 2);
  const int64_t n = batch.size();
  // Every operand's core dims must fit, and the results hold the full batch: the loops
  // below trust them.
  if (sx.empty() || sw.empty() || sg.empty() || xd[xd.size() - 2] != rows ||
      xd[xd.size() - 1] != in || wd[wd.size() - 2] != out || wd[wd.size() - 1] != in ||
      gd[gd.size() - 2] != rows || gd[gd.size() - 1] != out || gbd.size() < 1 ||
      gbd[gbd.size() - 1] != out || gwd[gwd.size() - 1] != in ||
      static_cast<int64_t>(gw.element_count()) != n * out * in ||
      static_cast<int64_t>(gb.element_count()) != n * out) {
    return ffi::Error::InvalidArgument(
        "jaxext_linear_backward: expected x (..., B, I), w (..., O, I), g (..., B, O) and "
        "results (..., B, I), (..., O, I), (..., O)");
  }
  Scratch<T> scratch{pool, {}};
  for (int64_t k = 0; k < n; ++k) {
    LinearBackwardKernel(x.typed_data<T>() + batch.offset(k, sx),
                         w.typed_data<T>() + batch.offset(k, sw),
                         g.typed_data<T>() + batch.offset(k, sg),
                         gx.typed_data<T>() + k * rows * in, gw.typed_data<T>() + k * out * in,
                         gb.typed_data<T>() + k * out, rows, in, out, scratch);
  }
  return ffi::Error::Success();
}

ffi::Error LinearBackwardImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer g,
                              ffi::Result<ffi::AnyBuffer> gx, ffi::Result<ffi::AnyBuffer> gw,
                              ffi::Result<ffi::AnyBuffer> gb) {
  const ffi::DataType t = x.element_type();
  if (w.element_type() != t || g.element_type() != t || gx->element_type() != t ||
      gw->element_type() != t || gb->element_type() != t) {
    return ffi::Error::InvalidArgument("jaxext_linear_backward: operands must share one dtype");
  }
  if (t == ffi::DataType::F32) return LinearBackwardTyped<float>(pool, x, w, g, *gx, *gw, *gb);
  if (t == ffi::DataType::F64) return LinearBackwardTyped<double>(pool, x, w, g, *gx, *gw, *gb);
  return UnsupportedDtype("jaxext_linear_backward");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxext_mul_constant, MulConstantImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()   // x
                                  .Arg<ffi::AnyBuffer>()   // the constant, x's dtype
                                  .Ret<ffi::AnyBuffer>()); // x * constant

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxext_linear_forward, LinearForwardImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // x
                                  .Arg<ffi::AnyBuffer>()  // w
                                  .Arg<ffi::AnyBuffer>()  // bias
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxext_linear_backward, LinearBackwardImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()   // x
                                  .Arg<ffi::AnyBuffer>()   // w
                                  .Arg<ffi::AnyBuffer>()   // g
                                  .Ret<ffi::AnyBuffer>()   // grad x
                                  .Ret<ffi::AnyBuffer>()   // grad w
                                  .Ret<ffi::AnyBuffer>()); // grad bias
