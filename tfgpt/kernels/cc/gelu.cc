// GELU and its gradient as single fused, multi-threaded CPU kernels.
//
// TensorFlow runs `keras.activations.gelu` as about eight elementwise ops
// forward and fifteen backward, each a pass over the (B, T, 4C)
// activations (with bfloat16 <-> float32 conversions around each under
// mixed precision). Here each direction is one Eigen expression evaluated
// in a single pass on the op's thread pool, in float32 whatever the
// storage type.
//
//   approximate (Hendrycks & Gimpel 2016, GPT-2's "gelu_new"):
//     y = x/2 (1 + tanh(u)),  u = sqrt(2/pi) (x + 0.044715 x^3)
//     dy/dx = (1 + tanh(u))/2 + x/2 (1 - tanh(u)^2) sqrt(2/pi) (1 + 3 * 0.044715 x^2)
//   exact:
//     y = x Phi(x) = x/2 (1 + erf(x / sqrt(2)))
//     dy/dx = Phi(x) + x phi(x),  phi(x) = exp(-x^2/2) / sqrt(2 pi)

#include "common.h"

#include "tensorflow/core/framework/common_shape_fns.h"

namespace tfgpt {

constexpr float kSqrt2OverPi = 0.7978845608028654f;
constexpr float kCubic = 0.044715f;
constexpr float kSqrtHalf = 0.7071067811865476f;
constexpr float kInvSqrt2Pi = 0.3989422804014327f;

REGISTER_OP("TfgptGelu")
    .Input("features: T")
    .Output("activations: T")
    .Attr("T: {float, bfloat16, half}")
    .Attr("approximate: bool = true")
    .SetShapeFn(::tensorflow::shape_inference::UnchangedShape)
    .Doc("GELU, tanh approximation or exact, in one pass (float32 math).");

REGISTER_OP("TfgptGeluGrad")
    .Input("gradients: T")
    .Input("features: T")
    .Output("backprops: T")
    .Attr("T: {float, bfloat16, half}")
    .Attr("approximate: bool = true")
    .SetShapeFn(::tensorflow::shape_inference::UnchangedShape)
    .Doc("Gradient of TfgptGelu with respect to its features, in one pass.");

template <typename T>
class GeluOp : public OpKernel {
 public:
  explicit GeluOp(OpKernelConstruction* context) : OpKernel(context) {
    OP_REQUIRES_OK(context, context->GetAttr("approximate", &approximate_));
  }

  void Compute(OpKernelContext* context) override {
    const Tensor& input = context->input(0);
    Tensor* output = nullptr;
    OP_REQUIRES_OK(context, context->forward_input_or_allocate_output(
                                {0}, 0, input.shape(), &output));
    const CPUDevice& device = context->eigen_device<CPUDevice>();
    auto x = input.flat<T>().template cast<float>();
    auto y = output->flat<T>();
    const float half = 0.5f, one = 1.0f;
    if (approximate_) {
      auto u = (x + x * x * x * kCubic) * kSqrt2OverPi;
      y.device(device) = (x * half * (u.tanh() + one)).template cast<T>();
    } else {
      y.device(device) = (x * half * ((x * kSqrtHalf).erf() + one)).template cast<T>();
    }
  }

 private:
  bool approximate_;
};

template <typename T>
class GeluGradOp : public OpKernel {
 public:
  explicit GeluGradOp(OpKernelConstruction* context) : OpKernel(context) {
    OP_REQUIRES_OK(context, context->GetAttr("approximate", &approximate_));
  }

  void Compute(OpKernelContext* context) override {
    const Tensor& gradients = context->input(0);
    const Tensor& features = context->input(1);
    OP_REQUIRES(context, gradients.shape() == features.shape(),
                absl::InvalidArgumentError(absl::StrCat("gradients and features must have the same shape: ",
                                gradients.shape().DebugString(), " vs ",
                                features.shape().DebugString())));
    Tensor* output = nullptr;
    OP_REQUIRES_OK(context, context->forward_input_or_allocate_output(
                                {0, 1}, 0, features.shape(), &output));
    const CPUDevice& device = context->eigen_device<CPUDevice>();
    auto dy = gradients.flat<T>().template cast<float>();
    auto x = features.flat<T>().template cast<float>();
    auto dx = output->flat<T>();
    const float half = 0.5f, one = 1.0f;
    if (approximate_) {
      auto x2 = x * x;
      auto t = ((x + x2 * x * kCubic) * kSqrt2OverPi).tanh();
      auto derivative = (t + one) * half +
                        x * half * (one - t * t) * kSqrt2OverPi * (x2 * (3.0f * kCubic) + one);
      dx.device(device) = (dy * derivative).template cast<T>();
    } else {
      auto cdf = ((x * kSqrtHalf).erf() + one) * half;
      auto pdf = (x * x * -half).exp() * kInvSqrt2Pi;
      dx.device(device) = (dy * (cdf + x * pdf)).template cast<T>();
    }
  }

 private:
  bool approximate_;
};

#define REGISTER(T)                                                              \
  REGISTER_KERNEL_BUILDER(                                                       \
      Name("TfgptGelu").Device(DEVICE_CPU).TypeConstraint<T>("T"), GeluOp<T>); \
  REGISTER_KERNEL_BUILDER(                                                       \
      Name("TfgptGeluGrad").Device(DEVICE_CPU).TypeConstraint<T>("T"),           \
      GeluGradOp<T>);

REGISTER(float)
REGISTER(Eigen::bfloat16)
REGISTER(Eigen::half)
#undef REGISTER

}  // namespace tfgpt
