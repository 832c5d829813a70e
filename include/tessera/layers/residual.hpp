// Residual<Main, Projection>: y = relu(main(x) + shortcut(x)), the block of He et al.'s ResNets.
//
// shortcut(x) is x itself (identity) when the block keeps shape, or a 1x1 strided convolution +
// BatchNorm ("projection", option B) when it changes channels or resolution. Both kinds are one
// C++ type (the projection is a std::optional), so a ResNet stage is a runtime array of one block
// type rather than a deep type.
//
// Backward, with s = main(x) + shortcut(x) and dy (N, C, H, W):
//   ds = dy * [s > 0];   dx = main'(x)^T ds + (shortcut'(x)^T ds  or  ds)
#pragma once

#include <optional>
#include <string>

#include "tessera/core/concepts.hpp"
#include "tessera/core/error.hpp"
#include "tessera/core/memory_format.hpp"
#include "tessera/core/tensor.hpp"
#include "tessera/kernels/elementwise.hpp"

namespace tessera {

template <class Main, class Projection>
class Residual {
  static_assert(check_layer<Main>() && check_layer<Projection>());

 public:
  using Env = typename Main::Env;
  using Tensor = typename Main::Tensor;
  using S = typename Env::Scalar;
  using D = typename Env::Device;
  // Activation memory (core/concepts.hpp): backward reads y (the ReLU mask); x only through the
  // branches' first layers. The branches' outputs are dead once added (unless their backward
  // reads them) and the branches' input gradients once summed.
  static constexpr bool kBackwardReadsInput = backward_reads_input<Main>() || backward_reads_input<Projection>();
  static constexpr bool kBackwardReadsOutput = true;
  // The weight half reads x through the branches' first layers, and ds (kept in the cache), never dy.
  static constexpr bool kWeightReadsInput = weight_reads_input<Main>() || weight_reads_input<Projection>();
  static constexpr bool kWeightReadsOutputGrad = false;
  struct Cache {
    typename Main::Cache main;
    typename Projection::Cache projection;
    Tensor y, dsum, dx;
    // Between backward_input and backward_weight: whether each branch handed ds on as its dL/dx.
    bool main_handed_on = false, shortcut_handed_on = false;
  };

  explicit Residual(Main main, std::optional<Projection> projection = std::nullopt)
      : main_(std::move(main)), projection_(std::move(projection)) {}

  const Tensor& forward(const Tensor& x, Cache& c) {
    // Forward only: the shortcut first, then the main branch's last convolution adds it and
    // applies the ReLU as it writes y (Sequential::forward_add_relu), so neither the branch's
    // output nor the sum is ever stored apart.
    if constexpr (requires(Tensor& y) { main_.forward_add_relu(x, c.main, x, y); }) {
      if (mode_ == Mode::Inference) {
        const Tensor& s = projection_ ? projection_->forward(x, c.projection) : x;
        main_.forward_add_relu(x, c.main, s, c.y);
        if (projection_) release_output(*projection_, c.projection);
        return c.y;
      }
    }
    // Train or Eval, a branch ending in a BatchNorm: the shortcut first, then the BatchNorm writes
    // relu(its output + shortcut) straight into y (Sequential::forward_norm_add_relu), the values
    // of the three steps below in one pass.
    if constexpr (requires(Tensor& y) { main_.forward_norm_add_relu(x, c.main, x, y); }) {
      const Tensor& s = projection_ ? projection_->forward(x, c.projection) : x;
      main_.forward_norm_add_relu(x, c.main, s, c.y);
      if constexpr (!backward_reads_output<Projection>()) {
        if (projection_) release_output(*projection_, c.projection);
      }
      return c.y;
    }
    const Tensor& m = main_.forward(x, c.main);
    const Tensor& s = projection_ ? projection_->forward(x, c.projection) : x;
    TESSERA_CHECK(m.shape() == s.shape(), ShapeError, "Residual: main branch gives ", m.shape(),
                  " but the shortcut gives ", s.shape(), " (a block that changes shape needs a projection)");
    c.y.resize(m.shape());
    add_relu_forward(D{}, m.data(), s.data(), m.numel(), c.y.data());  // y = max(m + s, 0)
    if constexpr (!backward_reads_output<Main>()) release_output(main_, c.main);
    if constexpr (!backward_reads_output<Projection>()) {
      if (projection_) release_output(*projection_, c.projection);
    }
    return c.y;
  }

