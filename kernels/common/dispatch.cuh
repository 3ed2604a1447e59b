// The one place where the runtime choices of a launch, head_dim and KV format, become
// template parameters (FlashInfer style). Both kernel families dispatch through these
// helpers over kernels/common/dispatch.h's lists, so a head dim or format is instantiated
// exactly where it is declared supported.
//
//   return dispatch_head_dim(a.cache.head_dim, [&](auto hd) {
//     constexpr int D = decltype(hd)::value;
//     return launch_kernel(my_kernel<D>, ...);
//   });
//
// f returns LaunchStatus or cudaError_t; a value outside the list gives
// cudaErrorInvalidValue (launchers check their arguments first, so only a list and an
// argument check that disagree can get there).
#pragma once

#include <cstddef>
#include <type_traits>
#include <utility>

#include "kernels/common/dispatch.h"
#include "kernels/common/gpu.h"

namespace kvfuse::gpu {

template <int D>
using HeadDimTag = std::integral_constant<int, D>;
template <KvFormat F>
using KvFormatTag = std::integral_constant<KvFormat, F>;

namespace dispatch_detail {

// f(std::integral_constant<T, kValues[i]>{}) for the i with kValues[i] == v.
template <const auto& kValues, class T, class F, size_t... I>
auto one_of(T v, F& f, std::index_sequence<I...>) {
  using R = decltype(f(std::integral_constant<T, kValues[0]>{}));
  R r = R(cudaErrorInvalidValue);
  (void)((v == kValues[I] ? (r = f(std::integral_constant<T, kValues[I]>{}), true) : false) || ...);
  return r;
}

}  // namespace dispatch_detail

// f(HeadDimTag<D>{}) for the D of kHeadDims that equals head_dim.
template <class F>
auto dispatch_head_dim(int32_t head_dim, F&& f) {
  return dispatch_detail::one_of<kHeadDims>(head_dim, f, std::make_index_sequence<kHeadDims.size()>{});
}

// f(KvFormatTag<F>{}) for the F of kKvFormats that equals format.
template <class F>
auto dispatch_kv_format(KvFormat format, F&& f) {
  return dispatch_detail::one_of<kKvFormats>(format, f, std::make_index_sequence<kKvFormats.size()>{});
}

// f(HeadDimTag<D>{}, KvFormatTag<F>{}) for the cache's head_dim and format.
template <class F>
auto dispatch_head_dim_format(int32_t head_dim, KvFormat format, F&& f) {
  return dispatch_head_dim(
      head_dim, [&](auto hd) { return dispatch_kv_format(format, [&](auto fmt) { return f(hd, fmt); }); });
}

}  // namespace kvfuse::gpu
