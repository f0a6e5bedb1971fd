// Sparse softmax cross-entropy of low- or full-precision logits in one pass.
//
// Under mixed precision the (N, V) logits would be cast to float32 (a pass
// writing 4 bytes per logit), then TensorFlow's SparseSoftmaxCrossEntropy-
// WithLogits takes further passes, and its float32 gradient is cast back.
// Here each row is read once in its own dtype, the softmax and loss are
// computed in float32, and the gradient (softmax - one_hot) is written in
// the logits' dtype, as TensorFlow's op does, for the backward pass.

#include "common.h"

#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"

namespace tfgpt {
namespace {

using Row = Eigen::Array<float, Eigen::Dynamic, 1>;

REGISTER_OP("TfgptSparseCrossEntropy")
    .Input("logits: T")
    .Input("labels: Tlabels")
    .Output("loss: float")
    .Output("backprop: T")
    .Attr("T: {float, bfloat16, half}")
    .Attr("Tlabels: {int32, int64} = DT_INT32")
    .SetShapeFn([](InferenceContext* c) {
      ::tensorflow::shape_inference::ShapeHandle logits;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 2, &logits));
      c->set_output(0, c->Vector(c->Dim(logits, 0)));
      c->set_output(1, logits);
      return absl::OkStatus();
    })
    .Doc("Per-row -log softmax(logits)[label] (float32) and softmax - one_hot (T).");

template <typename T, typename Label>
class SparseCrossEntropyOp : public OpKernel {
 public:
  explicit SparseCrossEntropyOp(OpKernelConstruction* context) : OpKernel(context) {}

  void Compute(OpKernelContext* context) override {
    const Tensor& logits = context->input(0);
    const Tensor& labels = context->input(1);
    OP_REQUIRES(context, logits.dims() == 2 && labels.dims() == 1 &&
                             labels.dim_size(0) == logits.dim_size(0),
                absl::InvalidArgumentError(absl::StrCat(
                    "logits must be (N, V) and labels (N,): logits ",
                    logits.shape().DebugString(), ", labels ", labels.shape().DebugString())));
    const int64_t rows = logits.dim_size(0), width = logits.dim_size(1);
    Tensor* loss = nullptr;
    OP_REQUIRES_OK(context, context->allocate_output(0, TensorShape({rows}), &loss));
    Tensor* backprop = nullptr;
    OP_REQUIRES_OK(context, context->allocate_output(1, logits.shape(), &backprop));
    if (rows == 0) return;
    OP_REQUIRES(context, width > 0,
                absl::InvalidArgumentError("logits must have at least one class"));
    const auto label = labels.flat<Label>();
    for (int64_t i = 0; i < rows; ++i) {
      OP_REQUIRES(context, label(i) >= 0 && label(i) < width,
                  absl::InvalidArgumentError(absl::StrCat(
                      "label ", static_cast<int64_t>(label(i)), " at row ", i,
                      " is outside the valid range [0, ", width, ")")));
    }
    const T* in = logits.flat<T>().data();
    T* grad = backprop->flat<T>().data();
    float* out = loss->flat<float>().data();
    auto work = [&](int64_t begin, int64_t end) {
      Row x(width);
      for (int64_t i = begin; i < end; ++i) {
        const T* row = in + i * width;
        for (int64_t j = 0; j < width; ++j) x[j] = static_cast<float>(row[j]);
        const float max = x.maxCoeff();
        const int64_t target = static_cast<int64_t>(label(i));
        const float shifted_target = x[target] - max;
        x = (x - max).exp();
        const float sum = x.sum();
        out[i] = std::log(sum) - shifted_target;
        x *= 1.0f / sum;
        x[target] -= 1.0f;
        T* grad_row = grad + i * width;
        for (int64_t j = 0; j < width; ++j) grad_row[j] = static_cast<T>(x[j]);
      }
    };
    auto* workers = context->device()->tensorflow_cpu_worker_threads()->workers;
    workers->ParallelFor(rows, 30 * width, work);
  }
};

#define REGISTER(T, Label)                                                     \
  REGISTER_KERNEL_BUILDER(Name("TfgptSparseCrossEntropy")                      \
                              .Device(DEVICE_CPU)                              \
                              .TypeConstraint<T>("T")                          \
                              .TypeConstraint<Label>("Tlabels"),               \
                          SparseCrossEntropyOp<T, Label>);

REGISTER(float, int32_t)
REGISTER(float, int64_t)
REGISTER(Eigen::bfloat16, int32_t)
REGISTER(Eigen::bfloat16, int64_t)
REGISTER(Eigen::half, int32_t)
REGISTER(Eigen::half, int64_t)
#undef REGISTER

}  // namespace
}  // namespace tfgpt