  const Tensor& backward(const Tensor& dy, Cache& c) {
    backward_impl(dy, c, /*input_only=*/false);
    release_branch_grads(c);
    return c.dx;
  }
  // backward for a chain of blocks (models/resnet.hpp), which saves the ReLU gradient's pass over
  // memory at each join. `dy_is_ds`: dy is already ds, dL/dy taken through this block's ReLU by
  // the block after it. `input_relu_output`, when given: this block's input x is that tensor, the
  // output of a block before it (a ReLU's), and the dL/dx returned is taken on through that ReLU,
  // dL/dx * [x > 0] (formed with the sum, add_relu_backward), for that block to take with
  // dy_is_ds. With neither: backward. The same bits as backward and relu_backward in turn.
  const Tensor& backward_chained(const Tensor& dy, Cache& c, bool dy_is_ds, const Tensor* input_relu_output) {
    backward_impl(dy, c, /*input_only=*/false, dy_is_ds, input_relu_output);
    release_branch_grads(c);
    return c.dx;
  }
  // The backward in two halves, for zero-bubble pipeline schedules (core/concepts.hpp,
  // SplitsBackward): backward_input runs both branches' input halves and sums dx; backward_weight
  // their weight halves, then releases what backward releases. ds stays in the cache between the
  // two when a branch's last layer reads it back, so only the block's input x must stay alive.
  const Tensor& backward_input(const Tensor& dy, Cache& c) { return backward_impl(dy, c, /*input_only=*/true); }
  void backward_weight(Cache& c) {
    split_backward_weight(main_, c.main);
    if (projection_) split_backward_weight(*projection_, c.projection);
    release_branch_grads(c);
  }

  void set_mode(Mode mode) {
    mode_ = mode;
    main_.set_mode(mode);
    if (projection_) projection_->set_mode(mode);
  }
  // The add and its ReLU are elementwise: the branches' format is the block's.
  void set_memory_format(MemoryFormat f) {
    apply_memory_format(main_, f, "Residual");
    if (projection_) apply_memory_format(*projection_, f, "Residual");
  }

  // torchvision names: the main branch's layers sit directly under the block ("layer1.0.conv1"),
  // the projection under "downsample".
  template <class V>
  void visit(V& v, const std::string& prefix) {
    main_.visit(v, prefix);
    if (projection_) projection_->visit(v, prefix + "downsample.");
  }

  Main& main() { return main_; }
  bool has_projection() const { return projection_.has_value(); }
  Projection* projection() { return projection_ ? &*projection_ : nullptr; }

 private:
  const Tensor& backward_impl(const Tensor& dy, Cache& c, bool input_only, bool dy_is_ds = false,
                              const Tensor* input_relu_output = nullptr) {
    check_backward_allowed(mode_, "Residual");
    TESSERA_CHECK(dy.shape() == c.y.shape(), ShapeError, "Residual::backward: dy ", dy.shape(),
                  " does not match the output ", c.y.shape());
    const Tensor* ds = &dy;
    if (!dy_is_ds) {
      c.dsum.resize(dy.shape());
      relu_backward(D{}, dy.data(), c.y.data(), dy.numel(), c.dsum.data());  // ds = dy * [y > 0]
      ds = &c.dsum;
    }
    const Tensor& dmain = backward_or_input(main_, *ds, c.main, input_only);
    const Tensor& dshortcut = projection_ ? backward_or_input(*projection_, *ds, c.projection, input_only) : *ds;
    c.dx.resize(dmain.shape());
    if (input_relu_output) {
      TESSERA_CHECK(input_relu_output->shape() == dmain.shape(), ShapeError, "Residual::backward_chained: the input ",
                    input_relu_output->shape(), " does not match dL/dx ", dmain.shape());
      add_relu_backward(D{}, dmain.data(), dshortcut.data(), input_relu_output->data(), dmain.numel(), c.dx.data());
    } else {
      add(D{}, dmain.data(), dshortcut.data(), dmain.numel(), c.dx.data());
    }
    c.main_handed_on = &dmain == ds;
    c.shortcut_handed_on = &dshortcut == ds;
    // The input half frees what no weight half reads: the branches' input gradients, and ds
    // unless a branch's last layer reads it back (a BatchNorm at the end does not).
    if (input_only) release_branch_grads(c, !weight_reads_output_grad<Main>() && !weight_reads_output_grad<Projection>());
    return c.dx;
  }
  // The branches' input gradients, dead once dx is formed, and ds (release_dsum) once no weight
  // half reads it. Releasing twice is harmless: the second finds nothing.
  void release_branch_grads(Cache& c, bool release_dsum = true) {
    if (!c.main_handed_on) release_input_grad(main_, c.main);
    if (projection_ && !c.shortcut_handed_on) release_input_grad(*projection_, c.projection);
    if (release_dsum) c.dsum.release();
  }

  Main main_;
  std::optional<Projection> projection_;
  Mode mode_ = Mode::Train;
};

}  // namespace tessera
