// GELU of a bias add, y = gelu(x + b), with the bias gradient computed in the
// same pass as the input gradient.
//
// A feed-forward layer's matmul output (M, N) would otherwise take a
// BiasAdd pass, the GELU pass(es), and in the backward pass a separate
// BiasAddGrad reduction over the M rows. Rows are split into fixed blocks;
// each block sums its rows' gradients in row order and the blocks are then
// added in block order, so the bias gradient does not depend on how the
// thread pool scheduled the blocks. Math in float32 whatever the storage
// type; the GELU formulas are those of gelu.cc.

#include "common.h"

#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"
#include "tensorflow/core/util/work_sharder.h"

namespace tfgpt {
namespace {

using Row = Eigen::Array<float, Eigen::Dynamic, 1>;

constexpr float kSqrt2OverPi = 0.7978845608028654f;
constexpr float kCubic = 0.044715f;
constexpr float kSqrtHalf = 0.7071067811865476f;
constexpr float kInvSqrt2Pi = 0.3989422804014327f;
// Rows per block of the bias-gradient reduction: fixed, for determinism.
constexpr int64_t kBlockRows = 32;

REGISTER_OP("TfgptBiasGelu")
    .Input("features: T")
    .Input("bias: T")
    .Output("activations: T")
    .Attr("T: {float, bfloat16, half}")
    .Attr("approximate: bool = true")
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->input(0));
      return absl::OkStatus();
    })
    .Doc("gelu(features + bias), bias over the last axis, in one pass.");

REGISTER_OP("TfgptBiasGeluGrad")
    .Input("gradients: T")
    .Input("features: T")
    .Input("bias: T")
    .Output("backprops: T")
    .Output("bias_backprops: T")
    .Attr("T: {float, bfloat16, half}")
    .Attr("approximate: bool = true")
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->input(1));
      c->set_output(1, c->input(2));
      return absl::OkStatus();
    })
    .Doc("Gradients of TfgptBiasGelu for features and bias, in one pass.");

absl::Status CheckShapes(const Tensor& features, const Tensor& bias) {
  if (features.dims() < 1 || bias.dims() != 1 ||
      bias.dim_size(0) != features.dim_size(features.dims() - 1)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "bias must be a vector as long as the last axis of features: features ",
        features.shape().DebugString(), ", bias ", bias.shape().DebugString()));
  }
  return absl::OkStatus();
}

template <typename T>
void ToFloat(const T* in, int64_t n, float* out) {
  for (int64_t j = 0; j < n; ++j) out[j] = static_cast<float>(in[j]);
}

template <typename T>
void FromFloat(const float* in, int64_t n, T* out) {
  for (int64_t j = 0; j < n; ++j) out[j] = static_cast<T>(in[j]);
}

// x := gelu(x) in place (forward).
void GeluRow(bool approximate, Eigen::Ref<Row> x, Row& t) {
  if (approximate) {
    t = ((x + x * x * x * kCubic) * kSqrt2OverPi).tanh();
    x = x * 0.5f * (t + 1.0f);
  } else {
    t = (x * kSqrtHalf).erf();
    x = x * 0.5f * (t + 1.0f);
  }
}

// dy := dy * gelu'(x) in place.
void GeluGradRow(bool approximate, const Row& x, Eigen::Ref<Row> dy, Row& t) {
  if (approximate) {
    t = ((x + x * x * x * kCubic) * kSqrt2OverPi).tanh();
    dy = dy * ((t + 1.0f) * 0.5f +
               x * 0.5f * (1.0f - t * t) * kSqrt2OverPi * (x * x * (3.0f * kCubic) + 1.0f));
  } else {
    t = (x * kSqrtHalf).erf();
    dy = dy * ((t + 1.0f) * 0.5f + x * (x * x * -0.5f).exp() * kInvSqrt2Pi);
  }
}

int64_t CostPerRow(int64_t n) { return 40 * n; }

template <typename T>
class BiasGeluOp : public OpKernel {
 public:
  explicit BiasGeluOp(OpKernelConstruction* context) : OpKernel(context) {
    OP_REQUIRES_OK(context, context->GetAttr("approximate", &approximate_));
  }

