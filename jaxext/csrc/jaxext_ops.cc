// jaxext's two ops as XLA FFI handlers for the CPU: mul_constant, and linear's
// forward and backward. Loaded through jaxext.cpp_extension.load by
// jaxext/cpp_extension/ops.py, which attaches the backward with a custom VJP.
//
// Every handler accepts float32 and float64 (chosen at run time from the buffer's
// dtype) and returns an ffi::Error for anything else.
//
// Batching: the linear handlers are called with vmap_method="expand_dims", so
// under jax.vmap every operand gets the same number of extra leading dimensions,
// each either the full batch size or 1 (an operand that is not batched). The
// results always have the full batch shape. Batch::offset maps a flat batch
// index to each operand's element offset, with stride 0 along its size-1 axes.

#include <cstddef>
#include <cstdint>
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

ffi::Error MulConstantImpl(ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y, double constant) {
  if (x.element_type() != y->element_type() || x.element_count() != y->element_count()) {
    return ffi::Error::InvalidArgument("jaxext_mul_constant: result must match `x`");
  }
  const int64_t n = static_cast<int64_t>(x.element_count());
  switch (x.element_type()) {
    case ffi::DataType::F32:
      MulConstantKernel(x.typed_data<float>(), y->typed_data<float>(), n,
                        static_cast<float>(constant));
      return ffi::Error::Success();
    case ffi::DataType::F64:
      MulConstantKernel(x.typed_data<double>(), y->typed_data<double>(), n, constant);
      return ffi::Error::Success();
    default:
      return UnsupportedDtype("jaxext_mul_constant");
  }
}

// -------------------------------------------------------------------- linear
//
// Shapes of one batch entry: x (B, I), w (O, I), bias (O), y (B, O), g (B, O).
// The loops keep the innermost index contiguous in memory and free of
// reductions, so the compiler vectorizes them without reassociating sums.

constexpr int64_t kBlock = 64;  // rows of w^T (input features) kept hot in cache

template <typename T>
void LinearForwardKernel(const T* x, const T* w, const T* bias, T* y, int64_t rows, int64_t in,
                         int64_t out, std::vector<T>& wt) {
  // wt = w^T, (I, O): row i holds feature i's weight for every output.
  wt.resize(static_cast<size_t>(in * out));
  for (int64_t o = 0; o < out; ++o)
    for (int64_t i = 0; i < in; ++i) wt[i * out + o] = w[o * in + i];
  for (int64_t b = 0; b < rows; ++b) {
    T* yb = y + b * out;
    for (int64_t o = 0; o < out; ++o) yb[o] = bias[o];
  }
  for (int64_t i0 = 0; i0 < in; i0 += kBlock) {
    const int64_t i1 = i0 + kBlock < in ? i0 + kBlock : in;
    for (int64_t b = 0; b < rows; ++b) {
      T* yb = y + b * out;
      const T* xb = x + b * in;
      for (int64_t i = i0; i < i1; ++i) {
        const T xi = xb[i];
        const T* wi = wt.data() + i * out;
        for (int64_t o = 0; o < out; ++o) yb[o] += xi * wi[o];
      }
    }
  }
}

template <typename T>
void LinearBackwardKernel(const T* x, const T* w, const T* g, T* gx, T* gw, T* gb, int64_t rows,
                          int64_t in, int64_t out) {
  for (int64_t k = 0; k < rows * in; ++k) gx[k] = T(0);
  for (int64_t k = 0; k < out * in; ++k) gw[k] = T(0);
  for (int64_t o = 0; o < out; ++o) gb[o] = T(0);
  for (int64_t b = 0; b < rows; ++b) {
    const T* gbrow = g + b * out;
    const T* xb = x + b * in;
    T* gxb = gx + b * in;
    for (int64_t o = 0; o < out; ++o) {
      const T go = gbrow[o];
      const T* wo = w + o * in;
      T* gwo = gw + o * in;
      for (int64_t i = 0; i < in; ++i) gxb[i] += go * wo[i];  // gx = g @ w
      for (int64_t i = 0; i < in; ++i) gwo[i] += go * xb[i];  // gw = g^T @ x
      gb[o] += go;                                            // gb = sum_b g
    }
  }
}

