// Compiled by jaxext.cpp_extension into every CPU extension, beside the user's sources.
//
// 1. Build info: the jaxlib version and XLA FFI API version of the headers the library
//    was compiled against, read at load time (a library built for another jaxlib is
//    refused with both versions named, rather than failing inside XLA).
// 2. Checking mode: each handler is registered through a trampoline that, while checking
//    mode is on (jaxext.cpp_extension.checking(), jaxext.opcheck), fills every result
//    buffer with NaN (floating types) or a sentinel (integers: the type's minimum, or its
//    maximum when unsigned) before calling the handler, so an element the handler never
//    writes shows instead of returning whatever memory held.
//
// Only XLA's stable C API (xla/ffi/api/c_api.h) is used here. Result buffers are filled
// with plain stores: CPU buffers only (CUDA extensions do not get this file).

#include <array>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>

#include "xla/ffi/api/c_api.h"

#ifndef JAXEXT_JAXLIB_VERSION
#define JAXEXT_JAXLIB_VERSION "unknown"
#endif
#define JAXEXT_STR_(x) #x
#define JAXEXT_STR(x) JAXEXT_STR_(x)

extern "C" __attribute__((visibility("default"))) const char jaxext_build_info[] =
    "jaxlib=" JAXEXT_JAXLIB_VERSION ";ffi_api=" JAXEXT_STR(XLA_FFI_API_MAJOR) "." JAXEXT_STR(
        XLA_FFI_API_MINOR);

namespace {

using Handler = XLA_FFI_Error* (*)(XLA_FFI_CallFrame*);
constexpr int kSlots = 128;  // handlers per extension that can be checked

Handler g_handlers[kSlots];
std::atomic<int> g_mode{0};

template <typename T>
void FillWith(void* data, int64_t count, T value) {
  T* out = static_cast<T*>(data);
  for (int64_t i = 0; i < count; ++i) out[i] = value;
}

template <typename T>
void FillBits(void* data, int64_t count, T bits) {  // a value given by its bit pattern
  FillWith<T>(data, count, bits);
}

void Fill(XLA_FFI_Buffer* buffer) {
  if (buffer == nullptr || buffer->data == nullptr) return;
  int64_t count = 1;
  for (int64_t i = 0; i < buffer->rank; ++i) count *= buffer->dims[i];
  if (count <= 0) return;
  void* d = buffer->data;
  switch (buffer->dtype) {
    case XLA_FFI_DataType_F32:
      return FillWith<float>(d, count, std::numeric_limits<float>::quiet_NaN());
    case XLA_FFI_DataType_F64:
      return FillWith<double>(d, count, std::numeric_limits<double>::quiet_NaN());
    case XLA_FFI_DataType_C64:
      return FillWith<float>(d, 2 * count, std::numeric_limits<float>::quiet_NaN());
    case XLA_FFI_DataType_C128:
      return FillWith<double>(d, 2 * count, std::numeric_limits<double>::quiet_NaN());
    case XLA_FFI_DataType_F16:
      return FillBits<uint16_t>(d, count, 0x7E00);  // quiet NaN
    case XLA_FFI_DataType_BF16:
      return FillBits<uint16_t>(d, count, 0x7FC0);  // quiet NaN
    case XLA_FFI_DataType_F8E5M2:
    case XLA_FFI_DataType_F8E4M3FN:
      return FillBits<uint8_t>(d, count, 0x7F);  // NaN
    case XLA_FFI_DataType_S8:
      return FillWith<int8_t>(d, count, std::numeric_limits<int8_t>::min());
    case XLA_FFI_DataType_S16:
      return FillWith<int16_t>(d, count, std::numeric_limits<int16_t>::min());
    case XLA_FFI_DataType_S32:
      return FillWith<int32_t>(d, count, std::numeric_limits<int32_t>::min());
    case XLA_FFI_DataType_S64:
      return FillWith<int64_t>(d, count, std::numeric_limits<int64_t>::min());
    case XLA_FFI_DataType_U8:
      return FillWith<uint8_t>(d, count, std::numeric_limits<uint8_t>::max());
    case XLA_FFI_DataType_U16:
      return FillWith<uint16_t>(d, count, std::numeric_limits<uint16_t>::max());
    case XLA_FFI_DataType_U32:
      return FillWith<uint32_t>(d, count, std::numeric_limits<uint32_t>::max());
    case XLA_FFI_DataType_U64:
      return FillWith<uint64_t>(d, count, std::numeric_limits<uint64_t>::max());
    default:  // PRED, sub-byte and other types are left as they are
      return;
  }
}

template <int I>
XLA_FFI_Error* Checked(XLA_FFI_CallFrame* frame) {
  // Metadata queries (an extension in the frame) and the stages before execution are
  // passed through untouched.
  if (g_mode.load(std::memory_order_relaxed) != 0 && frame->extension_start == nullptr &&
      frame->stage == XLA_FFI_ExecutionStage_EXECUTE) {
    for (int64_t i = 0; i < frame->rets.size; ++i) {
      if (frame->rets.types[i] == XLA_FFI_RetType_BUFFER) {
        Fill(static_cast<XLA_FFI_Buffer*>(frame->rets.rets[i]));
      }
    }
  }
  return g_handlers[I](frame);
}

template <size_t... I>
constexpr std::array<Handler, sizeof...(I)> MakeTrampolines(std::index_sequence<I...>) {
  return {&Checked<static_cast<int>(I)>...};
}

constexpr std::array<Handler, kSlots> kTrampolines =
    MakeTrampolines(std::make_index_sequence<kSlots>());

}  // namespace

// The trampoline of slot `slot`, now calling `handler`; null when the slots are used up.
extern "C" __attribute__((visibility("default"))) void* jaxext_checking_trampoline(
    int slot, void* handler) {
  if (slot < 0 || slot >= kSlots) return nullptr;
  g_handlers[slot] = reinterpret_cast<Handler>(handler);
  return reinterpret_cast<void*>(kTrampolines[slot]);
}

// 1: fill result buffers before each call; 0: do not.
extern "C" __attribute__((visibility("default"))) void jaxext_checking_set_mode(int mode) {
  g_mode.store(mode, std::memory_order_relaxed);
}
