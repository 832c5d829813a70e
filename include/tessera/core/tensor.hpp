// Tensor<S, D>: an owning, contiguous, row-major N-D array of scalars S on device D.
//
// Ensures: data() is 64-byte aligned and holds shape().numel() elements.
// resize() keeps the buffer when it is large enough, so tensors reused across steps (layer
// outputs, workspaces, gradients) stop allocating after the first step. Copies are deep; moves
// steal the buffer. There are no views with strides: kernels take pointers and shapes.
#pragma once

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <iterator>
#include <type_traits>
#include <span>
#include <utility>

#include "tessera/core/error.hpp"
#include "tessera/core/shape.hpp"

namespace tessera {

// The default device, declared only: core sits below device/ in the include graph, so a tensor's
// member functions need the device's header (tessera/device/cpu.hpp, device/cuda.cuh) where they
// are used; every layer, kernel and model header includes its devices.
struct Cpu;

template <class S, class D = Cpu>
class Tensor {
 public:
  using Scalar = S;
  using Device = D;

  Tensor() = default;
  explicit Tensor(const Shape& shape) { resize(shape); }
  Tensor(const Shape& shape, S value) {
    resize(shape);
    fill(value);
  }
  // Tensor<float>::from({2, 2}, {1, 2, 3, 4}): shape plus row-major values (tests, examples).
  static Tensor from(const Shape& shape, std::initializer_list<S> values) {
    TESSERA_CHECK(static_cast<std::int64_t>(values.size()) == shape.numel(), ShapeError,
                  "Tensor::from: ", values.size(), " values for shape ", shape);
    Tensor t(shape);
    D::copy_to_device(t.data(), std::data(values), t.bytes());
    return t;
  }

  Tensor(const Tensor& other) {
    resize(other.shape_);
    D::copy(data_, other.data_, bytes());
  }
  Tensor& operator=(const Tensor& other) {
    if (this != &other) {
      resize(other.shape_);
      D::copy(data_, other.data_, bytes());
    }
    return *this;
  }
  Tensor(Tensor&& other) noexcept { swap(other); }
  Tensor& operator=(Tensor&& other) noexcept {
    swap(other);
    return *this;
  }
  ~Tensor() { D::deallocate(data_, capacity_ * sizeof(S)); }

  void swap(Tensor& other) noexcept {
    std::swap(data_, other.data_);
    std::swap(capacity_, other.capacity_);
    std::swap(shape_, other.shape_);
  }

  // Sets the shape; reallocates only when the new size exceeds the capacity. Contents are
  // unspecified after a resize that grows the tensor.
  void resize(const Shape& shape) {
    const auto n = static_cast<std::size_t>(shape.numel());
    if (n > capacity_) {
      S* fresh = static_cast<S*>(D::allocate(n * sizeof(S)));  // may throw: then nothing changed
      D::deallocate(data_, capacity_ * sizeof(S));
      data_ = fresh;
      capacity_ = n;
    }
    shape_ = shape;
  }
  // Gives the buffer back to the device's allocator (its cache) and leaves an empty tensor of
  // shape (0): for activations and gradients whose consumer has run (core/concepts.hpp).
  void release() noexcept {
    D::deallocate(data_, capacity_ * sizeof(S));
    data_ = nullptr;
    capacity_ = 0;
    shape_ = Shape{0};
  }
  // Same data, new shape with the same number of elements (like torch.Tensor.view).
  void reshape(const Shape& shape) {
    TESSERA_CHECK(shape.numel() == shape_.numel(), ShapeError, "Tensor::reshape: cannot view ", shape_,
                  " as ", shape);
    shape_ = shape;
  }

  const Shape& shape() const { return shape_; }
  int rank() const { return shape_.rank(); }
  std::int64_t dim(int i) const { return shape_.dim(i); }
  std::int64_t numel() const { return shape_.numel(); }
  std::size_t bytes() const { return static_cast<std::size_t>(numel()) * sizeof(S); }
  bool empty() const { return numel() == 0; }

  S* data() { return data_; }
  const S* data() const { return data_; }
  std::span<S> span() { return {data_, static_cast<std::size_t>(numel())}; }
  std::span<const S> span() const { return {data_, static_cast<std::size_t>(numel())}; }
  S* begin() { return data_; }
  S* end() { return data_ + numel(); }
  const S* begin() const { return data_; }
  const S* end() const { return data_ + numel(); }

  // Flat element access (row-major index). Host memory only: a GPU tensor goes through to_host.
  S& operator[](std::int64_t i) {
    static_assert(D::host_accessible, "Tensor::operator[] on device memory: copy it with to_host() first");
    return data_[i];
  }
  const S& operator[](std::int64_t i) const {
    static_assert(D::host_accessible, "Tensor::operator[] on device memory: copy it with to_host() first");
    return data_[i];
  }

  // Multi-index access, bounds-checked in rank only: t.at(n, c, h, w).
  template <class... I>
  S& at(I... idx) {
    static_assert(D::host_accessible, "Tensor::at on device memory: copy it with to_host() first");
    return data_[offset(idx...)];
  }
  template <class... I>
  const S& at(I... idx) const {
    static_assert(D::host_accessible, "Tensor::at on device memory: copy it with to_host() first");
    return data_[offset(idx...)];
  }

  // On a GPU, a kernel on the device's stream (fill_elements is found by argument-dependent
  // lookup: the device's kernel header must be included where this is instantiated).
  void fill(S value) { fill_elements(D{}, data_, numel(), value); }
  void zero() { fill(S(0)); }

  // Converts element type (e.g. float64 reference data to float32). Host memory only.
  template <class T>
  Tensor<T, D> cast() const {
    static_assert(D::host_accessible, "Tensor::cast on device memory: cast on the host (to_host) and copy back");
    Tensor<T, D> out(shape_);
    for (std::int64_t i = 0; i < numel(); ++i) out[i] = static_cast<T>(data_[i]);
    return out;
  }

 private:
  template <class... I>
  std::int64_t offset(I... idx) const {
    TESSERA_CHECK(static_cast<int>(sizeof...(I)) == shape_.rank(), ShapeError, "Tensor::at: ",
                  sizeof...(I), " indices for a tensor of shape ", shape_);
    const std::int64_t index[] = {static_cast<std::int64_t>(idx)...};
    std::int64_t off = 0;
    for (int i = 0; i < shape_.rank(); ++i) off = off * shape_[i] + index[i];
    return off;
  }

  S* data_ = nullptr;
  std::size_t capacity_ = 0;
  Shape shape_{0};  // a default tensor is empty (shape (0)), not a rank-0 scalar with no storage
};

// Transfers between host memory and device D; each returns when the copy is complete (a GPU
// synchronizes its stream), so the result may be used at once.
template <class S, class D>
Tensor<S, Cpu> to_host(const Tensor<S, D>& src) {
  if constexpr (std::is_same_v<D, Cpu>) {
    return src;
  } else {
    Tensor<S, Cpu> out(src.shape());
    D::copy_to_host(out.data(), src.data(), src.bytes());
    D::synchronize();
    return out;
  }
}
template <class D, class S>
Tensor<S, D> to_device(const Tensor<S, Cpu>& src) {
  if constexpr (std::is_same_v<D, Cpu>) {
    return src;
  } else {
    Tensor<S, D> out(src.shape());
    D::copy_to_device(out.data(), src.data(), src.bytes());
    D::synchronize();
    return out;
  }
}

}  // namespace tessera