  void Compute(OpKernelContext* context) override {
    const Tensor& features = context->input(0);
    const Tensor& bias = context->input(1);
    OP_REQUIRES_OK(context, CheckShapes(features, bias));
    Tensor* output = nullptr;
    OP_REQUIRES_OK(context, context->forward_input_or_allocate_output(
                                {0}, 0, features.shape(), &output));
    const int64_t n = bias.dim_size(0);
    const int64_t m = n == 0 ? 0 : features.NumElements() / n;
    if (m == 0 || n == 0) return;
    Row b(n);
    ToFloat(bias.flat<T>().data(), n, b.data());
    const T* in = features.flat<T>().data();
    T* out = output->flat<T>().data();
    const bool approximate = approximate_;
    auto work = [&](int64_t begin, int64_t end) {
      Row x(n), t(n);
      for (int64_t i = begin; i < end; ++i) {
        ToFloat(in + i * n, n, x.data());
        x += b;
        GeluRow(approximate, x, t);
        FromFloat(x.data(), n, out + i * n);
      }
    };
    auto* workers = context->device()->tensorflow_cpu_worker_threads()->workers;
    workers->ParallelFor(m, CostPerRow(n), work);
  }

 private:
  bool approximate_;
};

template <typename T>
class BiasGeluGradOp : public OpKernel {
 public:
  explicit BiasGeluGradOp(OpKernelConstruction* context) : OpKernel(context) {
    OP_REQUIRES_OK(context, context->GetAttr("approximate", &approximate_));
  }

  void Compute(OpKernelContext* context) override {
    const Tensor& gradients = context->input(0);
    const Tensor& features = context->input(1);
    const Tensor& bias = context->input(2);
    OP_REQUIRES_OK(context, CheckShapes(features, bias));
    OP_REQUIRES(context, gradients.shape() == features.shape(),
                absl::InvalidArgumentError(absl::StrCat(
                    "gradients and features must have the same shape: ",
                    gradients.shape().DebugString(), " vs ",
                    features.shape().DebugString())));
    Tensor* backprops = nullptr;
    OP_REQUIRES_OK(context, context->forward_input_or_allocate_output(
                                {0}, 0, features.shape(), &backprops));
    Tensor* bias_backprops = nullptr;
    OP_REQUIRES_OK(context, context->allocate_output(1, bias.shape(), &bias_backprops));
    const int64_t n = bias.dim_size(0);
    const int64_t m = n == 0 ? 0 : features.NumElements() / n;
    T* db_out = bias_backprops->flat<T>().data();
    if (m == 0 || n == 0) {
      std::fill(db_out, db_out + n, static_cast<T>(0.0f));
      return;
    }
    Row b(n);
    ToFloat(bias.flat<T>().data(), n, b.data());
    const T* dy_in = gradients.flat<T>().data();
    const T* x_in = features.flat<T>().data();
    T* dx_out = backprops->flat<T>().data();
    const int64_t blocks = (m + kBlockRows - 1) / kBlockRows;
    std::vector<float> partial(blocks * n, 0.0f);
    const bool approximate = approximate_;
    auto work = [&](int64_t first_block, int64_t end_block) {
      Row x(n), dy(n), t(n);
      for (int64_t block = first_block; block < end_block; ++block) {
        Eigen::Map<Row> sum(partial.data() + block * n, n);
        const int64_t end = std::min(m, (block + 1) * kBlockRows);
        for (int64_t i = block * kBlockRows; i < end; ++i) {
          ToFloat(x_in + i * n, n, x.data());
          ToFloat(dy_in + i * n, n, dy.data());
          x += b;
          GeluGradRow(approximate, x, dy, t);
          sum += dy;
          FromFloat(dy.data(), n, dx_out + i * n);
        }
      }
    };
    auto* workers = context->device()->tensorflow_cpu_worker_threads()->workers;
    workers->ParallelFor(blocks, kBlockRows * CostPerRow(n), work);
    // Blocks in order, columns in parallel.
    auto reduce = [&](int64_t begin, int64_t end) {
      for (int64_t j = begin; j < end; ++j) {
        float total = 0.0f;
        for (int64_t block = 0; block < blocks; ++block) total += partial[block * n + j];
        db_out[j] = static_cast<T>(total);
      }
    };
    workers->ParallelFor(n, blocks * 2, reduce);
  }

 private:
  bool approximate_;
};

#define REGISTER(T)                                                                  \
  REGISTER_KERNEL_BUILDER(                                                           \
      Name("TfgptBiasGelu").Device(DEVICE_CPU).TypeConstraint<T>("T"), BiasGeluOp<T>); \
  REGISTER_KERNEL_BUILDER(                                                           \
      Name("TfgptBiasGeluGrad").Device(DEVICE_CPU).TypeConstraint<T>("T"),           \
      BiasGeluGradOp<T>);

REGISTER(float)
REGISTER(Eigen::bfloat16)
REGISTER(Eigen::half)
#undef REGISTER

}  // namespace
}  // namespace tfgpt
