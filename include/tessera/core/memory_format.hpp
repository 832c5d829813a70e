// MemoryFormat: how a 4-D activation (N, C, H, W) lies in memory, PyTorch's memory_format.
//
//   Contiguous     element (n, c, h, w) at ((n C + c) H + h) W + w     (NCHW, torch.contiguous_format)
//   ChannelsLast   element (n, c, h, w) at ((n H + h) W + w) C + c     (NHWC, torch.channels_last)
//
// As in PyTorch the shape a tensor reports stays (N, C, H, W) in both: only the layers that index
// by channel or position (Conv2d, BatchNorm2d, the pooling layers) read the format, set by
// set_memory_format on them or on the model that holds them; elementwise layers, residual adds and
// anything after global pooling ((N, C) is the same in both) do not care. The filters keep
// PyTorch's (C_out, C_in / groups, kH, kW) layout in both, so state_dicts, checkpoints and
// optimizers do not change.
//
// Why: on GPUs the tensor cores' convolutions run on NHWC (cuDNN transposes NCHW inputs to it
// around each call), so ChannelsLast is the faster format there; on the CPU Tessera's kernels are
// built for NCHW, and ChannelsLast there is a reference that transposes around the convolution
// (docs/cuda.md, "Memory format").
#pragma once

#include <string>
#include <string_view>

#include "tessera/core/error.hpp"

namespace tessera {

enum class MemoryFormat { Contiguous, ChannelsLast };

inline const char* to_string(MemoryFormat f) { return f == MemoryFormat::ChannelsLast ? "channels_last" : "contiguous"; }

// "contiguous" or "channels_last" (PyTorch's spellings, torch.contiguous_format / torch.channels_last);
// `what` names the setting in the error (a flag, an environment variable).
inline MemoryFormat parse_memory_format(std::string_view text, std::string_view what = "memory format") {
  if (text == "contiguous" || text == "contiguous_format") return MemoryFormat::Contiguous;
  if (text == "channels_last") return MemoryFormat::ChannelsLast;
  throw ArgumentError(detail::cat(what, ": '", std::string(text), "' is not a memory format (contiguous or channels_last)"));
}

}  // namespace tessera

namespace tessera {

// Sets f on a layer inside a container (Sequential, Residual, a model). A layer with
// set_memory_format takes it; an elementwise one (kElementwise: activations, dropout) has nothing
// to set; any other layer works on Contiguous data only, and channels_last on it is refused here,
// naming it, rather than giving wrong numbers later.
template <class L>
void apply_memory_format(L& layer, MemoryFormat f, const char* container) {
  if constexpr (requires { layer.set_memory_format(f); }) {
    layer.set_memory_format(f);
  } else if constexpr (!requires { L::kElementwise; }) {
    if (f == MemoryFormat::Contiguous) return;
    if constexpr (requires { layer.name(); })
      throw ArgumentError(detail::cat(container, "::set_memory_format(channels_last): ", layer.name(),
                                      " works on contiguous (NCHW) data only"));
    else
      throw ArgumentError(detail::cat(container, "::set_memory_format(channels_last): one of its layers works on ",
                                      "contiguous (NCHW) data only (channels_last: Conv2d, BatchNorm2d, the pooling ",
                                      "layers, Flatten, Linear on (N, F), elementwise layers)"));
  }
}

}  // namespace tessera