template <typename T>
ffi::Error LinearForwardTyped(ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer bias,
                              ffi::AnyBuffer y) {
  auto yd = y.dimensions();
  if (yd.size() < 2) return ffi::Error::InvalidArgument("jaxext_linear_forward: y must be 2-D");
  const int64_t rows = yd[yd.size() - 2], out = yd[yd.size() - 1];
  auto xd = x.dimensions();
  const int64_t in = xd.size() < 2 ? 0 : xd[xd.size() - 1];
  Batch batch(yd, 2);
  auto sx = batch.strides(xd, 2), sw = batch.strides(w.dimensions(), 2),
       sb = batch.strides(bias.dimensions(), 1);
  if (sx.empty() || sw.empty() || sb.empty() || xd[xd.size() - 2] != rows) {
    return ffi::Error::InvalidArgument(
        "jaxext_linear_forward: expected x (..., B, I), w (..., O, I), bias (..., O)");
  }
  std::vector<T> wt;
  const int64_t n = batch.size();
  for (int64_t k = 0; k < n; ++k) {
    LinearForwardKernel(x.typed_data<T>() + batch.offset(k, sx),
                        w.typed_data<T>() + batch.offset(k, sw),
                        bias.typed_data<T>() + batch.offset(k, sb),
                        y.typed_data<T>() + k * rows * out, rows, in, out, wt);
  }
  return ffi::Error::Success();
}

ffi::Error LinearForwardImpl(ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer bias,
                             ffi::Result<ffi::AnyBuffer> y) {
  const ffi::DataType t = x.element_type();
  if (w.element_type() != t || bias.element_type() != t || y->element_type() != t) {
    return ffi::Error::InvalidArgument("jaxext_linear_forward: operands must share one dtype");
  }
  if (t == ffi::DataType::F32) return LinearForwardTyped<float>(x, w, bias, *y);
  if (t == ffi::DataType::F64) return LinearForwardTyped<double>(x, w, bias, *y);
  return UnsupportedDtype("jaxext_linear_forward");
}

template <typename T>
ffi::Error LinearBackwardTyped(ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer g,
                               ffi::AnyBuffer gx, ffi::AnyBuffer gw, ffi::AnyBuffer gb) {
  auto gxd = gx.dimensions(), gwd = gw.dimensions();
  if (gxd.size() < 2 || gwd.size() < 2) {
    return ffi::Error::InvalidArgument("jaxext_linear_backward: results must be at least 2-D");
  }
  const int64_t rows = gxd[gxd.size() - 2], in = gxd[gxd.size() - 1];
  const int64_t out = gwd[gwd.size() - 2];
  Batch batch(gxd, 2);
  auto sx = batch.strides(x.dimensions(), 2), sw = batch.strides(w.dimensions(), 2),
       sg = batch.strides(g.dimensions(), 2);
  if (sx.empty() || sw.empty() || sg.empty()) {
    return ffi::Error::InvalidArgument(
        "jaxext_linear_backward: expected x (..., B, I), w (..., O, I), g (..., B, O)");
  }
  const int64_t n = batch.size();
  for (int64_t k = 0; k < n; ++k) {
    LinearBackwardKernel(x.typed_data<T>() + batch.offset(k, sx),
                         w.typed_data<T>() + batch.offset(k, sw),
                         g.typed_data<T>() + batch.offset(k, sg),
                         gx.typed_data<T>() + k * rows * in, gw.typed_data<T>() + k * out * in,
                         gb.typed_data<T>() + k * out, rows, in, out);
  }
  return ffi::Error::Success();
}

ffi::Error LinearBackwardImpl(ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer g,
                              ffi::Result<ffi::AnyBuffer> gx, ffi::Result<ffi::AnyBuffer> gw,
                              ffi::Result<ffi::AnyBuffer> gb) {
  const ffi::DataType t = x.element_type();
  if (w.element_type() != t || g.element_type() != t) {
    return ffi::Error::InvalidArgument("jaxext_linear_backward: operands must share one dtype");
  }
  if (t == ffi::DataType::F32) return LinearBackwardTyped<float>(x, w, g, *gx, *gw, *gb);
  if (t == ffi::DataType::F64) return LinearBackwardTyped<double>(x, w, g, *gx, *gw, *gb);
  return UnsupportedDtype("jaxext_linear_backward");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxext_mul_constant, MulConstantImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<double>("constant"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxext_linear_forward, LinearForwardImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()  // x
                                  .Arg<ffi::AnyBuffer>()  // w
                                  .Arg<ffi::AnyBuffer>()  // bias
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxext_linear_backward, LinearBackwardImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()   // x
                                  .Arg<ffi::AnyBuffer>()   // w
                                  .Arg<ffi::AnyBuffer>()   // g
                                  .Ret<ffi::AnyBuffer>()   // grad x
                                  .Ret<ffi::AnyBuffer>()   // grad w
                                  .Ret<ffi::AnyBuffer>()); // grad bias
